"""``pdctl bench decide``: per-call latency of the embedded router agent's ``decide()``."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer

from controller.cli._app import bench_app

if TYPE_CHECKING:
    from controller.policy import Features, Policy


def random_policy(seed: int, exploration: float = 0.05) -> Policy:
    """The default 10 x 10 x 10 axes with a random route and score per cell."""
    import random

    from controller.policy import Axes, LookupTable, Policy, Route

    rng = random.Random(seed)
    axes = Axes()
    n = axes.n_cells
    table = LookupTable(
        axes,
        tuple(rng.choice((Route.PREFILL_NODE, Route.DECODE_LOCAL)) for _ in range(n)),
        tuple(rng.uniform(-1.0, 1.0) for _ in range(n)),
        (exploration,) * n,
    )
    return Policy(version=1, table=table)


def random_features(seed: int, count: int) -> list[Features]:
    """Valid later-turn features spread (log-uniformly) over every bin of the default axes,
    so every call takes the full table path: validation, three bisections, exploration draw."""
    import random

    from controller.policy import Features

    rng = random.Random(seed)
    return [
        Features(
            turn=rng.randint(2, 12),
            context_tokens=10 ** rng.uniform(1.0, 5.5),
            append_tokens=10 ** rng.uniform(0.0, 3.5),
            expected_output_tokens=10 ** rng.uniform(0.0, 3.0),
            qps=10 ** rng.uniform(-1.0, 2.7),
        )
        for _ in range(count)
    ]


def run_decide_bench(n: int, seed: int) -> dict[str, Any]:
    """Time ``n`` calls of ``RouterAgent.decide()`` one by one (metric update included)."""
    from controller.clock import WallClock
    from controller.rollout.agent import RouterAgent

    clock = WallClock()
    agent = RouterAgent(clock=clock, initial_policy=random_policy(seed))
    features = random_features(seed + 1, 8192)
    mask = len(features) - 1
    decide = agent.decide
    perf = clock.perf_counter_ns

    for i in range(20_000):  # warm up caches and the interpreter's specialisations
        decide(features[i & mask])

    timer_floor = min(-(perf() - perf()) for _ in range(1000))
    latencies = [0] * n
    for i in range(n):
        f = features[i & mask]
        started = perf()
        decide(f)
        latencies[i] = perf() - started

    started = perf()
    for i in range(n):  # throughput without the per-call timer
        decide(features[i & mask])
    elapsed_ns = perf() - started

    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(n - 1, int(q * n))] / 1000.0

    decisions = sum(agent.metrics.decision_tallies[key].value()
                    for key in agent.metrics.decision_tallies)
    return {
        "cells": agent.policy.table.axes.n_cells if agent.policy else 0,
        "n": n,
        "p50_us": round(pct(0.50), 3),
        "p90_us": round(pct(0.90), 3),
        "p99_us": round(pct(0.99), 3),
        "p999_us": round(pct(0.999), 3),
        "max_us": round(latencies[-1] / 1000.0, 3),
        "decisions_per_s": round(n / (elapsed_ns / 1e9)),
        "timer_floor_us": round(timer_floor / 1000.0, 3),
        "decisions_counted": decisions,
    }


@bench_app.command("decide")
def bench_decide(
    n: Annotated[int, typer.Option("--n", min=1000, help="Timed decide() calls.")] = 200_000,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the table and the features.")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON only.")] = False,
) -> None:
    """Per-call latency of RouterAgent.decide() on a 10x10x10 table (0.05 exploration).

    Each call is timed on its own, including the agent's metric update and the timer's own
    cost (``timer_floor_us``); the garbage collector stays on. Target: p99 <= 5 us.
    """
    result = run_decide_bench(n, seed)
    if as_json:
        typer.echo(json.dumps(result))
        return
    typer.echo(
        f"decide() on {result['cells']} cells, {n} calls: p50 {result['p50_us']} us, "
        f"p99 {result['p99_us']} us, p99.9 {result['p999_us']} us, max {result['max_us']} us, "
        f"{result['decisions_per_s']:,} decisions/s (timer floor {result['timer_floor_us']} us)"
    )
