"""Soak: simulated days of control cycles through the daemon's real code paths, compressed.

The real ``Cycle`` (observe, drift, calibrate with the real ``CoreLearner``, guardrail,
canary, promote, reconcile), a real SQLite store with the daemon's retention
(``compact_windows`` every simulated hour), the real ``Reconciler`` over
``GrpcRouterTransport`` to ``--routers`` router agents (real ``grpc.aio`` servers on
127.0.0.1 in ``--processes`` worker processes, persisting every update), fed by a synthetic
metrics source for ``--workers`` workers whose load follows a daily cycle with a shift of the
request mix on day 3. Cycle time is virtual (each cycle advances a VirtualClock by the
interval); everything else runs for real.

Every simulated ``--sample-h`` hours it samples this process's RSS, open file descriptors,
asyncio tasks and the store's row counts, and prints one JSON object at the end: cycles by
result, calibrations, approved versions, wall time, RSS after warm-up and at the end (growth
in %), descriptors and tasks at the start and end, and the largest window count seen (bounded
by the retention). Each sample also splits RSS into anonymous and file-backed memory and
gives Python's block count and glibc's heap in use / free (``controller/heap.py``): a leak
grows "in use" or the blocks, fragmentation grows "free" or memory outside both. Like
``pdctl run``, the soak allocates through glibc and trims the heap after every cycle;
``PYTHONMALLOC=pymalloc`` and ``--no-malloc-trim`` show what each of those is worth.

    .venv/bin/python benchmarks/reliability_soak.py --days 0.25            # a quick look
    .venv/bin/python benchmarks/reliability_soak.py --days 7 --routers 512 --workers 256 \\
        --processes 4                                                      # the full soak
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import multiprocessing
import os
import random
import sys
import tempfile
import tracemalloc
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from prometheus_client import CollectorRegistry
from sqlalchemy import func, select

from controller.cli.bench_fanout import _serve_worker
from controller.clock import VirtualClock, WallClock
from controller.config import load_settings
from controller.core.window import RouteOutcome, Summary, Window, WorkerStats, Workload
from controller.heap import (
    heap_stats,
    reexec_with_system_malloc,
    release_free_heap,
    resident_mb,
)
from controller.loop.cycle import Cycle, CycleConfig
from controller.loop.learning import CoreLearner
from controller.loop.metrics import ControllerMetrics
from controller.observe.source import Target
from controller.policy import Route
from controller.rollout.client import GrpcRouterTransport
from controller.rollout.reconciler import Reconciler
from controller.store import Store
from controller.store.models import CalibrationRow, DriftEventRow, PolicyRow, PushRow, WindowRow

DAY_S = 86_400.0


class SyntheticSource:
    """Windows for ``workers`` workers and the given routers: request rates follow a daily
    sine; the share of long contexts shifts on ``shift_day``; goodput per route and bin is
    fixed per cell, so calibration has something true to find."""

    name = "synthetic"

    def __init__(self, routers: list[str], workers: int, clock: VirtualClock, seed: int,
                 shift_day: float) -> None:
        self.routers = routers
        self.workers = [f"10.0.{i // 250}.{i % 250}:8000" for i in range(workers)]
        self.clock = clock
        self.rng = random.Random(seed)
        self.start = clock.now()
        self.shift_day = shift_day

    def targets(self) -> list[Target]:
        return [Target(r, "router") for r in self.routers]

    async def window(self, start: float, end: float) -> Window:
        rng = self.rng
        interval = max(end - start, 1.0)
        day = (end - self.start) / DAY_S
        load = 1.0 + 0.5 * math.sin(2 * math.pi * day)
        long_share = 0.2 if day < self.shift_day else 0.6
        workers = []
        for i, w in enumerate(self.workers):
            role: Literal["prefill", "decode"] = "prefill" if i % 4 == 0 else "decode"
            ttft = 0.2 + 0.1 * load * rng.random()
            workers.append(WorkerStats(
                w, role, engine="vllm", request_rate=2.0 * load,
                ttft_s=Summary(ttft, 60.0 * load, ttft, ttft * 1.5, ttft * 2.0),
                running=float(rng.randint(0, 8)), waiting=float(rng.randint(0, 3)),
                kv_cache_usage=rng.random(),
            ))
        outcomes = []
        for r in self.routers:
            for ctx_bin in range(4):
                weight = long_share if ctx_bin >= 2 else 1.0 - long_share
                for io_bin in range(3):
                    for route in (Route.PREFILL_NODE, Route.DECODE_LOCAL):
                        n = float(max(1, round(4 * load * weight * rng.uniform(0.8, 1.2))))
                        p = 0.95 if (route is Route.DECODE_LOCAL) == (ctx_bin < 2) else 0.8
                        met = float(sum(rng.random() < p for _ in range(int(n))))
                        outcomes.append(RouteOutcome(r, route, ctx_bin, io_bin, n, met,
                                                     0.3 * n, n, 0.03 * n, n))
        return Window.build(
            start, end, interval, workers=workers, outcomes=outcomes,
            workload=Workload(qps_by_router={r: 0.1 * load for r in self.routers}),
            answered=[*self.workers, *self.routers], source=self.name,
        )

    def forget_baselines(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


COUNTED = {"windows": WindowRow, "policies": PolicyRow, "calibrations": CalibrationRow,
           "drift_events": DriftEventRow, "pushes": PushRow}


def row_counts(store: Store) -> dict[str, int]:
    with store.engine.connect() as conn:
        return {name: int(conn.execute(select(func.count()).select_from(model)).scalar_one())
                for name, model in COUNTED.items()}


async def soak(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    wall = WallClock()
    clock = VirtualClock(1_800_000_000.0)
    ctx = multiprocessing.get_context("spawn")
    loop = asyncio.get_running_loop()
    workers: list[tuple[Any, Any]] = []
    addresses: list[str] = []
    share, extra = divmod(args.routers, args.processes)
    first = 0
    for p in range(args.processes):
        n = share + (1 if p < extra else 0)
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve_worker, args=(n, first, str(tmp), True, child),
                           daemon=True)
        proc.start()
        workers.append((proc, parent))
        first += n
    for _, conn in workers:
        addresses.extend(await loop.run_in_executor(None, conn.recv))

    settings = load_settings(None)
    store = Store(f"sqlite:///{tmp / 'history.db'}", clock)
    store.upgrade()
    transport = GrpcRouterTransport()
    defaults = CycleConfig.from_settings(settings)
    config = dataclasses.replace(
        defaults, judge=dataclasses.replace(defaults.judge, interval_s=args.interval_s))
    cycle = Cycle(
        clock=clock,
        source=SyntheticSource(addresses, args.workers, clock, seed=1, shift_day=3.0),
        store=store, learner=CoreLearner(settings),
        reconciler=Reconciler(transport, clock, max_concurrency=256, deadline_s=30.0,
                              max_attempts=2, backoff_initial_s=0.0, backoff_max_s=0.0),
        metrics=ControllerMetrics(CollectorRegistry()), routers=addresses, config=config,
    )
    cycles = int(args.days * DAY_S / args.interval_s)
    sample_every = max(1, int(args.sample_h * 3600 / args.interval_s))
    compact_every = max(1, int(3600 / args.interval_s))
    results: Counter[str] = Counter()
    samples: list[dict[str, Any]] = []
    warm_snapshot: tracemalloc.Snapshot | None = None
    growth: list[str] = []
    if args.tracemalloc:
        tracemalloc.start(6)
    started = wall.monotonic()
    try:
        for i in range(cycles):
            clock.advance(args.interval_s)
            report = await cycle.run_once()
            results[report.result] += 1
            if args.malloc_trim:
                release_free_heap()
            if i % compact_every == 0:
                store.compact_windows(clock.utcnow() - timedelta(days=args.retention_days))
            if i % sample_every == 0 or i == cycles - 1:
                samples.append({"cycle": i, "sim_h": round(i * args.interval_s / 3600, 2),
                                **{f"{k}_mb": round(v, 1) for k, v in resident_mb().items()},
                                "fds": open_fds(), "py_blocks": sys.getallocatedblocks(),
                                **{f"malloc_{k}_mb": round(v, 1)
                                   for k, v in (heap_stats() or {}).items()},
                                "tasks": len(asyncio.all_tasks()), **row_counts(store)})
                # progress on stderr, one JSON line per sample: a long soak shows its trend
                # as it goes, and a soak stopped early still leaves its samples
                print(json.dumps({**samples[-1], "of_cycles": cycles,
                                  "wall_s": round(wall.monotonic() - started, 1)}),
                      file=sys.stderr, flush=True)
                if args.tracemalloc and len(samples) == 2:
                    warm_snapshot = tracemalloc.take_snapshot()
        if warm_snapshot is not None:
            diff = tracemalloc.take_snapshot().compare_to(warm_snapshot, "traceback")
            growth = [f"{d.size_diff / 1e6:+.2f} MB {d.count_diff:+d} blocks: "
                      + " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}"
                                    for f in reversed(list(d.traceback)[-4:]))
                      for d in diff[:12]]
            tracemalloc.stop()
        elapsed = wall.monotonic() - started
        policies = store.policies()
    finally:
        await transport.close()
        store.close()
        for _, conn in workers:
            conn.send("stop")
        for proc, conn in workers:
            await loop.run_in_executor(None, conn.recv)
            proc.join(timeout=30)

    warm = samples[min(len(samples) - 1, max(1, len(samples) // 10))]
    last = samples[-1]
    return {
        "days": args.days, "cycles": cycles, "interval_s": args.interval_s,
        "routers": args.routers, "workers": args.workers, "processes": args.processes,
        "wall_s": round(elapsed, 1), "results": dict(results),
        "approved_versions": [p.version for p in policies if p.status == "approved"][-10:],
        "rss_warm_mb": warm["rss_mb"], "rss_end_mb": last["rss_mb"],
        "rss_growth_pct": round(100 * (last["rss_mb"] - warm["rss_mb"]) / warm["rss_mb"], 1),
        "fds_start": samples[0]["fds"], "fds_end": last["fds"],
        "tasks_start": samples[0]["tasks"], "tasks_end": last["tasks"],
        "windows_max": max(s["windows"] for s in samples),
        "retention_days": args.retention_days,
        "samples": samples,
        "python_heap_growth_top": growth,
    }


def main() -> None:
    reexec_with_system_malloc()  # as `pdctl run` does (PYTHONMALLOC=pymalloc to compare)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=float, default=0.25)
    parser.add_argument("--interval-s", type=float, default=60.0)
    parser.add_argument("--routers", type=int, default=64)
    parser.add_argument("--workers", type=int, default=256)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--retention-days", type=float, default=1.0)
    parser.add_argument("--sample-h", type=float, default=1.0)
    parser.add_argument("--malloc-trim", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="Return freed heap pages to the OS after every cycle, as the "
                             "daemon does (--no-malloc-trim to see the difference).")
    parser.add_argument("--tracemalloc", action="store_true",
                        help="Also list the Python allocations that grew most after warm-up.")
    args = parser.parse_args()
    if not 0 < args.days <= 14 or not 1 <= args.routers <= 4096 or args.interval_s < 1:
        parser.error("--days in (0, 14], --routers 1..4096, --interval-s >= 1")
    with tempfile.TemporaryDirectory(prefix="pdc-soak-") as tmp:
        print(json.dumps(asyncio.run(soak(args, Path(tmp)))))


if __name__ == "__main__":
    main()
