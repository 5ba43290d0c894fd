"""``pdctl router serve``: the P/D router in front of vLLM prefill and decode instances.

Reads ``router.toml`` (:mod:`controller.router.config`), serves the OpenAI-compatible API on
``[http] listen`` and ``pdcontrol.v1.RouterPolicyService`` on ``[grpc] listen``; stops
cleanly on SIGTERM / SIGINT. ``pdctl router check`` validates a file without starting.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from controller.cli._app import EXIT_BAD_INPUT, app

if TYPE_CHECKING:
    from controller.router.config import RouterConfig

router_app = typer.Typer(help="The P/D router (pdctl router serve).", no_args_is_help=True)
app.add_typer(router_app, name="router")

ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="router.toml")]


def _load(config: Path) -> RouterConfig:
    from controller.errors import ConfigError
    from controller.router.config import load_router_config

    try:
        return load_router_config(config)
    except ConfigError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None


@router_app.command("check")
def check(config: ConfigOpt) -> None:
    """Validate a router config file (exit 2 with every problem named)."""
    cfg = _load(config)
    i = cfg.instances
    typer.echo(f"ok: {len(i.prefill)} prefill, {len(i.decode)} decode instance entries; "
               f"http {cfg.http.listen} x{cfg.http.processes}, grpc {cfg.grpc.listen}; "
               f"tokenizer: {cfg.model.tokenizer or 'none (estimates)'}")


@router_app.command("serve")
def serve(config: ConfigOpt) -> None:
    """Serve the OpenAI API, route each request (prefill node or decode-local) with the
    running policy, and take policy pushes on the gRPC port."""
    import asyncio

    from controller.errors import ConfigError
    from controller.router.multiproc import run_router_processes

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    cfg = _load(config)
    try:
        asyncio.run(run_router_processes(cfg, echo=typer.echo))
    except ConfigError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None
