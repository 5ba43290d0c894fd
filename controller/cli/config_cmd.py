"""``pdctl config check|reference``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from controller.cli._app import config_app, load_settings_or_exit


@config_app.command("check")
def check(config: Annotated[Path, typer.Argument(help="TOML config file.")]) -> None:
    """Load a config file and report every problem (exit 2 when invalid)."""

    settings = load_settings_or_exit(config)
    typer.echo(f"{config}: OK ({len(settings.routers.targets)} router(s) configured)")


@config_app.command("reference")
def reference() -> None:
    """Print the generated configuration reference (Markdown)."""
    from controller.config import config_reference

    typer.echo(config_reference(), nl=False)
