"""Virtual-time experiment: calibrate on the simulated cluster, then measure the table.

1. **Explore**: replay a scenario while, every control interval, a fresh random table
   (random route per cell, 20% exploration) is pushed to the routers; windows are built from
   the simulator's registries through ``controller.observe.inprocess.InProcessSource`` (the
   same parser and window builder as a real scrape).
2. **Calibrate**: the pure core fits on those windows (the last 20% held out) and builds a
   policy.
3. **Measure**: replay the same scenario (same seed) under the calibrated policy, under
   all-prefill-node and under all-decode-local; goodput is measured in the simulator
   (``controller.bench.report``), not predicted.

    .venv/bin/python benchmarks/core_sim_experiment.py scenarios/ppd-2p2d.toml
    .venv/bin/python benchmarks/core_sim_experiment.py scenarios/ppd-1p3d.toml --duration 600
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controller.bench.report import summarize  # noqa: E402
from controller.core.calibrate import CalibrationConfig, calibrate  # noqa: E402
from controller.core.window import Window  # noqa: E402
from controller.observe.inprocess import InProcessSource, sim_cluster_provider  # noqa: E402
from controller.policy.model import Axes, LookupTable, Policy, Route, Slo  # noqa: E402
from controller.sim.cluster import SimCluster  # noqa: E402
from controller.sim.run import run_scenario  # noqa: E402
from controller.sim.scenario import Scenario, load_scenario  # noqa: E402


def random_policy(version: int, rng: random.Random, slo: Slo, local_share: float) -> Policy:
    axes = Axes()
    n = axes.n_cells
    routes = tuple(Route.DECODE_LOCAL if rng.random() < local_share else Route.PREFILL_NODE
                   for _ in range(n))
    table = LookupTable(axes, routes, (0.0,) * n, (0.2,) * n)
    return Policy(version=version, table=table, slo=slo)


def load(path: str, args: argparse.Namespace) -> Scenario:
    """The scenario with the command line's overrides applied."""
    scenario = load_scenario(path)
    changes: dict[str, object] = {}
    if args.duration is not None:
        changes["duration_s"] = args.duration
    if args.ttft_slo is not None:
        changes["ttft_slo_s"] = args.ttft_slo
    if args.tpot_slo is not None:
        changes["tpot_slo_s"] = args.tpot_slo
    if args.rate_scale is not None:
        changes["workload"] = dataclasses.replace(scenario.workload, rate_scale=args.rate_scale)
    if args.link_gbps is not None:
        changes["cluster"] = dataclasses.replace(scenario.cluster, kv_link_gbps=args.link_gbps)
    return dataclasses.replace(scenario, **changes)  # type: ignore[arg-type]


def explore(scenario: Scenario, seed: int, max_local: float = 0.9
            ) -> tuple[list[Window], Slo]:
    slo = Slo(ttft_s=scenario.ttft_slo_s, tpot_s=scenario.tpot_slo_s)
    rng = random.Random(seed)
    windows: list[Window] = []
    state: dict[str, object] = {"version": 1, "source": None, "last": 0.0}

    def controller(now: float, cluster: SimCluster) -> None:
        source = state["source"]
        if source is None:
            # the cluster's own virtual clock: snapshots are taken at simulated times
            source = InProcessSource.following(sim_cluster_provider(cluster), cluster.clock)
            state["source"] = source
            asyncio.run(source.window(0.0, now))  # first snapshot: a baseline only
        else:
            assert isinstance(source, InProcessSource)
            last = state["last"]
            assert isinstance(last, float)
            windows.append(asyncio.run(source.window(last, now)))
        state["last"] = now
        version = state["version"]
        assert isinstance(version, int)
        version += 1
        state["version"] = version
        policy = random_policy(version, rng, slo, rng.uniform(0.0, max_local))
        for router in cluster.routers:
            router.agent.apply(policy)

    run_scenario(scenario, random_policy(1, rng, slo, max_local / 2), policy_key="explore",
                 controller=controller)
    return windows, slo


def measure(scenario: Scenario, policy: Policy, key: str) -> dict[str, object]:
    res = run_scenario(scenario, policy, policy_key=key)
    s = summarize(res)
    return {k: s[k] for k in ("goodput", "requests", "turn2_ttft_mean_s", "tpot_mean_s",
                              "tpot_p99_s")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("scenario")
    ap.add_argument("--duration", type=float, default=None, help="override duration_s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rate-scale", type=float, default=None, help="override workload rate")
    ap.add_argument("--ttft-slo", type=float, default=None)
    ap.add_argument("--tpot-slo", type=float, default=None)
    ap.add_argument("--link-gbps", type=float, default=None)
    ap.add_argument("--max-local-share", type=float, default=0.9,
                    help="exploration tables send at most this share of cells decode-local "
                         "(lower it where decode-local overloads the cluster)")
    args = ap.parse_args()
    scenario = load(args.scenario, args)

    windows, slo = explore(scenario, args.seed, args.max_local_share)
    usable = [w for w in windows if w.outcomes]
    print(f"explore: {len(windows)} windows, {len(usable)} with routed requests")
    result = calibrate(usable, now=usable[-1].end, config=CalibrationConfig(slo=slo))
    policy = result.policy
    print(json.dumps({
        "heldout": {r: {t: {"mape": e.mape, "r2": e.r2, "rows": e.rows} for t, e in v.items()}
                    for r, v in result.heldout.items()},
        "weights": result.weights.to_dict()["ratio"],
        "predicted_goodput": result.predicted_goodput_candidate,
        "decode_local_share": result.details.get("decode_local_share"),
        "rounds": len(result.rounds), "converged": result.converged,
    }, indent=1))
    rows = {
        "calibrated": measure(scenario, policy, "calibrated"),
        "calibrated, exploration off": measure(
            scenario, dataclasses.replace(policy, table=dataclasses.replace(
                policy.table, exploration=(0.0,) * policy.table.axes.n_cells)), "no-explore"),
        "all-prefill-node": measure(scenario, Policy.uniform(1, Route.PREFILL_NODE, slo=slo),
                                    "pd"),
        "all-decode-local": measure(scenario, Policy.uniform(1, Route.DECODE_LOCAL, slo=slo),
                                    "local"),
    }
    print("| policy | measured goodput | requests | turn-2+ TTFT mean (s) | TPOT mean (s) "
          "| TPOT p99 (s) |")
    print("|---|---|---|---|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v['goodput']:.4f} | {v['requests']} | {v['turn2_ttft_mean_s']:.3f} "
              f"| {v['tpot_mean_s']:.4f} | {v['tpot_p99_s']:.4f} |")


if __name__ == "__main__":
    main()
