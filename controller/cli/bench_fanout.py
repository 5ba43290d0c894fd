"""``pdctl bench fanout``: push one policy to many router agents and time the last ack.

Starts ``--routers`` router agents on 127.0.0.1 (real ``grpc.aio`` servers on free ports,
each persisting to its own state file in a temporary directory), builds a 10 x 10 x 10
policy and times one reconcile pass through the real gRPC transport: from the push decision
(the reconcile call) to the last acknowledgement. ``--processes N`` spreads the routers over
N worker processes (the reconciler runs in this one); ``--processes 1`` keeps everything in
one process and one event loop.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any

import typer

from controller.cli._app import bench_app, table_console


def _fanout_policy(version: int) -> Any:
    """A 10 x 10 x 10 PPD-style table: decode-local for short contexts and low io ratios."""
    from controller.cli.demo_cmd import ppd_policy

    return ppd_policy(version, reason="bench fanout")


def _serve_worker(
    n: int, first_index: int, state_dir: str, offload_apply: bool, conn: Any
) -> None:
    """Worker process: serve ``n`` routers, send their addresses, stop when told."""
    import asyncio

    from controller.rollout.agent import RouterAgent
    from controller.rollout.server import RouterServer

    async def main() -> None:
        servers = []
        for i in range(first_index, first_index + n):
            agent = RouterAgent(
                router_id=f"bench-{i}", state_file=Path(state_dir) / f"router-{i}.json"
            )
            server = RouterServer(agent, serve_decisions=False, offload_apply=offload_apply)
            await server.start()
            servers.append(server)
        conn.send([s.address for s in servers])
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, conn.recv)  # the parent says stop
        await asyncio.gather(*(s.stop(grace=None) for s in servers))
        conn.send("stopped")

    asyncio.run(main())


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    k = max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))
    return ordered[k]


async def run_fanout(
    routers: int,
    processes: int,
    concurrency: int,
    state_dir: Path,
    *,
    offload_apply: bool = True,
) -> dict[str, Any]:
    import asyncio
    import multiprocessing

    from controller.clock import WallClock
    from controller.rollout.agent import RouterAgent
    from controller.rollout.client import GrpcRouterTransport
    from controller.rollout.reconciler import Reconciler
    from controller.rollout.server import RouterServer

    clock = WallClock()
    servers: list[RouterServer] = []
    workers: list[tuple[Any, Any]] = []
    addresses: list[str] = []
    loop = asyncio.get_running_loop()
    try:
        if processes <= 1:
            for i in range(routers):
                agent = RouterAgent(
                    router_id=f"bench-{i}", clock=clock, state_file=state_dir / f"router-{i}.json"
                )
                server = RouterServer(agent, serve_decisions=False, offload_apply=offload_apply)
                await server.start()
                servers.append(server)
            addresses = [s.address for s in servers]
        else:
            ctx = multiprocessing.get_context("spawn")
            share, extra = divmod(routers, processes)
            start = 0
            for p in range(processes):
                n = share + (1 if p < extra else 0)
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=_serve_worker,
                    args=(n, start, str(state_dir), offload_apply, child),
                    daemon=True,
                )
                proc.start()
                workers.append((proc, parent))
                start += n
            for _, conn in workers:
                addresses.extend(await loop.run_in_executor(None, conn.recv))

        policy = _fanout_policy(1)
        transport = GrpcRouterTransport()
        reconciler = Reconciler(
            transport, clock, max_concurrency=concurrency, deadline_s=10.0, max_attempts=3
        )
        try:
            started = clock.monotonic()  # the push decision
            statuses = await reconciler.reconcile(dict.fromkeys(addresses, policy))
            all_acked_s = clock.monotonic() - started
            # A second pass over warm channels that finds nothing to push.
            started = clock.monotonic()
            again = await reconciler.reconcile(dict.fromkeys(addresses, policy))
            noop_pass_s = clock.monotonic() - started
            # And a second policy over the warm channels.
            started = clock.monotonic()
            warm = await reconciler.reconcile(dict.fromkeys(addresses, _fanout_policy(2)))
            warm_acked_s = clock.monotonic() - started
        finally:
            await transport.close()
    finally:
        await asyncio.gather(*(s.stop(grace=None) for s in servers))
        for _, conn in workers:
            conn.send("stop")
        for proc, conn in workers:
            await loop.run_in_executor(None, conn.recv)
            proc.join(timeout=10)

    failed = sum(1 for s in statuses.values() if not s.ok)
    errors = sorted({f"{s.outcome}: {s.last_error}" for s in statuses.values() if not s.ok})
    latencies = [s.latency_s for s in statuses.values() if s.ok]
    persisted = sum(1 for i in range(routers) if (state_dir / f"router-{i}.json").exists())
    return {
        "routers": routers,
        "all_acked_s": round(all_acked_s, 4),
        "failed": failed,
        "ack_p50_s": round(_percentile(latencies, 0.5), 4),
        "ack_p99_s": round(_percentile(latencies, 0.99), 4),
        "cells": policy.table.axes.n_cells,
        "persisted": persisted,
        "processes": processes,
        "concurrency": concurrency,
        "apply_in_thread": offload_apply,
        "warm_all_acked_s": round(warm_acked_s, 4),
        "warm_failed": sum(1 for s in warm.values() if not s.ok),
        "noop_pass_s": round(noop_pass_s, 4),
        "noop_pushes": sum(1 for s in again.values() if s.pushed),
        "errors": errors[:5],
    }


@bench_app.command("fanout")
def fanout(
    routers: Annotated[int, typer.Option(min=1, max=4096, help="Router agents to start.")] = 256,
    processes: Annotated[
        int, typer.Option(min=1, max=64, help="Worker processes serving the routers.")
    ] = 1,
    concurrency: Annotated[
        int, typer.Option(min=1, help="Reconciler's concurrent calls.")
    ] = 256,
    apply_in_thread: Annotated[
        bool,
        typer.Option(
            "--apply-in-thread/--apply-on-loop",
            help="Run each router's ApplyPolicy work in a worker thread (the servers' "
            "default) or on the event loop.",
        ),
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON only.")] = False,
) -> None:
    """Time one policy push to N router agents on loopback (persistence on)."""
    import asyncio
    import tempfile

    with tempfile.TemporaryDirectory(prefix="pdctl-fanout-") as tmp:
        result = asyncio.run(
            run_fanout(
                routers, processes, concurrency, Path(tmp), offload_apply=apply_in_thread
            )
        )
    if as_json:
        typer.echo(json.dumps(result))
        return
    from rich.table import Table

    table = Table(title=f"fan-out to {routers} router agents (persistence on)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result.items():
        table.add_row(key, str(value))
    table_console().print(table)
    if result["failed"]:
        raise typer.Exit(1)
