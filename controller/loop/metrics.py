"""The controller's own Prometheus metrics (``pdctl_*``), built in one place.

The daemon constructs one :class:`ControllerMetrics` on its registry and reports through the
typed helpers below; tests pass a fresh ``CollectorRegistry``. Naming follows the Prometheus
conventions: base units, ``_total`` counters, ``*_timestamp_seconds`` gauges for "time since"
alerts, and bounded labels. Enum-like labels (cycle result, job, trigger, decision, canary
state, ...) are checked against fixed tuples, so a typo cannot mint a new series, and their
children are created up front, so ``rate()`` and ``absent()`` see them from the first scrape.
Router names are the one open label set; they are bounded by the deployment, and
:meth:`ControllerMetrics.forget_router` drops a router that left.

The alert rules in ``deploy/prometheus/rules.yml`` and the dashboards in ``dashboards/`` use
these names: change them together.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from controller import __version__
from controller.core.drift import KINDS as DRIFT_DETECTORS
from controller.core.trigger import Trigger
from controller.core.window import FailureKind

CYCLE_RESULTS = ("ok", "skipped", "failed")
JOBS = ("observe", "assess", "calibrate", "reconcile")
JOB_SKIP_REASONS = ("overlap", "missed")
PUSH_RESULTS = ("ok", "failed", "conflict", "rejected")
# The daemon's triggers (an active calibration is pdctl's, not the daemon's).
RECALIBRATION_TRIGGERS = tuple(t.value for t in Trigger if t is not Trigger.ACTIVE)
GUARDRAIL_DECISIONS = ("approved", "rejected")
GOODPUT_POLICIES = ("current", "candidate")
CANARY_STATES = ("idle", "baking", "promoted", "rolled_back")
# pdctl_observe_failures' kinds (bounded: any other word counts as "other").
OBSERVE_FAILURE_KINDS = (*FailureKind, "source", "other")
# Who rolled a policy back: the canary's judge, the post-promotion watch, an operator.
ROLLBACK_DECIDERS = ("canary", "watch", "operator")
ROLES = ("prefill", "decode")

# Seconds. A cycle is a few queries plus, at times, a fit; a push is one gRPC call per router.
CYCLE_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
PUSH_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _check(kind: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"unknown {kind} {value!r}; expected one of {', '.join(allowed)}")
    return value


class ControllerMetrics:
    """Every ``pdctl_*`` metric of one controller process, registered on ``registry``."""

    def __init__(self, registry: CollectorRegistry, version: str = __version__) -> None:
        self.registry = registry
        self.canary_state_now = "idle"  # the state pdctl_canary_state reads 1 for
        self.build_info = Gauge(
            "pdctl_build_info", "Always 1; the version label names the running build.",
            ["version"], registry=registry,
        )
        self.build_info.labels(version).set(1)
        # Registration order is the order of the exposition: keep these calls in this order.
        self._loop_metrics(registry)
        self._rollout_metrics(registry)
        self._learning_metrics(registry)
        self._operator_metrics(registry)
        self._capacity_metrics(registry)
        self._create_children()

    def _loop_metrics(self, registry: CollectorRegistry) -> None:
        """The control loop: cycles and scheduler jobs."""
        self.cycles = Counter(
            "pdctl_cycles", "Control cycles by result (ok, skipped, failed).",
            ["result"], registry=registry,
        )
        self.cycle_duration = Histogram(
            "pdctl_cycle_duration_seconds", "Duration of control cycles that ran (ok or failed).",
            buckets=CYCLE_BUCKETS_S, registry=registry,
        )
        self.last_cycle_success = Gauge(
            "pdctl_last_cycle_success_timestamp_seconds",
            "Unix time of the last control cycle that completed successfully (0: none yet).",
            registry=registry,
        )
        self.job_duration = Histogram(
            "pdctl_job_duration_seconds", "Duration of scheduler job runs, by job.",
            ["job"], buckets=CYCLE_BUCKETS_S, registry=registry,
        )
        self.job_skipped = Counter(
            "pdctl_job_skipped",
            "Scheduler job runs not started, by job and reason (overlap: the previous run was "
            "still going; missed: the run was due while the loop was busy or down).",
            ["job", "reason"], registry=registry,
        )

    def _rollout_metrics(self, registry: CollectorRegistry) -> None:
        """Rollout to routers: pushes, versions, the canary."""
        self.push_duration = Histogram(
            "pdctl_push_duration_seconds", "Duration of one policy push to one router.",
            ["router"], buckets=PUSH_BUCKETS_S, registry=registry,
        )
        self.pushes = Counter(
            "pdctl_push", "Policy pushes by router and result (ok, failed, conflict, rejected).",
            ["router", "result"], registry=registry,
        )
        self.router_desired_version = Gauge(
            "pdctl_router_desired_version",
            "Policy version this router should run (canary routers may differ; 0: none).",
            ["router"], registry=registry,
        )
        self.router_acked_version = Gauge(
            "pdctl_router_acked_version",
            "Policy version this router last acknowledged (0: none).",
            ["router"], registry=registry,
        )
        self.canary_state = Gauge(
            "pdctl_canary_state",
            "1 for the rollout's current state (idle, baking, promoted, rolled_back), else 0.",
            ["state"], registry=registry,
        )

    def _learning_metrics(self, registry: CollectorRegistry) -> None:
        """Drift, calibration and the guardrail."""
        self.drift_statistic = Gauge(
            "pdctl_drift_statistic", "Latest drift statistic, by detector and feature.",
            ["detector", "feature"], registry=registry,
        )
        self.drift_threshold = Gauge(
            "pdctl_drift_threshold",
            "Threshold the drift statistic is compared with, by detector and feature.",
            ["detector", "feature"], registry=registry,
        )
        self.drift_events = Counter(
            "pdctl_drift_events", "Drift events (statistic above threshold), by detector.",
            ["detector"], registry=registry,
        )
        self.recalibrations = Counter(
            "pdctl_recalibrations",
            "Recalibrations started, by trigger (drift, schedule, scaling, operator, canary).",
            ["trigger"], registry=registry,
        )
        self.guardrail_decisions = Counter(
            "pdctl_guardrail_decisions", "Guardrail verdicts on candidate policies.",
            ["decision"], registry=registry,
        )
        self._decision_metrics(registry)

    def _decision_metrics(self, registry: CollectorRegistry) -> None:
        """What the guardrail decided last and the policy versions that came of it."""
        self.last_decision = Gauge(
            "pdctl_last_decision_info",
            "1 for the last guardrail verdict and its reason code (one series at a time).",
            ["decision", "reason"], registry=registry,
        )
        self.last_decision_time = Gauge(
            "pdctl_last_decision_timestamp_seconds",
            "Unix time of the last guardrail verdict (0: none yet).", registry=registry,
        )
        self.predicted_goodput = Gauge(
            "pdctl_predicted_goodput_ratio",
            "Predicted share of requests meeting both SLOs (0-1), for the current policy and "
            "the last candidate.",
            ["policy"], registry=registry,
        )
        self.policy_changes = Counter(
            "pdctl_policy_changes", "Approved policy versions made desired.", registry=registry,
        )
        self.rollbacks = Counter(
            "pdctl_rollbacks", "Policies rolled back, by what decided it (canary: the judge, "
            "watch: the post-promotion watch, operator).", ["by"], registry=registry,
        )
        self.desired_version = Gauge(
            "pdctl_desired_policy_version", "The fleet's desired (promoted) policy version.",
            registry=registry,
        )

    def _operator_metrics(self, registry: CollectorRegistry) -> None:
        """Operator and HA state."""
        self.leader = Gauge(
            "pdctl_leader", "1 while this replica holds the leader lease, else 0.",
            registry=registry,
        )
        self.paused = Gauge(
            "pdctl_paused", "1 while an operator has paused approvals and pushes, else 0.",
            registry=registry,
        )
        self.pinned = Gauge(
            "pdctl_pinned", "1 while an operator holds a pinned version or a fallback "
            "(until `pdctl unpin`), else 0.",
            registry=registry,
        )

    def _capacity_metrics(self, registry: CollectorRegistry) -> None:
        """Capacity planning and observation failures. Only the leader exports a
        recommendation (an autoscaler sums what the external-metrics query returns):
        followers clear these series."""
        self.recommended_workers = Gauge(
            "pdctl_recommended_workers",
            "Workers of this role the last capacity recommendation asks for (load and SLOs "
            "with headroom); absent until the first one and on non-leader replicas.",
            ["role"], registry=registry,
        )
        self.capacity_utilisation = Gauge(
            "pdctl_capacity_utilisation",
            "Predicted utilisation (0-1) of this role at the recommended worker count: demand "
            "/ (workers * per-worker capacity within the SLO).",
            ["role"], registry=registry,
        )
        self.capacity_current_workers = Gauge(
            "pdctl_capacity_current_workers",
            "Answering workers of this role when the last recommendation was computed.",
            ["role"], registry=registry,
        )
        self.capacity_extrapolated = Gauge(
            "pdctl_capacity_extrapolated",
            "1 when the last recommendation for this role used the fitted model beyond the "
            "observed load, else 0.",
            ["role"], registry=registry,
        )
        self.last_recommendation = Gauge(
            "pdctl_last_recommendation_timestamp_seconds",
            "Unix time of the last capacity recommendation (0: none yet).", registry=registry,
        )
        self.capacity_plan_failures = Counter(
            "pdctl_capacity_plan_failures",
            "Capacity plans that failed (the cycle goes on without a new recommendation).",
            registry=registry,
        )
        self.observe_failures = Counter(
            "pdctl_observe_failures",
            "Targets that failed a window, by why (unreachable, timeout, stale, no_baseline, "
            "...); source: the whole observation failed (the metrics source down).",
            ["kind"], registry=registry,
        )

    def _create_children(self) -> None:
        """Every bounded label value exists from the first scrape, so ``rate()`` and
        ``absent()`` see it; the canary reads ``idle``."""
        for result in CYCLE_RESULTS:
            self.cycles.labels(result)
        for job in JOBS:
            self.job_duration.labels(job)
            for reason in JOB_SKIP_REASONS:
                self.job_skipped.labels(job, reason)
        for trigger in RECALIBRATION_TRIGGERS:
            self.recalibrations.labels(trigger)
        for decision in GUARDRAIL_DECISIONS:
            self.guardrail_decisions.labels(decision)
        for by in ROLLBACK_DECIDERS:
            self.rollbacks.labels(by)
        for kind in OBSERVE_FAILURE_KINDS:
            self.observe_failures.labels(kind)
        # increase() over a series that appears at 1 misses its first event: drift events
        # exist at 0 so that an alert on repeated drift counts the first one after a restart.
        for detector in DRIFT_DETECTORS:
            self.drift_events.labels(detector)
        self.set_canary_state("idle")

    # The loop.
    def observe_cycle(self, result: str, seconds: float, now: float) -> None:
        """Count one cycle; a successful one also moves the "last success" timestamp."""
        self.cycles.labels(_check("cycle result", result, CYCLE_RESULTS)).inc()
        if result != "skipped":
            self.cycle_duration.observe(seconds)
        if result == "ok":
            self.last_cycle_success.set(now)

    def observe_job(self, job: str, seconds: float) -> None:
        self.job_duration.labels(_check("job", job, JOBS)).observe(seconds)

    def job_skipped_run(self, job: str, reason: str) -> None:
        self.job_skipped.labels(
            _check("job", job, JOBS), _check("skip reason", reason, JOB_SKIP_REASONS)
        ).inc()

    # Rollout.
    def observe_push(self, router: str, result: str, seconds: float) -> None:
        self.pushes.labels(router, _check("push result", result, PUSH_RESULTS)).inc()
        self.push_duration.labels(router).observe(seconds)

    def set_router_versions(self, router: str, desired: int, acked: int) -> None:
        self.router_desired_version.labels(router).set(desired)
        self.router_acked_version.labels(router).set(acked)

    def clear_router_versions(self) -> None:
        """Drop every router's version series: a standalone replica that stopped leading no
        longer reconciles, and its last values (a push in flight: desired above acked)
        would read as a router stuck behind for as long as it runs."""
        self.router_desired_version.clear()
        self.router_acked_version.clear()

    def forget_router(self, router: str) -> None:
        """Drop every series of a router that left the fleet (no-op for unknown routers)."""
        for metric in (self.push_duration, self.router_desired_version, self.router_acked_version):
            with contextlib.suppress(KeyError):
                metric.remove(router)
        for result in PUSH_RESULTS:
            with contextlib.suppress(KeyError):
                self.pushes.remove(router, result)

    def set_canary_state(self, state: str) -> None:
        _check("canary state", state, CANARY_STATES)
        self.canary_state_now = state
        for s in CANARY_STATES:
            self.canary_state.labels(s).set(1 if s == state else 0)

    def no_canary(self) -> None:
        """No canary in the store: a ``baking`` state left by one gone without a verdict of
        its own (a rollback, a pin) reads ``idle``; a verdict's state is kept."""
        if self.canary_state_now == "baking":
            self.set_canary_state("idle")

    # Drift and calibration.
    def set_drift(self, detector: str, feature: str, statistic: float, threshold: float) -> None:
        self.drift_statistic.labels(detector, feature).set(statistic)
        self.drift_threshold.labels(detector, feature).set(threshold)

    def drift_event(self, detector: str) -> None:
        self.drift_events.labels(_check("detector", detector, DRIFT_DETECTORS)).inc()

    def recalibration(self, trigger: Trigger) -> None:
        self.recalibrations.labels(_check("trigger", trigger, RECALIBRATION_TRIGGERS)).inc()

    def guardrail_decision(self, decision: str, reason: str, now: float) -> None:
        """Count a verdict and make it the one ``pdctl_last_decision_info`` series."""
        self.guardrail_decisions.labels(_check("decision", decision, GUARDRAIL_DECISIONS)).inc()
        self.last_decision.clear()
        self.last_decision.labels(decision, reason).set(1)
        self.last_decision_time.set(now)

    def set_predicted_goodput(self, current: float, candidate: float | None = None) -> None:
        self.predicted_goodput.labels("current").set(current)
        if candidate is not None:
            self.predicted_goodput.labels("candidate").set(candidate)

    def policy_changed(self, version: int) -> None:
        self.policy_changes.inc()
        self.desired_version.set(version)

    def rolled_back(self, by: str, to_version: int | None) -> None:
        """A policy was rolled back (``to_version``: what the fleet desires now)."""
        _check("rollback decider", by, ROLLBACK_DECIDERS)
        self.rollbacks.labels(by).inc()
        self.set_canary_state("rolled_back")
        if to_version is not None:
            self.desired_version.set(to_version)

    # Operator and HA state.
    def set_leader(self, leader: bool) -> None:
        self.leader.set(1 if leader else 0)

    def set_paused(self, paused: bool) -> None:
        self.paused.set(1 if paused else 0)

    def set_pinned(self, pinned: bool) -> None:
        self.pinned.set(1 if pinned else 0)

    def set_desired_version(self, version: int | None) -> None:
        """The fleet's version (not a baking canary's), read back from the store."""
        if version is not None:
            self.desired_version.set(version)

    # Capacity planning.
    def set_recommendation(self, role: str, workers: int, utilisation: float,
                           current: int | None, extrapolated: bool) -> None:
        """Export one role of the recommendation (utilisation as the planner computed it)."""
        _check("role", role, ROLES)
        self.recommended_workers.labels(role).set(workers)
        self.capacity_utilisation.labels(role).set(utilisation)
        if current is None:
            with contextlib.suppress(KeyError):
                self.capacity_current_workers.remove(role)
        else:
            self.capacity_current_workers.labels(role).set(current)
        self.capacity_extrapolated.labels(role).set(1 if extrapolated else 0)

    def recommended(self, now: float) -> None:
        self.last_recommendation.set(now)

    def capacity_plan_failed(self) -> None:
        self.capacity_plan_failures.inc()

    def observe_failed(self, kind: str) -> None:
        """One target's failure in a window (``source``: no window at all)."""
        known = kind in OBSERVE_FAILURE_KINDS
        self.observe_failures.labels(kind if known else "other").inc()

    def clear_recommendation(self) -> None:
        """Drop the per-role series (a follower must not feed an autoscaler stale counts)."""
        for metric in (self.recommended_workers, self.capacity_utilisation,
                       self.capacity_current_workers, self.capacity_extrapolated):
            metric.clear()
