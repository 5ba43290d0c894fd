"""``pdctl config check|reference``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from controller.cli._app import config_app, load_settings_or_exit


@config_app.command("check")
def check(
    file: Annotated[Path | None, typer.Argument(help="TOML config file.")] = None,
    config: Annotated[Path | None, typer.Option(
        "--config", "-c", help="The same, spelled as every other command takes it.")] = None,
) -> None:
    """Load a config file and report every problem (exit 2 when invalid)."""
    if (file is None) == (config is None):
        typer.echo("error: name one config file: `pdctl config check FILE` or --config FILE",
                   err=True)
        raise typer.Exit(2)
    config = file or config
    assert config is not None
    settings = load_settings_or_exit(config)
    typer.echo(f"{config}: OK ({len(settings.routers.targets)} router(s) configured)")


@config_app.command("reference")
def reference() -> None:
    """Print the generated configuration reference (Markdown)."""
    from controller.config import config_reference

    typer.echo(config_reference(), nl=False)
