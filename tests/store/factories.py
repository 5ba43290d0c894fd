"""Realistic windows for store tests (random, reproducible, with awkward values)."""

from __future__ import annotations

import math
import random

from controller.core.window import (
    FailureKind,
    Family,
    Histogram,
    RouteOutcome,
    Summary,
    TargetFailure,
    Window,
    WorkerStats,
    Workload,
)
from controller.policy.model import Route


def _maybe(rng: random.Random, value: float) -> float | None:
    return None if rng.random() < 0.15 else value


def _summary(rng: random.Random, scale: float) -> Summary | None:
    if rng.random() < 0.1:
        return None
    quantiles = rng.random() < 0.5
    base = rng.random() * scale
    return Summary(
        mean=_maybe(rng, base), count=float(rng.randint(0, 5000)),
        p50=base * 0.9 if quantiles else None, p90=base * 1.7 if quantiles else None,
        p99=base * 3.1 if quantiles else None, interpolated=quantiles and rng.random() < 0.5,
    )


def sample_window(
    rng: random.Random,
    start: float,
    interval_s: float = 30.0,
    n_workers: int = 8,
    n_routers: int = 4,
    cells: int = 100,
) -> Window:
    workers = [
        WorkerStats(
            worker=f"10.0.0.{i}:8000", role="prefill" if i % 3 == 0 else "decode",
            engine=rng.choice(["vllm", "sglang", None]),
            request_rate=_maybe(rng, rng.random() * 40),
            ttft_s=_summary(rng, 2.0), inter_token_s=_summary(rng, 0.05),
            tpot_s=_summary(rng, 0.05), queue_s=_summary(rng, 1.0),
            prefill_s=_summary(rng, 0.5), kv_transfer_s=_summary(rng, 0.2),
            kv_transfer_bytes=_summary(rng, 1e9),
            running=_maybe(rng, float(rng.randint(0, 64))),
            waiting=_maybe(rng, float(rng.randint(0, 16))),
            kv_cache_usage=_maybe(rng, rng.random()),
            prompt_tokens_by_source=(
                None if rng.random() < 0.2 else {
                    "local_compute": float(rng.randint(0, 10**6)),
                    "local_cache_hit": float(rng.randint(0, 10**6)),
                    "external_kv_transfer": rng.random() * 1e5,
                }
            ),
            generation_tokens=_maybe(rng, float(rng.randint(0, 10**6))),
            # From the index (no draw: the other fields stay what they were for a seed).
            aborted=float(i % 3) if i % 2 else None,
            errored=0.5 * i if i % 4 == 0 else None,
            missing=(Family.KV_TRANSFER, Family.TTFT) if i % 5 == 0 else (),
        )
        for i in range(n_workers)
    ]
    outcomes = []
    for r in range(n_routers):
        for route in Route:
            for c in range(cells):
                n = float(rng.randint(0, 500))
                outcomes.append(
                    RouteOutcome(
                        router=f"router-{r}", route=route, ctx_bin=c // 10, io_bin=c % 10,
                        requests=n, met=float(math.floor(n * rng.random())),
                        ttft_sum=n * rng.random() * 0.7, ttft_count=n,
                        tpot_sum=n * rng.random() * 0.03, tpot_count=n,
                    )
                )
    ctx_edges = (256.0, 1024.0, 4096.0, 16384.0, 65536.0, math.inf)
    io_edges = (0.125, 0.5, 2.0, 8.0, math.inf)
    workload = Workload(
        context_tokens=Histogram(ctx_edges, tuple(float(rng.randint(0, 900)) for _ in ctx_edges)),
        io_ratio=Histogram(io_edges, tuple(float(rng.randint(0, 900)) for _ in io_edges)),
        qps_by_router={f"router-{r}": rng.random() * 20 + 0.1 for r in range(n_routers)},
    )
    return Window.build(
        start=start, end=start + interval_s, interval_s=interval_s, workers=workers,
        outcomes=outcomes, workload=workload,
        answered=[w.worker for w in workers[:-1]] + [f"router-{r}" for r in range(n_routers)],
        failures=[TargetFailure(workers[-1].worker, FailureKind.TIMEOUT, "no answer within 2.0 s")],
        source="scrape",
    )
