"""The cycle's one write transaction: everything a cycle decided, stored at once.

:class:`DecisionWriter` writes the window, an adoption of the routers' running policy,
drift events, the capacity recommendation, operator requests, the canary's verdict or the
watch's, the calibration and its candidate policy (the only place a calibration takes a
version number: :meth:`DecisionWriter._store_candidate`), new routers' desired versions and
the leader's state gauges, in one ``store.cycle()`` transaction fenced by leadership. It
returns what to do once that committed (:class:`Written`): the metric events decided, the
approvals to export and the learner's memory after the write. A write that fails returns
nothing, so nothing of it is emitted, exported or remembered.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Protocol

from controller.clock import Clock
from controller.core.drift import feature_statistics
from controller.core.rollout import (
    CanaryAction,
    OperatorState,
    PolicyStatus,
    Rollout,
    canary_subset,
    candidate_status,
    operator_state,
)
from controller.core.trigger import Trigger
from controller.core.window import Window
from controller.loop.canary import Canary
from controller.loop.export import CapacityDraft, CapacityExport
from controller.loop.learning import (
    CalibrationOutcome,
    DriftFinding,
    Learner,
    LearnerState,
    renews_reference,
    without_exploration,
)
from controller.loop.metric_events import (
    CanaryState,
    DriftFired,
    DriftStatistic,
    GuardrailDecided,
    MetricEvents,
    NoCanary,
    OperatorGauges,
    PolicyChanged,
    PredictedGoodput,
)
from controller.loop.operator import OperatorRequests
from controller.loop.policies import PolicyBook, record_adoption
from controller.loop.report import CycleReport, CycleResult, join
from controller.policy import LookupTable, Policy, Provenance, dumps
from controller.rollout.reconciler import RunningPolicy
from controller.store import OperatorRequest, Store, Tx
from controller.store.kinds import REFIT_PREFIX, SEEDED_PREFIX, PolicyKind

DRY_RUN_PREFIX = "dry run: would "  # a dry run's outcome starts so (never "approved")


@dataclass
class Plan:
    """Decisions computed before the write transaction."""

    window: Window | None = None
    findings: list[DriftFinding] = field(default_factory=list)
    calibration: CalibrationOutcome | None = None
    calibration_windows: list[int] = field(default_factory=list)
    trigger: Trigger | None = None
    refits: Trigger | None = None  # a CANARY calibration: the trigger behind the canary
    recalibrate_request: OperatorRequest | None = None
    calibration_error: str | None = None
    too_few_windows: bool = False  # calibration_error is a lack of data, not a failed fit
    scaling: str | None = None  # the scaling event a "scaling" calibration answers
    scaling_recommendation: int | None = None  # ...and the recommendation it applied
    capacity: CapacityDraft | None = None
    applied_recommendation: int | None = None  # the scaling just confirmed reached it
    refit_of: int | None = None  # a "canary" calibration: the baking version it refits
    adopted: RunningPolicy | None = None  # what every router ran, adopted on an empty store
    canary_verdict: CanaryAction | None = None  # the judge's action this cycle
    link_retry_at: float | None = None  # a refused link calibration: calibrate again then



@dataclass(slots=True)
class LearnerMemo:
    """The learner's memory a write reads and changes: its state, the policy version that
    state belongs to, and when to retry a refused link calibration."""

    state: LearnerState
    state_for: int | None
    link_retry_at: float | None


@dataclass(slots=True)
class Written:
    """What a committed write leaves to do."""

    events: MetricEvents
    approved: list[tuple[Policy, CalibrationOutcome]]
    memo: LearnerMemo


class Fence(Protocol):
    holder: str

    def fence(self, tx: Tx) -> bool: ...


class LostLeadership(Exception):
    """The write found another replica leading: nothing was written."""


class WriteSettings(Protocol):
    """What the write reads of the cycle's settings (``CycleConfig``)."""

    @property
    def advisory(self) -> bool: ...

    @property
    def canary_fraction(self) -> float: ...

    @property
    def adopted_exploration(self) -> float: ...


class DecisionWriter:
    """Writes one cycle's decision (see the module)."""

    def __init__(self, *, store: Store, clock: Clock, config: WriteSettings, book: PolicyBook,
                 learner: Learner, operator: OperatorRequests, canary: Canary,
                 capacity: CapacityExport) -> None:
        self.store = store
        self.clock = clock
        self.config = config
        self.book = book
        self.learner = learner
        self.operator = operator
        self.canary = canary
        self.capacity = capacity
        self.leadership: Fence | None = None
        self._events = MetricEvents()
        self._approved: list[tuple[Policy, CalibrationOutcome]] = []
        self._memo = LearnerMemo(LearnerState(), None, None)
        self._released: dict[int, int] = {}

    def write(self, plan: Plan, claimed: list[OperatorRequest], report: CycleReport,
              memo: LearnerMemo, leadership: Fence, released: dict[int, int]) -> Written:
        """Write ``plan`` in one transaction (raises :class:`LostLeadership` when fenced
        out); ``released`` loses the requests finished here."""
        self._events, self._approved = MetricEvents(), []
        self._memo = LearnerMemo(memo.state, memo.state_for, memo.link_retry_at)
        self.leadership, self._released = leadership, released
        self._write_decision(plan, claimed, report, self.clock.utcnow())
        return Written(self._events, self._approved, self._memo)

    def _write_decision(self, plan: Plan, claimed: list[OperatorRequest],
                        report: CycleReport, now_dt: datetime) -> None:
        """The cycle's one write transaction, fenced by leadership: the window, an adoption,
        drift events, the capacity recommendation, operator requests, the canary's verdict
        or the watch's, the calibration and its candidate, new routers, state gauges."""
        with self.store.cycle() as tx:
            assert self.leadership is not None
            if not self.leadership.fence(tx):
                report.result, report.reason = CycleResult.SKIPPED, "lost leadership before writing"
                report.leader = False
                raise LostLeadership()
            window_ids: list[int] = []
            if plan.window is not None:
                report.window_id = tx.add_window(plan.window)
                window_ids = [report.window_id]
            if plan.adopted is not None and self.book.rollout(tx).fleet_version is None:
                self._record_adoption(tx, plan.adopted, report)
            self._record_drift(tx, plan.findings, window_ids, report)
            rid, said = self.capacity.record(tx, plan.applied_recommendation, plan.capacity,
                                             report.window_id)
            if rid is not None:
                report.recommendation_id, report.capacity = rid, said
            self._apply_requests(tx, claimed, report)
            rollout, ops = self._judge_rollout(tx, plan, report)
            if plan.trigger is not None:
                report.trigger = plan.trigger
                self._record_calibration(tx, plan, rollout, ops, report)
            self._finish_recalibrations(tx, claimed, plan, report)
            self._assign_new_routers(tx, now_dt)
            self._set_state_metrics(tx)

    def _apply_requests(self, tx: Tx, claimed: Sequence[OperatorRequest],
                        report: CycleReport) -> None:
        """Carry out and finish the claimed requests other than ``recalibrate``."""
        for r in claimed:
            if r.kind == "recalibrate":
                continue
            baking = self.book.rollout(tx).canary_version
            outcome, ok = self.operator.apply(tx, r, report, self._events)
            tx.finish_request(r.id, outcome, ok=ok)
            self._released.pop(r.id, None)
            report.requests.append(f"{r.kind}#{r.id}: {outcome}")
            self.operator.drop_abandoned_canary(tx, baking, f"{r.kind}#{r.id}: {outcome}",
                                                self._events)

    def _judge_rollout(self, tx: Tx, plan: Plan, report: CycleReport
                       ) -> tuple[Rollout, OperatorState]:
        """Judge the baking canary, or watch the fleet's promotion, with this cycle's window;
        the rollout and operator state as the write leaves them (operator requests just
        applied may have changed both). While paused a canary is not judged: a verdict is a
        push, so it waits for resume, and the windows baked meanwhile count then."""
        rollout = self.book.rollout(tx)
        ops = operator_state(tx.requests(status="done"))
        if rollout.canary_version is not None and plan.window is not None and ops.paused:
            report.canary = (f"v{rollout.canary_version}: baking; not judged while paused "
                             "(no pushes)")
        elif rollout.canary_version is not None and plan.window is not None:
            refit = plan.calibration if plan.refit_of == rollout.canary_version else None
            plan.canary_verdict = self.canary.apply_verdict(tx, rollout, report,
                                                             self._events, refit)
            rollout = self.book.rollout(tx)
        elif rollout.fleet_version is not None and plan.window is not None \
                and self.canary.watch(tx, rollout.fleet_version, ops, report, self._events):
            rollout = self.book.rollout(tx)
        return rollout, ops

    @staticmethod
    def _finish_recalibrations(tx: Tx, claimed: Sequence[OperatorRequest], plan: Plan,
                               report: CycleReport) -> None:
        """Finish the claimed ``recalibrate`` requests with the calibration's outcome."""
        for r in claimed:
            if r.kind != "recalibrate":
                continue
            ok = plan.calibration is not None
            outcome = report.guardrail or plan.calibration_error or "nothing to do"
            if plan.calibration is None and plan.calibration_error is None:
                outcome = report.reason or "not run"
            tx.finish_request(r.id, outcome, ok=ok)
            report.requests.append(f"recalibrate#{r.id}: {outcome}")

    def _record_drift(self, tx: Tx, findings: list[DriftFinding], window_ids: list[int],
                      report: CycleReport) -> None:
        for f in findings:
            if not math.isnan(f.statistic):
                self._events.append(DriftStatistic(f.kind, "all", f.statistic, f.threshold))
                # Which feature drives it (the dashboard's drift panel draws each).
                for feature, value in feature_statistics(f.kind, f.details).items():
                    if math.isfinite(value):
                        self._events.append(DriftStatistic(f.kind, feature, value, f.threshold))
            if f.fired:
                tx.add_drift_event(f.kind, f.statistic, f.threshold, window_ids,
                                   {"reason": f.reason, **_plain(f.details),
                                    "measured": f.measured})
                self._events.append(DriftFired(f.kind))
                report.drift.append(f.kind)

    def _record_calibration(self, tx: Tx, plan: Plan, rollout: Rollout, ops: OperatorState,
                            report: CycleReport) -> None:
        """Store this cycle's calibration and, unless it is a dry run, its candidate; adopt
        the learner's new drift reference."""
        outcome = plan.calibration
        if outcome is None:
            return
        ids = list(plan.calibration_windows) + ([report.window_id] if report.window_id else [])
        dry_run = bool(plan.recalibrate_request is not None
                       and (plan.recalibrate_request.args or {}).get("dry_run"))
        not_stored = "dry run" if dry_run else None
        if plan.refit_of is not None and plan.canary_verdict not in (CanaryAction.PROMOTE,
                                                                     CanaryAction.SUPERSEDED):
            # The judge was asked before the refit; only an operator action in this cycle
            # (a rollback, a pin, a pause) changes its answer. The refit is then only recorded.
            dry_run = True
            not_stored = (f"the refit of v{plan.refit_of}, which an operator action in this "
                          "cycle kept from its promotion")
            report.not_stored = not_stored
        outcome, seeded = self._final_outcome(plan, outcome, ops, report, not_stored)
        version: int | None = None
        candidate: tuple[str, str] | None = None
        reference_for: int | None = None
        if not dry_run:
            version, candidate = self._store_candidate(tx, plan, outcome, seeded, rollout,
                                                       ops, report)
        # A refused refit leaves drift measured as it was: it was trained on windows where
        # two policies ran, and the candidate it refitted keeps running.
        if not dry_run and (plan.refit_of is None or outcome.approved):
            # The learner decides what drift is measured against now: a refused candidate
            # trained across a shift does not hide it (see Learner.adopt), so that shift
            # fires again after the detector's cooldown and is calibrated for on its own
            # windows.
            self._memo.state = self.learner.adopt(self._memo.state, outcome, self.clock.now())
            if renews_reference(outcome) and self._memo.state_for is not None:
                # What a restart or a rollback to this version restores (policies.restore_learner).
                reference_for = self._memo.state_for
        report.calibration_id = tx.add_calibration(
            ids, outcome.heldout_error, outcome.predicted_goodput_new,
            outcome.predicted_goodput_current, version,
            # The cycle's own keys last: the learner's details carry the unforced verdict.
            {**_plain(outcome.details), "trigger": plan.trigger, "dry_run": dry_run,
             "not_stored": not_stored,
             "approved": outcome.approved, "reason": outcome.reason,
             "refit_of": plan.refit_of, "reference_for": reference_for,
             "link_retry_at": plan.link_retry_at,
             **_scaling_details(plan)},
            candidate=candidate,
        )
        self._memo.link_retry_at = plan.link_retry_at  # any stored calibration replaces it

    def _final_outcome(self, plan: Plan, outcome: CalibrationOutcome, ops: OperatorState,
                       report: CycleReport, not_stored: str | None
                       ) -> tuple[CalibrationOutcome, float | None]:
        """The outcome as stored: without exploration while an operator turned it off (read
        after this cycle's requests), or a first policy seeded with exploration; its
        guardrail metric events and verdict for the report. Also the seeded share."""
        if ops.exploration_off:
            outcome = plan.calibration = replace(outcome,
                                                 policy=without_exploration(outcome.policy))
        seeded: float | None = None
        if not ops.exploration_off and not self.config.advisory:
            outcome, seeded = self._seed_first_policy(outcome)
            plan.calibration = outcome
        self._events.append(GuardrailDecided(outcome.decision, outcome.label, self.clock.now()))
        if outcome.predicted_goodput_current is not None:
            self._events.append(PredictedGoodput(outcome.predicted_goodput_current,
                                                 outcome.predicted_goodput_new))
        report.guardrail = outcome.reason
        if not_stored == "dry run":  # an operator's dry run: what it would have done
            report.guardrail = dry_run_verdict(outcome.approved, outcome.reason)
        return outcome, seeded

    def _store_candidate(self, tx: Tx, plan: Plan, outcome: CalibrationOutcome,
                         seeded: float | None, rollout: Rollout, ops: OperatorState,
                         report: CycleReport) -> tuple[int | None, tuple[str, str] | None]:
        """Number and store the calibration's candidate policy (the one place a calibration
        takes a version), with the status :func:`candidate_status` gives it; an approved
        one becomes desired. Its version; or, for a candidate the guardrail refused, no
        version and the (policy JSON, checksum) its calibration keeps: a version number
        is taken only by a policy that can run or be rolled out (approved, held as a
        candidate, advisory), so refusals in a row leave the versions contiguous."""
        status, held = candidate_status(outcome.approved, self.config.advisory, ops,
                                        rollout.canary_version)
        if status is PolicyStatus.REJECTED:
            report.candidate_status = status
            return None, (dumps(outcome.policy), outcome.policy.checksum)
        version = tx.next_version()
        policy = outcome.policy.with_version(version)
        reason = outcome.reason
        if plan.refit_of is not None:
            reason = f"{REFIT_PREFIX}{plan.refit_of}: {reason}"
        if held is not None:
            reason = (f"held as a candidate, not rolled out ({held}); the guardrail's "
                      f"verdict: {outcome.reason}")
            report.guardrail = reason
        tx.add_policy(version, policy.checksum, dumps(policy), status, reason,
                      kind=PolicyKind.OTHER if plan.refit_of is None else PolicyKind.REFIT,
                      seeded_exploration=seeded)
        self.book.cache[version] = policy
        report.candidate_version, report.candidate_status = version, status
        if status is PolicyStatus.APPROVED:
            self._approve(tx, version, rollout, report)
            self._memo.state_for = version
            self._approved.append((policy, outcome))
        return version, None

    def _record_adoption(self, tx: Tx, found: RunningPolicy, report: CycleReport) -> None:
        policy, said, added = record_adoption(tx, found, self.book.routers, "the controller")
        if added:
            self.book.cache[policy.version] = policy
            self._events.append(PolicyChanged(policy.version))
        report.reason = join(report.reason, said)
        seeded = self._seed_exploration(tx, policy)
        if seeded is not None:
            report.reason = join(report.reason, seeded)

    def _seed_exploration(self, tx: Tx, adopted: Policy) -> str | None:
        """The adopted policy with ``adopted_exploration`` in every cell, approved and
        desired by every router (the daemon's first push), when the adopted one explores
        nowhere: otherwise the learner never measures the route the routers do not take,
        and every candidate is an extrapolation the guardrail refuses (predicted goodput
        0.0000 against the routers' own). Not in advisory mode (nothing is pushed), nor while
        an operator holds the rollout or turned exploration off. What was done, or None.

        The seeded table counts as a change for ``min_policy_interval_s``: the first
        calibration waits for the measurements it makes."""
        share = self.config.adopted_exploration
        if any(adopted.table.exploration):
            return None
        if share <= 0:  # said once, at adoption: the refusals that follow are not silent
            return (f"v{adopted.version} explores nowhere and [controller] adopted_exploration "
                    "is 0 (or [ppd] pins a route): the learner cannot measure the route the "
                    "routers never take (`pdctl calibrate-active` measures both)")
        if self.config.advisory:
            return None
        ops = operator_state(tx.requests(status="done"))
        if ops.holding or ops.exploration_off:
            return None
        assert self.leadership is not None
        version = tx.next_version()
        reason = (f"{SEEDED_PREFIX}{share:g} in every cell of v{adopted.version}, the routers' "
                  "own policy, which explores nowhere ([controller] adopted_exploration): the "
                  "learner measures the route the routers never take")
        t = adopted.table
        policy = replace(
            adopted, version=version,
            table=LookupTable(t.axes, t.routes, t.scores, (share,) * len(t.exploration)),
            provenance=Provenance(created_at=self.clock.utcnow(), reason=reason,
                                  created_by=self.leadership.holder))
        tx.add_policy(version, policy.checksum, dumps(policy), "approved", reason,
                      seeded_exploration=share, kind=PolicyKind.SEEDED)
        self.book.cache[version] = policy
        for router in self.book.routers:
            tx.set_desired(router, version)
        self._events.append(PolicyChanged(version))
        return f"v{version}: v{adopted.version} with exploration {share:g} to every router"

    def _seed_first_policy(self, outcome: CalibrationOutcome
                           ) -> tuple[CalibrationOutcome, float | None]:
        """A first policy (no current one: the routers ran none to adopt) that explores
        nowhere gets ``adopted_exploration`` in every cell, as an adopted one does: trained
        on windows where one route ran alone, it would keep the other route unmeasured for
        ever and every later candidate would be an extrapolation the guardrail refuses.
        The outcome unchanged and None otherwise; else the seeded outcome and its share."""
        share = self.config.adopted_exploration
        p = outcome.policy
        if (share <= 0 or not outcome.approved or outcome.predicted_goodput_current is not None
                or any(p.table.exploration)):
            return outcome, None
        t = p.table
        table = LookupTable(t.axes, t.routes, t.scores, (share,) * len(t.exploration))
        reason = (f"{outcome.reason}; exploration {share:g} in every cell ([controller] "
                  "adopted_exploration): the first policy explored nowhere")
        return replace(outcome, policy=replace(p, table=table), reason=reason), share

    def _approve(self, tx: Tx, version: int, rollout: Rollout, report: CycleReport) -> None:
        """Make an approved version desired: a canary share first when there is a fleet
        version to compare with, else every router at once."""
        report.approved_version = version
        self._events.append(PolicyChanged(version))
        if rollout.fleet_version is None or len(self.book.routers) < 2:
            for r in self.book.routers:
                tx.set_desired(r, version)
            report.canary = ("no previous policy: every router at once"
                             if rollout.fleet_version is None
                             else "one router: no control group, promoted at once")
            self._events.append(CanaryState("promoted"))
            return
        canary = canary_subset(self.book.routers, self.config.canary_fraction, version)
        for r in canary:
            tx.set_desired(r, version)
        # After a superseded canary the report says so first.
        report.canary = join(report.canary or "", f"baking v{version} on {', '.join(canary)}")
        self._events.append(CanaryState("baking"))

    def _assign_new_routers(self, tx: Tx, now: datetime) -> None:
        """A configured router without a desired version joins the fleet's version."""
        rollout = self.book.rollout(tx)
        if rollout.fleet_version is None:
            return
        desired = tx.desired_versions()
        for r in self.book.routers:
            if r not in desired:
                tx.set_desired(r, rollout.fleet_version, at=now)

    def _set_state_metrics(self, tx: Tx) -> None:
        """The leader's state gauges, from what this cycle's transaction leaves, every cycle:
        they hold after a pin, a re-issue, a canary or a failover."""
        ops = operator_state(tx.requests(status="done"))
        rollout = self.book.rollout(tx)
        # A fallback holds the rollout too: it reads pinned.
        self._events.append(OperatorGauges(ops.paused, ops.pinned is not None or ops.fallback,
                                           rollout.fleet_version))
        # Baking while a canary bakes (after a restart mid-bake too); idle once it is gone,
        # with a verdict or without one.
        if rollout.canary_version is not None:
            self._events.append(CanaryState("baking"))
        else:
            self._events.append(NoCanary())


def _scaling_details(plan: Plan) -> dict[str, Any]:
    """What a "scaling" calibration answers: the event, and the recommendation it applied."""
    details: dict[str, Any] = {}
    if plan.scaling is not None:
        details["scaling"] = plan.scaling
    if plan.scaling_recommendation is not None:
        details["recommendation_id"] = plan.scaling_recommendation
    return details


def _plain(d: Mapping[str, Any]) -> dict[str, Any]:
    from controller.loop.learning import json_safe

    out: dict[str, Any] = json_safe(dict(d))
    return out


def dry_run_verdict(approved: bool, reason: str) -> str:
    """The outcome of an operator's ``recalibrate --dry-run``: what the guardrail would
    have done, in the conditional (it approved nothing and stored no policy), with the
    guardrail's own reason and numbers after it."""
    return f"{DRY_RUN_PREFIX}{'approve' if approved else 'reject'}; nothing stored " \
           f"(guardrail: {reason})"



__all__ = ["DRY_RUN_PREFIX", "DecisionWriter", "LearnerMemo", "LostLeadership", "Plan",
           "Written", "dry_run_verdict"]
