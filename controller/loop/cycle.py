"""The control cycle, the orchestrator of the loop: leadership → gather (observe a window,
read the store) → decide (the pure rules of :mod:`controller.core.rollout`) → apply (one
write transaction) → reconcile.

:class:`Cycle` owns the order of those steps and what happens when one fails; the rooms do
the work: :mod:`.leader` (who may decide), :mod:`.gather` (the window, the adoption),
:mod:`.memory` (what decisions remember between cycles), :mod:`.calibrate` (the trigger and
the fit), :mod:`.canary` (the canary judge and the post-promotion watch), :mod:`.operator`
(operator requests), :mod:`.export` (capacity recommendations), :mod:`.write` (the write
transaction), :mod:`.reconcile` (pushes), :mod:`.policies` (the policy cache, the rollout,
the learner's restore). ``await cycle.run_once()`` runs one cycle: the daemon's scheduler on
the wall clock and the bench on a :class:`~controller.clock.VirtualClock` run this same code.

SQL holds the truth (DESIGN §4): desired versions, acknowledgements, operator requests,
canary state (a canary is "the newest approved version is desired by some routers only")
and every decision's reason. A new ``Cycle`` on the same store continues where the last one
stopped; the reconciler pushes only where a router differs from its desired version, so a
restart never re-pushes an acknowledged version.

Transactions: a cycle's decision is ONE ``store.cycle()`` transaction, written after the
observe and the fit so no database lock is held across network calls or a fit. Two small
transactions surround it: claiming operator requests (so that exactly one replica acts on
each) and recording what the routers acknowledged after the reconcile pass. The
:class:`~controller.loop.memory.DecisionMemory` goes back to its value before a decision
whose write did not commit.

Leadership: only the leader observes, stores windows, calibrates and approves. In
standalone mode the leader also reconciles every router; in sidecar mode
(``reconcile_only``) every replica reconciles its own router.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from controller.clock import Clock
from controller.core.drift import step_scaling
from controller.core.rollout import OperatorState, Rollout, operator_state
from controller.core.trigger import Trigger
from controller.core.window import Window
from controller.errors import TransientError
from controller.loop.calibrate import Calibration, calibration_trigger
from controller.loop.canary import Canary
from controller.loop.cycle_config import CycleConfig
from controller.loop.export import CapacityExport, CapacityPlanner, CapacitySettings
from controller.loop.gather import Gather
from controller.loop.leader import AlwaysLeader, Leadership
from controller.loop.learning import CalibrationOutcome, Learner
from controller.loop.memory import SETTLED_FAILURES, DecisionMemory, why_incomplete
from controller.loop.metrics import ControllerMetrics
from controller.loop.operator import OperatorRequests
from controller.loop.policies import PolicyBook, restore_learner
from controller.loop.reconcile import RouterSync
from controller.loop.report import CycleReport, CycleResult, join, report_fields
from controller.loop.write import DecisionWriter, LearnerMemo, LostLeadership, Plan
from controller.observe.source import MetricsSource
from controller.policy import Policy
from controller.rollout.reconciler import Reconciler
from controller.store import OperatorRequest, Store

T = TypeVar("T")
log = logging.getLogger("pdctl.cycle")

MAX_RELEASES = 2  # a request given back after its cycle failed, at most this often


async def _to_thread(fn: Callable[[], T]) -> T:
    return await asyncio.to_thread(fn)


async def run_inline(fn: Callable[[], T]) -> T:
    """``run_blocking`` for virtual-time runs: the fit runs right here, deterministically
    (the virtual clock does not move while it runs anyway)."""
    return fn()


class Cycle:
    def __init__(
        self,
        *,
        clock: Clock,
        source: MetricsSource,
        store: Store,
        learner: Learner,
        reconciler: Reconciler,
        metrics: ControllerMetrics,
        routers: Sequence[str],
        config: CycleConfig | None = None,
        leadership: Leadership | None = None,
        outcome_names: Mapping[str, str] | None = None,
        reconcile_only: Sequence[str] | None = None,
        run_blocking: Callable[[Callable[[], Any]], Awaitable[Any]] | None = None,
        planner: CapacityPlanner | None = None,
    ) -> None:
        self.clock = clock
        self.source = source
        self.store = store
        self.learner = learner
        self.reconciler = reconciler
        self.metrics = metrics
        self.book = PolicyBook(routers)
        self.routers = self.book.routers
        self.config = config or CycleConfig()
        self.leadership: Leadership = leadership or AlwaysLeader()
        # Router id (what the reconciler dials) -> its name in windows' route outcomes.
        self.outcome_names = {r: (outcome_names or {}).get(r, r) for r in self.routers}
        self.reconcile_only = tuple(reconcile_only) if reconcile_only is not None else None
        run_blocking = run_blocking or _to_thread
        self.memory = DecisionMemory()  # replaced per decision; a failed one puts it back
        self._leading = False
        self._led_term: int | None = None  # the leadership term this replica last led in
        # Given each approved calibration's policy and basis ([export], controller/exporter.py).
        self.on_approval: Callable[[Policy, Any], None] | None = None
        self.gather = Gather(source=source, store=store, clock=clock, metrics=metrics,
                             interval_s=self.config.interval_s)
        self.capacity = CapacityExport(
            planner, metrics, CapacitySettings(self.config.interval_s,
                                               self.config.capacity_interval_s,
                                               self.config.capacity_min_windows),
            run_blocking)
        self.operator = OperatorRequests(self.book, clock)
        self.canary = Canary(self.book, clock, self.config.judge, self.outcome_names)
        self.calibration = Calibration(store=store, clock=clock, learner=learner,
                                       metrics=metrics, canary=self.canary, config=self.config,
                                       run_blocking=run_blocking)
        self.sync = RouterSync(store=store, clock=clock, book=self.book, reconciler=reconciler,
                               metrics=metrics)
        self.writer = DecisionWriter(store=store, clock=clock, config=self.config,
                                     book=self.book, learner=learner, operator=self.operator,
                                     canary=self.canary, capacity=self.capacity)
        self.last_report: CycleReport | None = None
        self.last_completed_at: float | None = None  # clock.now() of the last ok cycle
        self.last_ended_at: float | None = None  # ... of the last cycle, any result (liveness)
        self._claimed: list[OperatorRequest] = []  # claimed by this cycle's decision
        self._released: dict[int, int] = {}  # request id -> times given back after a failure

    @property
    def planner(self) -> CapacityPlanner | None:
        """The capacity planner (None: no recommendations)."""
        return self.capacity.planner

    def scaling_damping_s(self) -> float:
        """The least time between two scaling recalibrations for one role."""
        return self.calibration.scaling_damping_s()

    # -- the whole cycle ------------------------------------------------------------------

    async def run_once(self) -> CycleReport:
        started = self.clock.monotonic()
        report = CycleReport()
        try:
            report.leader = await self._lead()
            if not report.leader:
                self.capacity.withdraw()  # only the leader feeds autoscalers
            if not report.leader and self.reconcile_only is None:
                self.sync.withdraw()  # only the leader reconciles them
            if report.leader:
                await self._decide_or_forget(report)
            # Standalone replicas: the leader reconciles every router (two replicas pushing
            # at once would race to re-issue versions). Sidecar mode: every replica
            # reconciles its own router.
            if report.result is not CycleResult.FAILED \
                    and (report.leader or self.reconcile_only is not None):
                await self._reconcile(report)
        except LostLeadership:
            # Leading again later starts afresh (baselines, pending causes from the store):
            # another replica may have stored windows and acted meanwhile.
            self._leading = False
        except TransientError as e:  # the store down, nothing answered: retried next cycle;
            # the summary line below names it, without a traceback (an outage repeats it)
            report.result, report.reason = CycleResult.FAILED, f"{type(e).__name__}: {e}"
        except Exception as e:  # a cycle never kills the daemon: record and go on
            log.exception("cycle failed")
            report.result, report.reason = CycleResult.FAILED, f"{type(e).__name__}: {e}"
        seconds = self.clock.monotonic() - started
        self.metrics.observe_cycle(report.result, seconds, self.clock.now())
        self.last_ended_at = self.clock.now()
        if report.result is CycleResult.OK:
            self.last_completed_at = self.last_ended_at
        self.last_report = report
        failed = report.result is CycleResult.FAILED
        log.log(logging.WARNING if failed else logging.INFO, "cycle %s",
                report.summary(), extra={"cycle": report_fields(report)})
        return report

    async def _lead(self) -> bool:
        """Take or renew leadership; whether this replica leads. Leading again, or in a new
        term, starts afresh: another replica may have led and stored windows meanwhile, so
        counters diffed across the gap would be counted in this window, and the pending
        causes are read from the store. When whether we lead is unknown (the lock's server
        out of reach), leading again later starts afresh too."""
        try:
            leader = await self.leadership.ensure()
        except Exception:
            self._leading = False
            self.metrics.set_leader(False)
            raise
        self.metrics.set_leader(leader)
        term = self.leadership.term
        if leader and (not self._leading or term != self._led_term):
            self.gather.restart()
            with self.store.read() as tx:  # a failure retries it next cycle
                self.memory = self.memory.restored(tx)
        self._leading, self._led_term = leader, term
        return leader

    # -- deciding (leader only) -----------------------------------------------------------

    async def _decide_or_forget(self, report: CycleReport) -> None:
        """Decide and write; a decision whose write did not commit (the store failed,
        leadership was lost, a bug) is forgotten: the memory goes back to before it, so a
        drift or scaling it consumed stays pending, and the policy cache is dropped, so no
        table the store never got is served. The requests it claimed are given back (twice
        at most: one that keeps failing its cycle waits for request_stale_after_s), so a
        pause does not wait for a store hiccup."""
        memory, self._claimed = self.memory, []
        try:
            await self._decide(report)
        except BaseException:
            self.memory = memory
            self.book.cache.clear()  # the store is the truth: read again
            claimed, self._claimed = self._claimed, []
            self._give_back(claimed)
            raise

    def _give_back(self, claimed: Sequence[OperatorRequest]) -> None:
        mine = [r.id for r in claimed if self._released.get(r.id, 0) < MAX_RELEASES]
        if not mine:
            return
        try:
            with self.store.cycle() as tx:
                given_back = tx.release_requests(mine, self.leadership.holder)
        except Exception as e:  # the store is why the cycle failed, often: stale_after_s then
            log.warning("could not give back request(s) %s: %s", mine, e)
            return
        for request_id in given_back:
            self._released[request_id] = self._released.get(request_id, 0) + 1

    async def _decide(self, report: CycleReport) -> None:
        """Gather (the window, the store), decide (trigger, calibration, capacity) and write
        the decision in one transaction."""
        now = self.clock.now()
        plan = Plan()
        plan.window = await self.gather.window(now, report)
        claimed = self._claimed = self.operator.claim(
            self.store, self.leadership.holder, self.config.request_stale_after_s)
        with self.store.read() as tx:
            rollout = self.book.rollout(tx)
            ops = operator_state(tx.requests(status="done"))
            current = self.book.current(tx, rollout)
            state, state_for = restore_learner(tx, rollout, self.learner, self.memory.state,
                                               self.memory.state_for)
            self.memory = replace(self.memory, state=state, state_for=state_for)
            # No configured router has a desired version: an empty store, or routers that
            # replaced every earlier one (new addresses, a redeploy) on a store with history.
            empty = rollout.fleet_version is None
        if empty and self.reconcile_only is None:
            current = await self.gather.adopt_running(self.reconciler, self.routers, plan,
                                                      report)
        self._assess(plan)
        recal = next((r for r in claimed if r.kind == "recalibrate"), None)
        plan.trigger, self.memory = self.calibration.trigger(plan, self.memory, rollout, ops,
                                                             recal, now)
        if plan.trigger is Trigger.CANARY:
            # Refit on the bake's windows (the candidate's own traffic on its routers) and
            # judge the refit against the candidate, not the fleet's policy.
            assert rollout.canary_version is not None
            plan.refit_of = rollout.canary_version
            with self.store.read() as tx:
                current = self.book.policy(tx, rollout.canary_version)
                plan.refits = calibration_trigger(tx, rollout.canary_version)
        if plan.trigger is not None:
            if not (plan.window is not None and self.usable(plan.window)) and recal is None:
                report.reason = join(report.reason, f"calibration ({plan.trigger}) deferred: "
                                     f"{why_incomplete(plan.window)}")
                plan.trigger = None
            else:
                self.memory = await self.calibration.run(plan, self.memory, current, now, recal)
        plan.capacity, plan_failed = await self.capacity.recommend(self.store, plan.window, now,
                                                                   self.usable)
        if plan_failed is not None:
            report.capacity = plan_failed
        self._write(plan, claimed, rollout, ops, report)

    def _assess(self, plan: Plan) -> None:
        """Track failed targets and scaling events, and run the drift detectors on this
        cycle's window; the causes found stay pending until a calibration answers them."""
        window = plan.window
        if window is None:
            return
        memory = self.memory.with_failures(window)
        scaling, events = step_scaling(memory.scaling, window, SETTLED_FAILURES)
        if events:
            plan.applied_recommendation = self.capacity.reached(self.store, events)
        memory = memory.with_scaling(scaling, events, plan.applied_recommendation)
        t0 = self.clock.monotonic()
        state, plan.findings = self.learner.assess(memory.state, window, window.end)
        self.metrics.observe_job("assess", self.clock.monotonic() - t0)
        self.memory = memory.with_drift(state, plan.findings)

    def usable(self, window: Window) -> bool:
        """Fit to learn from (:meth:`DecisionMemory.usable`)."""
        return self.memory.usable(window)

    # -- the one write transaction --------------------------------------------------------

    def _write(self, plan: Plan, claimed: list[OperatorRequest], rollout: Rollout,
               ops: OperatorState, report: CycleReport) -> None:
        """Write the decision in one transaction (:class:`DecisionWriter`); once it
        committed, keep the learner's memory it leaves, emit the metric events it decided,
        export a new capacity recommendation, and hand approvals to ``on_approval``. A write
        that fails does none of these."""
        m = self.memory
        written = self.writer.write(plan, claimed, report,
                                    LearnerMemo(m.state, m.state_for, m.link_retry_at),
                                    self.leadership, self._released)
        memo = written.memo
        self.memory = self.calibration.noted(plan, replace(
            m, state=memo.state, state_for=memo.state_for, link_retry_at=memo.link_retry_at),
            report)
        written.events.emit(self.metrics)
        if plan.capacity is not None:  # exported once stored, never before
            self.capacity.export(plan.capacity.capacity.to_dict(), self.clock.now())
        for policy, outcome in written.approved:
            self._export_approved(policy, outcome)

    def _export_approved(self, policy: Policy, outcome: CalibrationOutcome) -> None:
        """Hand an approved policy and its calibration's basis to ``on_approval`` after the
        write that stored it committed (a file never names a policy the store lacks); a
        failure there is logged, never the cycle's."""
        if self.on_approval is None:
            return
        try:
            self.on_approval(policy, outcome.basis)
        except Exception as e:
            log.error("on_approval failed for v%s: %s", policy.version, e)

    # -- reconcile (every replica) --------------------------------------------------------

    async def _reconcile(self, report: CycleReport) -> None:
        """Reconcile this replica's routers (:class:`RouterSync`); none in advisory mode."""
        if self.config.advisory:
            return
        mine = self.reconcile_only if self.reconcile_only is not None else self.routers
        await self.sync.run(mine, report)


__all__ = [
    "AlwaysLeader", "Cycle", "CycleConfig", "Leadership", "run_inline",
]
