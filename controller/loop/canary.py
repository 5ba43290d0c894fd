"""The canary and the post-promotion watch: gather the bake windows from the store, ask the
pure judges of :mod:`controller.core.rollout`, and write their verdicts in the cycle's
transaction (status changes, desired versions, metric events).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta

from controller.clock import Clock
from controller.core.rollout import (
    WATCH_OVER,
    CanaryAction,
    CanaryVerdict,
    JudgeParams,
    OperatorState,
    Rollout,
    WatchAction,
    WatchVerdict,
    judge_canary,
    judge_watch,
)
from controller.core.window import Window
from controller.loop.learning import CalibrationOutcome
from controller.loop.metric_events import CanaryState, MetricEvents, RolledBack
from controller.loop.policies import PolicyBook
from controller.loop.report import CycleReport
from controller.store import PolicyRecord, Store, Tx
from controller.store.kinds import PolicyKind, policy_kind

SUPERSEDED = "superseded by its canary refit"  # a superseded canary's reason starts so
UNPROMOTED = "rolled back after promotion"  # a promotion the watch undid: reason starts so


class Canary:
    """Judges the baking canary and watches a promotion, on ``book``'s routers
    (``outcome_names``: each router's name in windows' route outcomes)."""

    def __init__(self, book: PolicyBook, clock: Clock, params: JudgeParams,
                 outcome_names: Mapping[str, str]) -> None:
        self.book = book
        self.clock = clock
        self.params = params
        self.outcome_names = outcome_names

    def refit_due(self, store: Store, rollout: Rollout, window: Window | None) -> bool:
        """Whether to refit the baking canary now: it is not itself a refit, and the judge,
        with this cycle's window (stored with the verdict), will promote it. A canary that
        waits for traffic or is rolled back is not refitted: its refit would be discarded."""
        assert rollout.canary_version is not None
        if window is None:
            return False
        with store.read() as tx:
            record = tx.policy(rollout.canary_version)
            if record is None or policy_kind(record) is PolicyKind.REFIT:
                return False
            return self.judge_canary(tx, rollout, record, window).action is CanaryAction.PROMOTE

    def apply_verdict(self, tx: Tx, rollout: Rollout, report: CycleReport, events: MetricEvents,
                      refit: CalibrationOutcome | None = None) -> CanaryAction:
        """Judge the baking canary with this cycle's stored window and write the verdict:
        promote it to every router, roll it back to the fleet's version, or (promoted, with
        an approved refit of it) supersede it by its refit, which bakes instead so the fleet
        changes once, not twice."""
        assert rollout.canary_version is not None
        record = tx.policy(rollout.canary_version)
        assert record is not None
        verdict = self.judge_canary(tx, rollout, record)
        report.canary = f"v{rollout.canary_version}: {verdict.reason}"
        if verdict.action is CanaryAction.PROMOTE and refit is not None and refit.approved \
                and rollout.fleet_version is not None:
            tx.set_policy_status(rollout.canary_version, "superseded",
                                 f"{SUPERSEDED}: {verdict.reason}")
            for r in rollout.canary_routers:
                tx.set_desired(r, rollout.fleet_version)
            report.canary = f"v{rollout.canary_version}: superseded by its refit"
            return CanaryAction.SUPERSEDED
        if verdict.action is CanaryAction.PROMOTE:
            for r in self.book.routers:
                tx.set_desired(r, rollout.canary_version)
            tx.mark_promoted(rollout.canary_version, self.clock.utcnow())
            events.append(CanaryState("promoted"))
        elif verdict.action is CanaryAction.ROLL_BACK:
            tx.set_policy_status(rollout.canary_version, "rolled_back",
                                 f"canary rolled back: {verdict.reason}")
            if rollout.fleet_version is not None:
                for r in rollout.canary_routers:
                    tx.set_desired(r, rollout.fleet_version)
            events.append(RolledBack("canary", rollout.fleet_version))
        return verdict.action

    def judge_canary(self, tx: Tx, rollout: Rollout, record: PolicyRecord,
                     unstored: Window | None = None) -> CanaryVerdict:
        """The pure judge (:func:`controller.core.rollout.judge_canary`) on the windows
        since ``record``'s approval (``unstored``: this cycle's window, before it is
        stored)."""
        return judge_canary(self.bake_windows(tx, record, unstored),
                            {self.outcome_names[r] for r in rollout.canary_routers},
                            {self.outcome_names[r] for r in rollout.control_routers},
                            self.params)

    def watch(self, tx: Tx, version: int, ops: OperatorState, report: CycleReport,
              events: MetricEvents) -> bool:
        """Roll a promotion back when the fleet's goodput since falls well below the bake's;
        True when it did. A canary shares the workers with the control routers, so a route
        fine for its share of the traffic can overload a pool once every router sends it
        there: the judge could not see that, the fleet's goodput after the promotion does.
        Never while an operator holds the rollout (paused, pinned, in fallback): they chose
        what runs."""
        record = tx.policy(version)
        if record is None or record.promoted_at is None or self.params.watch_s is None:
            return False
        verdict = self.judge_promotion(tx, record)
        if verdict.action is WatchAction.ROLL_BACK and ops.holding:
            report.canary = f"v{version}: {verdict.reason}; not rolled back: the operator holds"
            return False
        if verdict.action is not WatchAction.ROLL_BACK:
            if verdict.action is not WatchAction.OVER:
                report.canary = f"v{version}: {verdict.reason}"
            return False
        target = self.book.rollback_target(tx, version, ops)
        if target is None:
            report.canary = f"v{version}: {verdict.reason}; nothing older to roll back to"
            return False
        tx.set_policy_status(version, "rolled_back", f"{UNPROMOTED}: {verdict.reason}")
        runs = self.book.desire_back(tx, target, ops, events)
        report.canary = f"v{version}: {UNPROMOTED} to v{target}{runs}: {verdict.reason}"
        events.append(RolledBack("watch", target))
        return True

    def judge_promotion(self, tx: Tx, record: PolicyRecord) -> WatchVerdict:
        """The pure watch (:func:`controller.core.rollout.judge_watch`) on the windows since
        ``record``'s approval; over once ``watch_s`` passed since its promotion (no read)."""
        cfg = self.params
        assert record.promoted_at is not None and cfg.watch_s is not None
        now, promoted = self.clock.now(), record.promoted_at.timestamp()
        if now - promoted > cfg.watch_s:
            return WATCH_OVER
        return judge_watch(now, promoted, self.bake_windows(tx, record),
                           {self.outcome_names[r] for r in self.book.routers}, cfg)

    def bake_windows(self, tx: Tx, record: PolicyRecord, unstored: Window | None = None
                      ) -> list[Window]:
        """Stored windows (and ``unstored``) that ended at least half an interval after
        ``record``'s approval: the one the approval happened in saw the old policy
        everywhere."""
        approved_at = record.created_at.timestamp()
        since = record.created_at - timedelta(seconds=self.params.interval_s)
        windows = [w.window for w in tx.windows(since=since)]
        if unstored is not None:
            windows.append(unstored)
        return [w for w in windows if w.end >= approved_at + 0.5 * self.params.interval_s]


__all__ = ["SUPERSEDED", "UNPROMOTED", "Canary"]
