"""The ``adaptive`` policy: pd-controller's own control cycle inside the simulator.

Not an imitation: :class:`controller.loop.cycle.Cycle` (the code ``pdctl run`` schedules) runs
every control interval of virtual time with an :class:`InProcessSource` over the simulated
workers' and routers' registries (the same parser and window builder as a scrape), the real
learner (:class:`controller.loop.learning.CoreLearner`: drift detectors, calibration, guardrail),
a :class:`Reconciler` pushing through :class:`FakeRouterTransport` to the simulated routers'
own agents, and a SQLite store in a temporary file. It starts from the ``ppd-static`` table,
stored as approved version 1 and desired by every router, with the controller's configured
overrides (``[ppd] first_turn_busy_waiting`` and ``later_turn_busy_waiting``): an operator
deploying pd-controller runs them from the start, and its later policies carry them too
(:func:`adaptive_start`). Beside
it the store holds what ``pdctl calibrate-active`` records with a first table: its
calibration, with the drift reference of the grid it was calibrated on.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from controller.policy import Policy, dumps, loads


def adaptive_start(table: Policy, settings: Any) -> Policy:
    """``table`` (the ``ppd-static`` policy) with the overrides ``settings`` configure."""
    from controller.loop.learning import calibration_config

    return replace(table, overrides=calibration_config(settings).overrides)


def fleet_changes(store: Any) -> tuple[list[tuple[float, Policy]], list[tuple[float, Policy]]]:
    """From a run's store: every policy that reached the fleet (approval time, policy), and
    each promotion the post-promotion watch rolled back (its time, the policy restored)."""
    rolled_back = store.policies(status="rolled_back")
    undone = {p.version: p.updated_at.timestamp() for p in rolled_back
              if p.promoted_at is not None}
    reached = sorted([*store.policies(status="approved"),
                      *(p for p in rolled_back if p.version in undone)],
                     key=lambda p: p.version)
    bodies = {p.version: loads(p.body_json) for p in reached}
    rollbacks = []
    for version, at in sorted(undone.items(), key=lambda item: item[1]):
        # What the watch restored: the newest older policy still approved then.
        restored = max(v for v in bodies if v < version and undone.get(v, math.inf) > at)
        rollbacks.append((at, bodies[restored]))
    return [(p.created_at.timestamp(), bodies[p.version]) for p in reached], rollbacks


@dataclass
class AdaptiveOutcome:
    """What the cycle did over a run (read back from its store)."""

    # Every policy that reached the fleet (virtual s of its approval, policy), a promotion the
    # post-promotion watch rolled back included.
    approvals: list[tuple[float, Policy]] = field(default_factory=list)
    # Those rollbacks (virtual s, the policy restored): fleet changes too.
    rollbacks: list[tuple[float, Policy]] = field(default_factory=list)
    # Approved canaries a refit replaced before they reached the fleet (virtual s): not
    # policy changes (the fleet never ran them), reported beside them.
    superseded: list[float] = field(default_factory=list)
    cycles: int = 0
    failed_cycles: list[str] = field(default_factory=list)
    windows: int = 0
    drift_events: list[tuple[float, str]] = field(default_factory=list)
    scaling_calibrations: list[float] = field(default_factory=list)  # virtual s
    calibrations: int = 0
    pushes: int = 0
    store_url: str = ""

    @property
    def reactions(self) -> list[float]:
        """When the loop noticed a change: every drift event and scaling calibration."""
        return sorted([t for t, _ in self.drift_events] + self.scaling_calibrations)


class AdaptiveController:
    """A ``run_scenario(controller=...)`` hook running one :class:`Cycle` per interval."""

    def __init__(self, initial: Policy, settings: Any, db_path: Path,
                 drift_reference: Mapping[str, Any] | None = None) -> None:
        self.initial = initial
        self.drift_reference = drift_reference
        self.settings = settings
        self.db_path = db_path
        self._loop = asyncio.new_event_loop()
        self._cycle: Any = None
        self._store: Any = None
        self.reports: list[Any] = []

    def _start(self, cluster: Any) -> None:
        from prometheus_client import CollectorRegistry

        from controller.loop.cycle import Cycle, CycleConfig, run_inline
        from controller.loop.learning import CoreLearner
        from controller.loop.metrics import ControllerMetrics
        from controller.observe.inprocess import InProcessSource, sim_cluster_provider
        from controller.rollout.reconciler import FakeRouterTransport, Reconciler
        from controller.store import Store

        store = Store(f"sqlite:///{self.db_path}", cluster.clock)
        store.upgrade()
        agents = {r.router_id: r.agent for r in cluster.routers}
        with store.cycle() as tx:
            tx.add_policy(self.initial.version, self.initial.checksum, dumps(self.initial),
                          "approved", "ppd-static: the bench's starting table")
            if self.drift_reference is not None:
                # What `pdctl calibrate-active` records with the first table: the cycle
                # restores its drift reference, so live traffic is measured against the grid.
                tx.add_calibration([], {}, None, None, self.initial.version,
                                   {"trigger": "active", "approved": True,
                                    "drift_reference": dict(self.drift_reference)})
            for router_id in agents:
                tx.set_desired(router_id, self.initial.version)
        self._store = store
        self._cycle = Cycle(
            clock=cluster.clock,
            source=InProcessSource.following(sim_cluster_provider(cluster), cluster.clock),
            store=store, learner=CoreLearner(self.settings),
            reconciler=Reconciler(FakeRouterTransport(agents), cluster.clock, max_attempts=1),
            metrics=ControllerMetrics(CollectorRegistry()), routers=list(agents),
            config=CycleConfig.from_settings(self.settings), run_blocking=run_inline,
        )

    @property
    def store(self) -> Any:
        """The run's store (None before the first cycle; closed by :meth:`finish`)."""
        return self._store

    def setup(self, cluster: Any) -> None:
        """``run_scenario(setup=...)``: store and cycle exist before the first request."""
        self._start(cluster)

    def __call__(self, now: float, cluster: Any) -> None:
        if self._cycle is None:
            self._start(cluster)
        self.reports.append(self._loop.run_until_complete(self._cycle.run_once()))

    def finish(self) -> AdaptiveOutcome:
        """Read the run's history back from the store, then close it."""
        self._loop.close()
        out = AdaptiveOutcome(cycles=len(self.reports),
                              failed_cycles=[r.reason for r in self.reports
                                             if r.result == "failed"])
        store = self._store
        if store is None:
            return out
        out.store_url = f"sqlite:///{self.db_path}"
        out.approvals, out.rollbacks = fleet_changes(store)
        out.superseded = sorted(p.created_at.timestamp()
                                for p in store.policies(status="superseded"))
        out.windows = len(store.windows())
        out.drift_events = [(e.at.timestamp(), e.kind) for e in store.drift_events()]
        calibrations = store.calibrations()
        out.calibrations = len(calibrations)
        out.scaling_calibrations = sorted(
            c.created_at.timestamp() for c in calibrations
            if (c.details or {}).get("trigger") == "scaling")
        out.pushes = len(store.pushes())
        store.close()
        return out
