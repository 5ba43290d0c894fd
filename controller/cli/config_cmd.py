"""``pdctl config check|reference``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from controller.cli._app import config_app, load_settings_or_exit
from controller.config import Settings, canary_names_problem, sidecar_store_problem


@config_app.command("check")
def check(
    file: Annotated[Path | None, typer.Argument(help="TOML config file.")] = None,
    config: Annotated[Path | None, typer.Option(
        "--config", "-c", help="The same, spelled as every other command takes it.")] = None,
    skip_files: Annotated[bool, typer.Option(
        "--skip-files", help="Do not read the files the config names (token, certificates, "
        "lookup table): for checking a config away from the host it runs on.")] = False,
) -> None:
    """Load a config file and report every problem (exit 2 when invalid), including the
    files it names that `pdctl run` or `pdctl router-agent` could not read or use."""
    if (file is None) == (config is None):
        typer.echo("error: name one config file: `pdctl config check FILE` or --config FILE",
                   err=True)
        raise typer.Exit(2)
    config = file or config
    assert config is not None
    settings = load_settings_or_exit(config)
    problems = [] if skip_files else _file_problems(settings)
    problems[:0] = [p for p in (sidecar_store_problem(settings),
                                canary_names_problem(settings)) if p is not None]
    if problems:
        typer.echo(f"{config}: {len(problems)} problem(s) `pdctl run` or `pdctl router-agent` "
                   "would refuse at start:", err=True)
        for problem in problems:
            typer.echo(f"  {problem}", err=True)
        raise typer.Exit(2)
    routers = len(settings.routers.targets)
    needs = "" if routers else ": `pdctl run` and `calibrate-active` need [routers] targets"
    typer.echo(f"{config}: OK ({routers} router(s) configured{needs})")


def _file_problems(settings: Settings) -> list[str]:
    """What the daemon and the router agent would refuse at start in the files the config
    names ([security] token and certificates, [ppd] lookup_table)."""
    from controller.cli.agent_cmd import initial_policy
    from controller.errors import ConfigError
    from controller.rollout.security import check_files

    problems = check_files(settings.security)
    try:
        initial_policy(settings)
    except ConfigError as e:
        problems.append(str(e))
    return problems


@config_app.command("reference")
def reference() -> None:
    """Print the generated configuration reference (Markdown)."""
    from controller.config import config_reference

    typer.echo(config_reference(), nl=False)
