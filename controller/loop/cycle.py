"""The control cycle, the orchestrator of the loop: leadership, then gather (observe a
window, read the store) → decide (assess drift and scaling, choose the trigger, calibrate,
plan capacity) → apply (one write transaction) → reconcile.

One :class:`Cycle` object holds the injected clock, metrics source, store, learner,
reconciler and metrics, and the rooms that do the work: :mod:`.write` (the write
transaction), :mod:`.operator` (operator requests), :mod:`.canary` (the canary judge and the
post-promotion watch), :mod:`.export` (capacity recommendations), :mod:`.reconcile`
(pushes), :mod:`.policies` (the policy cache and rollout). The rules they apply are the pure
functions of :mod:`controller.core.rollout`. ``await cycle.run_once()`` runs one cycle; the
daemon calls it from a scheduler job on the wall clock, the bench every control interval on
a :class:`~controller.clock.VirtualClock`. Both run this same code.

SQL holds the truth (DESIGN §4): desired versions, acknowledgements, operator requests,
canary state (a canary is "the newest approved version is desired by some routers only")
and every decision's reason. A new ``Cycle`` on the same store continues where the last one
stopped; the reconciler pushes only where a router differs from its desired version, so a
restart never re-pushes an acknowledged version.

Transactions: a cycle's decision is ONE ``store.cycle()`` transaction, written after the
observe and the fit so no database lock is held across network calls or a fit. Two small
transactions surround it: claiming operator requests (so that exactly one replica acts on
each) and recording what the routers acknowledged after the reconcile pass. What the cycle
remembers between cycles (:attr:`Cycle._DECISION_MEMORY`) goes back to before a decision
whose write did not commit.

Leadership: only the leader observes, stores windows, calibrates and approves. In
standalone mode the leader also reconciles every router; in sidecar mode
(``reconcile_only``) every replica reconciles its own router.

Missing data: a window with a failed target is not trained on, unless that target failed
``SETTLED_FAILURES`` windows in a row (gone: lost capacity, which is a scaling cause in its
own right). Drift and scaling causes found while a cycle cannot act (rate limit, deferred
window) are remembered until a calibration runs; drift during a canary bake is ignored.
When the answering workers change to what a stored capacity recommendation asked for, the
scaling event is a known one: the calibration it triggers records the recommendation, takes
precedence over drift the new shape causes, and the recommendation is marked applied.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from controller.clock import Clock
from controller.core.drift import (
    ScalingState,
    step_scaling,
    worker_counts,
)
from controller.core.rollout import (
    JudgeParams,
    OperatorState,
    Rollout,
    TriggerChoice,
    TriggerInputs,
    TriggerNote,
    choose_trigger,
    operator_state,
    scaling_damped,
)
from controller.core.trigger import Cause, Trigger
from controller.core.window import Window
from controller.errors import TransientError
from controller.loop.canary import Canary
from controller.loop.export import (
    CapacityExport,
    CapacityPlanner,
    CapacitySettings,
)
from controller.loop.learning import (
    MIN_REGIME_WINDOWS,
    CalibrationOutcome,
    Learner,
    LearnerError,
    LearnerState,
)
from controller.loop.metrics import ControllerMetrics
from controller.loop.operator import OperatorRequests
from controller.loop.policies import PolicyBook, reference_calibration
from controller.loop.reconcile import RouterSync
from controller.loop.report import CycleReport, CycleResult, join, report_fields
from controller.loop.write import DecisionWriter, LearnerMemo, LostLeadership, Plan
from controller.observe.source import MetricsSource
from controller.policy import Policy
from controller.rollout.reconciler import Reconciler
from controller.store import (
    OperatorRequest,
    Store,
    Tx,
)
from controller.store.kinds import (
    REFIT_PREFIX,
    PolicyKind,
    policy_kind,
)

T = TypeVar("T")
log = logging.getLogger("pdctl.cycle")

DRY_RUN_PREFIX = "dry run: would "  # a dry run's outcome starts so (never "approved")
MAX_RELEASES = 2  # a request given back after its cycle failed, at most this often
FIT_RETRY_INTERVALS = 10  # control intervals between automatic retries of a failed fit
SETTLED_FAILURES = 2  # windows a target must have failed in a row to count as gone
# Flap damping: one scaling recalibration per role per max(min_policy_interval_s, this many
# control intervals) at most (Cycle.scaling_damping_s).
SCALING_DAMPING_WINDOWS = 10


@dataclass(frozen=True, slots=True)
class CycleConfig:
    interval_s: float = 30.0
    calibrate_every_s: float | None = 3600.0
    training_windows: int = 120
    min_training_windows: int = 4
    min_policy_interval_s: float = 300.0  # as [controller] min_policy_interval_s
    advisory: bool = False
    canary_fraction: float = 0.25
    bake_windows: int = 3
    bake_min_requests: float = 100.0
    max_bake_windows: int = 12
    canary_refit: bool = True
    promote_margin: float = 0.02
    promote_alpha: float = 0.05
    watch_windows: int = 3
    watch_drop: float = 0.1
    watch_load_rise: float = 0.1
    request_stale_after_s: float = 300.0
    capacity_interval_s: float = 300.0
    capacity_min_windows: int = 2
    # Exploration share turned on in an adopted policy that explores nowhere (0: none); 0
    # as well where the operator pins a route ([ppd]): a pin explores nothing.
    adopted_exploration: float = 0.0

    @property
    def watch_s(self) -> float | None:
        """How long a promotion is watched at most (None: no watch): its windows and one
        interval more, so failed observes do not stretch it."""
        return self.judge.watch_s

    @property
    def judge(self) -> JudgeParams:
        """The settings the canary judge and the post-promotion watch read."""
        return JudgeParams(
            interval_s=self.interval_s, bake_windows=self.bake_windows,
            bake_min_requests=self.bake_min_requests, max_bake_windows=self.max_bake_windows,
            promote_margin=self.promote_margin, promote_alpha=self.promote_alpha,
            watch_windows=self.watch_windows, watch_drop=self.watch_drop,
            watch_load_rise=self.watch_load_rise)

    @classmethod
    def from_settings(cls, settings: Any, advisory: bool | None = None) -> CycleConfig:
        c = settings.controller
        return cls(
            interval_s=c.interval_s, calibrate_every_s=c.calibrate_every_s,
            training_windows=c.training_windows, min_training_windows=c.min_training_windows,
            min_policy_interval_s=c.min_policy_interval_s,
            advisory=c.advisory if advisory is None else advisory,
            canary_fraction=c.canary_fraction, bake_windows=c.bake_windows,
            bake_min_requests=c.bake_min_requests, max_bake_windows=c.max_bake_windows,
            canary_refit=c.canary_refit,
            promote_margin=c.promote_margin, promote_alpha=c.promote_alpha,
            watch_windows=c.watch_windows, watch_drop=c.watch_drop,
            watch_load_rise=c.watch_load_rise,
            capacity_interval_s=settings.capacity.interval_s,
            capacity_min_windows=settings.capacity.min_windows,
            adopted_exploration=(c.adopted_exploration if settings.ppd.enabled
                                 and settings.ppd.append_prefill_route == "dynamic" else 0.0),
        )


class Leadership(Protocol):
    """Who may calibrate and approve. ``ensure`` takes or renews leadership and says whether
    this replica leads; ``fence`` re-checks it inside the cycle's write transaction."""

    holder: str

    @property
    def term(self) -> int | None:
        """The fencing number of the leadership held (None: none); a new one each time
        leadership is taken, so a replica that lost it and took it again can tell."""

    async def ensure(self) -> bool: ...

    def fence(self, tx: Tx) -> bool: ...


class AlwaysLeader:
    """A single replica (tests, bench)."""

    def __init__(self, holder: str = "pdctl") -> None:
        self.holder = holder

    @property
    def term(self) -> int | None:
        return 1

    async def ensure(self) -> bool:
        return True

    def fence(self, tx: Tx) -> bool:
        return True




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
        self._run_blocking = run_blocking or _to_thread
        self._init_decision_memory()
        self._last_end: float | None = None  # while leading without a break
        self._leading = False
        self._led_term: int | None = None  # the leadership term this replica last led in
        # Given each approved calibration's policy and basis ([export], controller/exporter.py).
        self.on_approval: Callable[[Policy, Any], None] | None = None
        self.capacity = CapacityExport(
            planner, metrics, CapacitySettings(self.config.interval_s,
                                               self.config.capacity_interval_s,
                                               self.config.capacity_min_windows),
            self._run_blocking)
        self.operator = OperatorRequests(self.book, clock)
        self.canary = Canary(self.book, clock, self.config.judge, self.outcome_names)
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

    def _init_decision_memory(self) -> None:
        """What decisions remember between cycles (:attr:`_DECISION_MEMORY`: each value is
        replaced, never changed in place, so a failed decision can put it back)."""
        self._state = LearnerState()
        self._state_for: int | None = None  # the policy version the learner state belongs to
        self._fit_failed_at: float | None = None  # automatic fits back off after a failure
        self._scaling = ScalingState()
        # Causes not yet recalibrated for (a deferred or rate-limited cycle keeps them).
        self._pending_scaling: str | None = None
        self._pending_recommendation: int | None = None  # the scaling reached this one
        self._pending_scaling_roles: frozenset[str] = frozenset()  # the roles it is about
        # Flap damping: when each role's last scaling recalibration ran (clock.now()), and
        # the worker counts the last calibration saw.
        self._scaling_recal_at: dict[str, float] = {}
        self._calibrated_counts: dict[str, int] | None = None
        self._pending_drift = False
        self._pending_measured = False  # ... and led by the KV link (not rate-limited)
        # A link calibration refused before it could train on the new link's windows alone
        # is tried once more then (epoch s): the newest stored calibration's link_retry_at.
        self._link_retry_at: float | None = None
        self._failing: dict[str, int] = {}  # target -> windows failed in a row

    @property
    def planner(self) -> CapacityPlanner | None:
        """The capacity planner (None: no recommendations)."""
        return self.capacity.planner

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
                memory = self._decision_memory()
                try:
                    await self._decide(report)
                except BaseException:
                    self._forget_failed_decision(memory)
                    raise
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
            if self._last_end is not None:
                self.source.forget_baselines()
            self._last_end = None
            with self.store.read() as tx:  # a failure retries it next cycle
                self._restore_pending(tx)
        self._leading, self._led_term = leader, term
        return leader

    # -- deciding (leader only) -----------------------------------------------------------

    # What a decision changes in memory before its write commits (each replaced, never
    # changed in place).
    _DECISION_MEMORY = ("_state", "_state_for", "_pending_drift", "_pending_measured",
                        "_pending_scaling", "_pending_recommendation", "_scaling",
                        "_pending_scaling_roles", "_scaling_recal_at", "_calibrated_counts",
                        "_link_retry_at", "_fit_failed_at", "_failing")

    def _decision_memory(self) -> dict[str, Any]:
        self._claimed = []
        return {name: getattr(self, name) for name in self._DECISION_MEMORY}

    def _forget_failed_decision(self, memory: Mapping[str, Any]) -> None:
        """A decision whose write did not commit (the store failed, leadership was lost, a
        bug): memory goes back to before it, so a drift or scaling it consumed stays pending,
        and the policy cache is dropped, so no table the store never got is served. The
        requests it claimed are given back (twice at most: one that keeps failing its cycle
        waits for request_stale_after_s), so a pause does not wait for a store hiccup."""
        for name, value in memory.items():
            setattr(self, name, value)
        self.book.cache.clear()  # the store is the truth: read again
        claimed, self._claimed = self._claimed, []
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
        plan.window = await self._observe(self._window_start(now), now, report)
        self._last_end = now
        claimed = self._claimed = self.operator.claim(
            self.store, self.leadership.holder, self.config.request_stale_after_s)
        with self.store.read() as tx:
            rollout = self.book.rollout(tx)
            ops = operator_state(tx.requests(status="done"))
            current = self.book.current(tx, rollout)
            self._restore_learner(tx, rollout)
            # No configured router has a desired version: an empty store, or routers that
            # replaced every earlier one (new addresses, a redeploy) on a store with history.
            empty = rollout.fleet_version is None
        if empty and self.reconcile_only is None:
            current = await self._adopt_running(plan, report)
        self._assess(plan)
        recal = next((r for r in claimed if r.kind == "recalibrate"), None)
        plan.trigger = self._trigger(plan, rollout, ops, recal, now)
        if plan.trigger is Trigger.CANARY:
            # Refit on the bake's windows (the candidate's own traffic on its routers) and
            # judge the refit against the candidate, not the fleet's policy.
            assert rollout.canary_version is not None
            plan.refit_of = rollout.canary_version
            with self.store.read() as tx:
                current = self.book.policy(tx, rollout.canary_version)
                plan.refits = _calibration_trigger(tx, rollout.canary_version)
        if plan.trigger is not None:
            complete = plan.window is not None and self.usable(plan.window)
            if not complete and recal is None:
                report.reason = join(report.reason, f"calibration ({plan.trigger}) deferred: "
                                     f"{_why_incomplete(plan.window)}")
                plan.trigger = None
            else:
                await self._calibrate(plan, current, now, recal, report)
        plan.capacity, plan_failed = await self.capacity.recommend(self.store, plan.window, now,
                                                                   self.usable)
        if plan_failed is not None:
            report.capacity = plan_failed
        self._write(plan, claimed, rollout, ops, report)

    async def _observe(self, start: float, end: float, report: CycleReport) -> Window | None:
        """The window ``[start, end)``, or None (the cycle is then "skipped"): the source
        failed, or no target answered (the cluster, or the path to it, is down: not a
        scaling event to plan for, and not a successful cycle, as PdControllerStalled and
        /healthz say). Reconciling and operator requests go on either way."""
        t0 = self.clock.monotonic()
        try:
            window = await self.source.window(start, end)
            self.metrics.observe_job("observe", self.clock.monotonic() - t0)
            for failure in window.failures:  # why, on /metrics
                self.metrics.observe_failed(failure.kind)
            if window.failures and not window.answered:
                failed = sorted({f.target for f in window.failures})
                raise NothingAnswered(f"no target answered ({len(failed)} failed: "
                                      f"{', '.join(failed[:3])}"
                                      f"{', ...' if len(failed) > 3 else ''})")
        except Exception as e:
            if not isinstance(e, NothingAnswered):  # the source itself failed
                self.metrics.observe_failed("source")
            report.result = CycleResult.SKIPPED
            report.reason = f"observe failed: {type(e).__name__}: {e}"
            log.warning("%s", report.reason)
            return None
        return window

    async def _adopt_running(self, plan: Plan, report: CycleReport) -> Policy | None:
        """The policy every router already runs, adopted as the fleet's in this cycle's
        write: the first table is then judged against it and canaried, not approved
        unchecked to every router (docs/operations.md, "First start"). Sidecar replicas
        reach their own router only, so they adopt nothing."""
        found = await self.reconciler.running_policy(self.routers)
        if found.policy is not None:
            plan.adopted = found
        elif found.why:
            report.reason = join(report.reason, f"no running policy adopted: {found.why}")
        return found.policy

    def _assess(self, plan: Plan) -> None:
        """Track failed targets and scaling events, and run the drift detectors on this
        cycle's window; the causes found stay pending until a calibration answers them."""
        window = plan.window
        if window is None:
            return
        self._track_failures(window)
        self._scaling, events = step_scaling(self._scaling, window, SETTLED_FAILURES)
        if events:
            self._pending_scaling = "; ".join(e.reason for e in events)
            plan.applied_recommendation = self.capacity.reached(self.store, events)
            if plan.applied_recommendation is not None:
                self._pending_recommendation = plan.applied_recommendation
                self._pending_scaling += \
                    f" (recommendation #{plan.applied_recommendation} applied)"
        self._damp_flap(events)
        t0 = self.clock.monotonic()
        self._state, plan.findings = self.learner.assess(self._state, window, window.end)
        self.metrics.observe_job("assess", self.clock.monotonic() - t0)
        if any(f.fired for f in plan.findings):
            self._pending_drift = True
            self._pending_measured |= any(f.measured for f in plan.findings)

    def _window_start(self, end: float) -> float:
        """Windows tile time: continue from the last one, ours while leading without a
        break, else the store's newest (a restart, or leading again after another replica:
        a window overlapping stored ones would count that time twice in training and
        drift). From the store, at most one interval back: after an outage the window
        starts fresh rather than averaging over it."""
        floor = end - self.config.interval_s
        if self._last_end is not None:
            return self._last_end if self._last_end < end else floor
        with self.store.read() as tx:
            stored = tx.last_window_end()
        last = stored.timestamp() if stored is not None else None
        return last if last is not None and floor < last < end else floor

    def _track_failures(self, window: Window) -> None:
        failed = {f.target for f in window.failures}
        self._failing = {t: self._failing.get(t, 0) + 1 for t in failed}

    def usable(self, window: Window) -> bool:
        """Fit to learn from: routed requests, and no target missing except those gone for
        good (failing ``SETTLED_FAILURES`` windows in a row: lost capacity, not missing
        data). A transient scrape failure makes the window unusable."""
        # Outcome rows with no requests are not routed requests: at start-up Prometheus
        # reports the routers' counters before they move, and a fit on such windows fails
        # (then backs off FIT_RETRY_INTERVALS instead of waiting for data).
        if not window.outcomes.total("requests") > 0:
            return False
        gone = {t for t, n in self._failing.items() if n >= SETTLED_FAILURES}
        return all(f.target in gone for f in window.failures)


    def _trigger(self, plan: Plan, rollout: Rollout, ops: OperatorState,
                 recal: OperatorRequest | None, now: float) -> Trigger | None:
        """Why to calibrate now, or None: :func:`controller.core.rollout.choose_trigger` on
        what this cycle gathered (the store is read only for what the choice can use)."""
        baking = rollout.canary_version is not None
        free = recal is None and not baking and not ops.holding
        choice = choose_trigger(TriggerInputs(
            now=now, operator_recalibrate=recal is not None, canary_baking=baking,
            canary_refit=self.config.canary_refit,
            refit_due=(recal is None and baking and self.config.canary_refit and not ops.holding
                       and self.canary.refit_due(self.store, rollout, plan.window)),
            holding=ops.holding, pending_drift=self._pending_drift,
            pending_measured=self._pending_measured,
            pending_scaling=self._pending_scaling is not None,
            pending_recommendation=self._pending_recommendation is not None,
            scaling_damped=self._scaling_damped(now),
            drift_fired=any(f.fired for f in plan.findings),
            since_last_change=self._since_last_change(now) if free else math.inf,
            min_policy_interval_s=self.config.min_policy_interval_s,
            fit_failed_at=self._fit_failed_at,
            fit_retry_s=FIT_RETRY_INTERVALS * self.config.interval_s,
            link_retry_at=self._link_retry_at,
            next_due=self.next_due() if free else None))
        self._note_trigger(choice)
        return choice.trigger

    def _note_trigger(self, choice: TriggerChoice) -> None:
        if choice.clear_pending_drift:
            self._pending_drift = self._pending_measured = False
        for note in choice.notes:
            if note is TriggerNote.RATE_LIMITED_DRIFT:
                log.info("drift fired but the policy changed less than %.0f s ago",
                         self.config.min_policy_interval_s)
            elif note is TriggerNote.SCALING_HELD:
                log.info("scaling cause held back: a scaling recalibration for %s ran less "
                         "than %.0f s ago", ", ".join(sorted(self._pending_scaling_roles)),
                         self.scaling_damping_s())
            elif note is TriggerNote.LINK_RETRY:
                log.info("calibrating again for the KV link's drift, on the windows since it")

    def _damp_flap(self, events: Sequence[Any]) -> None:
        """Scaling events name the roles of the pending scaling cause. A flap that brought
        every role back to the counts the last calibration saw (a worker that failed, then
        answered again) cancels the cause: nothing changed to calibrate for. An applied
        recommendation is never cancelled."""
        if not events:
            return
        self._pending_scaling_roles = self._pending_scaling_roles | {e.role for e in events}
        if self._pending_recommendation is None and self._calibrated_counts is not None \
                and dict(self._scaling.known) == self._calibrated_counts:
            log.info("scaling cause dropped: the workers answering are back to the counts "
                     "the last calibration saw (%s)", self._pending_scaling)
            self._pending_scaling = None
            self._pending_scaling_roles = frozenset()

    def scaling_damping_s(self) -> float:
        """The least time between two scaling recalibrations for one role (cause):
        ``max(min_policy_interval_s, SCALING_DAMPING_WINDOWS * interval_s)``."""
        return max(self.config.min_policy_interval_s,
                   SCALING_DAMPING_WINDOWS * self.config.interval_s)

    def _scaling_damped(self, now: float) -> bool:
        """Whether every role of the pending scaling cause had a scaling recalibration less
        than :meth:`scaling_damping_s` ago (approved or not: a rejected candidate counts).
        The cause stays pending and is calibrated for once one role is free; an applied
        recommendation (an operator-intended change, not a flap) is never damped."""
        if self._pending_scaling is None or self._pending_recommendation is not None:
            return False
        return scaling_damped(self._pending_scaling_roles, self._scaling_recal_at, now,
                              self.scaling_damping_s())


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

    async def _calibrate(self, plan: Plan, current: Policy | None, now: float,
                         recal: OperatorRequest | None, report: CycleReport) -> None:
        trigger = plan.trigger or Trigger.SCHEDULE
        with self.store.read() as tx:
            stored = tx.windows(limit=self.config.training_windows)
        usable = [s for s in stored if self.usable(s.window)]
        force = bool(recal is not None and (recal.args or {}).get("force"))
        plan.recalibrate_request = recal
        if plan.window is not None and self.usable(plan.window):
            # This cycle's window is written in the same transaction; train on it too.
            windows = [s.window for s in usable] + [plan.window]
        else:
            windows = [s.window for s in usable]
        plan.calibration_windows = [s.id for s in usable]
        if len(windows) < 2:
            # Too little data is not a failed fit: the cause stays pending and is retried
            # next cycle, without the failed-fit back-off (at start-up the first windows
            # often miss targets not yet scraped; backing off then delayed the first policy
            # by FIT_RETRY_INTERVALS).
            plan.calibration_error = f"only {len(windows)} complete window(s) stored"
            plan.too_few_windows = True
            return
        self.metrics.recalibration(trigger)
        for_link = trigger is Trigger.DRIFT and self._pending_measured  # led by the KV link
        cause = self._take_cause(plan, trigger, current, recal, now)

        def fit() -> CalibrationOutcome:
            return self.learner.calibrate(windows, current, now, cause, force)

        t0 = self.clock.monotonic()
        try:
            outcome: CalibrationOutcome = await self._run_blocking(fit)
            self.metrics.observe_job("calibrate", self.clock.monotonic() - t0)
        except LearnerError as e:
            plan.calibration_error = str(e)
            return
        except Exception as e:  # a bug in a fit must not push anything
            log.exception("calibration failed")
            plan.calibration_error = f"{type(e).__name__}: {e}"
            return
        plan.calibration = outcome
        if for_link and not outcome.approved and not outcome.details.get("regime_only"):
            # Calibrated at the link's detection, it trained across the change. The change
            # began before its detection: by then the learner has the windows to train on
            # the new link's traffic alone (docs/bench.md, "A slower link is not
            # rate-limited").
            plan.link_retry_at = now + MIN_REGIME_WINDOWS * self.config.interval_s

    def _take_cause(self, plan: Plan, trigger: Trigger, current: Policy | None,
                    recal: OperatorRequest | None, now: float) -> Cause:
        """The cause this calibration answers. A canary refit keeps the candidate's own
        reason and regime (the learner trains it on the same regime's windows, the bake's
        included) and leaves the causes pending for the fleet's policy; any other
        calibration sees the new capacity and mix, so it takes every pending cause."""
        if trigger is Trigger.SCALING:
            plan.scaling = self._pending_scaling
            plan.scaling_recommendation = self._pending_recommendation
            self._scaling_recal_at = {**self._scaling_recal_at,
                                      **dict.fromkeys(self._pending_scaling_roles, now)}
        if trigger is Trigger.CANARY:
            assert current is not None
            return Cause(trigger, refits=plan.refits,
                         text=f"{current.provenance.reason or Trigger.SCHEDULE} "
                              f"({REFIT_PREFIX}{plan.refit_of})")
        self._pending_scaling = None
        self._pending_recommendation = None
        self._pending_scaling_roles = frozenset()
        self._calibrated_counts = dict(self._scaling.known) or None
        self._pending_drift = self._pending_measured = False
        if recal is not None and recal.reason:
            return Cause(trigger, recal.reason)
        if plan.scaling is not None:  # the policy's provenance says which shape
            return Cause(trigger, plan.scaling)
        return Cause(trigger)

    # -- the one write transaction --------------------------------------------------------

    def _write(self, plan: Plan, claimed: list[OperatorRequest], rollout: Rollout,
               ops: OperatorState, report: CycleReport) -> None:
        """Write the decision in one transaction (:class:`DecisionWriter`); once it
        committed, keep the learner's memory it leaves, emit the metric events it decided,
        export a new capacity recommendation, and hand approvals to ``on_approval``. A write
        that fails does none of these."""
        written = self.writer.write(
            plan, claimed, report, LearnerMemo(self._state, self._state_for, self._link_retry_at),
            self.leadership, self._released)
        memo = written.memo
        self._state, self._state_for, self._link_retry_at = (memo.state, memo.state_for,
                                                              memo.link_retry_at)
        self._note_calibration(plan, report)
        written.events.emit(self.metrics)
        if plan.capacity is not None:  # exported once stored, never before
            self.capacity.export(plan.capacity.capacity.to_dict(), self.clock.now())
        for policy, outcome in written.approved:
            self._export_approved(policy, outcome)

    def _note_calibration(self, plan: Plan, report: CycleReport) -> None:
        """After the commit: why no calibration ran, and the failed-fit back-off (a failed
        refit sets none: the candidate is left to the judge)."""
        if plan.too_few_windows:
            report.reason = join(report.reason, f"calibration ({plan.trigger}) deferred: "
                                 f"{plan.calibration_error}")
        elif plan.calibration_error is not None:
            report.reason = join(report.reason, f"calibration skipped: {plan.calibration_error}")
            if plan.refit_of is None:
                self._fit_failed_at = self.clock.now()
        elif plan.calibration is not None:
            self._fit_failed_at = None


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


    # -- capacity -------------------------------------------------------------------------


    # -- canary ---------------------------------------------------------------------------


    # -- operator requests ----------------------------------------------------------------


    # -- reading the store ----------------------------------------------------------------


    def _restore_learner(self, tx: Tx, rollout: Rollout) -> None:
        """After a restart (or a rollback), the drift reference of the fleet's policy: the
        one last renewed for it. That is its own calibration's, or a later one's that was
        refused on the traffic since a change alone (the policy was judged on it and kept),
        so traffic the running policy was already judged on does not fire a drift again."""
        version = rollout.canary_version or rollout.fleet_version
        if version is None or version == self._state_for:
            return
        record = reference_calibration(tx, version)
        # A version with no calibration of its own (re-issued, exploration off, fallback)
        # keeps the reference the learner has.
        if record is not None or self._state_for is None:
            self._state = self.learner.restore(record.details if record else None)
        self._state_for = version

    def _restore_pending(self, tx: Tx) -> None:
        """On taking the lead (a start, a restart, a failover), the causes not yet
        calibrated for (held back by the change limit or an operator), from the store: not
        what this replica remembers of an earlier term, which another leader may have acted
        on since. Without this a restart inside `min_policy_interval_s` dropped them.

        - A drift stored since the last calibration and since the last bake ended.
        - A change of the worker counts since the last calibration's newest window: the
          scaling detector counts from those, not from this term's first window.
        - The retry of a refused link calibration, when it was the newest calibration.
        Kept in memory during the term (one read per term, not per cycle: a calibration's
        details are large)."""
        newest = tx.calibrations(limit=1)
        retry_at = (newest[0].details or {}).get("link_retry_at") if newest else None
        self._link_retry_at = float(retry_at) if isinstance(retry_at, (int, float)) else None
        marks = [c.created_at for c in newest]
        # Drift while a canary baked is void (see _trigger). A bake ends with a calibration
        # (the refit) or, without one, with the newest policy's promotion or rollback.
        for p in tx.policies(limit=1):
            marks += [p.promoted_at] if p.promoted_at is not None else []
            marks += [p.updated_at] if p.status == "rolled_back" else []
        since = max(marks) if marks else None
        pending = [e for e in tx.drift_events(since=since) if since is None or e.at > since]
        self._pending_drift = bool(pending)
        self._pending_measured = any((e.details or {}).get("measured") for e in pending)
        self._pending_scaling = self._pending_recommendation = None  # counted again below
        if pending:
            log.info("a drift stored since the last calibration is still pending: %s",
                     ", ".join(sorted({e.kind for e in pending})))
        trained = tx.windows_by_ids([newest[0].last_window_id]) \
            if newest and newest[0].last_window_id is not None else []
        # Compacted away, or nothing calibrated yet: the first window sets the counts.
        self._scaling = ScalingState(worker_counts(trained[0].window)) if trained \
            else ScalingState()
        self._pending_scaling_roles = frozenset()
        self._calibrated_counts = dict(self._scaling.known) or None


    # -- reconcile (every replica) --------------------------------------------------------

    async def _reconcile(self, report: CycleReport) -> None:
        """Reconcile this replica's routers (:class:`RouterSync`); none in advisory mode."""
        if self.config.advisory:
            return
        mine = self.reconcile_only if self.reconcile_only is not None else self.routers
        await self.sync.run(mine, report)


class NothingAnswered(TransientError):
    """A window in which every worker and router target failed."""




def _calibration_trigger(tx: Tx, version: int) -> Trigger | None:
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


def _why_incomplete(window: Window | None) -> str:
    if window is None:
        return "no window (observe failed)"
    if window.failures:
        names = ", ".join(sorted(f.target for f in window.failures)[:5])
        return (f"{len(window.failures)} target(s) failed: {names} (a target failing "
                f"{SETTLED_FAILURES} windows in a row counts as gone, not missing)")
    return "the window has no routed requests"



__all__ = [
    "AlwaysLeader", "Cycle", "CycleConfig", "Leadership", "run_inline",
]
