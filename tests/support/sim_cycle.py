"""The daemon's :class:`~controller.loop.cycle.Cycle` driven in virtual time inside a
simulated cluster, as the bench's ``adaptive`` policy runs it: the in-process source over the
simulator's registries, the routers' own agents through ``FakeRouterTransport``, the real
learner and a SQLite store. One cycle runs at every controller tick of the scenario."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from controller.daemon import SettingsPlanner
from controller.loop.cycle import Cycle, CycleConfig, run_inline
from controller.loop.learning import CoreLearner
from controller.loop.metrics import ControllerMetrics
from controller.loop.report import CycleReport
from controller.observe.inprocess import InProcessSource, sim_cluster_provider
from controller.policy import Policy
from controller.rollout.reconciler import FakeRouterTransport, Reconciler
from controller.sim.run import run_scenario
from controller.sim.scenario import Scenario
from controller.store import Store


@dataclass
class SimCycleRun:
    """What a run leaves: the store (open: the caller closes it), the routers' agents by id
    and every cycle's report."""

    store: Store
    agents: dict[str, Any]
    reports: list[CycleReport] = field(default_factory=list)


def run_cycle_in_sim(scenario: Scenario, routers_run: Policy, settings: Any, store_url: str,
                     *, starts_s: float = 0.0, planner: bool = True) -> SimCycleRun:
    """Run ``scenario`` with its routers on ``routers_run`` and the daemon's cycle from
    ``starts_s`` on (virtual seconds) on an empty store at ``store_url``; ``planner``: the
    capacity planner of ``settings`` (else none)."""
    loop = asyncio.new_event_loop()
    state: dict[str, Any] = {}

    def tick(t: float, cluster: Any) -> None:
        if t < starts_s:
            return
        if "run" not in state:
            store = Store(store_url, cluster.clock)
            store.upgrade()
            agents = {r.router_id: r.agent for r in cluster.routers}
            state["run"] = SimCycleRun(store, agents)
            state["cycle"] = Cycle(
                clock=cluster.clock,
                source=InProcessSource.following(sim_cluster_provider(cluster), cluster.clock),
                store=store, learner=CoreLearner(settings),
                reconciler=Reconciler(FakeRouterTransport(agents), cluster.clock,
                                      max_attempts=1),
                metrics=ControllerMetrics(CollectorRegistry()), routers=list(agents),
                config=CycleConfig.from_settings(settings), run_blocking=run_inline,
                planner=SettingsPlanner(settings) if planner else None)
        state["run"].reports.append(loop.run_until_complete(state["cycle"].run_once()))

    try:
        run_scenario(scenario, routers_run, controller=tick)
    finally:
        loop.close()
    run: SimCycleRun = state["run"]
    return run
