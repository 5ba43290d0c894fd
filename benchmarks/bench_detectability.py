"""How fast can any detector see a built-in scenario's rate steps? (issue 7's "adapt within
3 control intervals")

Replays a bench scenario under ``pd`` (routing does not change arrivals), records one window
per control interval, and for every ``rate_scale`` event prints the per-window log request
rate's spread in the phase before it, the step in those standard deviations, and what a
one-sided CUSUM tuned for exactly that step would need: Siegmund's approximations for the
average run length, with the threshold set for at most one false alarm in two stationary
hours, and the expected delay after the step. With a mean log-rate step ``d`` (in sd units)
the best allowance is ``k = d / 2``; the run lengths are

    ARL(mu) = (exp(-2 b D) + 2 b D - 1) / (2 D^2),  D = mu - k,  b = h + 1.166

(in windows; ``mu`` = 0 for the false-alarm run length, ``d`` for the delay).

    .venv/bin/python benchmarks/bench_detectability.py          # scenario 1
    .venv/bin/python benchmarks/bench_detectability.py 1 --seed 2
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controller.bench.baselines import static_policy  # noqa: E402
from controller.bench.oracle import windows_in  # noqa: E402
from controller.bench.runner import (  # noqa: E402
    WindowRecorder,
    numbered_scenarios,
    quiet_logs,
    slo_of,
)
from controller.core.drift import window_qps  # noqa: E402
from controller.policy import Route  # noqa: E402
from controller.sim.run import run_scenario  # noqa: E402


def siegmund_arl(mu: float, k: float, h: float) -> float:
    """Average run length of a one-sided CUSUM (unit variance, drift ``mu``)."""
    d, b = mu - k, h + 1.166
    if abs(d) < 1e-9:
        return b * b
    return (math.exp(-2.0 * b * d) + 2.0 * b * d - 1.0) / (2.0 * d * d)


def threshold_for(arl0: float, k: float) -> float:
    """The smallest CUSUM threshold whose in-control run length reaches ``arl0``."""
    lo, hi = 0.0, 50.0
    for _ in range(60):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if siegmund_arl(0.0, k, mid) < arl0 else (lo, mid)
    return hi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("which", nargs="*", default=["1"], help="scenario numbers")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    quiet_logs()
    for _, scenario in numbered_scenarios(ROOT / "scenarios/bench", args.which, args.seed):
        recorder = WindowRecorder()
        run_scenario(scenario, static_policy(Route.PREFILL_NODE, slo_of(scenario)),
                     policy_key="pd", controller=recorder, setup=recorder.setup)
        recorder.close()
        bounds = scenario.phase_bounds()
        arl0 = 2 * 3600 / scenario.interval_s  # one false alarm per two stationary hours
        for i, event in enumerate(e for e in scenario.events if e.kind == "rate_scale"):
            if event.factor == 1.0:
                continue  # a report boundary, not a change
            phase = next(j for j, (s, _) in enumerate(bounds) if s >= event.at_s)
            before = [math.log(max(window_qps(w), 1e-9))
                      for w in windows_in(recorder.windows, *bounds[phase - 1])]
            after = [math.log(max(window_qps(w), 1e-9))
                     for w in windows_in(recorder.windows, *bounds[phase])]
            sd = statistics.stdev(before)
            base = statistics.fmean(before)
            # The whole next phase, and its first three windows: a rate step on session
            # starts reaches the request rate gradually (later turns follow think times).
            for label, sample in (("phase", after), ("first 3 windows", after[:3])):
                step = (statistics.fmean(sample) - base) / sd
                k = step / 2.0
                h = threshold_for(arl0, k)
                delay = siegmund_arl(step, k, h)
                print(f"{scenario.name} seed {scenario.seed} event {i} (x{event.factor:g} at "
                      f"{event.at_s:.0f} s), {label}: log-rate sd per "
                      f"{scenario.interval_s:.0f} s window {sd:.3f} ({len(before)} windows), "
                      f"step {step:.2f} sd; best CUSUM for it (k {k:.2f}, h {h:.2f}, one "
                      f"false alarm per {arl0:.0f} windows) expects {delay:.1f} windows = "
                      f"{delay * scenario.interval_s:.0f} s", flush=True)


if __name__ == "__main__":
    main()
