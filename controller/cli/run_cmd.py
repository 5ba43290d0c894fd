"""``pdctl run --config FILE``: the long-running controller daemon.

The config file is required: a production daemon never falls back to a simulated cluster
(``pdctl demo`` is the embedded default)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from controller.cli._app import app, load_settings_or_exit


@app.command("run")
def run(
    config: Annotated[Path, typer.Option(
        "--config", "-c", help="TOML config file (required).", exists=False)],
    advisory: Annotated[bool, typer.Option(
        "--advisory", help="Everything but pushes: candidates are recorded as advisory.")
    ] = False,
    log_json: Annotated[bool, typer.Option(
        "--log-json", help="Structured logs: one JSON object per line on stderr.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logs.")] = False,
    init: Annotated[bool, typer.Option(
        "--init", help="Create the SQLite store even where one was created before and is "
        "now missing (without it that is refused: a removed history is not silently "
        "replaced by an empty one).")
    ] = False,
) -> None:
    """Run the control loop: observe, detect drift, recalibrate, canary, push. Serves
    /healthz, /readyz and /metrics on the metrics listen address; stops on SIGTERM."""
    import logging

    from controller.daemon import configure_logging, run_daemon

    settings = load_settings_or_exit(config)
    configure_logging(log_json, logging.DEBUG if verbose else logging.INFO)
    raise typer.Exit(run_daemon(settings, advisory=advisory, init=init))
