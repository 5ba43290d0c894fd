"""The cycle's calibration step: choose the trigger, run the fit, note its result.

:class:`Calibration` owns why a cycle calibrates (:func:`controller.core.rollout.choose_trigger`
on what the cycle gathered and the :class:`~controller.loop.memory.DecisionMemory`), the fit
itself (on the stored usable windows and this cycle's, off the event loop through
``run_blocking``), and the failed-fit back-off after the write. Each step takes the memory
and returns the new one; the plan it fills is written by :mod:`.write`. A failed fit pushes
nothing: its error is the plan's ``calibration_error``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any, Protocol

from controller.clock import Clock
from controller.core.rollout import (
    OperatorState,
    Rollout,
    TriggerChoice,
    TriggerInputs,
    TriggerNote,
    choose_trigger,
)
from controller.core.trigger import Cause, Trigger
from controller.loop.canary import Canary
from controller.loop.learning import MIN_REGIME_WINDOWS, CalibrationOutcome, Learner, LearnerError
from controller.loop.memory import DecisionMemory, cause_of
from controller.loop.metrics import ControllerMetrics
from controller.loop.report import CycleReport, join
from controller.loop.write import Plan
from controller.policy import Policy
from controller.store import OperatorRequest, Store, Tx
from controller.store.kinds import REFIT_PREFIX, PolicyKind, policy_kind

log = logging.getLogger("pdctl.cycle")

FIT_RETRY_INTERVALS = 10  # control intervals between automatic retries of a failed fit
# Flap damping: one scaling recalibration per role per max(min_policy_interval_s, this many
# control intervals) at most (Calibration.scaling_damping_s).
SCALING_DAMPING_WINDOWS = 10


class CalibrationSettings(Protocol):
    """What the calibration step reads of the cycle's settings (``CycleConfig``)."""

    @property
    def interval_s(self) -> float: ...

    @property
    def calibrate_every_s(self) -> float | None: ...

    @property
    def training_windows(self) -> int: ...

    @property
    def min_training_windows(self) -> int: ...

    @property
    def min_policy_interval_s(self) -> float: ...

    @property
    def canary_refit(self) -> bool: ...


class Calibration:
    """The calibration step of one cycle (leader only)."""

    def __init__(self, *, store: Store, clock: Clock, learner: Learner,
                 metrics: ControllerMetrics, canary: Canary, config: CalibrationSettings,
                 run_blocking: Callable[[Callable[[], Any]], Awaitable[Any]]) -> None:
        self.store = store
        self.clock = clock
        self.learner = learner
        self.metrics = metrics
        self.canary = canary
        self.config = config
        self._run_blocking = run_blocking

    def scaling_damping_s(self) -> float:
        """The least time between two scaling recalibrations for one role (cause):
        ``max(min_policy_interval_s, SCALING_DAMPING_WINDOWS * interval_s)``."""
        return max(self.config.min_policy_interval_s,
                   SCALING_DAMPING_WINDOWS * self.config.interval_s)

    # -- why ------------------------------------------------------------------------------

    def trigger(self, plan: Plan, memory: DecisionMemory, rollout: Rollout,
                ops: OperatorState, recal: OperatorRequest | None, now: float
                ) -> tuple[Trigger | None, DecisionMemory]:
        """Why to calibrate now, or None: :func:`controller.core.rollout.choose_trigger` on
        what this cycle gathered (the store is read only for what the choice can use)."""
        baking = rollout.canary_version is not None
        free = recal is None and not baking and not ops.holding
        choice = choose_trigger(TriggerInputs(
            now=now, operator_recalibrate=recal is not None, canary_baking=baking,
            canary_refit=self.config.canary_refit,
            refit_due=(recal is None and baking and self.config.canary_refit and not ops.holding
                       and self.canary.refit_due(self.store, rollout, plan.window)),
            holding=ops.holding, pending_drift=memory.pending_drift,
            pending_measured=memory.pending_measured,
            pending_scaling=memory.pending_scaling is not None,
            pending_recommendation=memory.pending_recommendation is not None,
            scaling_damped=memory.scaling_damped(now, self.scaling_damping_s()),
            drift_fired=any(f.fired for f in plan.findings),
            since_last_change=self._since_last_change(now) if free else math.inf,
            min_policy_interval_s=self.config.min_policy_interval_s,
            fit_failed_at=memory.fit_failed_at,
            fit_retry_s=FIT_RETRY_INTERVALS * self.config.interval_s,
            link_retry_at=memory.link_retry_at,
            next_due=self.next_due() if free else None))
        memory = memory.after_choice(choice)
        self._log_notes(choice, memory)
        return choice.trigger, memory

    def _log_notes(self, choice: TriggerChoice, memory: DecisionMemory) -> None:
        for note in choice.notes:
            if note is TriggerNote.RATE_LIMITED_DRIFT:
                log.info("drift fired but the policy changed less than %.0f s ago",
                         self.config.min_policy_interval_s)
            elif note is TriggerNote.SCALING_HELD:
                log.info("scaling cause held back: a scaling recalibration for %s ran less "
                         "than %.0f s ago", ", ".join(sorted(memory.pending_scaling_roles)),
                         self.scaling_damping_s())
            elif note is TriggerNote.LINK_RETRY:
                log.info("calibrating again for the KV link's drift, on the windows since it")

    def next_due(self) -> float | None:
        """When the next scheduled calibration is due (epoch s), from the store."""
        every = self.config.calibrate_every_s
        with self.store.read() as tx:
            last = tx.calibrations(limit=1)
            if last:
                return last[0].created_at.timestamp() + every if every is not None else None
            recent = tx.windows(limit=self.config.min_training_windows)
        # Never calibrated: due as soon as enough windows exist.
        if len(recent) >= self.config.min_training_windows:
            return recent[-1].window.end
        return None

    def _since_last_change(self, now: float) -> float:
        with self.store.read() as tx:
            latest = tx.policies(limit=1, status="approved")
            undone = tx.policies(limit=1, status="rolled_back")
        # Adopting what the routers already ran changed nothing on them.
        changes = [p.created_at for p in latest if policy_kind(p) is not PolicyKind.ADOPTED]
        # A promotion the watch rolled back changed every router too.
        changes += [p.updated_at for p in undone if p.promoted_at is not None]
        if not changes:
            return math.inf
        elapsed = now - max(changes).timestamp()
        # Negative: the wall clock was stepped back since that approval. Waiting until it
        # catches up could block recalibration for hours, so the rate limit does not apply.
        return elapsed if elapsed >= 0 else math.inf

    # -- the fit --------------------------------------------------------------------------

    async def run(self, plan: Plan, memory: DecisionMemory, current: Policy | None,
                  now: float, recal: OperatorRequest | None) -> DecisionMemory:
        """Calibrate for ``plan.trigger`` on the usable stored windows and this cycle's; the
        outcome (or why none) goes into ``plan``. Returns the memory with the causes the
        calibration took."""
        trigger = plan.trigger or Trigger.SCHEDULE
        with self.store.read() as tx:
            stored = tx.windows(limit=self.config.training_windows)
        usable = [s for s in stored if memory.usable(s.window)]
        force = bool(recal is not None and (recal.args or {}).get("force"))
        plan.recalibrate_request = recal
        windows = [s.window for s in usable]
        if plan.window is not None and memory.usable(plan.window):
            windows.append(plan.window)  # written in the same transaction; trained on too
        plan.calibration_windows = [s.id for s in usable]
        if len(windows) < 2:
            # Too little data is not a failed fit: the cause stays pending and is retried
            # next cycle, without the failed-fit back-off (at start-up the first windows
            # often miss targets not yet scraped).
            plan.calibration_error = f"only {len(windows)} complete window(s) stored"
            plan.too_few_windows = True
            return memory
        self.metrics.recalibration(trigger)
        for_link = trigger is Trigger.DRIFT and memory.pending_measured  # led by the KV link
        cause = self._cause(plan, trigger, memory, current, recal)
        memory = memory.take_cause(trigger, now)
        outcome = await self._fit(plan, lambda: self.learner.calibrate(
            windows, current, now, cause, force))
        if outcome is None:
            return memory
        plan.calibration = outcome
        if for_link and not outcome.approved and not outcome.details.get("regime_only"):
            # Calibrated at the link's detection, it trained across the change. The change
            # began before its detection: by then the learner has the windows to train on
            # the new link's traffic alone (CHANGELOG.md, "A slower link is not
            # rate-limited").
            plan.link_retry_at = now + MIN_REGIME_WINDOWS * self.config.interval_s
        return memory

    @staticmethod
    def _cause(plan: Plan, trigger: Trigger, memory: DecisionMemory, current: Policy | None,
               recal: OperatorRequest | None) -> Cause:
        """The cause this calibration answers. A canary refit keeps the candidate's own
        reason and regime (the learner trains it on the same regime's windows, the bake's
        included); a scaling calibration answers the pending scaling event."""
        if trigger is Trigger.SCALING:
            plan.scaling = memory.pending_scaling
            plan.scaling_recommendation = memory.pending_recommendation
        if trigger is Trigger.CANARY:
            assert current is not None
            return Cause(trigger, refits=plan.refits,
                         text=f"{current.provenance.reason or Trigger.SCHEDULE} "
                              f"({REFIT_PREFIX}{plan.refit_of})")
        return cause_of(trigger, plan.scaling, recal)

    async def _fit(self, plan: Plan, fit: Callable[[], CalibrationOutcome]
                   ) -> CalibrationOutcome | None:
        """Run ``fit`` through ``run_blocking``; None (and the plan's error) if it failed."""
        t0 = self.clock.monotonic()
        try:
            outcome: CalibrationOutcome = await self._run_blocking(fit)
            self.metrics.observe_job("calibrate", self.clock.monotonic() - t0)
        except LearnerError as e:
            plan.calibration_error = str(e)
            return None
        except Exception as e:  # a bug in a fit must not push anything
            log.exception("calibration failed")
            plan.calibration_error = f"{type(e).__name__}: {e}"
            return None
        return outcome

    # -- after the write ------------------------------------------------------------------

    def noted(self, plan: Plan, memory: DecisionMemory, report: CycleReport
              ) -> DecisionMemory:
        """After the commit: why no calibration ran, and the failed-fit back-off (a failed
        refit sets none: the candidate is left to the judge)."""
        if plan.too_few_windows:
            report.reason = join(report.reason, f"calibration ({plan.trigger}) deferred: "
                                 f"{plan.calibration_error}")
        elif plan.calibration_error is not None:
            report.reason = join(report.reason, f"calibration skipped: {plan.calibration_error}")
            if plan.refit_of is None:
                return replace(memory, fit_failed_at=self.clock.now())
        elif plan.calibration is not None:
            return replace(memory, fit_failed_at=None)
        return memory


def calibration_trigger(tx: Tx, version: int) -> Trigger | None:
    """The trigger of the calibration that produced policy ``version``, as stored in its
    details; None for a policy no calibration produced (adopted, seeded, set by hand) or a
    value no :class:`Trigger` names."""
    record = tx.calibration_for(version)
    details = record.details if record is not None else None
    stored = details.get("trigger") if isinstance(details, Mapping) else None
    try:
        return Trigger(stored) if isinstance(stored, str) else None
    except ValueError:
        return None
