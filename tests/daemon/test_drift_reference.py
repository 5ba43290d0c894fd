"""What drift is measured against after a calibration (issue 7): the running policy's
calibration set. A refused candidate trained across a shift does not become the reference
(its windows hid the shift, and the bench's Mooncake scenarios then never adapted to a later
rate step); only its latency model, fitted under the running policy, is taken."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from controller.config import load_settings
from controller.core.drift import reference_from_windows
from controller.core.trigger import Cause, Trigger
from controller.core.window import Window
from controller.loop.learning import CalibrationOutcome, CoreLearner, LearnerState
from controller.policy import Policy, Route, Slo
from tests.core.synth import Mix, Truth, stationary

SLO = Slo(ttft_s=1.0, tpot_s=0.05)
T0 = 1_750_000_000.0
INTERVAL = 30.0


def _outcome(
    windows: Sequence[Window], approved: bool, model: Any = None, **details: Any
) -> CalibrationOutcome:
    return CalibrationOutcome(
        Policy.uniform(2, Route.PREFILL_NODE),
        approved,
        "scripted",
        0.9,
        0.9,
        {},
        details,
        reference=(reference_from_windows(windows, None), model),
    )


def _fired(
    learner: CoreLearner, state: LearnerState, windows: Sequence[Window]
) -> tuple[LearnerState, list[float]]:
    """Assess ``windows`` in order: the new state and the window ends where workload fired."""
    fired = []
    for w in windows:
        state, findings = learner.assess(state, w, w.end)
        fired += [w.end for f in findings if f.kind == "workload" and f.fired]
    return state, fired


def _streams() -> tuple[list[Window], list[Window]]:
    before = stationary(Truth(), Mix(), 2.0, 0.6, 20, seed=1, start=T0, slo=SLO)
    after = stationary(Truth(), Mix(), 6.0, 0.6, 40, seed=2, start=T0 + 20 * INTERVAL, slo=SLO)
    return before, after


def test_a_refused_candidate_leaves_the_workload_reference_so_the_shift_fires_again() -> None:
    learner = CoreLearner(load_settings())  # cooldown 300 s: 10 windows; 10 reference windows
    before, after = _streams()
    state = learner.adopt(LearnerState(), _outcome(before, True), 0.0)
    state, fired = _fired(learner, state, after[:8])
    assert fired, "the tripled rate fires the workload detector"
    # A drift calibration 8 windows after the change is refused; its newest 10 windows are
    # mostly after the change.
    across = before[-2:] + after[:8]
    refused = learner.adopt(state, _outcome(across, False), after[7].end)
    _, again = _fired(learner, refused, after[8:])
    assert again and again[0] >= fired[0] + 300, "the same shift fires again after the cooldown"
    # Taken as the reference (what the cycle did before), the refused candidate's windows
    # hid the shift for the rest of the run.
    hidden = learner.adopt(state, _outcome(across, True), after[7].end)
    assert _fired(learner, hidden, after[8:])[1] == []


def test_a_refused_candidate_gives_the_performance_detector_its_model() -> None:
    learner = CoreLearner(load_settings())
    before, after = _streams()
    approved_model, candidate_model = object(), object()
    state = learner.adopt(LearnerState(), _outcome(before, True, approved_model), 0.0)
    refused = learner.adopt(state, _outcome(after[:10], False, candidate_model), 1.0)
    assert refused.model is candidate_model
    assert refused.reference.qps_log_median == state.reference.qps_log_median
    assert refused.reference.context_counts == state.reference.context_counts


def test_with_no_reference_yet_a_refused_candidate_is_the_reference() -> None:
    """Else nothing would be measured at all until the first approval."""
    learner = CoreLearner(load_settings())
    before, _ = _streams()
    state = learner.adopt(LearnerState(), _outcome(before, False), 0.0)
    assert state.reference is not None


def test_a_candidate_refused_on_the_windows_since_the_change_alone_is_the_new_normal() -> None:
    """Judged on the new regime alone and refused, the running policy suits the new regime:
    its windows become the reference, and the shift stops firing every cooldown."""
    learner = CoreLearner(load_settings())
    before, after = _streams()
    state = learner.adopt(LearnerState(), _outcome(before, True), 0.0)
    state, fired = _fired(learner, state, after[:12])
    assert fired
    judged = learner.adopt(state, _outcome(after[2:12], False, regime_only=True), after[11].end)
    assert _fired(learner, judged, after[12:])[1] == []
    across = learner.adopt(state, _outcome(after[2:12], False, regime_only=False), after[11].end)
    assert _fired(learner, across, after[12:])[1], "kept reference: the shift fires again"


def test_a_refusal_does_not_silence_a_performance_detector_that_did_not_fire() -> None:
    """The performance detector restarts on the candidate's model after a refusal, in the
    cooldown of its own last firing, not in a new one (a workload calibration refused just
    before a KV-link slowdown used to hide the slowdown for a whole cooldown)."""
    from controller.core.drift import DetectorState

    learner = CoreLearner(load_settings())  # cooldown 300 s
    before, after = _streams()
    state = learner.adopt(LearnerState(), _outcome(before, True, object()), 0.0)
    assert state.drift is not None
    now = after[9].end
    quiet = replace(state, drift=replace(state.drift, performance=DetectorState(
        consecutive=0, cooldown_until=now - 1.0, cusum={"KV.transfer": (3.0, 0.0)})))
    refused = learner.adopt(quiet, _outcome(after[:10], False, object()), now)
    assert refused.drift is not None
    assert refused.drift.performance.cooldown_until < now  # may fire on the next windows
    assert refused.drift.performance.cusum == {}  # but starts over on the new model
    assert refused.drift.workload == quiet.drift.workload  # the others are left as they were
    fired = replace(quiet, drift=replace(quiet.drift, performance=DetectorState(
        consecutive=0, cooldown_until=now + 200.0)))
    refused = learner.adopt(fired, _outcome(after[:10], False, object()), now)
    assert refused.drift is not None and refused.drift.performance.cooldown_until == now + 200.0
    approved = learner.adopt(quiet, _outcome(after[:10], True, object()), now)
    assert approved.drift is not None and approved.drift.performance.cooldown_until == now + 300.0


def _performance_drift(learner: CoreLearner, state: LearnerState,
                       windows: Sequence[Window]) -> LearnerState:
    """Assess ``windows`` until a drift fires; fails unless it is the performance detector's
    alone."""
    for w in windows:
        state, findings = learner.assess(state, w, w.end)
        kinds = {f.kind for f in findings if f.fired}
        if kinds:
            assert kinds == {"performance"}, kinds
            assert not any(f.measured for f in findings), "a model's misfit, not the link's"
            return state
    raise AssertionError("no drift fired")


def test_a_performance_drift_on_the_traffic_of_the_last_approval_needs_the_refinement_margin(
) -> None:
    """A second change on the same traffic (the performance detector alone, nothing else
    fired since the last approval) needs ``refinement_margin``; the calibration records it
    and judges with it. A workload drift in between, or no approval since the learner
    started, leaves the guardrail margin."""
    settings = load_settings(None, controller={"refinement_margin": 0.03})
    learner = CoreLearner(settings)
    before, _ = _streams()
    slower = stationary(Truth(b=2 * Truth().b), Mix(), 2.0, 0.6, 20, seed=3,
                        start=T0 + 20 * INTERVAL, slo=SLO)
    first = learner.calibrate(before, None, before[-1].end, "schedule")
    assert first.approved and not first.details["refinement"]
    state = learner.adopt(LearnerState(), first, before[-1].end)
    state = _performance_drift(learner, state, slower)
    assert learner.is_refinement(Cause(Trigger.DRIFT))
    assert not learner.is_refinement("drift")  # free text names no trigger
    refit = Cause(Trigger.CANARY, refits=Trigger.DRIFT, text="drift (canary refit of v2)")
    assert not learner.is_refinement(refit)  # a canary's refit: no change
    assert not learner.is_refinement(Cause(Trigger.SCHEDULE))
    now = slower[-1].end
    outcome = learner.calibrate(before + slower, first.policy, now, Cause(Trigger.DRIFT))
    assert outcome.details["refinement"]
    assert outcome.details["verdict"]["margin"] == 0.03
    # After a rollback the learner does not know what the restored policy was learned on.
    rolled_back = replace(learner.restore(first.details), model=state.model)
    _performance_drift(learner, rolled_back, slower)
    assert not learner.is_refinement(Cause(Trigger.DRIFT))
    # The same drift by a learner that has approved nothing since it started (a restart).
    fresh = CoreLearner(settings)
    fresh_state = replace(fresh.restore(first.details), model=state.model)
    _performance_drift(fresh, fresh_state, slower)
    assert not fresh.is_refinement(Cause(Trigger.DRIFT))
    assert fresh.calibrate(before + slower, first.policy, now, Cause(Trigger.DRIFT)) \
        .details["verdict"]["margin"] == settings.controller.guardrail_margin


def test_a_workload_drift_since_the_last_approval_ends_refinement() -> None:
    """After a workload drift whose calibration was refused, a performance drift alone is
    not a refinement: the traffic moved since the policy was learned."""
    learner = CoreLearner(load_settings())
    before, _ = _streams()
    busier = stationary(Truth(), Mix(), 3.0, 0.6, 12, seed=2, start=T0 + 20 * INTERVAL,
                        slo=SLO)
    slower = stationary(Truth(b=2 * Truth().b), Mix(), 3.0, 0.6, 20, seed=3,
                        start=T0 + 32 * INTERVAL, slo=SLO)
    first = learner.calibrate(before, None, before[-1].end, "schedule")
    state = learner.adopt(LearnerState(), first, before[-1].end)
    state, fired = _fired(learner, state, busier)
    assert fired
    kept = learner.calibrate(before + busier, first.policy, busier[-1].end, Cause(Trigger.DRIFT))
    assert not kept.approved and not kept.details["refinement"]
    state = learner.adopt(state, kept, busier[-1].end)
    _performance_drift(learner, state, slower)
    assert not learner.is_refinement(Cause(Trigger.DRIFT)), "a refusal is not an approval"
