"""Shifts on the simulated cluster: does the right detector fire, and does recalibrating pay?

Base: a scenario (default ``scenarios/ppd-2p2d.toml`` with tight SLOs). The policy P0 is
calibrated from an exploration run of the base regime (random tables, as in
``core_sim_experiment.py``). Then, per shift:

1. **Detection**: the scenario runs under P0 with the shift as an event at ``--shift-at``;
   windows come from ``InProcessSource`` every control interval; the drift reference is built
   from the windows of the base regime before the shift; every later window is assessed
   (workload, performance, SLO) and checked for scaling events. Printed: windows from the
   shift until each detector (or the scaling check) fires.
2. **Recalibration**: an exploration run of the new regime (the shift applied from t = 0)
   gives the calibration set of P1 (an active recalibration). Goodput is then *measured* in
   the new regime for P0, P1, all-prefill-node and all-decode-local.

    .venv/bin/python benchmarks/core_sim_shifts.py
    .venv/bin/python benchmarks/core_sim_shifts.py --only "KV link / 4"
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from core_sim_experiment import explore  # noqa: E402

from controller.bench.report import summarize  # noqa: E402
from controller.core.calibrate import CalibrationConfig, CalibrationResult, calibrate  # noqa: E402
from controller.core.drift import (  # noqa: E402
    DriftState,
    ScalingState,
    assess,
    performance_residuals,
    reference_from_windows,
    step_scaling,
)
from controller.core.window import Window  # noqa: E402
from controller.observe.inprocess import InProcessSource, sim_cluster_provider  # noqa: E402
from controller.policy.model import Policy, Route, Slo  # noqa: E402
from controller.sim.cluster import SimCluster  # noqa: E402
from controller.sim.run import run_scenario  # noqa: E402
from controller.sim.scenario import Event, Scenario, load_scenario  # noqa: E402


def add_base_options(ap: argparse.ArgumentParser) -> None:
    """The options the shift benchmarks share: the base scenario, its SLOs, and how long the
    exploration and measurement runs last."""
    ap.add_argument("--scenario", default=str(ROOT / "scenarios/ppd-2p2d.toml"))
    ap.add_argument("--ttft-slo", type=float, default=0.06)
    ap.add_argument("--tpot-slo", type=float, default=0.012)
    ap.add_argument("--explore-s", type=float, default=900.0)
    ap.add_argument("--measure-s", type=float, default=600.0)


def base_regime(args: argparse.Namespace) -> tuple[Scenario, Slo]:
    """The base scenario with the SLOs of ``args`` and no events, and those SLOs."""
    base = dataclasses.replace(load_scenario(args.scenario), ttft_slo_s=args.ttft_slo,
                               tpot_slo_s=args.tpot_slo, events=())
    return base, Slo(args.ttft_slo, args.tpot_slo)


def explored(regime: Scenario, duration_s: float, seed: int) -> tuple[list[Window], float]:
    """An exploration run (random tables) of ``regime``: its windows that saw requests, and
    the end of its last window."""
    windows, _ = explore(dataclasses.replace(regime, duration_s=duration_s), seed)
    return [w for w in windows if w.outcomes], windows[-1].end


def with_params(s: Scenario, **changes: float) -> Scenario:
    params = dict(s.workload.params) | changes
    return dataclasses.replace(
        s, workload=dataclasses.replace(s.workload, params=MappingProxyType(params)))


Shift = tuple[str, Callable[[Scenario, float], Event], Callable[[Scenario], Scenario]]


def shifts(base: Scenario) -> list[Shift]:
    t1 = int(base.workload.params.get("turn1_input", 2048))
    ctx3 = with_params(base, turn1_input=t1 * 3)
    return [
        ("KV link / 4", lambda s, t: Event(t, "link_bandwidth", factor=0.25),
         lambda s: dataclasses.replace(s, cluster=dataclasses.replace(
             s.cluster, kv_link_gbps=s.cluster.kv_link_gbps / 4))),
        ("prefill workers 2 -> 1", lambda s, t: Event(t, "remove_worker", role="prefill"),
         lambda s: dataclasses.replace(s, cluster=dataclasses.replace(
             s.cluster, prefill_workers=s.cluster.prefill_workers - 1))),
        ("context_tokens x3", lambda s, t: Event(t, "workload", workload=ctx3.workload),
         lambda s: with_params(s, turn1_input=t1 * 3)),
        ("QPS x2", lambda s, t: Event(t, "rate_scale", factor=2.0),
         lambda s: dataclasses.replace(s, workload=dataclasses.replace(
             s.workload, rate_scale=s.workload.rate_scale * 2.0))),
        ("QPS x1.3", lambda s, t: Event(t, "rate_scale", factor=1.3),
         lambda s: dataclasses.replace(s, workload=dataclasses.replace(
             s.workload, rate_scale=s.workload.rate_scale * 1.3))),
    ]


def detect(scenario: Scenario, policy: Policy, result: CalibrationResult, shift_at: float,
           ref_from: float) -> dict[str, int | None]:
    """Windows after the shift until each detector fires (None: not within the run)."""
    windows: list[Window] = []
    state: dict[str, object] = {"source": None, "last": 0.0, "drift": DriftState(),
                                "ref": None, "scaling": ScalingState()}
    fired: dict[str, int | None] = {"workload": None, "performance": None, "slo": None,
                                    "scaling": None}

    def controller(now: float, cluster: SimCluster) -> None:
        source = state["source"]
        if source is None:
            source = InProcessSource.following(sim_cluster_provider(cluster), cluster.clock)
            state["source"] = source
            asyncio.run(source.window(0.0, now))
            state["last"] = now
            return
        assert isinstance(source, InProcessSource)
        last = state["last"]
        assert isinstance(last, float)
        w = asyncio.run(source.window(last, now))
        state["last"] = now
        windows.append(w)
        scaling = state["scaling"]
        assert isinstance(scaling, ScalingState)
        scaling, events = step_scaling(scaling, w)
        state["scaling"] = scaling
        if w.end <= shift_at:
            return
        if state["ref"] is None:
            base = [x for x in windows if x.start >= ref_from and x.end <= shift_at]
            state["ref"] = reference_from_windows(base, result.model)
        ref = state["ref"]
        k = (w.end - shift_at) / scenario.interval_s  # windows since the shift
        if events and fired["scaling"] is None:
            fired["scaling"] = round(k)
        drift = state["drift"]
        assert isinstance(drift, DriftState)
        residuals = performance_residuals(result.model, [w])[0]
        drift, verdicts = assess(drift, ref, w, w.end, residuals)  # type: ignore[arg-type]
        state["drift"] = drift
        for v in verdicts:
            if v.fired and fired[v.kind] is None:
                fired[v.kind] = round(k)

    run_scenario(scenario, policy, policy_key="p0", controller=controller)
    return fired


def steady_false_alarms(scenario: Scenario, policy: Policy, result: CalibrationResult,
                        duration_s: float, ref_until: float) -> dict[str, int]:
    """Fires per detector over ``duration_s`` of the unchanged regime (no event)."""
    counts = {"workload": 0, "performance": 0, "slo": 0, "scaling": 0}
    windows: list[Window] = []
    state: dict[str, object] = {"source": None, "last": 0.0, "drift": DriftState(),
                                "ref": None, "scaling": ScalingState()}

    def controller(now: float, cluster: SimCluster) -> None:
        source = state["source"]
        if source is None:
            source = InProcessSource.following(sim_cluster_provider(cluster), cluster.clock)
            state["source"] = source
            asyncio.run(source.window(0.0, now))
            state["last"] = now
            return
        assert isinstance(source, InProcessSource)
        last = state["last"]
        assert isinstance(last, float)
        w = asyncio.run(source.window(last, now))
        state["last"] = now
        windows.append(w)
        scaling = state["scaling"]
        assert isinstance(scaling, ScalingState)
        scaling, events = step_scaling(scaling, w)
        state["scaling"] = scaling
        if w.end <= ref_until or w.end > scenario.duration_s:
            return  # the reference period, and the drain after the last arrivals
        if state["ref"] is None:
            state["ref"] = reference_from_windows(
                [x for x in windows if x.start >= 120.0 and x.end <= ref_until], result.model)
        counts["scaling"] += len(events)
        drift = state["drift"]
        assert isinstance(drift, DriftState)
        residuals = performance_residuals(result.model, [w])[0]
        drift, verdicts = assess(drift, state["ref"], w, w.end, residuals)  # type: ignore[arg-type]
        state["drift"] = drift
        for v in verdicts:
            counts[v.kind] += int(v.fired)

    run_scenario(dataclasses.replace(scenario, duration_s=ref_until + duration_s), policy,
                 policy_key="p0", controller=controller)
    return counts


def measure(scenario: Scenario, policy: Policy) -> float:
    g = summarize(run_scenario(scenario, policy))["goodput"]
    assert isinstance(g, float)
    return g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_base_options(ap)
    ap.add_argument("--shift-at", type=float, default=600.0)
    ap.add_argument("--after-s", type=float, default=300.0, help="run time after the shift")
    ap.add_argument("--only", default=None, help="one shift by name ('none': no shift)")
    ap.add_argument("--steady-s", type=float, default=7200.0,
                    help="steady run after the reference to count false alarms (0: skip)")
    args = ap.parse_args()

    base, slo = base_regime(args)
    cfg = CalibrationConfig(slo=slo)
    r0 = calibrate(*explored(base, args.explore_s, 0), config=cfg)
    p0 = r0.policy
    print(f"P0: weights {r0.weights.ratio:g}, decode-local share "
          f"{r0.details['decode_local_share']:.2f}, held-out MAPE {r0.heldout_mape()}")
    if args.steady_s > 0:
        fires = steady_false_alarms(base, p0, r0, args.steady_s, args.shift_at)
        print(f"steady regime under P0, {args.steady_s / 3600:g} h after the reference "
              f"({args.steady_s / base.interval_s:.0f} windows): fires {fires}", flush=True)
    all_p = Policy.uniform(1, Route.PREFILL_NODE, slo=slo)
    all_l = Policy.uniform(1, Route.DECODE_LOCAL, slo=slo)
    print("| shift | workload | performance | slo | scaling | goodput new regime: P0 "
          "| P1 (recalibrated) | guardrail on P1 | deployed | all-prefill | all-local |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, event, new_regime in shifts(base):
        if args.only and args.only != name:
            continue
        run = dataclasses.replace(base, duration_s=args.shift_at + args.after_s,
                                  events=(event(base, args.shift_at),))
        fired = detect(run, p0, r0, args.shift_at, ref_from=120.0)
        regime = new_regime(base)
        r1 = calibrate(*explored(regime, args.explore_s, 1), current=p0, config=cfg)
        m = dataclasses.replace(regime, duration_s=args.measure_s)
        g = [measure(m, p) for p in (p0, r1.policy, all_p, all_l)]

        def cell(v: int | None) -> str:
            return "-" if v is None else str(v)

        print(f"| {name} | {cell(fired['workload'])} | {cell(fired['performance'])} | "
              f"{cell(fired['slo'])} | {cell(fired['scaling'])} | {g[0]:.4f} | {g[1]:.4f} | "
              f"{'approved' if r1.approved else 'rejected'} "
              f"({r1.predicted_goodput_candidate:.3f} vs {r1.predicted_goodput_current:.3f}) | "
              f"{g[1] if r1.approved else g[0]:.4f} | {g[2]:.4f} | {g[3]:.4f} |", flush=True)


if __name__ == "__main__":
    main()
