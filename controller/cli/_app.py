"""The typer apps every command module registers on (one file per command family)."""

from __future__ import annotations

import typer

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
