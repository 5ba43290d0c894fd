"""How often does the post-promotion watch roll back a policy it should keep, and how soon does
it catch one it should not? (``Cycle.judge_promotion``)

The watch compares the fleet's goodput over the windows since a promotion with all routers'
over the bake, again at each of its ``watch_windows`` looks, each time on every window since
the promotion. A policy whose goodput fell by exactly the allowed drop (``watch_drop``) is the
worst case the rollback rule must keep: at ``alpha`` per look its false-rollback rate is above
``alpha``. This Monte Carlo draws binomial windows for such a policy and for policies that fell
further, and applies the watch's own test (``two_proportion_z`` below ``watch_critical``) with
each per-look bound:

- ``alpha per look``: ``inv_cdf(alpha)`` at every look (before the bound was split);
- ``alpha / looks``: ``watch_critical(alpha, looks)``, Bonferroni (the code's rule);
- ``Pocock``: the one bound for every look that spends exactly ``alpha`` when the looks add
  equal numbers of requests (multivariate normal, correlation ``sqrt(i / j)``; SciPy's
  integration takes seconds, which is why the daemon does not solve it).

Requests per window: 120 is the bench's fleet (scenario 2 seed 3's rolled-back v11 had 122 in
its first watch window), 800 a larger cluster. Prints, per rule, the share of trials rolled
back and the mean look at which they were.

    .venv/bin/python benchmarks/watch_false_rollbacks.py
    .venv/bin/python benchmarks/watch_false_rollbacks.py --trials 100000 --seed 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from statistics import NormalDist

import numpy as np
from scipy.optimize import brentq
from scipy.stats import multivariate_normal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controller.core.rollout import JudgeParams, two_proportion_z, watch_critical  # noqa: E402


def rollbacks(rng: np.random.Generator, trials: int, per_window: int, bake_windows: int,
              looks: int, p_bake: float, p_watch: float, drop: float, min_requests: float,
              critical: float) -> tuple[float, float]:
    """Share of ``trials`` the watch rolls back, and the mean look (1-based) it did so at."""
    bake = rng.binomial(per_window * bake_windows, p_bake, size=trials)
    watch = rng.binomial(per_window, p_watch, size=(trials, looks)).cumsum(axis=1)
    n_b = per_window * bake_windows
    at = []
    for t in range(trials):
        for look in range(looks):
            n_w = per_window * (look + 1)
            if n_w < min_requests:
                continue
            z = two_proportion_z(float(watch[t, look]), n_w, float(bake[t]), n_b, drop)
            if z is not None and z < critical:
                at.append(look + 1)
                break
    return len(at) / trials, (sum(at) / len(at) if at else float("nan"))


def pocock(alpha: float, looks: int) -> float:
    """The z every look must fall below for a false-rollback rate of exactly ``alpha`` over
    ``looks`` equal increments (negative)."""
    if looks == 1:
        return NormalDist().inv_cdf(alpha)
    cov = np.array([[np.sqrt(min(i, j) / max(i, j)) for j in range(1, looks + 1)]
                    for i in range(1, looks + 1)])
    mvn = multivariate_normal(np.zeros(looks), cov, seed=1)
    return -float(brentq(lambda c: 1 - mvn.cdf(np.full(looks, c)) - alpha, 1.0, 5.0,
                         xtol=1e-4))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20_000, help="trials per row (default 20000)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--p-bake", type=float, default=0.92,
                    help="the bake's goodput (default 0.92, the bench's Mooncake runs)")
    args = ap.parse_args()
    if args.trials < 1 or not 0 < args.p_bake < 1:
        ap.error("--trials must be positive and --p-bake in (0, 1)")
    cfg = JudgeParams()
    looks, drop, alpha = cfg.watch_windows, cfg.watch_drop, cfg.promote_alpha
    rules = {"alpha per look": NormalDist().inv_cdf(alpha),
             "alpha / looks": watch_critical(alpha, looks),
             "Pocock": pocock(alpha, looks)}
    print(f"watch: {looks} looks, drop allowed {drop:g}, alpha {alpha:g}, bake "
          f"{cfg.bake_windows} windows at goodput {args.p_bake:g}, {args.trials} trials a row")
    print("| requests/window | watch goodput (fall) | "
          + " | ".join(f"{name} ({c:.3f}): rolled back, mean look" for name, c in rules.items())
          + " |")
    print("|---|---|" + "---|" * len(rules))
    for per_window in (120, 800):
        for fall in (drop, drop + 0.05, drop + 0.1, 0.5):
            p_watch = args.p_bake - fall
            cells = []
            for critical in rules.values():
                rng = np.random.default_rng(args.seed)  # the same draws for every rule
                share, look = rollbacks(rng, args.trials, per_window, cfg.bake_windows,
                                        looks, args.p_bake, p_watch, drop,
                                        cfg.bake_min_requests, critical)
                cells.append(f"{share:.4f}, {look:.2f}")
            print(f"| {per_window} | {p_watch:.2f} ({fall:g}) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
