"""Reconcile 1,000 routers after an approval: time to all acknowledged, controller CPU.

Starts ``--routers`` router agents (real ``grpc.aio`` servers on 127.0.0.1, each persisting
every applied policy with an fsynced atomic write) spread over ``--processes`` worker
processes, then, in this process, runs the real Reconciler over GrpcRouterTransport:

1. ``approve``: a newly approved 10 x 10 x 10 policy reaches every router (cold channels);
2. ``steady``: the next pass finds every router in sync (GetPolicy only, no push);
3. ``next``: the following approval over warm channels.

For each pass it prints the wall time from the reconcile call to the last acknowledgement,
the controller process's CPU seconds during the pass (user + system, from getrusage; the
routers' processes are not counted) and how many routers failed. One JSON object.

    .venv/bin/python benchmarks/reliability_scale.py                    # 1,000 routers
    .venv/bin/python benchmarks/reliability_scale.py --routers 200 --processes 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import resource
import tempfile
from pathlib import Path
from typing import Any

from controller.cli.bench_fanout import _fanout_policy, _percentile, _serve_worker
from controller.clock import WallClock
from controller.policy import Policy
from controller.rollout.client import GrpcRouterTransport
from controller.rollout.reconciler import Reconciler, RouterStatus


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def timed_pass(
    reconciler: Reconciler, clock: WallClock, addresses: list[str], policy: Policy
) -> tuple[dict[str, Any], dict[str, RouterStatus]]:
    cpu0, t0 = cpu_s(), clock.monotonic()
    statuses = await reconciler.reconcile(dict.fromkeys(addresses, policy))
    wall, cpu = clock.monotonic() - t0, cpu_s() - cpu0
    latencies = [s.latency_s for s in statuses.values() if s.ok]
    return {
        "all_acked_s": round(wall, 3),
        "controller_cpu_s": round(cpu, 3),
        "cpu_ms_per_router": round(1000 * cpu / max(1, len(addresses)), 3),
        "ack_p50_s": round(_percentile(latencies, 0.5), 3),
        "ack_p99_s": round(_percentile(latencies, 0.99), 3),
        "pushed": sum(1 for s in statuses.values() if s.pushed),
        "failed": sum(1 for s in statuses.values() if not s.ok),
    }, statuses


async def run(routers: int, processes: int, concurrency: int, state_dir: Path) -> dict[str, Any]:
    clock = WallClock()
    ctx = multiprocessing.get_context("spawn")
    loop = asyncio.get_running_loop()
    workers: list[tuple[Any, Any]] = []
    addresses: list[str] = []
    share, extra = divmod(routers, processes)
    first = 0
    try:
        for p in range(processes):
            n = share + (1 if p < extra else 0)
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_serve_worker, args=(n, first, str(state_dir), True, child), daemon=True
            )
            proc.start()
            workers.append((proc, parent))
            first += n
        for _, conn in workers:
            addresses.extend(await loop.run_in_executor(None, conn.recv))

        transport = GrpcRouterTransport()
        reconciler = Reconciler(
            transport, clock, max_concurrency=concurrency, deadline_s=30.0, max_attempts=3
        )
        try:
            approve, statuses = await timed_pass(reconciler, clock, addresses, _fanout_policy(1))
            steady, _ = await timed_pass(reconciler, clock, addresses, _fanout_policy(1))
            following, _ = await timed_pass(reconciler, clock, addresses, _fanout_policy(2))
        finally:
            await transport.close()
    finally:
        for _, conn in workers:
            conn.send("stop")
        for proc, conn in workers:
            await loop.run_in_executor(None, conn.recv)
            proc.join(timeout=30)
    errors = sorted({f"{s.outcome}: {s.last_error}" for s in statuses.values() if not s.ok})
    return {
        "routers": routers,
        "processes": processes,
        "concurrency": concurrency,
        "cells": _fanout_policy(1).table.axes.n_cells,
        "approve": approve,
        "steady": steady,
        "next": following,
        "persisted": sum(1 for i in range(routers) if (state_dir / f"router-{i}.json").exists()),
        "errors": errors[:5],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--routers", type=int, default=1000)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=256)
    args = parser.parse_args()
    if not 1 <= args.processes <= 64 or not 1 <= args.routers <= 4096:
        parser.error("--routers 1..4096, --processes 1..64")
    with tempfile.TemporaryDirectory(prefix="pdc-scale-") as tmp:
        result = asyncio.run(run(args.routers, args.processes, args.concurrency, Path(tmp)))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
