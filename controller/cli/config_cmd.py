"""``pdctl config check|reference``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from controller.cli._app import config_app


@config_app.command("check")
def check(config: Annotated[Path, typer.Argument(help="TOML config file.")]) -> None:
    """Load a config file and report every problem (exit 2 when invalid)."""
    from controller.config import load_settings
    from controller.errors import ConfigError

    try:
        settings = load_settings(config)
    except ConfigError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{config}: OK ({len(settings.routers.targets)} router(s) configured)")


@config_app.command("reference")
def reference() -> None:
    """Print the generated configuration reference (Markdown)."""
    from controller.config import config_reference

    typer.echo(config_reference(), nl=False)
