"""The capacity adapter on real simulator windows: the demand it reads is the load that ran."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

from controller.config import load_settings
from controller.core.latency_model import ComponentParams
from controller.core.window import Window
from controller.loop.capacity import (
    NoDemand,
    PlanOverrides,
    fitted_params,
    observe_demand,
    plan_from_windows,
)
from controller.sim.run import RunResult

WARMUP_S = 30.0


@functools.cache
def sim_run(shape: tuple[int, int] = (1, 2), qps: float = 6.0) -> tuple[list[Window], RunResult]:
    """A short multi-turn synthetic run, one window per 10 s through the in-process scrape;
    appends below 2048 uncached tokens go decode-local (Dynamo's rule, no busyness clause)."""
    from controller.bench.baselines import ThresholdConfig, install_threshold
    from controller.bench.runner import WindowRecorder
    from controller.sim.run import run_scenario
    from controller.sim.scenario import parse_scenario

    scenario = parse_scenario({
        "name": "capacity-adapter", "seed": 5, "duration_s": 120,
        "cluster": {"prefill_workers": shape[0], "decode_workers": shape[1]},
        "workload": {"source": "synthetic", "params": {
            "qps": qps, "turns": 3, "turn1_input": 1024, "turn1_output": 128,
            "append_input": 128, "append_output": 128, "think_s": 1.0, "think": "exp"}},
        "controller": {"interval_s": 10},
    })
    recorder = WindowRecorder()
    route = install_threshold(ThresholdConfig(prefill_waiting=0))

    def setup(cluster: Any) -> None:
        route(cluster)
        recorder.setup(cluster)

    result = run_scenario(scenario, None, controller=recorder, setup=setup)
    recorder.close()
    return recorder.windows, result


def measured(windows: list[Window]) -> list[Window]:
    return [w for w in windows if w.start >= WARMUP_S and w.end <= 120.0]


def test_demand_is_the_load_that_ran() -> None:
    windows, result = sim_run()
    win = measured(windows)
    seen = observe_demand(win)
    t0, t1 = win[0].start, win[-1].end
    done = [r for r in result.records if r.finish_s is not None and t0 <= r.finish_s < t1]
    arrived = [r for r in result.records if t0 <= r.arrival_s < t1]
    assert seen.qps == pytest.approx(len(arrived) / (t1 - t0), rel=0.1)
    assert seen.output_tokens == pytest.approx(np.mean([r.output_tokens for r in done]), rel=0.1)
    assert seen.input_tokens == pytest.approx(np.mean([r.prompt_tokens for r in done]), rel=0.1)
    local = np.mean([r.route == "DECODE_LOCAL" for r in done])
    assert seen.decode_local_share == pytest.approx(local, abs=0.05)
    # later turns reuse the session's KV: a large cached share, and decode-local requests
    # compute about their appended tokens
    assert seen.cached_fraction is not None and 0.3 < seen.cached_fraction < 0.95
    assert seen.local_append_tokens == pytest.approx(128, rel=0.35)
    assert seen.current == (1, 2)
    assert seen.observed is not None and seen.observed.prefill_rate_per_worker > 0
    assert np.mean(seen.rate_profile) == pytest.approx(1.0)
    assert seen.profile_window_s == pytest.approx(10.0)


def test_plan_follows_the_observed_load() -> None:
    settings = load_settings(None, slo={"ttft_s": 1.0, "tpot_s": 0.05})
    low = plan_from_windows(measured(sim_run(qps=3.0)[0]), settings)
    high = plan_from_windows(measured(sim_run(qps=12.0)[0]), settings)
    assert high.demand.qps > 3 * low.demand.qps
    assert high.decode.demand > low.decode.demand
    assert need(high) > need(low)
    assert low.prefill.current_workers == 1 and low.decode.current_workers == 2
    assert any(line.startswith("physics: fitted") for line in low.prefill.explanation)


def need(plan: Any) -> float:
    return float(plan.prefill.demand / plan.prefill.per_worker_capacity
                 + plan.decode.demand / plan.decode.per_worker_capacity)


def test_overrides_win_over_the_windows() -> None:
    settings = load_settings(None)
    windows = measured(sim_run()[0])
    plan = plan_from_windows(windows, settings, PlanOverrides(
        qps=40.0, output_tokens=500.0, tpot_slo_s=0.03, headroom=0.5))
    assert plan.demand.qps == 40.0 and plan.demand.output_tokens == 500.0
    assert plan.slo_tpot_s == 0.03 and plan.headroom == 0.5
    assert plan.slo_ttft_s == settings.slo.ttft_s
    assert "qps: 40 (given)" in plan.decode.explanation


def test_no_history_needs_the_load_by_hand() -> None:
    settings = load_settings(None)
    with pytest.raises(NoDemand, match="--qps"):
        plan_from_windows([], settings)
    with pytest.raises(NoDemand, match="--input-tokens"):
        plan_from_windows([], settings, PlanOverrides(qps=5.0))
    plan = plan_from_windows([], settings, PlanOverrides(qps=5.0, input_tokens=1000.0,
                                                         output_tokens=100.0))
    assert plan.demand.decode_local_share == 0.0 and plan.demand.cached_fraction == 0.0
    assert plan.prefill.extrapolated  # nothing observed to check the model against
    assert "physics: defaults (no windows to fit on)" in plan.prefill.explanation


def test_implausible_fits_keep_the_prior() -> None:
    windows = measured(sim_run()[0])
    prior = ComponentParams()
    params, lines = fitted_params(windows, prior)
    for name in ("step_per_ctx_token_s", "step_per_prefill_token_s", "prefill_per_token_s"):
        value, base = getattr(params, name), getattr(prior, name)
        assert base / 5 <= value <= base * 5, name
    # this run's prompts barely vary (turn 1 is always 1024 tokens): the slope is not
    # identifiable, and the prefill component comes back whole from the prior
    kept = [line for line in lines if line.startswith("physics: prior kept")]
    assert len(kept) == 1 and "prefill (prefill_per_token_s)" in kept[0]
    assert (params.prefill_base_s, params.prefill_per_token2_s) == (
        prior.prefill_base_s, prior.prefill_per_token2_s)
    assert lines[0].startswith("physics: fitted on")
    # no windows: the prior, said so
    assert fitted_params([], prior) == (prior, ["physics: defaults (no windows to fit on)"])


def test_rate_profile_drops_counting_noise_and_keeps_bursts() -> None:
    from controller.loop.capacity import rate_profile

    rng = np.random.default_rng(3)
    steady = [float(n) / 10.0 for n in rng.poisson(200, size=60)]  # 20 req/s, 10 s windows
    prof = rate_profile(steady, [10.0] * 60)
    assert max(abs(f - 1.0) for f in prof) < 0.5 * max(abs(r / 20.0 - 1.0) for r in steady)
    bursty = [float(n) / 10.0 for n in rng.poisson([100] * 50 + [1000] * 10)]
    kept = rate_profile(bursty, [10.0] * 60)
    assert max(kept) > 3.0  # 100 req/s against a mean of 25
    assert np.mean(kept) == pytest.approx(1.0)
    assert rate_profile([], []) == (1.0,)


def _worker_rows(seed: int, rows: int, scv: float, curve: tuple[float, float, float],
                 max_requests: int) -> Any:
    """Per-worker window means of gamma-distributed prompts priced by a known curve."""
    from controller.loop.capacity import WorkerMeans

    rng = np.random.default_rng(seed)
    n = rng.integers(1, max_requests + 1, rows).astype(np.float64)
    tokens, times = [], []
    for k in n:
        prompts = rng.gamma(1.0 / scv, 8000.0 * scv, int(k))
        tokens.append(prompts.mean())
        times.append(float(np.mean(curve[0] + curve[1] * prompts + curve[2] * prompts**2)))
    return WorkerMeans(n, np.array(tokens), np.array(times))


def test_prefill_curve_refit_sees_the_attention_term() -> None:
    from controller.loop.capacity import fit_prefill_curve, token_scv

    curve = (0.008, 19e-6, 0.65e-9)
    rows = _worker_rows(1, 200, 2.0, curve, 4)
    fitted = fit_prefill_curve(rows, token_scv(rows))
    assert fitted is not None
    (_base, per_token, per_token2), used = fitted
    assert used == int((rows.requests == 1).sum())  # the exact single-request rows
    assert per_token2 == pytest.approx(curve[2], rel=0.05)
    assert per_token == pytest.approx(curve[1], rel=0.1)
    # prompts that do not vary cannot tell a linear from a quadratic cost
    flat = _worker_rows(2, 200, 0.001, curve, 4)
    assert fit_prefill_curve(flat, token_scv(flat)) is None


def test_token_spread_from_per_worker_means() -> None:
    from controller.loop.capacity import token_scv

    for scv in (0.5, 2.0):
        rows = _worker_rows(3, 400, scv, (0.0, 1e-5, 0.0), 6)
        assert token_scv(rows) == pytest.approx(scv, rel=0.3), scv
    assert token_scv(_worker_rows(4, 5, 1.0, (0.0, 1e-5, 0.0), 6)) is None  # too few rows


def test_token_spreads_come_from_the_windows_unless_given() -> None:
    settings = load_settings(None)
    windows = measured(sim_run()[0])
    plan = plan_from_windows(windows, settings)
    lines = plan.prefill.explanation
    assert any(line.startswith("input_scv:") and "per-worker window means" in line
               for line in lines)
    assert "append_scv: 1 (not observed; assumed)" in lines
    given = plan_from_windows(windows, settings, PlanOverrides(input_scv=0.25))
    assert given.demand.input_scv == 0.25 and "input_scv: 0.25 (given)" in given.decode.explanation


KV_TOKENS = 200_000.0  # a decode worker's KV pool, as an operator configures it


def test_session_kv_feedback_from_the_windows() -> None:
    settings = load_settings(None, slo={"ttft_s": 1.0, "tpot_s": 0.05})
    windows = measured(sim_run()[0])
    seen = observe_demand(windows)
    # the decode-held part of the cached share: later turns' prefixes on their decode worker
    assert seen.cached_fraction is not None and seen.decode_cached_fraction is not None
    assert 0.5 * seen.cached_fraction < seen.decode_cached_fraction <= seen.cached_fraction
    assert seen.decode_kv_usage is not None and 0 < seen.decode_kv_usage < 2  # two pools
    # sessions that wait long between turns need more KV than fewer decode workers hold
    long_wait = plan_from_windows(windows, settings, PlanOverrides(
        session_gap_s=1e5, kv_capacity_tokens=KV_TOKENS))
    short_wait = plan_from_windows(windows, settings, PlanOverrides(
        session_gap_s=0.01, kv_capacity_tokens=KV_TOKENS))
    off = plan_from_windows(windows, settings, PlanOverrides(
        session_feedback=False, kv_capacity_tokens=KV_TOKENS))
    assert long_wait.decode.workers == short_wait.decode.workers == 1  # of 2 observed
    lw, sw = long_wait.demand_at_shape, short_wait.demand_at_shape
    assert lw is not None and sw is not None and off.demand_at_shape is None
    assert lw.decode_local_share < sw.decode_local_share == seen.decode_local_share
    assert lw.cached_fraction < sw.cached_fraction
    assert any("session KV working set" in line for line in long_wait.prefill.explanation)
    assert any("session KV feedback: off" in line for line in off.prefill.explanation)
