"""The control cycle: observe → store → assess drift → calibrate → guardrail → approve →
canary → bake → promote or roll back → reconcile.

One :class:`Cycle` object holds the injected clock, metrics source, store, learner,
reconciler and metrics. ``await cycle.run_once()`` runs one cycle; the daemon calls it from
a scheduler job on the wall clock, the bench calls it every control interval on a
:class:`~controller.clock.VirtualClock`. Both run this same code.

SQL holds the truth (DESIGN §4): desired versions, acknowledgements, operator requests,
canary state (a canary is "the newest approved version is desired by some routers only")
and every decision's reason. A new ``Cycle`` on the same store continues where the last one
stopped; the reconciler pushes only where a router differs from its desired version, so a
restart never re-pushes an acknowledged version.

Transactions: a cycle's decision writes (window, drift events, calibration, policy,
desired versions, canary verdict, operator outcomes) are ONE ``store.cycle()``
transaction, written after the observe and the fit so no database lock is held across
network calls or a fit. Two small transactions surround it: claiming operator requests
(so that exactly one replica acts on each) and recording what the routers acknowledged
after the reconcile pass.

Leadership: only the leader observes, stores windows, calibrates and approves. In
standalone mode the leader also reconciles every router; in sidecar mode
(``reconcile_only``) every replica reconciles its own router.

Missing data: a window with a failed target is not trained on, unless that target failed
``SETTLED_FAILURES`` windows in a row (gone: lost capacity, which is a scaling cause in its
own right). Drift and scaling causes found while a cycle cannot act (rate limit, deferred
window) are remembered until a calibration runs; drift during a canary bake is ignored.

Capacity: with a planner injected, the leader computes a capacity recommendation every
``capacity_interval_s`` from the recent complete windows, stores it in the cycle's
transaction and exports it (``pdctl_recommended_workers{role}``); a failed plan is logged
and counted, never a failed cycle. When the answering workers change to what a stored
recommendation asked for, the scaling event is a known one: the calibration it triggers
records the recommendation, takes precedence over drift the new shape causes, and the
recommendation is marked applied.

Operator requests use the store's kinds: ``pause``/``resume`` with ``args.what`` in
``approvals`` (default), ``pin`` (``args.version``) or ``exploration``; ``rollback`` with
``args.version`` (None: the previous approved) or ``args.to == "fallback-prefill"``;
``recalibrate`` with ``args.dry_run``/``args.force``.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol, TypeVar

from controller.clock import Clock
from controller.core.capacity import CapacityPlan
from controller.core.drift import (
    ScalingEvent,
    ScalingState,
    feature_statistics,
    step_scaling,
    worker_counts,
)
from controller.core.rollout import (
    FALLBACK_PREFILL,
    NOT_A_VERSION,
    WATCH_OVER,
    CanaryVerdict,
    JudgeParams,
    OperatorState,
    Rollout,
    TriggerChoice,
    TriggerInputs,
    TriggerNote,
    VersionInfo,
    WatchVerdict,
    canary_subset,
    choose_trigger,
    judge_canary,
    judge_watch,
    operator_state,
    rollout_of,
    scaling_damped,
    version_arg,
)
from controller.core.trigger import Cause, Trigger
from controller.core.window import Window
from controller.errors import TransientError
from controller.loop.learning import (
    MIN_REGIME_WINDOWS,
    CalibrationOutcome,
    DriftFinding,
    Learner,
    LearnerError,
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
    RolledBack,
)
from controller.loop.metrics import ControllerMetrics
from controller.observe.source import MetricsSource
from controller.policy import LookupTable, Policy, Provenance, Route, dumps, loads
from controller.rollout.reconciler import Reconciler, RouterStatus, RunningPolicy
from controller.store import (
    CalibrationRecord,
    OperatorRequest,
    PolicyRecord,
    Store,
    StoreError,
    Tx,
)
from controller.store.kinds import (
    ADOPTED_PREFIX,
    REFIT_PREFIX,
    SEEDED_PREFIX,
    PolicyKind,
    policy_kind,
)
from controller.store.types import dumps_json

T = TypeVar("T")
log = logging.getLogger("pdctl.cycle")

SUPERSEDED = "superseded by its canary refit"  # a superseded canary's reason starts so
ABANDONED_PREFIX = "dropped from its bake by "  # a canary an operator action took off
UNPROMOTED = "rolled back after promotion"  # a promotion the watch undid: reason starts so
DRY_RUN_PREFIX = "dry run: would "  # a dry run's outcome starts so (never "approved")
MAX_REQUESTS_PER_CYCLE = 16
MAX_RELEASES = 2  # a request given back after its cycle failed, at most this often
FIT_RETRY_INTERVALS = 10  # control intervals between automatic retries of a failed fit
SETTLED_FAILURES = 2  # windows a target must have failed in a row to count as gone
# Flap damping: one scaling recalibration per role per max(min_policy_interval_s, this many
# control intervals) at most (Cycle.scaling_damping_s).
SCALING_DAMPING_WINDOWS = 10
RECENT_RECOMMENDATIONS = 5  # a scaling event is matched against this many of the newest
STALE_RECOMMENDATION_INTERVALS = 3  # older than this many capacity intervals: not re-exported


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


class CapacityPlanner(Protocol):
    """Recent complete windows (oldest first) -> a capacity plan. The daemon's is
    :func:`controller.loop.capacity.plan_from_windows` on the configured SLOs."""

    def plan(self, windows: Sequence[Window]) -> CapacityPlan: ...


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


def _without_exploration_key(policy: Policy) -> str:
    """What decides a route once exploration is set aside (version aside too)."""
    return without_exploration(policy).with_version(1).checksum


@dataclass
class CycleReport:
    """What one cycle did (also logged and kept as :attr:`Cycle.last_report`)."""

    result: str = "ok"  # ok | skipped | failed
    reason: str = ""
    leader: bool = True
    window_id: int | None = None
    drift: list[str] = field(default_factory=list)
    trigger: Trigger | None = None
    calibration_id: int | None = None
    candidate_version: int | None = None
    candidate_status: str | None = None  # as stored: approved, rejected, candidate, advisory
    not_stored: str = "dry run"  # why a calibration stored no policy (candidate_version None)
    approved_version: int | None = None
    guardrail: str | None = None
    canary: str | None = None
    requests: list[str] = field(default_factory=list)
    pushes: int = 0
    acked: dict[str, int | None] = field(default_factory=dict)
    recommendation_id: int | None = None
    capacity: str | None = None  # the recommendation in words, or why there is none

    def summary(self) -> str:
        """The cycle in one line, for a text log (the JSON log has every field too): its
        result, then only what happened in it. A quiet cycle is just its result."""
        parts = [] if self.leader else ["follower"]
        if self.reason:
            parts.append(self.reason)
        if self.drift:
            parts.append("drift: " + ", ".join(self.drift))
        if self.trigger is not None and self.guardrail is not None:
            # The guardrail's reason starts with its verdict; the version's stored status
            # is the cycle's (advisory, and a held rollout, keep an approval back).
            stored = f"not stored ({self.not_stored})" if self.candidate_version is None \
                else f"v{self.candidate_version} {self.candidate_status}"
            parts.append(f"recalibration ({self.trigger}): {stored}, guardrail {self.guardrail}")
        parts += self.requests
        if self.canary:
            parts.append(f"canary {self.canary}")
        if self.pushes:
            acked = ", ".join(f"{r} v{v}" for r, v in sorted(self.acked.items())
                              if v is not None)
            parts.append(f"{self.pushes} push(es); acked: {acked or 'none'}")
        if self.recommendation_id is not None and self.capacity:
            parts.append(f"capacity: {self.capacity}")
        return ": ".join([self.result, "; ".join(parts)]) if parts else self.result


@dataclass
class _Plan:
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
    capacity: CapacityPlan | None = None
    capacity_windows: list[int] = field(default_factory=list)  # stored ids it was planned on
    capacity_with_window: bool = False  # ...plus this cycle's window
    applied_recommendation: int | None = None  # the scaling just confirmed reached it
    refit_of: int | None = None  # a "canary" calibration: the baking version it refits
    adopted: RunningPolicy | None = None  # what every router ran, adopted on an empty store
    canary_verdict: str | None = None  # the judge's action this cycle
    link_retry_at: float | None = None  # a refused link calibration: calibrate again then


def reference_calibration(tx: Tx, version: int) -> CalibrationRecord | None:
    """The calibration whose drift reference ``version`` runs against: the newest that
    renewed it (its own, or a later one refused on the traffic since a change alone, which
    records ``reference_for``), else its own (stored before ``reference_for``)."""
    return tx.newest_renewal(version) or tx.calibration_for(version)


def read_rollout(tx: Tx, routers: Sequence[str] | None = None) -> Rollout:
    """Fleet and canary versions from the desired versions (of ``routers``, default all):
    :func:`controller.core.rollout.rollout_of` on the stored versions they name."""
    desired = {r: v for r, v in tx.desired_versions().items()
               if routers is None or r in routers}
    records: dict[int, VersionInfo | None] = {}
    if len(set(desired.values())) > 1:
        for v in sorted(set(desired.values())):
            rec = tx.policy(v)
            records[v] = None if rec is None else VersionInfo(rec.status, rec.reissue_of)
    return rollout_of(desired, records)


class _RecentPolicies(OrderedDict[int, Policy]):
    """The policies the cycle decoded or built lately, by version. Bounded: a long-running
    daemon makes a candidate per calibration (one an hour in the soak), each with its whole
    table. The oldest go first; any version evicted is read back from the store (and cached
    again) when needed."""

    def __init__(self, capacity: int = 32) -> None:
        super().__init__()
        self.capacity = capacity

    def __setitem__(self, version: int, policy: Policy) -> None:
        super().__setitem__(version, policy)
        self.move_to_end(version)
        while len(self) > self.capacity:
            self.popitem(last=False)


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
        self.routers = tuple(sorted(routers))
        self.config = config or CycleConfig()
        self.leadership: Leadership = leadership or AlwaysLeader()
        # Router id (what the reconciler dials) -> its name in windows' route outcomes.
        self.outcome_names = {r: (outcome_names or {}).get(r, r) for r in self.routers}
        self.reconcile_only = tuple(reconcile_only) if reconcile_only is not None else None
        self._run_blocking = run_blocking or _to_thread
        self._state = LearnerState()
        self._state_for: int | None = None  # the policy version the learner state belongs to
        self._last_end: float | None = None  # while leading without a break
        self._leading = False
        self._led_term: int | None = None  # the leadership term this replica last led in
        self._policies = _RecentPolicies()
        self._fit_failed_at: float | None = None  # automatic fits back off after a failure
        self._scaling = ScalingState()
        # Given each approved calibration's policy and basis ([export], controller/exporter.py).
        self.on_approval: Callable[[Policy, Any], None] | None = None
        # Metric events and approvals of the write in progress, used once it committed.
        self._events = MetricEvents()
        self._approved_in_write: list[tuple[Policy, CalibrationOutcome]] = []
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
        self.planner = planner
        self._plan_failed_at: float | None = None
        self._exported_recommendation = False
        self._exported_versions = False  # pdctl_router_*_version set by this replica
        self._failing: dict[str, int] = {}  # target -> windows failed in a row
        self.last_report: CycleReport | None = None
        self.last_completed_at: float | None = None  # clock.now() of the last ok cycle
        self.last_ended_at: float | None = None  # ... of the last cycle, any result (liveness)
        self._claimed: list[OperatorRequest] = []  # claimed by this cycle's decision
        self._released: dict[int, int] = {}  # request id -> times given back after a failure

    # -- the whole cycle ------------------------------------------------------------------

    async def run_once(self) -> CycleReport:
        started = self.clock.monotonic()
        report = CycleReport()
        try:
            try:
                report.leader = await self.leadership.ensure()
            except Exception:
                # Whether we still lead is unknown (the lock's server out of reach): another
                # replica may lead meanwhile, so leading again starts afresh, as below.
                self._leading = False
                self.metrics.set_leader(False)
                raise
            self.metrics.set_leader(report.leader)
            term = self.leadership.term
            if report.leader and (not self._leading or term != self._led_term):
                # Leading (again), or in a new term: another replica may have led and stored
                # windows meanwhile (this one's lease expired during a long cycle, say), and
                # counters diffed across the gap would be counted in this window.
                if self._last_end is not None:
                    self.source.forget_baselines()
                self._last_end = None
                with self.store.read() as tx:  # a failure retries it next cycle
                    self._restore_pending(tx)
            self._leading, self._led_term = report.leader, term
            if not report.leader and self._exported_recommendation:
                self.metrics.clear_recommendation()  # only the leader feeds autoscalers
                self._exported_recommendation = False
            if not report.leader and self.reconcile_only is None and self._exported_versions:
                self.metrics.clear_router_versions()  # only the leader reconciles them
                self._exported_versions = False
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
            if report.result != "failed" and (report.leader or self.reconcile_only is not None):
                await self._reconcile(report)
        except _LostLeadership:
            # Leading again later starts afresh (baselines, pending causes from the store):
            # another replica may have stored windows and acted meanwhile.
            self._leading = False
        except TransientError as e:  # the store down, nothing answered: retried next cycle;
            # the summary line below names it (a traceback each cycle flooded an outage's log)
            report.result, report.reason = "failed", f"{type(e).__name__}: {e}"
        except Exception as e:  # a cycle never kills the daemon: record and go on
            log.exception("cycle failed")
            report.result, report.reason = "failed", f"{type(e).__name__}: {e}"
        seconds = self.clock.monotonic() - started
        self.metrics.observe_cycle(report.result, seconds, self.clock.now())
        self.last_ended_at = self.clock.now()
        if report.result == "ok":
            self.last_completed_at = self.last_ended_at
        self.last_report = report
        log.log(logging.WARNING if report.result == "failed" else logging.INFO, "cycle %s",
                report.summary(), extra={"cycle": _report_fields(report)})
        return report

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
        bug): memory goes back to before it. Else a drift or scaling it consumed was gone
        (the event rolled back, the detector past it), and the policy cache kept a table the
        store never got, which a later pass then re-issued to a router as approved. The
        requests it claimed are given back (twice at most: one that keeps failing its cycle
        waits for request_stale_after_s), not held for request_stale_after_s: a pause must
        not wait five minutes for a store hiccup."""
        for name, value in memory.items():
            setattr(self, name, value)
        self._policies.clear()  # the store is the truth: read again
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
        now = self.clock.now()
        end = now
        start = self._window_start(end)
        plan = _Plan()
        t0 = self.clock.monotonic()
        try:
            plan.window = await self.source.window(start, end)
            self.metrics.observe_job("observe", self.clock.monotonic() - t0)
            for failure in plan.window.failures:  # why, on /metrics (the log only said so)
                self.metrics.observe_failed(failure.kind)
            if plan.window.failures and not plan.window.answered:
                # Nothing answered (the cluster, or our path to it, is down): not a scaling
                # event to plan for, and not a successful cycle (PdControllerStalled and
                # /healthz say so). Reconciling and operator requests go on.
                failed = sorted({f.target for f in plan.window.failures})
                plan.window = None
                raise NothingAnswered(f"no target answered ({len(failed)} failed: "
                                    f"{', '.join(failed[:3])}{', ...' if len(failed) > 3 else ''})")
        except Exception as e:
            if not isinstance(e, NothingAnswered):  # the source itself failed
                self.metrics.observe_failed("source")
            report.result = "skipped"
            report.reason = f"observe failed: {type(e).__name__}: {e}"
            log.warning("%s", report.reason)
        self._last_end = end
        claimed = self._claim_requests(report)
        with self.store.read() as tx:
            rollout = self._rollout(tx)
            ops = operator_state(tx.requests(status="done"))
            current = self._current_policy(tx, rollout)
            self._restore_learner(tx, rollout)
            # No configured router has a desired version: an empty store, or routers that
            # replaced every earlier one (new addresses, a redeploy) on a store with history.
            empty = rollout.fleet_version is None
        if empty and self.reconcile_only is None:
            # The policy every router already runs becomes the fleet's (written with this
            # cycle): the first table is then judged against it and canaried, not approved
            # unchecked to every router (docs/operations.md, "First start"). Sidecar
            # replicas reach their own router only.
            found = await self.reconciler.running_policy(self.routers)
            if found.policy is not None:
                plan.adopted = found
            elif found.why:
                report.reason = _join(report.reason, f"no running policy adopted: {found.why}")
            current = found.policy
        window = plan.window
        if window is not None:
            self._track_failures(window)
            self._scaling, events = step_scaling(self._scaling, window, SETTLED_FAILURES)
            if events:
                self._pending_scaling = "; ".join(e.reason for e in events)
                plan.applied_recommendation = self._recommendation_reached(events)
                if plan.applied_recommendation is not None:
                    self._pending_recommendation = plan.applied_recommendation
                    self._pending_scaling += \
                        f" (recommendation #{plan.applied_recommendation} applied)"
            self._damp_flap(events)
        complete = window is not None and self.usable(window)
        if window is not None:
            t0 = self.clock.monotonic()
            self._state, plan.findings = self.learner.assess(self._state, window, window.end)
            self.metrics.observe_job("assess", self.clock.monotonic() - t0)
            if any(f.fired for f in plan.findings):
                self._pending_drift = True
                self._pending_measured |= any(f.measured for f in plan.findings)
        recal = next((r for r in claimed if r.kind == "recalibrate"), None)
        plan.trigger = self._trigger(plan, rollout, ops, recal, now)
        if plan.trigger is Trigger.CANARY:
            # Refit on the bake's windows (the candidate's own traffic on its routers) and
            # judge the refit against the candidate, not the fleet's policy.
            assert rollout.canary_version is not None
            plan.refit_of = rollout.canary_version
            with self.store.read() as tx:
                current = self._policy(tx, rollout.canary_version)
                plan.refits = _calibration_trigger(tx, rollout.canary_version)
        if plan.trigger is not None:
            if not complete and recal is None:
                report.reason = _join(report.reason, f"calibration ({plan.trigger}) deferred: "
                                      f"{_why_incomplete(window)}")
                plan.trigger = None
            else:
                await self._calibrate(plan, current, now, recal, report)
        await self._recommend(plan, now, report)
        self._write(plan, claimed, rollout, ops, report)

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

    def _claim_requests(self, report: CycleReport) -> list[OperatorRequest]:
        claimed: list[OperatorRequest] = []
        holder = self.leadership.holder
        with self.store.cycle() as tx:
            # Requests a previous leader claimed before our term began died with it (its
            # writes are fenced out): claimed again now, not after request_stale_after_s.
            lease = tx.lease()
            since = lease.acquired_at if lease is not None and lease.holder == holder else None
            for _ in range(MAX_REQUESTS_PER_CYCLE):
                r = tx.claim_next_request(holder, stale_after_s=self.config.request_stale_after_s,
                                          reclaim_before=since)
                if r is None:
                    break
                claimed.append(r)
        self._claimed = claimed
        return claimed

    def _trigger(self, plan: _Plan, rollout: Rollout, ops: OperatorState,
                 recal: OperatorRequest | None, now: float) -> Trigger | None:
        """Why to calibrate now, or None: :func:`controller.core.rollout.choose_trigger` on
        what this cycle gathered (the store is read only for what the choice can use)."""
        baking = rollout.canary_version is not None
        free = recal is None and not baking and not ops.holding
        choice = choose_trigger(TriggerInputs(
            now=now, operator_recalibrate=recal is not None, canary_baking=baking,
            canary_refit=self.config.canary_refit,
            refit_due=(recal is None and baking and self.config.canary_refit
                       and not ops.holding and self._refit_due(rollout, plan.window)),
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

    def _refit_due(self, rollout: Rollout, window: Window | None) -> bool:
        """Whether to refit the baking canary now: it is not itself a refit, and the judge,
        with this cycle's window (stored with the verdict), will promote it. A canary that
        waits for traffic or is rolled back is not refitted: its refit would be discarded."""
        assert rollout.canary_version is not None
        if window is None:
            return False
        with self.store.read() as tx:
            record = tx.policy(rollout.canary_version)
            if record is None or policy_kind(record) is PolicyKind.REFIT:
                return False
            return self.judge_canary(tx, rollout, record, window).action == "promote"

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

    async def _calibrate(self, plan: _Plan, current: Policy | None, now: float,
                         recal: OperatorRequest | None, report: CycleReport) -> None:
        trigger = plan.trigger or Trigger.SCHEDULE
        for_link = False  # a drift led by the KV link
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
        if trigger is Trigger.SCALING:
            plan.scaling = self._pending_scaling
            plan.scaling_recommendation = self._pending_recommendation
            self._scaling_recal_at = {**self._scaling_recal_at,
                                      **dict.fromkeys(self._pending_scaling_roles, now)}
        if trigger is Trigger.CANARY:
            # The candidate's own reason and regime: the learner trains the refit on the
            # same regime's windows (since the drift or the scaling it answered), the bake's
            # included. Causes pending for the fleet's policy stay pending.
            assert current is not None
            cause = Cause(trigger, refits=plan.refits,
                          text=f"{current.provenance.reason or Trigger.SCHEDULE} "
                               f"({REFIT_PREFIX}{plan.refit_of})")
        else:
            for_link = trigger is Trigger.DRIFT and self._pending_measured
            self._pending_scaling = None  # this calibration sees the new capacity and mix
            self._pending_recommendation = None
            self._pending_scaling_roles = frozenset()
            self._calibrated_counts = dict(self._scaling.known) or None
            self._pending_drift = self._pending_measured = False
            if recal is not None and recal.reason:
                cause = Cause(trigger, recal.reason)
            elif plan.scaling is not None:  # the policy's provenance says which shape
                cause = Cause(trigger, plan.scaling)
            else:
                cause = Cause(trigger)

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

    # -- the one write transaction --------------------------------------------------------

    def _write(self, plan: _Plan, claimed: list[OperatorRequest], rollout: Rollout,
               ops: OperatorState, report: CycleReport) -> None:
        """Write the decision in one transaction; once it committed, emit the metric events
        it decided, export a new capacity recommendation, and hand approvals to
        ``on_approval``. A write that fails does none of these."""
        now_dt = self.clock.utcnow()
        self._events = MetricEvents()
        self._approved_in_write = []
        self._write_decision(plan, claimed, rollout, ops, report, now_dt)
        events, self._events = self._events, MetricEvents()
        events.emit(self.metrics)
        if plan.capacity is not None:  # exported once stored, never before
            self._export_recommendation(plan.capacity.to_dict(), self.clock.now())
        approved, self._approved_in_write = self._approved_in_write, []
        for policy, outcome in approved:
            self._export_approved(policy, outcome)

    def _write_decision(self, plan: _Plan, claimed: list[OperatorRequest], rollout: Rollout,
                        ops: OperatorState, report: CycleReport, now_dt: datetime) -> None:
        with self.store.cycle() as tx:
            if not self.leadership.fence(tx):
                report.result, report.reason = "skipped", "lost leadership before writing"
                report.leader = False
                raise _LostLeadership()
            window_ids: list[int] = []
            if plan.window is not None:
                report.window_id = tx.add_window(plan.window)
                window_ids = [report.window_id]
            if plan.adopted is not None and self._rollout(tx).fleet_version is None:
                self._record_adoption(tx, plan.adopted, report)
            self._record_drift(tx, plan.findings, window_ids, report)
            self._record_recommendation(tx, plan, report)
            for r in claimed:
                if r.kind != "recalibrate":
                    baking = self._rollout(tx).canary_version
                    outcome, ok = self._apply_request(tx, r, report)
                    tx.finish_request(r.id, outcome, ok=ok)
                    self._released.pop(r.id, None)
                    report.requests.append(f"{r.kind}#{r.id}: {outcome}")
                    self._drop_abandoned_canary(tx, baking, f"{r.kind}#{r.id}: {outcome}")
            # Operator actions above may have changed the rollout; read it again.
            rollout = self._rollout(tx)
            ops = operator_state(tx.requests(status="done"))
            if rollout.canary_version is not None and plan.window is not None and ops.paused:
                # A verdict is a push (a promotion or a rollback): it waits for resume, and
                # the windows baked meanwhile count then. Promoted while paused, the watch
                # judged a fleet that had not received the policy.
                report.canary = (f"v{rollout.canary_version}: baking; not judged while paused "
                                 "(no pushes)")
            elif rollout.canary_version is not None and plan.window is not None:
                refit = plan.calibration if plan.refit_of == rollout.canary_version else None
                plan.canary_verdict = self._judge_canary(tx, rollout, report, refit)
                rollout = self._rollout(tx)
            elif rollout.fleet_version is not None and plan.window is not None \
                    and self._watch_promotion(tx, rollout.fleet_version, ops, report):
                rollout = self._rollout(tx)
            if plan.trigger is not None:
                report.trigger = plan.trigger
                self._record_calibration(tx, plan, rollout, ops, report)
            for r in claimed:
                if r.kind == "recalibrate":
                    ok = plan.calibration is not None
                    outcome = report.guardrail or plan.calibration_error or "nothing to do"
                    if plan.calibration is None and plan.calibration_error is None:
                        outcome = report.reason or "not run"
                    tx.finish_request(r.id, outcome, ok=ok)
                    report.requests.append(f"recalibrate#{r.id}: {outcome}")
            self._assign_new_routers(tx, now_dt)
            self._set_state_metrics(tx)
        if plan.too_few_windows:
            report.reason = _join(report.reason, f"calibration ({plan.trigger}) deferred: "
                                  f"{plan.calibration_error}")
        elif plan.calibration_error is not None:
            report.reason = _join(report.reason, f"calibration skipped: {plan.calibration_error}")
            if plan.refit_of is None:  # a failed refit leaves the candidate to the judge
                self._fit_failed_at = self.clock.now()
        elif plan.calibration is not None:
            self._fit_failed_at = None

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

    def _record_calibration(self, tx: Tx, plan: _Plan, rollout: Rollout, ops: OperatorState,
                            report: CycleReport) -> None:
        outcome = plan.calibration
        if outcome is None:
            return
        ids = list(plan.calibration_windows) + ([report.window_id] if report.window_id else [])
        dry_run = bool(plan.recalibrate_request is not None
                       and (plan.recalibrate_request.args or {}).get("dry_run"))
        not_stored = "dry run" if dry_run else None
        if plan.refit_of is not None and plan.canary_verdict not in ("promote", "superseded"):
            # The judge was asked before the refit; only an operator action in this cycle
            # (a rollback, a pin, a pause) changes its answer. The refit is then only recorded.
            dry_run = True
            not_stored = (f"the refit of v{plan.refit_of}, which an operator action in this "
                          "cycle kept from its promotion")
            report.not_stored = not_stored
        if ops.exploration_off:  # read after this cycle's requests: one may have turned it off
            outcome = plan.calibration = replace(outcome,
                                                 policy=without_exploration(outcome.policy))
        seeded: float | None = None
        if not ops.exploration_off and not self.config.advisory:
            outcome, seeded = self._seed_first_policy(outcome)
            plan.calibration = outcome
        decision = "approved" if outcome.approved else "rejected"
        self._events.append(GuardrailDecided(
            decision, "forced" if "forced" in outcome.reason else decision, self.clock.now()))
        if outcome.predicted_goodput_current is not None:
            self._events.append(PredictedGoodput(outcome.predicted_goodput_current,
                                                 outcome.predicted_goodput_new))
        report.guardrail = outcome.reason
        if not_stored == "dry run":  # an operator's dry run: what it would have done
            report.guardrail = dry_run_verdict(outcome.approved, outcome.reason)
        version: int | None = None
        reference_for: int | None = None
        if not dry_run:
            version = tx.next_version()
            policy = outcome.policy.with_version(version)
            reason = outcome.reason
            if plan.refit_of is not None:
                reason = f"{REFIT_PREFIX}{plan.refit_of}: {reason}"
            if self.config.advisory:
                status = "advisory"
            elif not outcome.approved:
                status = "rejected"
            elif ops.holding or rollout.canary_version is not None:
                status = "candidate"  # an operator asked for it; the rollout is held
                held = ("paused" if ops.paused else "in fallback" if ops.fallback
                        else f"v{ops.pinned} is pinned" if ops.pinned is not None
                        else f"v{rollout.canary_version} is baking")
                reason = (f"held as a candidate, not rolled out ({held}); the guardrail's "
                          f"verdict: {outcome.reason}")
                report.guardrail = reason
            else:
                status = "approved"
            tx.add_policy(version, policy.checksum, dumps(policy), status, reason,
                          kind=PolicyKind.OTHER if plan.refit_of is None else PolicyKind.REFIT,
                          seeded_exploration=seeded)
            self._policies[version] = policy
            report.candidate_version, report.candidate_status = version, status
            if status == "approved":
                self._approve(tx, version, rollout, report)
                self._state_for = version
                self._approved_in_write.append((policy, outcome))
        # A refused refit leaves drift measured as it was: it was trained on windows where
        # two policies ran, and the candidate it refitted keeps running. (Adopting its model
        # for the performance detector moved later detections and cost goodput in 15 replays:
        # docs/bench.md, "The canary refit".)
        if not dry_run and (plan.refit_of is None or outcome.approved):
            # The learner decides what drift is measured against now: a refused candidate
            # trained across a shift does not hide it (see Learner.adopt), so that shift
            # fires again after the detector's cooldown and is calibrated for on its own
            # windows. (This replaced a one-off retry of a refused drift calibration.)
            self._state = self.learner.adopt(self._state, outcome, self.clock.now())
            if renews_reference(outcome) and self._state_for is not None:
                # What a restart or a rollback to this version restores (_restore_learner).
                reference_for = self._state_for
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
        )
        self._link_retry_at = plan.link_retry_at  # any stored calibration replaces it

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

    def _record_adoption(self, tx: Tx, found: RunningPolicy, report: CycleReport) -> None:
        policy, said, added = record_adoption(tx, found, self.routers, "the controller")
        if added:
            self._policies[policy.version] = policy
            self._events.append(PolicyChanged(policy.version))
        report.reason = _join(report.reason, said)
        seeded = self._seed_exploration(tx, policy)
        if seeded is not None:
            report.reason = _join(report.reason, seeded)

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
        self._policies[version] = policy
        for router in self.routers:
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

    def _everywhere(self, tx: Tx, policy: Policy, reason: str) -> None:
        """Store ``policy`` as approved and make it every router's desired version at once
        (no canary: an adoption, an operator's fallback or exploration off)."""
        tx.add_policy(policy.version, policy.checksum, dumps(policy), "approved", reason)
        self._policies[policy.version] = policy
        for router in self.routers:
            tx.set_desired(router, policy.version)
        self._events.append(PolicyChanged(policy.version))

    def _approve(self, tx: Tx, version: int, rollout: Rollout, report: CycleReport) -> None:
        """Make an approved version desired: a canary share first when there is a fleet
        version to compare with, else every router at once."""
        report.approved_version = version
        self._events.append(PolicyChanged(version))
        if rollout.fleet_version is None or len(self.routers) < 2:
            for r in self.routers:
                tx.set_desired(r, version)
            report.canary = ("no previous policy: every router at once"
                             if rollout.fleet_version is None
                             else "one router: no control group, promoted at once")
            self._events.append(CanaryState("promoted"))
            return
        canary = canary_subset(self.routers, self.config.canary_fraction, version)
        for r in canary:
            tx.set_desired(r, version)
        # After a superseded canary the report says so first.
        report.canary = _join(report.canary or "", f"baking v{version} on {', '.join(canary)}")
        self._events.append(CanaryState("baking"))

    # -- capacity -------------------------------------------------------------------------

    async def _recommend(self, plan: _Plan, now: float, report: CycleReport) -> None:
        """Compute a capacity plan when one is due; a failure is logged and counted."""
        cfg = self.config
        if self.planner is None:
            return
        with self.store.read() as tx:
            last = tx.recommendations(limit=1)
            if last:
                self._refresh_export(last[-1].body, last[-1].created_at.timestamp(), now)
            if last and 0 <= now - last[-1].created_at.timestamp() < cfg.capacity_interval_s:
                return
            if self._plan_failed_at is not None \
                    and 0 <= now - self._plan_failed_at < cfg.capacity_interval_s:
                return  # a failing plan is retried once per interval, not every cycle
            # The load of the last interval: windows that started within it (after downtime,
            # older ones would describe a load that may be gone).
            since = datetime.fromtimestamp(now - cfg.capacity_interval_s, tz=UTC)
            covering = max(cfg.capacity_min_windows,
                           math.ceil(cfg.capacity_interval_s / cfg.interval_s))
            stored = [s for s in tx.windows(since=since, limit=covering)
                      if self.usable(s.window)]
        windows = [s.window for s in stored]
        with_window = plan.window is not None and self.usable(plan.window)
        if with_window:
            assert plan.window is not None
            windows.append(plan.window)
        if len(windows) < cfg.capacity_min_windows:
            return
        planner = self.planner
        try:
            capacity: CapacityPlan = await self._run_blocking(lambda: planner.plan(windows))
            _check_storable(capacity)
        except Exception as e:  # planning is advisory: it never fails the cycle
            log.warning("capacity plan failed: %s: %s", type(e).__name__, e)
            self.metrics.capacity_plan_failed()
            self._plan_failed_at = now
            report.capacity = f"plan failed: {type(e).__name__}: {e}"
            return
        self._plan_failed_at = None
        plan.capacity = capacity
        plan.capacity_windows = [s.id for s in stored]
        plan.capacity_with_window = with_window

    def _record_recommendation(self, tx: Tx, plan: _Plan, report: CycleReport) -> None:
        if plan.applied_recommendation is not None:
            tx.mark_recommendation_applied(plan.applied_recommendation)
        capacity = plan.capacity
        if capacity is None:
            return
        ids = list(plan.capacity_windows)
        if plan.capacity_with_window and report.window_id is not None:
            ids.append(report.window_id)
        p, d = capacity.prefill, capacity.decode
        report.recommendation_id = tx.add_recommendation(
            window_ids=ids, workers=(p.workers, d.workers),
            current=(p.current_workers, d.current_workers), binding=(p.binding, d.binding),
            utilisation=(p.utilisation, d.utilisation), body=capacity.to_dict(),
        )
        report.capacity = (f"prefill {p.workers} ({p.binding}), decode {d.workers} "
                           f"({d.binding})")

    def _recommendation_reached(self, events: Sequence[ScalingEvent]) -> int | None:
        """The newest recent recommendation whose counts every confirmed scaling event
        reached, for a role it asked to change; None if the change was not recommended."""
        with self.store.read() as tx:
            recent = tx.recommendations(limit=RECENT_RECOMMENDATIONS)
        for rec in reversed(recent):
            asked = {"prefill": rec.current_prefill, "decode": rec.current_decode}
            if all(e.after == rec.workers(e.role) and asked[e.role] != e.after
                   for e in events):
                return rec.id
        return None

    def _refresh_export(self, body: Mapping[str, Any], at: float, now: float) -> None:
        """Export the newest stored recommendation while it is fresh: after a restart or a
        change of leader (an autoscaler is not left without a value until the next plan),
        and withdraw it once no plan has succeeded for a few intervals (an autoscaler then
        holds its count instead of following a load that may be gone)."""
        stale = now - at >= STALE_RECOMMENDATION_INTERVALS * self.config.capacity_interval_s
        if stale and self._exported_recommendation:
            log.warning("capacity recommendation withdrawn: none for %.0f s", now - at)
            self.metrics.clear_recommendation()
            self._exported_recommendation = False
        if stale or self._exported_recommendation:
            return
        try:
            self._export_recommendation(body, at)
        except (KeyError, TypeError, ValueError) as e:
            log.warning("stored recommendation not exported: %s: %s", type(e).__name__, e)

    def _export_recommendation(self, body: Mapping[str, Any], at: float) -> None:
        """``body`` is ``CapacityPlan.to_dict()`` (a new plan or a stored one)."""
        for role in ("prefill", "decode"):
            r = body[role]
            util = r.get("utilisation")
            self.metrics.set_recommendation(
                role, int(r["workers"]), math.nan if util is None else float(util),
                r.get("current_workers"), bool(r.get("extrapolated")),
            )
        self.metrics.recommended(at)
        self._exported_recommendation = True

    # -- canary ---------------------------------------------------------------------------

    def _judge_canary(self, tx: Tx, rollout: Rollout, report: CycleReport,
                      refit: CalibrationOutcome | None = None) -> str:
        assert rollout.canary_version is not None
        record = tx.policy(rollout.canary_version)
        assert record is not None
        verdict = self.judge_canary(tx, rollout, record)
        report.canary = f"v{rollout.canary_version}: {verdict.reason}"
        if verdict.action == "promote" and refit is not None and refit.approved \
                and rollout.fleet_version is not None:
            # Refitted on the candidate's own traffic, the model prefers another table: that
            # table bakes instead, and the fleet changes once, not twice.
            tx.set_policy_status(rollout.canary_version, "superseded",
                                 f"{SUPERSEDED}: {verdict.reason}")
            for r in rollout.canary_routers:
                tx.set_desired(r, rollout.fleet_version)
            report.canary = f"v{rollout.canary_version}: superseded by its refit"
            return "superseded"
        if verdict.action == "promote":
            for r in self.routers:
                tx.set_desired(r, rollout.canary_version)
            tx.mark_promoted(rollout.canary_version, self.clock.utcnow())
            self._events.append(CanaryState("promoted"))
        elif verdict.action == "roll_back":
            tx.set_policy_status(rollout.canary_version, "rolled_back",
                                 f"canary rolled back: {verdict.reason}")
            if rollout.fleet_version is not None:
                for r in rollout.canary_routers:
                    tx.set_desired(r, rollout.fleet_version)
            self._events.append(RolledBack("canary", rollout.fleet_version))
        return verdict.action

    def judge_canary(self, tx: Tx, rollout: Rollout, record: PolicyRecord,
                     unstored: Window | None = None) -> CanaryVerdict:
        """The pure judge (:func:`controller.core.rollout.judge_canary`) on the windows
        since ``record``'s approval (``unstored``: this cycle's window, before it is
        stored)."""
        return judge_canary(self._bake_windows(tx, record, unstored),
                            {self.outcome_names[r] for r in rollout.canary_routers},
                            {self.outcome_names[r] for r in rollout.control_routers},
                            self.config.judge)

    def _watch_promotion(self, tx: Tx, version: int, ops: OperatorState,
                         report: CycleReport) -> bool:
        """Roll a promotion back when the fleet's goodput since falls well below the bake's;
        True when it did. A canary shares the workers with the control routers, so a route
        fine for its share of the traffic can overload a pool once every router sends it
        there: the judge could not see that, the fleet's goodput after the promotion does.
        Never while an operator holds the rollout (paused, pinned, in fallback): they chose
        what runs."""
        record = tx.policy(version)
        if record is None or record.promoted_at is None or self.config.watch_s is None:
            return False
        verdict = self.judge_promotion(tx, record)
        if verdict.action == "roll_back" and ops.holding:
            report.canary = f"v{version}: {verdict.reason}; not rolled back: the operator holds"
            return False
        if verdict.action != "roll_back":
            if verdict.action != "over":
                report.canary = f"v{version}: {verdict.reason}"
            return False
        target = self._rollback_target(tx, version, ops)
        if target is None:
            report.canary = f"v{version}: {verdict.reason}; nothing older to roll back to"
            return False
        tx.set_policy_status(version, "rolled_back", f"{UNPROMOTED}: {verdict.reason}")
        runs = self._desire_back(tx, target, ops)
        report.canary = f"v{version}: {UNPROMOTED} to v{target}{runs}: {verdict.reason}"
        self._events.append(RolledBack("watch", target))
        return True

    def _rollback_target(self, tx: Tx, newest: int | None, ops: OperatorState) -> int | None:
        """The newest approved version below ``newest``. While exploration is off, one that
        differs from ``newest`` only in exploration is passed over: it would be re-issued
        without exploration, the same table again (e.g. the one `exploration off` copied)."""
        approved = sorted((p.version for p in tx.policies(status="approved")), reverse=True)
        below = [v for v in approved if newest is None or v < newest]
        if newest is None or not ops.exploration_off:
            return below[0] if below else None
        quiet = _without_exploration_key(self._policy(tx, newest))
        return next((v for v in below
                     if _without_exploration_key(self._policy(tx, v)) != quiet), None)

    def _desire_back(self, tx: Tx, target: int, ops: OperatorState) -> str:
        """Every router to ``target``; while exploration is off, a target that explores is
        re-issued without it (as ``exploration off`` does). What runs, for the outcome."""
        policy = self._policy(tx, target)
        if ops.exploration_off and any(policy.table.exploration):
            version = self._everywhere_without_exploration(
                tx, policy, f"v{target} without exploration (rolled back while exploration "
                "is off)")
            return f", re-issued without exploration as v{version}"
        for router in self.routers:
            tx.set_desired(router, target)
        return ""

    def judge_promotion(self, tx: Tx, record: PolicyRecord) -> WatchVerdict:
        """The pure watch (:func:`controller.core.rollout.judge_watch`) on the windows since
        ``record``'s approval; over once ``watch_s`` passed since its promotion (no read)."""
        cfg = self.config
        assert record.promoted_at is not None and cfg.watch_s is not None
        now, promoted = self.clock.now(), record.promoted_at.timestamp()
        if now - promoted > cfg.watch_s:
            return WATCH_OVER
        return judge_watch(now, promoted, self._bake_windows(tx, record),
                           {self.outcome_names[r] for r in self.routers}, cfg.judge)

    def _bake_windows(self, tx: Tx, record: PolicyRecord, unstored: Window | None = None
                      ) -> list[Window]:
        """Stored windows (and ``unstored``) that ended at least half an interval after
        ``record``'s approval: the one the approval happened in saw the old policy
        everywhere."""
        approved_at = record.created_at.timestamp()
        since = record.created_at - timedelta(seconds=self.config.interval_s)
        windows = [w.window for w in tx.windows(since=since)]
        if unstored is not None:
            windows.append(unstored)
        return [w for w in windows if w.end >= approved_at + 0.5 * self.config.interval_s]

    # -- operator requests ----------------------------------------------------------------

    def _apply_request(self, tx: Tx, r: OperatorRequest, report: CycleReport
                       ) -> tuple[str, bool]:
        args = r.args or {}
        what = args.get("what", "approvals")
        if r.kind == "pause":
            if what == "pin":
                version = version_arg(args.get("version"))
                if version is None:
                    return f"cannot pin {args.get('version')!r}: {NOT_A_VERSION}", False
                rec = tx.policy(version)
                if rec is None or rec.status != "approved":
                    return (f"cannot pin v{version}: "
                            f"{'no such version' if rec is None else rec.status}"), False
                for router in self.routers:
                    tx.set_desired(router, version)
                return f"pinned v{version} on every router", True
            if what == "exploration":
                return self._exploration_off(tx, report), True
            return "paused: no approvals and no pushes until resume", True
        if r.kind == "resume":
            # Done either way (the state is what was asked), but say when nothing changed.
            ops = operator_state(tx.requests(status="done"))
            if what == "pin":
                held = ops.pinned is not None or ops.fallback
                return ("unpinned" if held else "nothing was pinned (no change)"), True
            if what == "exploration":
                return ("exploration back on" if ops.exploration_off
                        else "exploration was on (no change)"), True
            return ("resumed" if ops.paused else "was not paused (no change)"), True
        if r.kind == "rollback":
            if args.get("to") == FALLBACK_PREFILL:
                return self._fallback(tx, r), True
            return self._rollback(tx, args.get("version"))
        return f"unknown request kind {r.kind}", False

    def _drop_abandoned_canary(self, tx: Tx, baking: int | None, why: str) -> None:
        """A canary that an operator action took off its routers (a pin of another version,
        a fallback, exploration off) without promoting it is rolled back: left approved, a
        later rollback or a watch went back to it though it had never run on the fleet."""
        if baking is None:
            return
        after = self._rollout(tx)
        record = tx.policy(baking)
        if after.canary_version is None and after.fleet_version != baking \
                and record is not None and record.status == "approved":
            tx.set_policy_status(baking, "rolled_back", f"{ABANDONED_PREFIX}{why}")
            self._events.append(CanaryState("rolled_back"))

    def _rollback(self, tx: Tx, version: Any) -> tuple[str, bool]:
        asked = None if version is None else version_arg(version)
        if version is not None and asked is None:
            return f"cannot roll back to {version!r}: {NOT_A_VERSION}", False
        rollout = self._rollout(tx)
        newest = rollout.canary_version or rollout.fleet_version
        ops = operator_state(tx.requests(status="done"))
        if asked is not None and rollout.canary_version is None \
                and rollout.fleet_version == asked:
            return f"v{rollout.fleet_version} already runs on every router (no change)", True
        if asked is None:
            found = self._rollback_target(tx, newest, ops)
            if found is None:
                return "nothing to roll back to", False
            target = found
        else:
            target = asked
            rec = tx.policy(target)
            if rec is None or rec.status != "approved":
                return (f"cannot roll back to v{target}: "
                        f"{'no such version' if rec is None else rec.status}"), False
        if newest is not None and newest > target:
            for p in tx.policies(status="approved"):
                if p.version > target:
                    tx.set_policy_status(p.version, "rolled_back", "operator rollback")
        runs = self._desire_back(tx, target, ops)
        self._events.append(RolledBack("operator", target))
        return f"rolled back to v{target}{runs}", True

    def _fallback(self, tx: Tx, r: OperatorRequest) -> str:
        version = tx.next_version()
        policy = Policy.uniform(version, Route.PREFILL_NODE, provenance=Provenance(
            created_at=self.clock.utcnow(), reason=f"operator fallback ({r.who})",
            created_by="pdctl fallback prefill"))
        self._everywhere(tx, policy, f"fallback prefill by {r.who}: {r.reason}")
        return f"fallback: every router to all-prefill-node v{version} (held until unpin)"

    def _exploration_off(self, tx: Tx, report: CycleReport) -> str:
        rollout = self._rollout(tx)
        if rollout.fleet_version is None:
            return "exploration off (no policy yet)"
        current = self._policy(tx, rollout.fleet_version)
        if not any(current.table.exploration):
            return f"exploration off (v{rollout.fleet_version} explores nothing)"
        version = self._everywhere_without_exploration(
            tx, current, f"v{rollout.fleet_version} without exploration (operator)")
        report.approved_version = version
        return f"exploration off: every router to v{version}"

    def _everywhere_without_exploration(self, tx: Tx, policy: Policy, reason: str) -> int:
        """``policy``'s table with no exploration, as a new version on every router."""
        version = tx.next_version()
        self._everywhere(tx, without_exploration(policy).with_version(version), reason)
        return version

    # -- reading the store ----------------------------------------------------------------

    def _rollout(self, tx: Tx) -> Rollout:
        return read_rollout(tx, self.routers)

    def _current_policy(self, tx: Tx, rollout: Rollout) -> Policy | None:
        return None if rollout.fleet_version is None else self._policy(tx, rollout.fleet_version)

    def _policy(self, tx: Tx, version: int) -> Policy:
        cached = self._policies.get(version)
        if cached is None:
            rec = tx.policy(version)
            if rec is None:
                raise LookupError(f"desired policy v{version} is not stored")
            cached = self._policies[version] = loads(rec.body_json)
        return cached

    def _restore_learner(self, tx: Tx, rollout: Rollout) -> None:
        """After a restart (or a rollback), the drift reference of the fleet's policy: the
        one last renewed for it. That is its own calibration's, or a later one's that was
        refused on the traffic since a change alone (the policy was judged on it and kept):
        restoring the older reference made traffic the running policy had already been
        judged on fire a drift again (a rollback in bench scenario 1, held-out seed 8, brought
        back the active calibration grid's reference and a workload drift against it)."""
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

    def _assign_new_routers(self, tx: Tx, now: datetime) -> None:
        """A configured router without a desired version joins the fleet's version."""
        rollout = self._rollout(tx)
        if rollout.fleet_version is None:
            return
        desired = tx.desired_versions()
        for r in self.routers:
            if r not in desired:
                tx.set_desired(r, rollout.fleet_version, at=now)

    def _set_state_metrics(self, tx: Tx) -> None:
        """The leader's state gauges, from what this cycle's transaction leaves (set only at
        events, the desired version read a canary's, missed a pin or a re-issue, and was 0
        after a failover)."""
        ops = operator_state(tx.requests(status="done"))
        rollout = self._rollout(tx)
        # A fallback holds the rollout too: it reads pinned.
        self._events.append(OperatorGauges(ops.paused, ops.pinned is not None or ops.fallback,
                                           rollout.fleet_version))
        # Baking after a restart mid-bake (it read idle); a canary gone without a verdict
        # of its own no longer reads baking.
        if rollout.canary_version is not None:
            self._events.append(CanaryState("baking"))
        else:
            self._events.append(NoCanary())

    # -- reconcile (every replica) --------------------------------------------------------

    async def _reconcile(self, report: CycleReport) -> None:
        if self.config.advisory:
            return
        with self.store.read() as tx:
            ops = operator_state(tx.requests(status="done"))
            desired_versions = tx.desired_versions()
            mine = self.reconcile_only if self.reconcile_only is not None else self.routers
            if ops.paused:
                report.reason = _join(report.reason, "paused: no pushes")
                # Still what the store says: a router held behind by the pause shows it.
                acked = {r.router_id: r.acked_version for r in tx.routers()}
                for r in mine:
                    self.metrics.set_router_versions(r, desired_versions.get(r, 0),
                                                     acked.get(r) or 0)
                self._exported_versions = True
                return
            desired = {r: self._policy(tx, v) for r, v in desired_versions.items() if r in mine}
            # A router at a version we stored and moved back from (a rollback, a pin, a
            # rolled-back canary) gets a rollback push; a router ahead at a version we never
            # stored (a restored backup) gets the desired policy re-issued above it.
            acked = {r.router_id: r.acked_version for r in tx.routers()}
            back = {
                r for r, p in desired.items()
                if (a := acked.get(r)) is not None and a > p.version
                and tx.policy(a) is not None
            }
            # A re-issue above a router that is ahead (a manual `pdctl push`, a restored
            # backup) takes a number no stored policy has: one above the routers' can still
            # be a rejected candidate's, and storing it then failed the cycle after the
            # router had applied it.
            floor = tx.next_version()
        if not desired:
            return
        forward = {r: p for r, p in desired.items() if r not in back}
        backward = {r: p for r, p in desired.items() if r in back}
        statuses: dict[str, RouterStatus] = {}
        t0 = self.clock.monotonic()
        for d, rb in ((forward, False), (backward, True)):
            if not d:
                continue
            part = await self.reconciler.reconcile(d, rollback=rb, version_floor=floor)
            statuses.update(part)  # one pass after the other: their re-issues never collide
            floor = max([floor, *(s.reissued_as + 1 for s in part.values()
                                  if s.reissued_as is not None)])
        self.metrics.observe_job("reconcile", self.clock.monotonic() - t0)
        self._record_statuses(statuses, desired_versions, report)

    def _record_statuses(self, statuses: Mapping[str, RouterStatus],
                         desired_versions: Mapping[str, int], report: CycleReport) -> None:
        at = self.clock.utcnow()
        with self.store.cycle() as tx:
            reissued: dict[int, int] = {}
            acks: list[tuple[str, int, str]] = []
            for router, s in statuses.items():
                if s.reissued_as is not None:
                    old = desired_versions[router]
                    if old not in reissued and tx.policy(s.reissued_as) is None:
                        policy = self._policy(tx, old).with_version(s.reissued_as)
                        rec = tx.policy(old)
                        tx.add_policy(s.reissued_as, policy.checksum, dumps(policy), "approved",
                                      f"v{old} re-issued above a router that was ahead",
                                      reissue_of=(rec.reissue_of if rec and rec.reissue_of
                                                  else old))
                        self._policies[s.reissued_as] = policy
                    reissued[old] = s.reissued_as
                    tx.set_desired(router, s.reissued_as, at=at)
                if s.ok and s.acked_version is not None and s.acked_checksum is not None:
                    acks.append((router, s.acked_version, s.acked_checksum))
                elif not s.ok:
                    tx.record_router_error(router, f"{s.outcome}: {s.last_error}", at=at)
                if s.pushed:
                    report.pushes += 1
                    version = s.reissued_as or desired_versions[router]
                    tx.add_push(router, version, _push_result(s), s.latency_s,
                                None if s.ok else s.last_error, at=at)
                    self.metrics.observe_push(router, _push_result(s), s.latency_s)
                if s.ok:  # "acked" in the log: only what acknowledged the desired version
                    report.acked[router] = s.acked_version
                desired = s.reissued_as or desired_versions[router]
                self.metrics.set_router_versions(router, desired, s.acked_version or 0)
                self._exported_versions = True
            tx.record_acks(acks, at=at)


class NothingAnswered(TransientError):
    """A window in which every worker and router target failed."""


class _LostLeadership(Exception):
    pass


def _push_result(s: RouterStatus) -> str:
    if s.ok:
        return "ok"
    if s.outcome in ("conflict", "stale"):
        return "conflict"
    if s.outcome in ("invalid", "refused"):
        return "rejected"
    return "failed"


def record_adoption(tx: Tx, found: RunningPolicy, routers: Sequence[str], who: str
                    ) -> tuple[Policy, str, bool]:
    """Record the one policy every router runs (``found.policy``) as the fleet's, desired
    for every router, when no configured router has a desired version: an empty store, or
    routers that replaced every earlier one (``who`` started then). The policy as stored,
    what was done, and whether a version was added (False: a stored one desired again)."""
    policy = found.policy
    assert policy is not None
    ran = policy.version
    stored = tx.policy(policy.version)
    if stored is not None and stored.checksum == policy.checksum:
        # The routers run a stored version (their rows were under other names): it is
        # desired again as it is, no push.
        for router in routers:
            tx.set_desired(router, policy.version)
        return policy, f"the routers run stored v{policy.version}: desired again", False
    if tx.policies(limit=1):
        where = f"{who} found no configured router with a desired version"
        if stored is not None or policy.version < tx.next_version():
            # Its number is taken or behind the store's: stored under the next one (the
            # routers get the same table under it, one push each).
            policy = policy.with_version(tx.next_version())
    else:
        where = f"{who} started on an empty store"
    tx.add_policy(policy.version, policy.checksum, dumps(policy), "approved",
                  f"{ADOPTED_PREFIX}{found.why} when {where}", kind=PolicyKind.ADOPTED)
    for router in routers:
        tx.set_desired(router, policy.version)
    renumbered = "" if policy.version == ran else f" (it ran as v{ran})"
    return policy, f"adopted the routers' policy as v{policy.version}{renumbered}", True


def dry_run_verdict(approved: bool, reason: str) -> str:
    """The outcome of an operator's ``recalibrate --dry-run``: what the guardrail would
    have done, in the conditional (it approved nothing and stored no policy), with the
    guardrail's own reason and numbers after it."""
    return f"{DRY_RUN_PREFIX}{'approve' if approved else 'reject'}; nothing stored " \
           f"(guardrail: {reason})"


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


def _scaling_details(plan: _Plan) -> dict[str, Any]:
    """What a "scaling" calibration answers: the event, and the recommendation it applied."""
    details: dict[str, Any] = {}
    if plan.scaling is not None:
        details["scaling"] = plan.scaling
    if plan.scaling_recommendation is not None:
        details["recommendation_id"] = plan.scaling_recommendation
    return details


def _check_storable(capacity: CapacityPlan) -> None:
    """Refuse a plan the store would refuse, before it can fail the cycle's transaction."""
    for r in (capacity.prefill, capacity.decode):
        if r.workers < 1 or not math.isfinite(r.utilisation):
            raise StoreError(f"{r.role}: {r.workers} workers at utilisation {r.utilisation}")
    dumps_json(capacity.to_dict())


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b


def _plain(d: Mapping[str, Any]) -> dict[str, Any]:
    from controller.loop.learning import json_safe

    out: dict[str, Any] = json_safe(dict(d))
    return out


def _report_fields(r: CycleReport) -> dict[str, Any]:
    return {k: v for k, v in r.__dict__.items() if v not in (None, [], {}, "")}


__all__ = [
    "ADOPTED_PREFIX", "DRY_RUN_PREFIX", "REFIT_PREFIX", "SEEDED_PREFIX",
    "AlwaysLeader", "CapacityPlanner", "Cycle", "CycleConfig", "CycleReport", "Leadership",
    "dry_run_verdict", "read_rollout", "run_inline",
]
