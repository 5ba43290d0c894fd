"""What does exploration cost after a shift, predicted against measured? (issue 5, QPS x2)

``core_sim_shifts.py`` measures the recalibrated policy P1 after QPS x2 below all-prefill-node
(0.3420 against 0.3629) although P1's table sends every later turn to a prefill node, as
all-prefill does. This replays that calibration (the same exploration runs of the base and
the new regime, the same P0 and P1) and measures, over several simulator seeds of the new
regime, P1's table with its exploration set to fixed shares in every cell that has one
(0 = the table alone), with P1's own exploration, and all-decode-local. Per row: the goodput
the model predicts (``predicted_goodput`` at the recent windows' loads, as the guardrail
sees it), the goodput measured per seed, its mean and the mean paired difference against
exploration 0, and, for the later turns of the busiest cell on a prefill node, the mean TPOT
and the share meeting both SLOs, predicted and measured (the latter over later turns on a
prefill node).

    .venv/bin/python benchmarks/core_sim_exploration_cost.py
    .venv/bin/python benchmarks/core_sim_exploration_cost.py --seeds 3 --shift "QPS x1.3"
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
from core_sim_shifts import add_base_options, base_regime, explored, shifts  # noqa: E402

from controller.core.calibrate import (  # noqa: E402
    CalibrationConfig,
    calibrate,
    local_share,
    policy_routes_on,
    predicted_goodput,
    table_grid,
)
from controller.core.features import build_training_set  # noqa: E402
from controller.policy.model import LookupTable, Policy, Route  # noqa: E402
from controller.sim.run import run_scenario  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_base_options(ap)
    ap.add_argument("--shift", default="QPS x2")
    ap.add_argument("--seeds", type=int, default=5, help="simulator seeds 1..N per row")
    ap.add_argument("--shares", default="0,0.0025,0.005,0.01,0.02",
                    help="exploration shares to try in P1's exploring cells")
    args = ap.parse_args()

    base, slo = base_regime(args)
    cfg = CalibrationConfig(slo=slo)
    regime = next(s for s in shifts(base) if s[0] == args.shift)[2](base)
    # The same exploration runs and calibrations as core_sim_shifts.py.
    r0 = calibrate(*explored(base, args.explore_s, 0), config=cfg)
    w1, _ = explored(regime, args.explore_s, 1)
    r1 = calibrate(w1, w1[-1].end, current=r0.policy, config=cfg)
    p1 = r1.policy
    grid = table_grid(build_training_set(w1), cfg.axes, cfg.recent_windows,
                      r0.policy.overrides.first_turn_route)
    busiest = int(np.argmax(grid.mix))
    own = np.array(p1.table.exploration)
    print(f"P1 ({'approved' if r1.approved else 'rejected'}, predicted "
          f"{r1.predicted_goodput_candidate:.4f} vs current "
          f"{r1.predicted_goodput_current:.4f}): exploration in {int((own > 0).sum())} cells, "
          f"{own[own > 0].min():.4f}-{own.max():.4f}; price scale "
          f"{r1.details['exploration_scale']:.3f}; model sigma {r1.model.sigma}")

    def with_exploration(share: float | None) -> Policy:
        t = p1.table
        expl = t.exploration if share is None else tuple(
            share if x > 0 else 0.0 for x in t.exploration)
        return dataclasses.replace(p1, table=LookupTable(t.axes, t.routes, t.scores, expl))

    rows: list[tuple[str, Policy]] = [
        (f"P1 table, exploration {float(s):g}", with_exploration(float(s)))
        for s in args.shares.split(",")]
    rows.append(("P1 as calibrated", with_exploration(None)))
    rows.append(("all-decode-local", Policy.uniform(1, Route.DECODE_LOCAL, slo=slo)))
    seeds = list(range(1, args.seeds + 1))
    baseline: list[float] | None = None
    print(f"| policy | predicted | measured, seeds {seeds[0]}-{seeds[-1]} | mean | "
          f"mean - exploration 0 | busiest cell, prefill node: TPOT predicted / measured "
          f"(ms) | both SLOs met, predicted / measured |")
    print("|---|---|---|---|---|---|---|")
    for label, pol in rows:
        g = grid.with_first_turn(pol.overrides.first_turn_route)
        routes, expl = policy_routes_on(pol, g)
        predicted, _ = predicted_goodput(r1.model, g, routes, expl, slo)
        ev, rows_of = g.evaluation()
        sc = ev.scenario(np.broadcast_to(local_share(routes, expl),
                                         (g.qps.shape[0], g.context.shape[0]))[rows_of])
        pred = r1.model.predict(sc)
        met = r1.model.met_probability(pred, sc, slo.ttft_s, slo.tpot_s)
        tpot_pred = float(np.dot(ev.qps_weight, pred.tpot[:, busiest, 0]))
        met_pred = float(np.dot(ev.qps_weight, met[:, busiest, 0]))
        measured, tpots, met_share = [], [], []
        for seed in seeds:
            res = run_scenario(dataclasses.replace(regime, duration_s=args.measure_s,
                                                   seed=seed), pol)
            recs = res.records
            ok = [not r.rejected and r.ttft_s is not None and r.ttft_s <= slo.ttft_s
                  and (r.tpot_s is None or r.tpot_s <= slo.tpot_s) for r in recs]
            measured.append(float(np.mean(ok)))
            later = [(r.tpot_s, o) for r, o in zip(recs, ok, strict=True)
                     if r.turn > 1 and r.route == "PREFILL_NODE" and r.tpot_s is not None]
            if later:
                tpots.append(float(np.mean([t for t, _ in later])))
                met_share.append(float(np.mean([o for _, o in later])))
        if baseline is None:
            baseline = measured
        diff = float(np.mean(np.array(measured) - np.array(baseline)))
        m_tpot = f"{np.mean(tpots) * 1e3:.2f}" if tpots else "-"
        m_met = f"{np.mean(met_share):.3f}" if met_share else "-"
        print(f"| {label} | {predicted:.4f} | {', '.join(f'{x:.4f}' for x in measured)} | "
              f"{np.mean(measured):.4f} | {diff:+.4f} | {tpot_pred * 1e3:.2f} / {m_tpot} | "
              f"{met_pred:.3f} / {m_met} |", flush=True)


if __name__ == "__main__":
    main()
