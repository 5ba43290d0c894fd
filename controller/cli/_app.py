"""The typer apps every command module registers on (one file per command family)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from controller.config import Settings

app = typer.Typer(
    name="pdctl",
    help="pd-controller: closes the control loop of prefill/decode-disaggregated LLM serving.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Help texts name config sections as "[store]"; rich markup would swallow them as tags.
    rich_markup_mode=None,
)
table_app = typer.Typer(help="Inspect lookup-table policy files.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks that print numbers.", no_args_is_help=True)
sim_app = typer.Typer(help="The simulated P/D cluster.", no_args_is_help=True)
config_app = typer.Typer(help="Configuration helpers.", no_args_is_help=True)

app.add_typer(table_app, name="table")
app.add_typer(bench_app, name="bench")
app.add_typer(sim_app, name="sim")
app.add_typer(config_app, name="config")

EXIT_BAD_INPUT = 2  # bad flags, config or input files: the operator must change something


def load_settings_or_exit(config: Path | None) -> Settings:
    """The typed settings of ``config`` (defaults when None); a bad file exits 2 with the
    reason on stderr instead of a traceback."""
    from controller.config import load_settings
    from controller.errors import ConfigError

    try:
        return load_settings(config)
    except ConfigError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None
