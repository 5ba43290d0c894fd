"""Load time and shape of every workload source (the numbers in docs/workloads.md).

For each source: the cold load (parse + link, first call in this process), the time to
generate all sessions, and summary statistics of the sessions (default parameters, seed 1).

    .venv/bin/python benchmarks/workload_stats.py            # Markdown tables
    .venv/bin/python benchmarks/workload_stats.py --json     # one JSON object
"""

from __future__ import annotations

import argparse
import json
import random
from typing import Any

from controller.clock import WallClock
from controller.sim.workloads import WorkloadConfig, build_workload
from controller.sim.workloads.stats import summarize

CASES: list[tuple[str, WorkloadConfig]] = [
    ("mooncake", WorkloadConfig("mooncake")),
    ("azure-conv", WorkloadConfig("azure-conv")),
    ("azure-code", WorkloadConfig("azure-code")),
    ("servegen (5 req/s, first hour)", WorkloadConfig("servegen")),
    ("servegen (5 req/s, day in 1 h)", WorkloadConfig("servegen", params={"time_scale": 24.0})),
    (
        "synthetic mid_bal, 4 turns, 4 qps",
        WorkloadConfig(
            "synthetic",
            params={"class": "mid_bal", "turns": 4, "qps": 4.0, "duration_s": 3600.0},
        ),
    ),
]


def measure(cfg: WorkloadConfig, seed: int) -> dict[str, Any]:
    clock = WallClock()
    t0 = clock.perf_counter_ns()
    workload = build_workload(cfg)
    t1 = clock.perf_counter_ns()
    sessions = list(workload.sessions(random.Random(seed)))
    t2 = clock.perf_counter_ns()
    again = list(workload.sessions(random.Random(seed)))
    t3 = clock.perf_counter_ns()
    assert again == sessions, "same seed, same sessions"
    return {
        "load_s": (t1 - t0) / 1e9,
        "generate_s": (t2 - t1) / 1e9,
        "generate_again_s": (t3 - t2) / 1e9,
        "stats": summarize(sessions).as_dict(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    results = {name: measure(cfg, args.seed) for name, cfg in CASES}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(
        "| workload | load s | sessions s | sessions | requests | mean turns "
        "| 1 / 2 / 3 / 4 / 5+ turns (%) | max turns |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        s = r["stats"]
        shares = " / ".join(f"{100 * v:.1f}" for v in s["turns_share"].values())
        print(
            f"| {name} | {r['load_s']:.2f} | {r['generate_s']:.2f} | {s['sessions']:,} | "
            f"{s['requests']:,} | {s['mean_turns']:.3f} | {shares} | {s['max_turns']} |"
        )
    print()
    print(
        "| workload | turn-1 prompt mean | output mean | later turns | append mean / p50 / p90 "
        "| context mean / p50 | think p50 / p90 s | max_tokens / output |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        s = r["stats"]
        print(
            f"| {name} | {s['turn1_prompt_mean']:,.0f} | {s['output_mean']:,.0f} | "
            f"{s['later_turns']:,} | {s['later_new_mean']:,.0f} / {s['later_new_p50']:,.0f} / "
            f"{s['later_new_p90']:,.0f} | {s['later_context_mean']:,.0f} / "
            f"{s['later_context_p50']:,.0f} | {s['think_p50_s']:.0f} / {s['think_p90_s']:.0f} | "
            f"{s['max_tokens_over_output_mean']:.2f} |"
        )


if __name__ == "__main__":
    main()
