"""What the daemon's capacity step costs per run: ``plan_from_windows`` on real windows.

Run from the repository root: ``.venv/bin/python benchmarks/capacity_plan_cost.py``.

A short virtual-time simulation (1 prefill, 3 decode workers, 2 routers, a multi-turn
synthetic workload whose rate triples halfway) yields one window per 30 s control interval
through ``InProcessSource``, exactly as the cycle observes it. Then the daemon's planner
(``controller.daemon.SettingsPlanner``: demand from the windows, physics fitted on them, the
plan) runs on the newest 10 windows (the default ``[capacity] interval_s`` 300 s / 30 s) and
on 40 windows, ``--repeat`` times each; it prints the median and p95 wall time per plan and
the recommendation. Writing the recommendation is one more row in the cycle's transaction
(see ``benchmarks/store_write_window.py`` for the store's write costs).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from controller.clock import WallClock  # noqa: E402
from controller.config import load_settings  # noqa: E402
from controller.core.window import Window  # noqa: E402
from controller.daemon import SettingsPlanner  # noqa: E402
from controller.observe.inprocess import InProcessSource, sim_cluster_provider  # noqa: E402
from controller.policy import Policy, Route  # noqa: E402
from controller.sim.run import run_scenario  # noqa: E402
from controller.sim.scenario import load_scenario  # noqa: E402

INTERVAL_S = 30

SCENARIO = f"""
name = "capacity-plan-cost"
seed = 11
duration_s = 1500

[cluster]
prefill_workers = 1
decode_workers = 3
profile = "llama-3.1-8b-h100"
kv_link_gbps = 100
max_batch_tokens = 8192
routers = 2
prefill_prefix_cache = true
transfer_missing_only = true

[workload]
source = "synthetic"

[workload.params]
qps = 4
turns = 4
turn1_input = 1024
turn1_output = 128
append_input = 128
append_output = 128
think_s = 2.0

[[events]]
at_s = 750
kind = "rate_scale"
factor = 3.0

[slo]
ttft_s = 0.5
tpot_s = 0.05

[controller]
interval_s = {INTERVAL_S}
"""


def collect_windows() -> list[Window]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "scenario.toml"
        path.write_text(SCENARIO)
        scenario = load_scenario(path)
    loop = asyncio.new_event_loop()
    windows: list[Window] = []
    state: dict[str, Any] = {}

    def controller(t: float, cluster: Any) -> None:
        if "source" not in state:
            state["source"] = InProcessSource.following(sim_cluster_provider(cluster),
                                                        cluster.clock)
            state["last"] = t - INTERVAL_S
        windows.append(loop.run_until_complete(state["source"].window(state["last"], t)))
        state["last"] = t

    try:
        run_scenario(scenario, Policy.uniform(1, Route.PREFILL_NODE), controller=controller)
    finally:
        loop.close()
    return windows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeat", type=int, default=20, help="plans per window count")
    args = parser.parse_args()
    clock = WallClock()
    t0 = clock.perf_counter_ns()
    windows = collect_windows()
    print(f"simulated {len(windows)} windows of {INTERVAL_S} s in "
          f"{(clock.perf_counter_ns() - t0) / 1e9:.1f} s")
    planner = SettingsPlanner(load_settings(slo={"ttft_s": 0.5, "tpot_s": 0.05}))
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    for n in (10, 40):
        recent = windows[-n:]
        times_ms = []
        plan = None
        for _ in range(args.repeat):
            t = clock.perf_counter_ns()
            plan = planner.plan(recent)
            times_ms.append((clock.perf_counter_ns() - t) / 1e6)
        assert plan is not None
        times_ms.sort()
        p95 = times_ms[min(len(times_ms) - 1, round(0.95 * (len(times_ms) - 1)))]
        print(f"{n:3d} windows: plan median {statistics.median(times_ms):7.1f} ms, "
              f"p95 {p95:7.1f} ms over {args.repeat} runs; recommends prefill "
              f"{plan.prefill.workers} ({plan.prefill.binding}), decode {plan.decode.workers} "
              f"({plan.decode.binding}) for {plan.demand.qps:.1f} req/s")
    print(f"load ≈ {load} (/proc/loadavg, 1 min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
