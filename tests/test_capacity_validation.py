"""The capacity plan on the simulator, end to end and short: windows from one run, the plan
from those windows, then the recommended shape meets the SLOs and one decode worker fewer does
not (the full table over three workloads is benchmarks/capacity_validation.py)."""

from __future__ import annotations

from typing import Any

import numpy as np

from controller.config import load_settings
from controller.loop.capacity import PlanOverrides, plan_from_windows
from controller.sim.run import RunResult

SLO = (1.0, 0.015)  # p99 TTFT, p99 TPOT (s)
WARMUP_S, DURATION_S = 40.0, 160.0


def _run(shape: tuple[int, int], recorder: Any = None) -> RunResult:
    from controller.bench.baselines import ThresholdConfig, install_threshold
    from controller.sim.run import run_scenario
    from controller.sim.scenario import parse_scenario

    scenario = parse_scenario({
        "name": "capacity-check", "seed": 11, "duration_s": DURATION_S,
        "cluster": {"prefill_workers": shape[0], "decode_workers": shape[1]},
        "workload": {"source": "synthetic", "params": {
            "qps": 20.0, "turns": 3, "turn1_input": 512, "turn1_output": 512,
            "append_input": 64, "append_output": 512, "think_s": 1.0, "think": "exp"}},
        "slo": {"ttft_s": SLO[0], "tpot_s": SLO[1]},
        "controller": {"interval_s": 10},
    })
    route = install_threshold(ThresholdConfig(prefill_waiting=0))

    def setup(cluster: Any) -> None:
        route(cluster)
        if recorder is not None:
            recorder.setup(cluster)

    return run_scenario(scenario, None, controller=recorder, setup=setup)


def _p99(result: RunResult) -> tuple[float, float]:
    rows = [r for r in result.records if WARMUP_S <= r.arrival_s < DURATION_S]
    assert rows and not any(r.rejected for r in rows)
    ttft = [r.ttft_s for r in rows if r.ttft_s is not None]
    tpot = [r.tpot_s for r in rows if r.tpot_s is not None]
    return float(np.percentile(ttft, 99)), float(np.percentile(tpot, 99))


def test_recommended_shape_meets_the_slos_and_one_decode_fewer_does_not() -> None:
    from controller.bench.runner import WindowRecorder

    recorder = WindowRecorder()
    observed = _run((2, 4), recorder)
    recorder.close()
    windows = [w for w in recorder.windows if w.start >= WARMUP_S and w.end <= DURATION_S]
    profile = observed.cluster.profile
    plan = plan_from_windows(
        windows, load_settings(None, slo={"ttft_s": SLO[0], "tpot_s": SLO[1]}),
        PlanOverrides(headroom=0.0, prefill_scv=0.0, input_scv=0.3, append_scv=0.0,
                      kv_capacity_tokens=profile.num_gpu_blocks * profile.block_size,
                      max_num_seqs=profile.max_num_seqs),
    )
    shape = (plan.prefill.workers, plan.decode.workers)
    assert plan.decode.binding == "p99 TPOT"
    assert shape[1] >= 2, plan.decode.explanation  # this load needs more than one
    ttft, tpot = _p99(_run(shape))
    assert ttft <= SLO[0] and tpot <= SLO[1], (shape, ttft, tpot)
    _, tpot_fewer = _p99(_run((shape[0], shape[1] - 1)))
    assert tpot_fewer > SLO[1], (shape, tpot_fewer)
    # the prediction at the recommendation is within the SLO and not far below the measure
    assert plan.decode.predicted_p99_s <= SLO[1]
    assert plan.decode.predicted_p99_s >= 0.5 * tpot
