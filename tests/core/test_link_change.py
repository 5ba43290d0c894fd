"""A slower KV link (issue 7, bench scenario 2): its own drift residual, and a calibration
that fits the link on the transfers since the change while every window keeps explaining
the rest of the model."""

from __future__ import annotations

import numpy as np
import pytest

from controller.config import load_settings
from controller.core.drift import (
    DriftState,
    assess,
    feature_statistics,
    performance_residuals,
    reference_from_windows,
)
from controller.core.features import build_training_set
from controller.core.latency_model import LatencyModel, fit_latency_model, fit_link_change
from controller.core.trigger import Cause, Trigger
from controller.core.window import Window
from controller.loop.learning import CoreLearner, LearnerState
from controller.policy.model import Slo
from tests.core.synth import Mix, Truth, stationary, training_windows

SLO = Slo(ttft_s=1.0, tpot_s=0.05)
T0 = 1_760_000_000.0
SLOW = Truth(link_bw=Truth().link_bw / 4)


@pytest.fixture(scope="module")
def model() -> LatencyModel:
    windows = training_windows(Truth(), Mix(), 300, seed=1, slo=SLO)
    return fit_latency_model(build_training_set(windows), SLO.ttft_s, SLO.tpot_s)


def _stream(n_before: int, n_after: int, seed: int, slow: Truth = SLOW) -> list[Window]:
    before = stationary(Truth(), Mix(), 2.0, 0.6, n_before, seed=seed, slo=SLO, start=T0)
    after = stationary(slow, Mix(), 2.0, 0.6, n_after, seed=seed + 50, slo=SLO,
                       start=before[-1].end)
    return before + after


@pytest.mark.parametrize("seed", range(3))
def test_the_link_residual_sees_a_quarter_bandwidth_at_once(seed: int, model: LatencyModel
                                                            ) -> None:
    stream = _stream(10, 3, seed)
    res = performance_residuals(model, stream)
    before = [r["KV.transfer"][0] for r in res[:10]]
    after = [r["KV.transfer"][0] for r in res[10:]]
    # Transfers here are mostly bytes / bandwidth: a quarter bandwidth is ~log 4 = 1.39.
    assert abs(float(np.mean(before))) < 0.15
    assert min(after) > 0.9
    ref = reference_from_windows(stream[:10], model)
    assert "KV.transfer" in ref.residual_mean
    state = DriftState()
    fired_at = None
    for i, (w, r) in enumerate(zip(stream, res, strict=True)):
        state, verdicts = assess(state, ref, w, w.end, r)
        perf = next(v for v in verdicts if v.kind == "performance")
        if perf.fired:
            fired_at = i
            assert perf.details["KV.transfer"]["cusum_up"] > perf.threshold
            assert perf.reason.endswith("(led by KV.transfer)"), perf.reason
            shares = feature_statistics("performance", perf.details)
            assert shares["KV.transfer"] == perf.statistic
            assert set(shares) <= {"KV.transfer", "PREFILL_NODE.ttft", "PREFILL_NODE.tpot",
                                   "DECODE_LOCAL.ttft", "DECODE_LOCAL.tpot"}
            work = next(v for v in verdicts if v.kind == "workload")
            work_shares = feature_statistics("workload", work.details)
            assert set(work_shares) == {"context_tokens", "io_ratio", "qps"}
            assert max(work_shares.values()) == pytest.approx(work.statistic)
            break
    assert fired_at is not None and 10 <= fired_at <= 11


@pytest.mark.parametrize("n_after", [1, 2, 6])
def test_fit_link_change_finds_the_change_and_both_links(n_after: int) -> None:
    stream = _stream(20, n_after, seed=3)
    ts = build_training_set(stream)
    change = stream[20].start
    mixed = fit_latency_model(ts, SLO.ttft_s, SLO.tpot_s)
    # The detector's onset can be a window late: the change point is searched up to it.
    late = stream[-1].start
    params, link = fit_link_change(ts, mixed.params, late)
    assert link is not None and link.at == change
    nbytes = np.array([2000 * Truth().kv_bytes_per_token])
    now = float(params.transfer_s(nbytes, np.zeros(1))[0])
    truth_now = float(SLOW.xfer_time(np.array([2000.0]))[0])
    assert now == pytest.approx(truth_now, rel=0.3)
    assert link.before_scale == pytest.approx(0.25, rel=0.3)
    # One fit over both links lands in between and predicts neither.
    blended = float(mixed.params.transfer_s(nbytes, np.zeros(1))[0])
    assert blended < 0.8 * truth_now or n_after == 6


def test_a_model_fitted_across_the_change_explains_both_sides() -> None:
    stream = _stream(20, 2, seed=4)
    ts = build_training_set(stream)
    model = fit_latency_model(ts, SLO.ttft_s, SLO.tpot_s, link_changed_at=stream[-1].start)
    assert model.link_change is not None
    res = performance_residuals(model, stream)
    kv = [r["KV.transfer"][0] for r in res]
    assert max(abs(v) for v in kv) < 0.3, kv
    # One link over every window explains the slower one as contention (the slow link is
    # busier): it then predicts the old, fast link once less traffic crosses it.
    plain = fit_latency_model(ts, SLO.ttft_s, SLO.tpot_s)
    nbytes, idle = np.array([2000 * Truth().kv_bytes_per_token]), np.array([0.03])
    truth = float(SLOW.xfer_time(np.array([2000.0]))[0])
    assert float(plain.params.transfer_s(nbytes, idle)[0]) < 0.6 * truth
    assert float(model.params.transfer_s(nbytes, idle)[0]) == pytest.approx(truth, rel=0.3)


def test_the_learner_calibrates_a_link_drift_with_the_change_located() -> None:
    learner = CoreLearner(load_settings())
    stream = _stream(30, 6, seed=5)
    base = learner.calibrate(stream[:20], None, stream[19].end, "schedule")
    state = learner.adopt(LearnerState(), base, stream[19].end)  # then 300 s of cooldown
    fired = None
    for w in stream[20:]:
        state, findings = learner.assess(state, w, w.end)
        if any(f.fired and f.kind == "performance" for f in findings):
            fired = w
            # Led by the link's own residual: the cycle does not rate-limit it.
            assert all(f.measured for f in findings if f.fired)
            break
    assert fired is not None and fired.start <= stream[31].start
    windows = [w for w in stream if w.end <= fired.end]
    outcome = learner.calibrate(windows, base.policy, fired.end,
                               Cause(Trigger.DRIFT, "performance"))
    kv = outcome.details["model"]["components"]["kv_transfer"]
    assert kv["changed_at"] == stream[30].start
    assert kv["bandwidth_Bps"] == pytest.approx(SLOW.link_bw, rel=0.3)
    # A scheduled calibration is not about a change: one link over every window.
    plain = learner.calibrate(windows, base.policy, fired.end, "schedule")
    assert "changed_at" not in plain.details["model"]["components"]["kv_transfer"]


@pytest.mark.parametrize("seed", range(4))
def test_no_change_is_found_where_the_link_did_not_change(seed: int) -> None:
    # E.g. the held-out fit of a calibration after a link drift: its earlier windows can
    # end before the change, and a best split among them is noise with a scale near 1.
    stream = _stream(20, 0, seed)
    ts = build_training_set(stream)
    mixed = fit_latency_model(ts, SLO.ttft_s, SLO.tpot_s)
    params, link = fit_link_change(ts, mixed.params, stream[-1].start)
    assert link is None
    assert params == mixed.params
    model = fit_latency_model(ts, SLO.ttft_s, SLO.tpot_s, link_changed_at=stream[-1].start)
    assert model.link_change is None


@pytest.mark.parametrize("seed", range(2))
def test_a_smaller_slowdown_is_still_a_change(seed: int) -> None:
    stream = _stream(20, 4, seed, slow=Truth(link_bw=Truth().link_bw / 1.3))
    ts = build_training_set(stream)
    mixed = fit_latency_model(ts, SLO.ttft_s, SLO.tpot_s)
    _, link = fit_link_change(ts, mixed.params, stream[-1].start)
    assert link is not None and link.at == stream[20].start
    assert link.before_scale == pytest.approx(1 / 1.3, rel=0.1)
