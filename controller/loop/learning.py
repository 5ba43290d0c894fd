"""The one seam between the control cycle and the learning core.

:class:`Learner` is what :class:`controller.loop.cycle.Cycle` calls: ``assess`` runs the drift
detectors on a new window, ``calibrate`` fits and judges a candidate policy, ``adopt``
makes an approved calibration the new drift reference, ``restore`` rebuilds that reference
after a restart or a rollback. :class:`CoreLearner` delegates to :mod:`controller.core`;
tests pass their own small learner.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from controller.core.rollout import GuardrailVerdict
from controller.core.trigger import Cause, Trigger
from controller.core.window import Window
from controller.policy import LookupTable, Policy

if TYPE_CHECKING:
    from controller.core.calibrate import CalibrationConfig
    from controller.core.drift import DriftConfig

# Windows after a shift that a drift or scaling calibration needs to train on them alone:
# fewer lets a minute of a bursty trace flip the table at every cooldown, more delays the
# adaptation (the choice is measured in CHANGELOG.md, "Windows a calibration needs after a change").
MIN_REGIME_WINDOWS = 7
MIN_MIX_WINDOWS = 4


class LearnerError(Exception):
    """The windows cannot support a calibration (the message says why)."""


@dataclass(frozen=True, slots=True)
class DriftFinding:
    """One detector's verdict on one window."""

    kind: str  # workload | performance | slo
    fired: bool
    statistic: float  # NaN: too few samples
    threshold: float
    reason: str
    details: Mapping[str, Any] = field(default_factory=dict)
    # Led by a quantity the windows measure directly (the KV link's transfer time against
    # its fit), not by a model's misfit: a change of the cluster the cycle need not wait out
    # ``min_policy_interval_s`` for.
    measured: bool = False


@dataclass(frozen=True, slots=True)
class CalibrationOutcome:
    """A candidate policy and the guardrail's verdict on it."""

    policy: Policy  # its version is renumbered by the store
    approved: bool
    reason: str
    predicted_goodput_new: float | None
    predicted_goodput_current: float | None
    heldout_error: Mapping[str, Any]
    details: Mapping[str, Any] = field(default_factory=dict)
    reference: Any = None  # what `adopt` turns into the new drift reference
    # What the candidate was fitted with: (latency model, calibration grid); what a peer's
    # rule is fitted on ([export]). None from learners that keep no model.
    basis: Any = None
    # Approved by an operator's force despite the guardrail (its verdict's ``overridden``).
    forced: bool = False

    @property
    def decision(self) -> GuardrailVerdict:
        """The guardrail's decision: approved or rejected."""
        return GuardrailVerdict.APPROVED if self.approved else GuardrailVerdict.REJECTED

    @property
    def label(self) -> GuardrailVerdict:
        """The decision as counted: forced when an operator's force approved it despite the
        guardrail, else the decision."""
        return GuardrailVerdict.FORCED if self.forced else self.decision


@dataclass(frozen=True, slots=True)
class LearnerState:
    """Opaque to the cycle: the drift reference and the detectors' state."""

    reference: Any = None
    drift: Any = None
    model: Any = None


class Learner(Protocol):
    def assess(
        self, state: LearnerState, window: Window, now: float
    ) -> tuple[LearnerState, list[DriftFinding]]: ...

    def calibrate(
        self,
        windows: Sequence[Window],
        current: Policy | None,
        now: float,
        reason: Cause | str,
        force: bool = False,
    ) -> CalibrationOutcome:
        """Fit and judge a candidate. ``reason`` is the typed :class:`Cause` of a
        triggered calibration, or free text (an active calibration, ``pdctl recalibrate
        --local``) that no regime follows."""
        ...

    def adopt(self, state: LearnerState, outcome: CalibrationOutcome, now: float) -> LearnerState:
        """What drift is measured against after ``outcome`` (called for every calibration,
        approved or refused)."""
        ...

    def restore(self, details: Mapping[str, Any] | None) -> LearnerState: ...


def without_exploration(policy: Policy) -> Policy:
    """The same table with every cell's exploration share at 0 (operator: exploration off)."""
    t = policy.table
    table = LookupTable(t.axes, t.routes, t.scores, (0.0,) * len(t.exploration))
    return replace(policy, table=table)


def calibration_config(settings: Any) -> CalibrationConfig:
    """The calibration settings of a :class:`controller.config.Settings` (also what
    ``pdctl explain`` refits with).

    ``[ppd] enabled = false`` is classic P/D: every turn to a prefill node, no override that
    sends anything decode-local. ``append_prefill_route = "prefill"`` / ``"decode"`` pins
    every later turn to that route (``"dynamic"``: the calibrated table).
    """
    from controller.core.calibrate import CalibrationConfig
    from controller.policy import Overrides, Route, Slo, Weights

    ppd = settings.ppd
    pins = {"prefill": Route.PREFILL_NODE, "decode": Route.DECODE_LOCAL, "dynamic": None}
    if ppd.enabled:
        overrides = Overrides(
            first_turn_route=Route.parse(ppd.first_turn_route),
            bypass_append_tokens=ppd.bypass_append_tokens,
            first_turn_busy_waiting=ppd.first_turn_busy_waiting,
            later_turn_busy_waiting=ppd.later_turn_busy_waiting,
        )
        pin = pins[ppd.append_prefill_route]
    else:  # classic P/D: nothing decode-local
        overrides, pin = Overrides(Route.PREFILL_NODE, 0, 0, 0), Route.PREFILL_NODE
    return CalibrationConfig(
        slo=Slo(settings.slo.ttft_s, settings.slo.tpot_s),
        pinned_weights=Weights(ppd.wtft, ppd.wtpot) if ppd.pin_weights else None,
        guardrail_margin=settings.controller.guardrail_margin,
        guardrail_overload_goodput=settings.controller.guardrail_overload_goodput,
        exploration_max_rate=settings.controller.exploration_max_rate,
        overrides=overrides,
        pinned_route=pin,
    )


def follows_pin(policy: Policy, config: CalibrationConfig) -> bool:
    """Whether ``policy`` already is what the operator's pin asks for (True: no pin)."""
    pin = config.pinned_route
    if pin is None:
        return True
    t = policy.table
    return (all(r is pin for r in t.routes) and not any(t.exploration)
            and policy.overrides == config.overrides)


def drift_config(settings: Any) -> DriftConfig:
    """The drift detector settings of a :class:`controller.config.Settings`."""
    from controller.core.drift import DetectorConfig, DriftConfig

    d = settings.drift
    base = DriftConfig()
    return DriftConfig(
        workload=DetectorConfig(base.workload.threshold, d.min_requests, d.hysteresis,
                                d.cooldown_s),
        performance=DetectorConfig(base.performance.threshold, base.performance.min_samples,
                                   base.performance.hysteresis, d.cooldown_s),
        slo=DetectorConfig(base.slo.threshold, d.min_requests, d.hysteresis, d.cooldown_s),
        qps_cusum_allowance=d.qps_cusum_allowance,
        qps_cusum_threshold=d.qps_cusum_threshold,
    )


class CoreLearner:
    """The real learner: :mod:`controller.core` drift detectors and calibration."""

    def __init__(self, settings: Any) -> None:
        self._reference_windows = settings.drift.reference_windows
        self._drift = drift_config(settings)
        self._drift_onset: float | None = None  # when the last drift that fired began
        self._link_changed_at: float | None = None  # ... when it was the KV link's
        self._config = calibration_config(settings)
        self._refinement_margin = max(settings.controller.refinement_margin,
                                      self._config.guardrail_margin)
        self._fired: frozenset[str] = frozenset()  # the detectors of the last drift
        # Whether the traffic may have shifted since the last approval this learner saw: a
        # workload or SLO drift, the KV link, or no approval yet (a restart, a rollback).
        self._shift_since_approval = True

    def assess(
        self, state: LearnerState, window: Window, now: float
    ) -> tuple[LearnerState, list[DriftFinding]]:
        from controller.core import drift

        if state.reference is None:
            return state, []
        residuals = None
        if state.model is not None:
            residuals = drift.performance_residuals(state.model, [window])[0]
        drift_state = state.drift if state.drift is not None else drift.DriftState()
        new, verdicts = drift.assess(drift_state, state.reference, window, now, residuals,
                                     self._drift)
        onsets = [drift.drift_onset(new.of(v.kind), v.threshold) for v in verdicts if v.fired]
        # A link drift: the KV transfers' own CUSUM is over the threshold.
        by_link = [v.fired and drift.feature_statistics(v.kind, v.details).get(
            drift.KV_RESIDUAL, 0.0) > v.threshold for v in verdicts]
        if any(v.fired for v in verdicts):
            # The earliest onset among the detectors that fired (None: not known).
            known = [t for t in onsets if t is not None]
            self._drift_onset = min(known) if known else None
            link = any(by_link)
            self._link_changed_at = (
                drift.drift_onset(new.performance, self._drift.performance.threshold)
                if link else None)
            self._fired = frozenset(v.kind for v in verdicts if v.fired)
            if link or self._fired != {"performance"}:
                self._shift_since_approval = True
        findings = [
            DriftFinding(v.kind, v.fired, v.statistic, v.threshold, v.reason, dict(v.details),
                         measured=measured)
            for v, measured in zip(verdicts, by_link, strict=True)
        ]
        return replace(state, drift=new), findings

    def calibrate(
        self,
        windows: Sequence[Window],
        current: Policy | None,
        now: float,
        reason: Cause | str,
        force: bool = False,
    ) -> CalibrationOutcome:
        from controller.core import drift
        from controller.core.calibrate import CalibrationError, calibrate
        from controller.core.guardrail import check

        windows, config, regime_only = self._regime(windows, reason)
        refinement = self.is_refinement(reason)
        if refinement:
            config = replace(config, guardrail_margin=self._refinement_margin)
        try:
            result = calibrate(windows, now, current, config, reason=str(reason))
        except CalibrationError as e:
            raise LearnerError(str(e)) from None
        verdict = result.verdict
        # An operator's new pin is applied, not judged: the candidate is what they asked for.
        force = force or (current is not None and not follows_pin(current, config))
        if force and not verdict.approved:
            verdict = check(result.predicted_goodput_candidate, result.predicted_goodput_current,
                            self._config.guardrail_margin, force=True)
        reference = drift.reference_from_windows(windows[-self._reference_windows:],
                                                 result.model)
        details = result.to_dict()
        details["regime_windows"] = config.recent_windows if config is not self._config \
            else None
        details["regime_only"] = regime_only
        details["refinement"] = refinement
        details["verdict"] = verdict.to_dict()
        details["drift_reference"] = reference.to_dict()
        return CalibrationOutcome(
            policy=result.policy, approved=verdict.approved, reason=verdict.reason,
            predicted_goodput_new=_finite(result.predicted_goodput_candidate),
            predicted_goodput_current=_finite(result.predicted_goodput_current),
            heldout_error=json_safe(result.heldout_mape()), details=json_safe(details),
            reference=(reference, result.model), basis=(result.model, result.grid),
            forced=verdict.overridden,
        )

    def is_refinement(self, reason: Cause | str) -> bool:
        """Whether a calibration for ``reason`` now refines the running policy on the
        traffic it was learned on: a drift of the performance detector alone, not led by the
        KV link, with no workload or SLO drift since the last approval. It then needs
        ``[controller] refinement_margin``: a second change within a stationary phase must
        predict a larger gain than a first one (CHANGELOG.md, "A refinement needs a larger
        gain", measures it)."""
        return (reason == Cause(Trigger.DRIFT) and self._fired == {"performance"}
                and not self._shift_since_approval)

    def _regime(self, windows: Sequence[Window], reason: Cause | str
                ) -> tuple[Sequence[Window], Any, bool]:
        """The windows and settings a calibration for ``reason`` should use, and whether
        they are the windows since a change alone (its verdict is then about the new regime).

        After a drift or a scaling event, the windows since the change describe the new
        regime: with at least ``MIN_REGIME_WINDOWS`` of them the calibration trains on those
        alone; with fewer, it trains on everything but takes the current mix and load (the
        table's goodput is predicted for) from those windows only. Otherwise: unchanged.
        Every window can be from since the change (a drift older than the training set):
        the verdict is about the new regime then too.
        """
        regime = reason.regime if isinstance(reason, Cause) else None
        start: float | None = None
        if regime is Trigger.DRIFT:
            start = self._drift_onset
        elif regime is Trigger.SCALING:
            start = shape_change(windows)
        if start is None:
            return windows, self._config, False
        post = [w for w in windows if w.start >= start - 1e-6]
        if len(post) == len(windows):
            return windows, self._config, len(post) >= MIN_REGIME_WINDOWS
        if not post:
            return windows, self._config, False
        # The mix and load of a window or two are noise (a bursty trace swings 2x between
        # windows): the current mix takes at least MIN_MIX_WINDOWS, the newest first.
        config = replace(self._config, recent_windows=max(len(post), MIN_MIX_WINDOWS))
        if regime is Trigger.DRIFT and self._link_changed_at is not None:
            # The link is measured directly: a minute of transfers fits it, and every window
            # still explains the rest of the model.
            config = replace(config, link_changed_at=self._link_changed_at)
        if len(post) >= MIN_REGIME_WINDOWS:
            return post, config, True
        return windows, config, False

    def adopt(self, state: LearnerState, outcome: CalibrationOutcome, now: float) -> LearnerState:
        """The drift reference after a calibration. Approved, trained on the windows since
        a change alone (the running policy was judged on the new regime and kept), or no
        reference yet: its calibration set, with fresh detectors in cooldown. Otherwise
        refused: the workload and goodput reference stays the running policy's (a shift that
        began in the candidate's windows keeps being measured, and fires again after the
        cooldown); the performance detector takes the candidate's latency model and residual
        scale, fitted on windows under the running policy, with fresh accumulators and only
        the cooldown it was already in."""
        from controller.core import drift

        if outcome.reference is None:
            return state
        reference, model = outcome.reference
        previous = state.drift if state.drift is not None else drift.DriftState()
        rearmed = drift.after_recalibration(previous, now, self._drift)
        if outcome.approved:
            self._shift_since_approval = False
        if renews_reference(outcome) or state.reference is None:
            return LearnerState(reference, rearmed, model)
        kept = replace(state.reference, residual_mean=reference.residual_mean,
                       residual_sd=reference.residual_sd)
        # Fresh accumulators for the new model, but no new cooldown: a refusal must not
        # silence a detector that did not ask for it (a later KV-link slowdown is detected
        # on time). Its own firing's cooldown still holds.
        performance = replace(rearmed.performance,
                              cooldown_until=previous.performance.cooldown_until)
        return LearnerState(kept, replace(previous, performance=performance), model)

    def restore(self, details: Mapping[str, Any] | None) -> LearnerState:
        """After a restart or a rollback: the reference stored with the calibration that last
        renewed it for the running policy (the performance detector waits for the next
        calibration: its model is not stored)."""
        from controller.core import drift

        self._shift_since_approval = True  # what ran before is not known
        if not details or "drift_reference" not in details:
            return LearnerState()
        return LearnerState(drift.DriftReference.from_dict(details["drift_reference"]),
                            drift.DriftState(), None)


def renews_reference(outcome: CalibrationOutcome) -> bool:
    """Whether ``outcome``'s calibration set becomes the drift reference (see
    :meth:`CoreLearner.adopt`): approved, or refused on the windows since a change alone (the
    running policy was judged on the new regime and kept). The cycle records which version
    such a reference stands for, so a restart or a rollback to that version restores it."""
    return outcome.approved or bool(outcome.details.get("regime_only"))


def shape_change(windows: Sequence[Window]) -> float | None:
    """Start of the newest run of windows with the same answering prefill and decode worker
    counts as the last window (None: every window has that shape)."""
    def shape(w: Window) -> tuple[int, int]:
        return (sum(1 for x in w.workers if x.role == "prefill"),
                sum(1 for x in w.workers if x.role == "decode"))

    if not windows:
        return None
    last = shape(windows[-1])
    for i in range(len(windows) - 1, -1, -1):
        if shape(windows[i]) != last:
            return windows[i + 1].start
    return None


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def json_safe(value: Any) -> Any:
    """NaN and infinities become None (the store keeps strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return json_safe(value.item())
    return value
