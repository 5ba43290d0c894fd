"""Predicted vs measured goodput of a phase's tables (issue 5/7 diagnosis).

For one phase of a bench scenario: the forced runs (all-prefill-node, all-decode-local)
record windows; a table is calibrated on the phase's windows (weights searched, and 1:1);
the latency model then *predicts* the goodput of that table, of all-decode-local and of
all-prefill-node under the phase's mix; each is replayed and the goodput *measured*. Per route
it also prints the predicted against the measured mean TTFT/TPOT (request-weighted over the
phase's cells) under each table's own load, and the SLO-attainment per route.

    .venv/bin/python benchmarks/bench_diagnose.py scenarios/bench/1-mooncake-rising-load.toml \
        --phase 0
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from controller.bench.baselines import ThresholdConfig, install_threshold, static_policy  # noqa: E402
from controller.bench.oracle import windows_in  # noqa: E402
from controller.bench.runner import WindowRecorder, slo_of  # noqa: E402
from controller.core.calibrate import (  # noqa: E402
    CalibrationConfig,
    calibrate,
    policy_routes_on,
    predicted_goodput,
)
from controller.core.features import build_training_set  # noqa: E402
from controller.policy import Policy, Route, Weights  # noqa: E402
from controller.sim.run import RunResult, run_scenario  # noqa: E402
from controller.sim.scenario import load_scenario  # noqa: E402


def phase_stats(res: RunResult, phase: int) -> dict[str, float]:
    slo_t, slo_p = res.ttft_slo_s, res.tpot_slo_s
    recs = [r for r in res.records if r.phase == phase]
    out: dict[str, float] = {"n": len(recs)}
    met = [not r.rejected and r.ttft_s is not None and r.ttft_s <= slo_t
           and (r.tpot_s is None or r.tpot_s <= slo_p) for r in recs]
    out["goodput"] = float(np.mean(met)) if recs else float("nan")
    for route in ("PREFILL_NODE", "DECODE_LOCAL"):
        sel = [r for r in recs if r.route == route and r.turn > 1 and r.ttft_s is not None]
        key = "P" if route == "PREFILL_NODE" else "L"
        out[f"n2_{key}"] = len(sel)
        if sel:
            out[f"ttft_{key}"] = float(np.mean([r.ttft_s for r in sel]))
            out[f"tpot_{key}"] = float(np.mean([r.tpot_s for r in sel if r.tpot_s is not None]))
            out[f"okttft_{key}"] = float(np.mean([r.ttft_s <= slo_t for r in sel]))
            out[f"oktpot_{key}"] = float(np.mean([r.tpot_s is None or r.tpot_s <= slo_p
                                                  for r in sel]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario")
    ap.add_argument("--phase", type=int, default=0)
    ap.add_argument("--scale", type=float, default=1.0, help="duration scale")
    args = ap.parse_args()
    sc = load_scenario(args.scenario)
    from controller.bench.runner import scale_scenario

    sc = scale_scenario(sc, args.scale)
    phases = sc.phase_bounds()
    start, end = phases[args.phase]
    sc = dataclasses.replace(sc, duration_s=end,
                             events=tuple(e for e in sc.events if e.at_s < end))
    slo = slo_of(sc)
    windows = []
    runs: dict[str, RunResult] = {}
    for key, route in (("pd", Route.PREFILL_NODE), ("local", Route.DECODE_LOCAL)):
        rec = WindowRecorder()
        runs[key] = run_scenario(sc, static_policy(route, slo), policy_key=key,
                                 controller=rec, setup=rec.setup)
        rec.close()
        windows += windows_in(rec.windows, start, end)
    windows.sort(key=lambda w: (w.end, w.start))
    runs["threshold"] = run_scenario(sc, static_policy(Route.PREFILL_NODE, slo),
                                     policy_key="threshold",
                                     setup=install_threshold(ThresholdConfig()))
    tables: dict[str, Policy] = {}
    results = {}
    whole = len(windows)  # the phase's whole mix, as the oracle's tables use
    for name, cfg in (("cal-search", CalibrationConfig(slo=slo, recent_windows=whole)),
                      ("cal-1:1", CalibrationConfig(slo=slo, pinned_weights=Weights(1, 1),
                                                    recent_windows=whole))):
        res = calibrate(windows, windows[-1].end, None, cfg)
        results[name] = res
        tables[name] = res.policy
    ref = results["cal-search"]
    model, grid = ref.model, ref.grid
    print("model:", {k: v for k, v in model.report.items() if k != "components"})
    print("components:", model.report.get("components"))
    print("heldout MAPE:", ref.heldout_mape())
    print("weights:", ref.weights.to_dict() if hasattr(ref.weights, "to_dict") else ref.weights)
    print("grid qps_weight nonzero rows:", np.flatnonzero(grid.qps_weight),
          "n_routers", grid.n_routers, "out", grid.output_tokens)
    for name, pol in tables.items():
        runs[name] = run_scenario(sc, pol, policy_key=name)
    candidates = {"pd": static_policy(Route.PREFILL_NODE, slo),
                  "local": static_policy(Route.DECODE_LOCAL, slo), **tables}
    print(f"\n{'policy':12} {'pred':>6} {'meas':>6} | per route (turn 2+): n, TTFT mean "
          "pred/meas, TPOT mean pred/meas, TTFT ok, TPOT ok")
    for name in ("pd", "local", "threshold", *tables):
        st = phase_stats(runs[name], args.phase)
        pred_g = None
        line = ""
        if name in candidates:
            g_ = grid.with_first_turn(candidates[name].overrides.first_turn_route)
            routes, expl = policy_routes_on(candidates[name], g_)
            pred_g, pred = predicted_goodput(model, g_, routes, expl, slo)
            sc_ = g_.scenario(routes.astype(float))
            w = (np.stack([sc_.rate_p, sc_.rate_l], axis=2)) * grid.qps_weight[:, None, None]
            for r, key in ((0, "P"), (1, "L")):
                m = w[:, :, r].sum()
                if m > 0:
                    pt = float((w[:, :, r] * pred.ttft[:, :, r]).sum() / m)
                    pp = float((w[:, :, r] * pred.tpot[:, :, r]).sum() / m)
                    line += (f" {key}: n={st.get('n2_' + key, 0):.0f} ttft {pt:.3f}/"
                             f"{st.get('ttft_' + key, float('nan')):.3f} tpot {pp:.4f}/"
                             f"{st.get('tpot_' + key, float('nan')):.4f} ok "
                             f"{st.get('okttft_' + key, float('nan')):.2f}/"
                             f"{st.get('oktpot_' + key, float('nan')):.2f}")
        else:
            for key in ("P", "L"):
                if st.get("n2_" + key):
                    line += (f" {key}: n={st['n2_' + key]:.0f} ttft -/{st['ttft_' + key]:.3f}"
                             f" tpot -/{st['tpot_' + key]:.4f} ok {st['okttft_' + key]:.2f}/"
                             f"{st['oktpot_' + key]:.2f}")
        ps = f"{pred_g:.3f}" if pred_g is not None else "  -  "
        print(f"{name:12} {ps:>6} {st['goodput']:.3f} |{line}")
    ts = build_training_set(windows)
    print("\nwindows", len(windows), "rows", ts.n_rows)
    print("table decode-local share (cal-search):", ref.details.get("decode_local_share"),
          "first turn:", ref.details.get("first_turn_route"), ref.details.get("first_turn_goodput"))


if __name__ == "__main__":
    main()
