"""What the loop's decisions remember between cycles: :class:`DecisionMemory`.

It owns the learner's state (and the policy version it belongs to), the causes found but not
yet calibrated for (drift, scaling, an applied recommendation), the scaling detector and the
flap damping's marks, the failed-fit back-off, the refused link calibration's retry time and
the targets failing in a row. It is frozen: every step returns a new value, so the cycle
keeps the one it started a decision with and a decision whose write did not commit is
forgotten by putting that value back (one assignment).

Missing data: a window with a failed target is not trained on, unless that target failed
``SETTLED_FAILURES`` windows in a row (gone: lost capacity, which is a scaling cause in its
own right). Causes found while a cycle cannot act (rate limit, deferred window) stay here
until a calibration takes them; drift during a canary bake is void. When the answering
workers change to what a stored capacity recommendation asked for, the scaling event is a
known one: the calibration it triggers records the recommendation, takes precedence over
drift the new shape causes, and the recommendation is marked applied.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from controller.core.drift import ScalingState, worker_counts
from controller.core.rollout import TriggerChoice, scaling_damped
from controller.core.trigger import Cause, Trigger
from controller.core.window import Window
from controller.loop.learning import DriftFinding, LearnerState
from controller.store import OperatorRequest, Tx

log = logging.getLogger("pdctl.cycle")

SETTLED_FAILURES = 2  # windows a target must have failed in a row to count as gone


@dataclass(frozen=True, slots=True)
class DecisionMemory:
    """What decisions remember between cycles; replaced as a whole, never changed."""

    state: LearnerState = field(default_factory=LearnerState)
    state_for: int | None = None  # the policy version the learner state belongs to
    fit_failed_at: float | None = None  # automatic fits back off after a failure
    scaling: ScalingState = field(default_factory=ScalingState)
    # Causes not yet recalibrated for (a deferred or rate-limited cycle keeps them).
    pending_scaling: str | None = None
    pending_recommendation: int | None = None  # the scaling reached this one
    pending_scaling_roles: frozenset[str] = frozenset()  # the roles it is about
    # Flap damping: when each role's last scaling recalibration ran (clock.now()), and the
    # worker counts the last calibration saw.
    scaling_recal_at: Mapping[str, float] = field(default_factory=dict)
    calibrated_counts: Mapping[str, int] | None = None
    pending_drift: bool = False
    pending_measured: bool = False  # ... and led by the KV link (not rate-limited)
    # A link calibration refused before it could train on the new link's windows alone is
    # tried once more then (epoch s): the newest stored calibration's link_retry_at.
    link_retry_at: float | None = None
    failing: Mapping[str, int] = field(default_factory=dict)  # target -> windows failed in a row

    # -- a window's findings --------------------------------------------------------------

    def usable(self, window: Window) -> bool:
        """Fit to learn from: routed requests, and no target missing except those gone for
        good (failing ``SETTLED_FAILURES`` windows in a row: lost capacity, not missing
        data). A transient scrape failure makes the window unusable."""
        # Outcome rows with no requests are not routed requests: at start-up Prometheus
        # reports the routers' counters before they move, and a fit on such windows fails.
        if not window.outcomes.total("requests") > 0:
            return False
        gone = {t for t, n in self.failing.items() if n >= SETTLED_FAILURES}
        return all(f.target in gone for f in window.failures)

    def with_failures(self, window: Window) -> DecisionMemory:
        """The targets failing in a row, after ``window``."""
        failed = {f.target for f in window.failures}
        return replace(self, failing={t: self.failing.get(t, 0) + 1 for t in failed})

    def with_scaling(self, scaling: ScalingState, events: Sequence[Any],
                     applied: int | None) -> DecisionMemory:
        """The scaling detector's new state and the cause its ``events`` make pending
        (``applied``: the stored recommendation they reached), damped for a flap."""
        memory = replace(self, scaling=scaling)
        if events:
            text = "; ".join(e.reason for e in events)
            if applied is not None:
                text += f" (recommendation #{applied} applied)"
                memory = replace(memory, pending_recommendation=applied)
            memory = replace(memory, pending_scaling=text)
        return memory._damp_flap(events)

    def _damp_flap(self, events: Sequence[Any]) -> DecisionMemory:
        """Scaling events name the roles of the pending scaling cause. A flap that brought
        every role back to the counts the last calibration saw (a worker that failed, then
        answered again) cancels the cause: nothing changed to calibrate for. An applied
        recommendation is never cancelled."""
        if not events:
            return self
        memory = replace(self, pending_scaling_roles=self.pending_scaling_roles
                         | {e.role for e in events})
        if memory.pending_recommendation is None and memory.calibrated_counts is not None \
                and dict(memory.scaling.known) == memory.calibrated_counts:
            log.info("scaling cause dropped: the workers answering are back to the counts "
                     "the last calibration saw (%s)", memory.pending_scaling)
            memory = replace(memory, pending_scaling=None, pending_scaling_roles=frozenset())
        return memory

    def with_drift(self, state: LearnerState, findings: Sequence[DriftFinding]
                   ) -> DecisionMemory:
        """The learner's state after assessing a window; a fired detector's drift pending."""
        memory = replace(self, state=state)
        if any(f.fired for f in findings):
            memory = replace(memory, pending_drift=True, pending_measured=(
                memory.pending_measured or any(f.measured for f in findings)))
        return memory

    # -- choosing and taking a cause ------------------------------------------------------

    def scaling_damped(self, now: float, damping_s: float) -> bool:
        """Whether every role of the pending scaling cause had a scaling recalibration less
        than ``damping_s`` ago (approved or not: a rejected candidate counts). The cause
        stays pending and is calibrated for once one role is free; an applied recommendation
        (an operator-intended change, not a flap) is never damped."""
        if self.pending_scaling is None or self.pending_recommendation is not None:
            return False
        return scaling_damped(self.pending_scaling_roles, self.scaling_recal_at, now,
                              damping_s)

    def after_choice(self, choice: TriggerChoice) -> DecisionMemory:
        """The pending drift the trigger choice voided (a canary baking) is dropped."""
        if choice.clear_pending_drift:
            return replace(self, pending_drift=False, pending_measured=False)
        return self

    def take_cause(self, trigger: Trigger, now: float) -> DecisionMemory:
        """The memory once a calibration for ``trigger`` takes the pending causes. A canary
        refit leaves them pending for the fleet's policy; any other calibration sees the new
        capacity and mix, so it takes every one. A scaling calibration marks its roles'
        damping."""
        memory = self
        if trigger is Trigger.SCALING:
            memory = replace(memory, scaling_recal_at={
                **memory.scaling_recal_at, **dict.fromkeys(memory.pending_scaling_roles, now)})
        if trigger is Trigger.CANARY:
            return memory
        return replace(memory, pending_scaling=None, pending_recommendation=None,
                       pending_scaling_roles=frozenset(),
                       calibrated_counts=dict(memory.scaling.known) or None,
                       pending_drift=False, pending_measured=False)

    # -- taking the lead ------------------------------------------------------------------

    def restored(self, tx: Tx) -> DecisionMemory:
        """On taking the lead (a start, a restart, a failover), the causes not yet
        calibrated for (held back by the change limit or an operator), from the store: not
        what this replica remembers of an earlier term, which another leader may have acted
        on since.

        - A drift stored since the last calibration and since the last bake ended.
        - A change of the worker counts since the last calibration's newest window: the
          scaling detector counts from those, not from this term's first window.
        - The retry of a refused link calibration, when it was the newest calibration.
        Kept in memory during the term (one read per term, not per cycle: a calibration's
        details are large)."""
        newest = tx.calibrations(limit=1)
        retry_at = (newest[0].details or {}).get("link_retry_at") if newest else None
        marks = [c.created_at for c in newest]
        # Drift while a canary baked is void. A bake ends with a calibration (the refit) or,
        # without one, with the newest policy's promotion or rollback.
        for p in tx.policies(limit=1):
            marks += [p.promoted_at] if p.promoted_at is not None else []
            marks += [p.updated_at] if p.status == "rolled_back" else []
        since = max(marks) if marks else None
        pending = [e for e in tx.drift_events(since=since) if since is None or e.at > since]
        if pending:
            log.info("a drift stored since the last calibration is still pending: %s",
                     ", ".join(sorted({e.kind for e in pending})))
        trained = tx.windows_by_ids([newest[0].last_window_id]) \
            if newest and newest[0].last_window_id is not None else []
        # Compacted away, or nothing calibrated yet: the first window sets the counts.
        scaling = ScalingState(worker_counts(trained[0].window)) if trained else ScalingState()
        return replace(
            self, link_retry_at=float(retry_at) if isinstance(retry_at, (int, float)) else None,
            pending_drift=bool(pending),
            pending_measured=any((e.details or {}).get("measured") for e in pending),
            pending_scaling=None, pending_recommendation=None, scaling=scaling,
            pending_scaling_roles=frozenset(), calibrated_counts=dict(scaling.known) or None)


def cause_of(trigger: Trigger, scaling: str | None, recal: OperatorRequest | None) -> Cause:
    """The cause a (non-canary) calibration answers: the operator's reason, else the scaling
    event (the policy's provenance says which shape), else the trigger alone."""
    if recal is not None and recal.reason:
        return Cause(trigger, recal.reason)
    if scaling is not None:
        return Cause(trigger, scaling)
    return Cause(trigger)


def why_incomplete(window: Window | None) -> str:
    """Why a window is not fit to calibrate on."""
    if window is None:
        return "no window (observe failed)"
    if window.failures:
        names = ", ".join(sorted(f.target for f in window.failures)[:5])
        return (f"{len(window.failures)} target(s) failed: {names} (a target failing "
                f"{SETTLED_FAILURES} windows in a row counts as gone, not missing)")
    return "the window has no routed requests"
