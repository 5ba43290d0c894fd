"""How long does writing one window to the history store take?

One realistic window: 8 workers (every metric present, quantiles included), 4 routers x 2
routes x 100 (context bin, io bin) cells, workload histograms and qps. Each write is one
``store.cycle()`` transaction, as in the daemon, of a window as a source builds it (route
outcomes as objects, not yet packed). Prints mean, p50, p99 and max in ms, the CPU time of
this process per write, and the load average before and after.

    .venv/bin/python benchmarks/store_write_window.py            # SQLite in a temp dir
    .venv/bin/python benchmarks/store_write_window.py --url postgresql+psycopg://postgres@127.0.0.1:5432/test
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import secrets
import statistics
import tempfile
import time  # process_time only: CPU accounting, not the wall clock
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from controller.clock import WallClock
from controller.core.window import (
    Histogram,
    RouteOutcome,
    Summary,
    TargetFailure,
    Window,
    WorkerStats,
    Workload,
)
from controller.policy.model import Route
from controller.store import Store

N_WORKERS, N_ROUTERS, N_CELLS = 8, 4, 100


def realistic_window(rng: random.Random, start: float, interval_s: float = 30.0) -> Window:
    def summary(scale: float) -> Summary:
        m = rng.random() * scale
        return Summary(m, float(rng.randint(1, 5000)), m * 0.9, m * 1.8, m * 3.0, True)

    workers = [
        WorkerStats(
            worker=f"10.0.0.{i}:8000", role="prefill" if i < 3 else "decode", engine="vllm",
            request_rate=rng.random() * 30, ttft_s=summary(2), inter_token_s=summary(0.05),
            tpot_s=summary(0.05), queue_s=summary(1), prefill_s=summary(0.5),
            kv_transfer_s=summary(0.2), kv_transfer_bytes=summary(1e9),
            running=float(rng.randint(0, 64)), waiting=float(rng.randint(0, 8)),
            kv_cache_usage=rng.random(),
            prompt_tokens_by_source={
                "local_compute": float(rng.randint(0, 10**6)),
                "local_cache_hit": float(rng.randint(0, 10**6)),
                "external_kv_transfer": float(rng.randint(0, 10**6)),
            },
            generation_tokens=float(rng.randint(0, 10**6)),
        )
        for i in range(N_WORKERS)
    ]
    outcomes = []
    for r in range(N_ROUTERS):
        for route in Route:
            for c in range(N_CELLS):
                n = float(rng.randint(0, 400))
                outcomes.append(RouteOutcome(
                    f"router-{r}", route, c // 10, c % 10, n, float(int(n * 0.9)),
                    n * rng.random(), n, n * rng.random() * 0.05, n,
                ))
    edges = (*(float(2**k) for k in range(8, 18)), float("inf"))
    io_edges = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, float("inf"))
    workload = Workload(
        context_tokens=Histogram(edges, tuple(float(rng.randint(0, 500)) for _ in edges)),
        io_ratio=Histogram(io_edges, tuple(float(rng.randint(0, 500)) for _ in io_edges)),
        qps_by_router={f"router-{r}": rng.random() * 20 for r in range(N_ROUTERS)},
    )
    return Window.build(
        start, start + interval_s, interval_s, workers, outcomes, workload,
        answered=[w.worker for w in workers] + [f"router-{r}" for r in range(N_ROUTERS)],
        failures=[TargetFailure("10.0.0.99:8000", "timeout", "no answer in 2 s")],
        source="scrape",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="database URL (default: SQLite file in a temp dir)")
    ap.add_argument("--n", type=int, default=300, help="windows to write (default 300)")
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args()

    clock = WallClock()
    rng = random.Random(42)
    windows = [realistic_window(rng, 1.9e9 + 30 * i) for i in range(args.n + args.warmup)]
    body = json.dumps(windows[0].to_dict(compact=True), allow_nan=False)
    # Fresh outcome objects: the body above packed windows[0]'s outcomes once already.
    windows[0] = dataclasses.replace(windows[0], outcomes=tuple(windows[0].outcomes))
    load_before = _load()

    with (
        tempfile.TemporaryDirectory() as tmp,
        _database(args.url, Path(tmp)) as url,
        Store(url, clock) as store,
    ):
        store.upgrade()
        samples_ms: list[float] = []
        cpu_ms: list[float] = []
        for i, w in enumerate(windows):
            t0, c0 = clock.perf_counter_ns(), time.process_time_ns()
            with store.cycle() as tx:
                tx.add_window(w)
            dt = (clock.perf_counter_ns() - t0) / 1e6
            if i >= args.warmup:
                samples_ms.append(dt)
                cpu_ms.append((time.process_time_ns() - c0) / 1e6)
        t0 = clock.perf_counter_ns()
        back = store.windows(limit=1)[0].window
        read_ms = (clock.perf_counter_ns() - t0) / 1e6
        assert back == windows[-1], "round trip changed the window"
        dialect = store.dialect

    encode = []
    for w in windows[: args.n]:
        fresh = dataclasses.replace(w, outcomes=tuple(w.outcomes))  # not packed yet
        t0 = clock.perf_counter_ns()
        json.dumps(fresh.to_dict(compact=True), allow_nan=False, separators=(",", ":"))
        encode.append((clock.perf_counter_ns() - t0) / 1e6)

    samples_ms.sort()
    p99 = samples_ms[min(len(samples_ms) - 1, int(0.99 * len(samples_ms)))]
    print(f"backend: {dialect}")
    print(f"window: {N_WORKERS} workers, {N_ROUTERS} routers x 2 routes x {N_CELLS} "
          f"cells = {len(windows[0].outcomes)} outcomes, stored body {len(body)} bytes")
    print(f"write one window (one transaction), n={len(samples_ms)}: "
          f"mean {statistics.fmean(samples_ms):.2f} ms, "
          f"p50 {statistics.median(samples_ms):.2f} ms, p99 {p99:.2f} ms, "
          f"max {samples_ms[-1]:.2f} ms")
    print(f"  CPU time of this process per write: mean {statistics.fmean(cpu_ms):.2f} ms "
          "(wall minus CPU = waiting: disk, server, or other processes on a busy machine)")
    print(f"  of which to_dict(compact) + JSON encode (incl. packing the outcomes): "
          f"mean {statistics.fmean(encode):.2f} ms")
    print(f"read newest window back (decode + rebuild): {read_ms:.2f} ms")
    print(f"load average before: {load_before}, after: {_load()}")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


@contextmanager
def _database(url: str | None, tmp: Path) -> Iterator[str]:
    """SQLite: a file in ``tmp``. PostgreSQL: a throwaway schema, dropped afterwards."""
    if url is None:
        yield f"sqlite:///{tmp / 'bench.db'}"
        return
    if not url.startswith("postgresql"):
        yield url
        return
    import psycopg

    schema = f"pdc_bench_{secrets.token_hex(4)}"
    conninfo = url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        sep = "&" if "?" in url else "?"
        yield f"{url}{sep}options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")

if __name__ == "__main__":
    main()
