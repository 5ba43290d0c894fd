"""Speed of the simulator: the whole Mooncake conversation hour on 2 prefill + 6 decode workers.

Run from the repository root: ``.venv/bin/python benchmarks/sim_mooncake_hour.py [--policy
pd|local] [--step-by-step]``. Prints simulated requests, wall seconds, simulated requests per
wall second, events processed and the peak resident memory of the process (target: under 60 s
and under 1 GB on a 2-core machine).
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from controller.bench.report import summarize  # noqa: E402
from controller.clock import WallClock  # noqa: E402
from controller.policy import Policy, Route  # noqa: E402
from controller.sim.run import run_scenario  # noqa: E402
from controller.sim.scenario import parse_scenario  # noqa: E402

SCENARIO = {
    "name": "mooncake-hour-2p6d",
    "seed": 1,
    "duration_s": 3700.0,  # the trace spans one hour; arrivals jitter inside 3-s stamps
    "cluster": {"prefill_workers": 2, "decode_workers": 6, "profile": "llama-3.1-8b-h100",
                "kv_link_gbps": 200},
    "workload": {"source": "mooncake"},
    "slo": {"ttft_s": 2.0, "tpot_s": 0.1},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--policy", choices=("pd", "local"), default="pd")
    ap.add_argument("--step-by-step", action="store_true",
                    help="disable closed-form decode runs (for comparison)")
    args = ap.parse_args()
    route = Route.PREFILL_NODE if args.policy == "pd" else Route.DECODE_LOCAL
    wall = WallClock()
    t0 = wall.perf_counter_ns()
    scenario = parse_scenario(SCENARIO)
    res = run_scenario(scenario, Policy.uniform(1, route), policy_key=args.policy,
                       closed_form=not args.step_by_step)
    total_s = (wall.perf_counter_ns() - t0) / 1e9
    s = summarize(res)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    n = s["requests"]
    print(f"scenario            {scenario.name} (policy {args.policy}, "
          f"{'step-by-step' if args.step_by_step else 'closed-form runs'})")
    print(f"requests            {n} ({s['rejected']} rejected)")
    print(f"simulated time      {res.sim_end_s:.0f} s")
    print(f"wall time           {res.wall_s:.1f} s run, {total_s:.1f} s with loading")
    print(f"requests/wall s     {n / total_s:.0f}")
    print(f"events              {res.events}")
    print(f"peak RSS            {peak_mb:.0f} MB")
    print(f"goodput             {s['goodput']:.3f}")
    t2 = s["turn2_ttft_mean_s"]
    print(f"turn-2+ TTFT mean   {t2 * 1e3:.1f} ms" if t2 is not None else "turn-2+ TTFT -")
    print(f"TPOT mean           {s['tpot_mean_s'] * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
