"""Virtual-time runs: a scenario, a policy, one process, per-request records.

Turn 1 of a session arrives at its (warped) start time; every later turn arrives ``think_s``
after the previous turn of the session completes (closed loop). Sessions start until
``duration_s``; their later turns still run, up to ``drain_limit_s`` after ``duration_s``
(requests unfinished by then, and the turns their sessions had left, are counted as
rejected, reason ``unfinished``). A rejected turn
ends its session: the turns it would have led to are counted as rejected too
(``session_aborted``), so every request of the workload is accounted for.

Events: ``rate_scale`` warps the start times of sessions after it (the rate becomes
``factor`` x the base rate; gaps inside a session are kept), ``link_bandwidth`` sets every
KV link to ``factor`` x its initial bandwidth, ``add_worker`` / ``remove_worker`` change the
pools (a removed worker's requests are retried elsewhere; its sessions lose their KV), and
``workload`` switches to another source whose sessions start from the event time on.
"""

from __future__ import annotations

import itertools
import random
from bisect import bisect_right
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from controller.clock import VirtualClock, WallClock
from controller.policy import Policy
from controller.sim.cluster import SimCluster, SimRequest
from controller.sim.scenario import Event, Scenario
from controller.sim.workloads.base import SessionSpec, Workload, WorkloadConfig, build_workload
from controller.sim.workloads.compose import WorkloadSwitch, apply_events

PolicySource = Policy | Callable[[int], Policy] | None


@dataclass(frozen=True, slots=True)
class RequestRecord:
    session: str
    turn: int
    arrival_s: float
    prompt_tokens: int
    new_tokens: int
    output_tokens: int
    max_tokens: int
    route: str
    reason: str
    context_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    finish_s: float | None
    kv_bytes: int
    rejected: bool
    reject_reason: str
    prefill_worker: str | None
    decode_worker: str | None
    retries: int
    phase: int


@dataclass(slots=True)
class RunResult:
    scenario: str
    policy: str
    records: list[RequestRecord]
    phases: list[tuple[float, float]]
    ttft_slo_s: float
    tpot_slo_s: float
    wall_s: float
    events: int
    sim_end_s: float
    cluster: SimCluster = field(repr=False)


def session_feed(scenario: Scenario, rng: random.Random,
                  workload: Workload | None = None) -> Iterator[tuple[float, SessionSpec]]:
    """(sim start time, session) in start order, with rate-scale events and workload
    switches applied (``controller.sim.workloads.compose``). ``workload``, when given, is
    the traffic instead of the scenario's, and the events apply to it alike."""
    factors = [e.factor for e in scenario.events if e.kind == "rate_scale"]
    horizon = scenario.duration_s * max([1.0, *factors])

    def build(cfg: WorkloadConfig) -> Workload:
        if cfg.source == "synthetic" and "duration_s" not in cfg.params:
            # synthetic sessions start over the whole run (in the workload's own time)
            cfg = replace(cfg, params={**cfg.params, "duration_s": horizon})
        return build_workload(cfg)

    feed = apply_events(
        workload if workload is not None else build(scenario.workload),
        rate_changes=[(e.at_s, e.factor) for e in scenario.events if e.kind == "rate_scale"],
        switches=[WorkloadSwitch(e.at_s, build(e.workload)) for e in scenario.events
                  if e.kind == "workload" and e.workload is not None],
    )
    for spec in feed.sessions(rng):
        if spec.start_s >= scenario.duration_s:
            break
        yield spec.start_s, spec


class ScenarioDriver:
    """Feeds a scenario's sessions and events into a cluster's event loop (virtual or live)."""

    def __init__(self, scenario: Scenario, cluster: SimCluster, *,
                 traffic: bool = True,
                 workload: Workload | None = None) -> None:
        self.scenario = scenario
        self.cluster = cluster
        self.traffic = traffic
        self.requests: list[SimRequest] = []
        self._rid = itertools.count()
        self._pending: dict[str, tuple[SessionSpec, int]] = {}
        self._feed = session_feed(scenario, random.Random(scenario.seed), workload)

    def next_rid(self) -> int:
        return next(self._rid)

    def install(self) -> None:
        loop = self.cluster.loop
        for ev in self.scenario.events:
            loop.at(ev.at_s, self._apply_event, ev)
        if self.traffic:
            self._start_next()

    def _issue(self, spec: SessionSpec, index: int) -> None:
        turn = spec.turns[index]
        req = SimRequest(self.next_rid(), spec.session_id, turn.turn, self.cluster.loop.now,
                         turn.prompt_tokens, turn.new_tokens, turn.output_tokens,
                         turn.max_tokens, on_complete=self._completed)
        self._pending[spec.session_id] = (spec, index)
        self.requests.append(req)
        self.cluster.submit(req)

    def _completed(self, req: SimRequest) -> None:
        spec, index = self._pending[req.session]
        loop = self.cluster.loop
        if index + 1 >= len(spec.turns):
            del self._pending[req.session]
            return
        if req.rejected:
            del self._pending[req.session]
            for turn in spec.turns[index + 1:]:
                self.requests.append(SimRequest(
                    self.next_rid(), spec.session_id, turn.turn, loop.now, turn.prompt_tokens,
                    turn.new_tokens, turn.output_tokens, turn.max_tokens, rejected=True,
                    reject_reason="session_aborted"))
            return
        nxt = spec.turns[index + 1]
        loop.at(loop.now + nxt.think_s, self._issue, spec, index + 1)

    def close_out(self) -> None:
        """At the run's horizon: the turns of sessions still open (a turn in flight, or the
        next one not issued yet) are counted as rejected, ``unfinished``, so the workload's
        request count does not depend on the policy: one that leaves more sessions open is
        not scored on fewer requests."""
        now = self.cluster.loop.now
        for spec, index in self._pending.values():
            for turn in spec.turns[index + 1:]:
                self.requests.append(SimRequest(
                    self.next_rid(), spec.session_id, turn.turn, now, turn.prompt_tokens,
                    turn.new_tokens, turn.output_tokens, turn.max_tokens, rejected=True,
                    reject_reason="unfinished"))
        self._pending.clear()

    def _start_next(self) -> None:
        item = next(self._feed, None)
        if item is not None:
            self.cluster.loop.at(item[0], self._start_session, item[1])

    def _start_session(self, spec: SessionSpec) -> None:
        self._issue(spec, 0)
        self._start_next()

    def _apply_event(self, ev: Event) -> None:
        cluster = self.cluster
        if ev.kind == "link_bandwidth":
            cluster.set_link_factor(ev.factor)
        elif ev.kind == "add_worker":
            for _ in range(ev.count):
                cluster.add_worker(ev.role)  # type: ignore[arg-type]
        elif ev.kind == "remove_worker":
            for _ in range(ev.count):
                cluster.remove_worker(ev.role)  # type: ignore[arg-type]
        # rate_scale and workload act through the session feed


def run_scenario(
    scenario: Scenario,
    policy: PolicySource,
    *,
    policy_key: str = "",
    closed_form: bool = True,
    controller: Callable[[float, SimCluster], None] | None = None,
    progress: Callable[[float], None] | None = None,
    drain_limit_s: float = 3600.0,
    max_events: int = 200_000_000,
    setup: Callable[[SimCluster], None] | None = None,
    workload: Workload | None = None,
) -> RunResult:
    """Replay ``scenario`` under ``policy`` (one for all routers, or a factory by router
    index). ``controller(t, cluster)`` runs every ``[controller] interval_s`` of virtual time
    (a closed-loop test swaps policies there through ``cluster.routers[i].agent.apply``).
    ``setup(cluster)`` runs once before any traffic (e.g. to install a router ``decider``).
    ``workload`` replaces the scenario's traffic (e.g. an active calibration's grid)."""
    wall = WallClock()  # wall time of the run itself, for speed reports only
    wall0 = wall.perf_counter_ns()
    cfg = scenario.cluster
    cluster = SimCluster(
        type(cfg)(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__},
                     "closed_form_runs": closed_form}),
        scenario.profile, policy, clock=VirtualClock(start=0.0), seed=scenario.seed,
    )
    if setup is not None:
        setup(cluster)
    loop = cluster.loop
    phases = scenario.phase_bounds()
    phase_starts = [a for a, _ in phases]
    driver = ScenarioDriver(scenario, cluster, workload=workload)
    requests = driver.requests
    if controller is not None:
        def tick() -> None:
            controller(loop.now, cluster)
            nxt = loop.now + scenario.interval_s
            if nxt <= scenario.duration_s or cluster.busy():
                loop.at(nxt, tick)
        loop.at(scenario.interval_s, tick)
    if progress is not None:
        step = scenario.duration_s / 100.0

        def report() -> None:
            progress(loop.now)
            if loop.now + step <= scenario.duration_s:
                loop.at(loop.now + step, report)
        loop.at(0.0, report)
    driver.install()
    horizon = scenario.duration_s + drain_limit_s
    if not loop.run(horizon, max_events):
        raise RuntimeError(f"run exceeded max_events={max_events} at t={loop.now:.3f}s")
    driver.close_out()
    records = []
    for r in requests:
        if not r.rejected and r.finish is None:
            r.rejected = True
            r.reject_reason = "unfinished"
        records.append(RequestRecord(
            session=r.session, turn=r.turn, arrival_s=r.arrival, prompt_tokens=r.prompt,
            new_tokens=r.new_tokens, output_tokens=r.output_tokens, max_tokens=r.max_tokens,
            route=r.route.name if r.route is not None else "", reason=r.reason,
            context_tokens=r.context_tokens,
            ttft_s=r.ttft if not r.rejected else None,
            tpot_s=r.tpot if not r.rejected else None,
            finish_s=r.finish, kv_bytes=r.kv_bytes, rejected=r.rejected,
            reject_reason=r.reject_reason, prefill_worker=r.prefill_worker,
            decode_worker=r.decode_worker, retries=r.retries,
            phase=max(0, bisect_right(phase_starts, r.arrival) - 1),
        ))
    if progress is not None:
        progress(scenario.duration_s)
    return RunResult(
        scenario=scenario.name, policy=policy_key, records=records, phases=phases,
        ttft_slo_s=scenario.ttft_slo_s, tpot_slo_s=scenario.tpot_slo_s,
        wall_s=(wall.perf_counter_ns() - wall0) / 1e9, events=loop.processed, sim_end_s=loop.now,
        cluster=cluster,
    )
