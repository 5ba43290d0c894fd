"""Small fakes for the cycle: a source whose goodput follows each router's running policy,
and a learner whose drift and verdicts the test scripts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

from prometheus_client import CollectorRegistry

from controller.clock import VirtualClock
from controller.core.rollout import JudgeParams
from controller.core.trigger import Cause, Trigger
from controller.core.window import (
    FailureKind,
    RouteOutcome,
    TargetFailure,
    Window,
    WorkerStats,
    Workload,
)
from controller.loop.cycle import Cycle, CycleConfig
from controller.loop.export import CapacityPlanner
from controller.loop.learning import (
    CalibrationOutcome,
    DriftFinding,
    LearnerState,
    renews_reference,
)
from controller.loop.metrics import ControllerMetrics
from controller.loop.report import CycleReport
from controller.observe.source import Target
from controller.policy import Policy, Provenance, Route
from controller.rollout.agent import RouterAgent
from controller.rollout.reconciler import FakeRouterTransport, Reconciler
from controller.store import Store


class ObserveFailed(Exception):
    pass


class PolicyAwareSource:
    """Each router serves ``requests`` per window; the share meeting the SLOs is
    ``goodput[v]`` for the policy version ``v`` the router's agent runs (``default`` else).
    ``fail_next`` makes the next window raise; ``down`` lists targets reported failed.
    ``unprimed``: the next window only sets the counters' baseline, as a snapshot source's
    first read (after a start, or ``forget_baselines``): every target ``no_baseline``, no
    requests (tests/observe/test_contract.py holds the real sources to it)."""

    name = "fake"

    def __init__(self, agents: Mapping[str, RouterAgent], requests: float = 200.0,
                 default: float = 0.9) -> None:
        self.agents = agents
        self.requests = requests
        self.default = default
        self.goodput: dict[int, float] = {}
        self.fail_next = False
        self.down: set[str] = set()
        self.unprimed = False
        self.calls = 0
        self.workers = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}

    def targets(self) -> Sequence[Target]:
        return [Target(name=r, role="router") for r in self.agents]

    async def window(self, start: float, end: float) -> Window:
        self.calls += 1
        if self.fail_next:
            self.fail_next = False
            raise ObserveFailed("scripted observe failure")
        if self.unprimed:
            self.unprimed = False
            names = sorted({*self.agents, *self.workers} - self.down)
            return Window.build(
                start, end, max(end - start, 1.0), answered=names,
                workers=[WorkerStats(n, r, "vllm")  # type: ignore[arg-type]
                         for n, r in sorted(self.workers.items()) if n not in self.down],
                failures=[TargetFailure(n, FailureKind.NO_BASELINE, "first window") for n in names]
                + [TargetFailure(t, FailureKind.UNREACHABLE, "scripted")
                   for t in sorted(self.down)],
                source="fake")
        outcomes = []
        for name, agent in sorted(self.agents.items()):
            if name in self.down:
                continue
            snap = agent.snapshot
            share = self.goodput.get(snap.version, self.default) if snap else self.default
            outcomes.append(RouteOutcome(name, Route.PREFILL_NODE, 0, 0, self.requests,
                                         round(share * self.requests), 1.0, 1.0, 1.0, 1.0))
        failures = [TargetFailure(t, FailureKind.UNREACHABLE, "scripted")
                    for t in sorted(self.down)]
        workers = [WorkerStats(name, role, "vllm")  # type: ignore[arg-type]
                   for name, role in sorted(self.workers.items()) if name not in self.down]
        return Window.build(start, end, max(end - start, 1.0), workers=workers,
                            outcomes=outcomes,
                            workload=Workload(qps_by_router={n: 1.0 for n in self.agents}),
                            answered=[n for n in self.agents if n not in self.down],
                            failures=failures, source="fake")

    def forget_baselines(self) -> None:
        self.unprimed = True

    async def aclose(self) -> None:
        return None


@dataclass
class ScriptedLearner:
    """``fire`` makes the next assessed window fire a workload drift; ``approve`` and
    ``route`` shape the next candidate; ``fail`` makes calibrate raise. A canary's refit
    (its reason names the refit) is approved only with ``approve_refit``: by default the
    refit finds nothing better than the candidate it refits."""

    fire: bool = False
    measured: bool = False  # the next fire is led by the KV link (DriftFinding.measured)
    approve: bool = True
    approve_refit: bool = False
    route: Route = Route.DECODE_LOCAL
    exploration: float = 0.05
    fail: bool = False
    calibrations: int = 0
    trained_on: list[int] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    adopted: list[bool] = field(default_factory=list)  # each adopted outcome's verdict
    # The next refusals were judged on the windows since a change alone (see CoreLearner).
    regime_only: bool = False
    restored: list[object] = field(default_factory=list)  # the calibration each restore read
    judged_against: list[int | None] = field(default_factory=list)  # each current's version

    def assess(self, state: LearnerState, window: Window, now: float
               ) -> tuple[LearnerState, list[DriftFinding]]:
        fired, self.fire = self.fire, False
        measured, self.measured = fired and self.measured, False
        return state, [DriftFinding("workload", fired, 2.0 if fired else 0.5, 1.0,
                                    "scripted", {"n": len(window.outcomes),
                                                 "qps": {"log_ratio": 0.6 if fired else 0.15,
                                                         "threshold": 0.3}},
                                    measured=measured)]

    def calibrate(self, windows: Sequence[Window], current: Policy | None, now: float,
                  reason: Cause | str, force: bool = False) -> CalibrationOutcome:
        from controller.loop.learning import LearnerError

        refit = isinstance(reason, Cause) and reason.trigger is Trigger.CANARY
        text = str(reason)
        if self.fail:
            raise LearnerError("scripted fit failure")
        self.calibrations += 1
        self.trained_on.append(len(windows))
        self.reasons.append(text)
        self.judged_against.append(current.version if current else None)
        version = (current.version + 1) if current else 1
        # Like the real learner, the candidate's provenance keeps the reason it was fitted for.
        policy = Policy.uniform(version, self.route, exploration=self.exploration,
                                provenance=Provenance(reason=text))
        approve = self.approve_refit if refit else self.approve
        ok = approve or force
        # Like the real learner, the details keep the unforced verdict.
        return CalibrationOutcome(policy, ok, "approved: scripted" if ok else "rejected: scripted",
                                  0.95, 0.9 if current else None, {"mape": 0.1},
                                  {"scripted": True, "approved": approve,
                                   "regime_only": self.regime_only,
                                   "calibration": self.calibrations},
                                  reference=f"calibration {self.calibrations}")

    def adopt(self, state: LearnerState, outcome: CalibrationOutcome, now: float
              ) -> LearnerState:
        self.adopted.append(outcome.approved)
        if not renews_reference(outcome) and state.reference is not None:
            return state  # like CoreLearner: a refused candidate is not the new reference
        return LearnerState(reference=outcome.reference)

    def restore(self, details: Mapping[str, object] | None) -> LearnerState:
        self.restored.append(details.get("calibration") if details else None)
        return LearnerState(reference="restored" if details else None)


@dataclass
class Rig:
    clock: VirtualClock
    store: Store
    agents: dict[str, RouterAgent]
    transport: FakeRouterTransport
    source: PolicyAwareSource
    learner: ScriptedLearner
    config: CycleConfig
    registry: CollectorRegistry
    cycle: Cycle
    planner: CapacityPlanner | None = None

    def new_cycle(self) -> Cycle:
        """A fresh Cycle (a restarted daemon) on the same store, routers and clock. Its
        source's first read only sets the counters' baseline, as a new process's does (a
        rig that never read yet is primed, as the tests' first windows assume)."""
        self.registry = CollectorRegistry()
        self.source.unprimed = self.source.calls > 0
        self.cycle = make_cycle(self)
        return self.cycle

    async def step(self) -> CycleReport:
        self.clock.advance(self.config.interval_s)
        return await self.cycle.run_once()

    def applies(self) -> int:
        return sum(1 for kind, _ in self.transport.calls if kind == "apply")


def make_cycle(rig: Rig) -> Cycle:
    reconciler = Reconciler(rig.transport, rig.clock, max_attempts=1)
    return Cycle(clock=rig.clock, source=rig.source, store=rig.store, learner=rig.learner,
                 reconciler=reconciler, metrics=ControllerMetrics(rig.registry),
                 routers=list(rig.agents), config=rig.config, planner=rig.planner)


def cycle_config(**settings: object) -> CycleConfig:
    """A :class:`CycleConfig` from flat keywords, the canary judge's among them (as in
    ``[controller]``)."""
    judged = {f.name for f in fields(JudgeParams)}
    judge = JudgeParams(**{k: v for k, v in settings.items() if k in judged})  # type: ignore[arg-type]
    return CycleConfig(judge=judge, **{k: v for k, v in settings.items()  # type: ignore[arg-type]
                                       if k not in judged})


def make_rig(tmp_path: Path, routers: int = 4, **config: object) -> Rig:
    clock = VirtualClock(1_800_000_000.0)
    store = Store(f"sqlite:///{tmp_path / 'history.db'}", clock)
    store.upgrade()
    agents = {f"r{i}": RouterAgent(router_id=f"r{i}", clock=clock) for i in range(routers)}
    transport = FakeRouterTransport(agents)
    defaults: dict[str, object] = dict(
        interval_s=30.0, calibrate_every_s=None, min_training_windows=2,
        min_policy_interval_s=0.0, bake_windows=2, bake_min_requests=100.0,
        max_bake_windows=6,
    )
    defaults.update(config)
    cfg = cycle_config(**defaults)
    rig = Rig(clock, store, agents, transport, PolicyAwareSource(agents), ScriptedLearner(),
              cfg, CollectorRegistry(), None)  # type: ignore[arg-type]
    rig.cycle = make_cycle(rig)
    return rig
