"""Running ``pdctl router serve``: one process, or several sharing the HTTP port."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

from controller.router.config import RouterConfig
from controller.router.serve import Started, serve_router


async def run_router_processes(cfg: RouterConfig, *, echo: Callable[[str], None]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def started(s: Started) -> None:
        echo(f"router listening on {s.http} (OpenAI API), policy gRPC on {s.grpc}; "
             f"tokenizer: {s.tokenizer}; policy: v{s.policy_version}")

    await serve_router(cfg, stop, on_started=started)
    echo("router stopped")
