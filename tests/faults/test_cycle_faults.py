"""Controller-side faults through the real control cycle (``Cycle.run_once``) against real
gRPC routers on 127.0.0.1 and a real SQLite store:

* the store restored from an older backup while the routers run a newer version: the
  desired policy is re-issued above every router's version, never under a used number;
* the controller stopped in the middle of a push (its cycle task cancelled, then a fresh
  Cycle on the same store — a restart): every router converges, nothing recorded is lost;
* the wall clock jumping back an hour and forward a day between cycles (the monotonic
  clock running on): every cycle completes, every window is stored, versions stay unique
  and consecutive, and every router ends on the desired version;
* PostgreSQL dropping the cycle's connection inside its write transaction (as a server
  restart does): the cycle fails with the reason, writes nothing, and the next one commits.

(The daemon-process versions — SIGKILL of ``pdctl run``, two replicas at once — are in
``tests/daemon/``.)
"""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from controller.clock import VirtualClock
from controller.loop.cycle import AlwaysLeader, Cycle
from controller.loop.metrics import ControllerMetrics
from controller.policy import Policy, Route, dumps
from controller.rollout.agent import RouterAgent
from controller.rollout.client import GrpcRouterTransport
from controller.rollout.reconciler import FakeRouterTransport, Reconciler
from controller.store import Store
from controller.store.repository import Tx
from tests.daemon.fakes import PolicyAwareSource, ScriptedLearner, cycle_config
from tests.faults.harness import Routers, SlowAgent
from tests.support.postgres import admin_execute

P1 = Policy.uniform(1, Route.PREFILL_NODE)
P2 = Policy.uniform(2, Route.DECODE_LOCAL, exploration=0.05)


def make_cycle(store: Store, clock: VirtualClock, routers: Routers,
               transport: GrpcRouterTransport) -> Cycle:
    reconciler = Reconciler(transport, clock, deadline_s=5.0, max_attempts=3,
                            backoff_initial_s=0.0, backoff_max_s=0.0)
    agents = {a: routers.agent(a) for a in routers.addresses}
    # No calibration of its own: the test approves the versions (as an operator would).
    config = cycle_config(interval_s=30.0, calibrate_every_s=None, min_training_windows=10_000,
                         min_policy_interval_s=0.0)
    return Cycle(clock=clock, source=PolicyAwareSource(agents), store=store,
                 learner=ScriptedLearner(), reconciler=reconciler,
                 metrics=ControllerMetrics(CollectorRegistry()), routers=routers.addresses,
                 config=config)


def approve(store: Store, policy: Policy, routers: list[str]) -> None:
    with store.cycle() as tx:
        tx.add_policy(policy.version, policy.checksum, dumps(policy), "approved", "test")
        for r in routers:
            tx.set_desired(r, policy.version)


def restore(backup: Path, db: Path) -> None:
    shutil.copyfile(backup, db)
    for suffix in ("-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)


def records(store: Store) -> dict[str, Any]:
    return {
        "policies": [(p.version, p.checksum, p.status) for p in store.policies()],
        "windows": [sw.id for sw in store.windows()],
        "pushes": [(p.id, p.router_id, p.version, p.result) for p in store.pushes()],
    }


async def test_store_restored_from_an_older_backup_reissues_above_the_routers(
    tmp_path: Path,
) -> None:
    db, backup = tmp_path / "history.db", tmp_path / "backup.db"
    clock = VirtualClock(1_800_000_000.0)
    routers = Routers(tmp_path, 3)
    await routers.start()
    transport = GrpcRouterTransport(reconnect_backoff_max_s=0.2)
    try:
        store = Store(f"sqlite:///{db}", clock)
        store.upgrade()
        approve(store, P1, routers.addresses)
        clock.advance(30)
        assert (await make_cycle(store, clock, routers, transport).run_once()).result == "ok"
        src, dst = sqlite3.connect(db), sqlite3.connect(backup)
        try:
            src.backup(dst)  # the nightly backup: v1 desired everywhere
        finally:
            src.close()
            dst.close()

        approve(store, P2, routers.addresses)
        clock.advance(30)
        assert (await make_cycle(store, clock, routers, transport).run_once()).result == "ok"
        assert set(routers.versions().values()) == {2}
        store.close()

        restore(backup, db)  # the store never heard of v2
        store = Store(f"sqlite:///{db}", clock)
        before = records(store)
        assert [p[0] for p in before["policies"]] == [1]

        clock.advance(30)
        report = await make_cycle(store, clock, routers, transport).run_once()  # a restart
        assert report.result == "ok", report.reason
        after = records(store)
        # v1's content, re-issued as v3: above the v2 the routers ran, never reusing "2".
        assert [(v, c) for v, c, _ in after["policies"]] == [(1, P1.checksum), (3, P1.checksum)]
        assert store.desired_versions() == dict.fromkeys(routers.addresses, 3)
        assert set(routers.versions().values()) == {3}
        assert {routers.agent(a).checksum for a in routers.addresses} == {P1.checksum}
        assert {(r.acked_version, r.acked_checksum) for r in store.routers()} == {
            (3, P1.checksum)
        }
        assert store.next_version() == 4
        # Nothing the restored store held was lost.
        assert after["windows"][: len(before["windows"])] == before["windows"]
        assert after["pushes"][: len(before["pushes"])] == before["pushes"]
        store.close()
    finally:
        await transport.close()
        await routers.close()


async def test_controller_stopped_mid_push_and_restarted_converges(tmp_path: Path) -> None:
    clock = VirtualClock(1_800_000_000.0)
    routers = Routers(tmp_path, 4, agent_factory=SlowAgent)
    await routers.start()
    transport = GrpcRouterTransport(reconnect_backoff_max_s=0.2)
    store = Store(f"sqlite:///{tmp_path / 'history.db'}", clock)
    store.upgrade()
    try:
        approve(store, P1, routers.addresses)
        clock.advance(30)
        assert (await make_cycle(store, clock, routers, transport).run_once()).result == "ok"
        before = records(store)

        approve(store, P2, routers.addresses)
        slow = routers.agent(routers.addresses[1])
        assert isinstance(slow, SlowAgent)
        slow.slow_applies, slow.delay_s = 1, 10.0
        clock.advance(30)
        doomed = asyncio.create_task(make_cycle(store, clock, routers, transport).run_once())
        assert await asyncio.to_thread(slow.entered.wait, 10)
        doomed.cancel()  # the controller dies with a push in flight
        await asyncio.gather(doomed, return_exceptions=True)
        slow.release.set()

        clock.advance(30)
        report = await make_cycle(store, clock, routers, transport).run_once()  # restarted
        assert report.result == "ok", report.reason
        assert set(routers.versions().values()) == {2}
        assert {(r.acked_version, r.acked_checksum) for r in store.routers()} == {
            (2, P2.checksum)
        }
        after = records(store)
        assert [(v, c) for v, c, _ in after["policies"]] == [(1, P1.checksum), (2, P2.checksum)]
        for key in ("windows", "pushes"):  # everything recorded before is still there
            assert after[key][: len(before[key])] == before[key]
        assert store.next_version() == 3  # no version skipped or reused
    finally:
        store.close()
        await transport.close()
        await routers.close()


class ConnectionKillingLeader(AlwaysLeader):
    """Leads; when ``kill_next`` is set, its fence check (run inside the cycle's write
    transaction) has PostgreSQL terminate that very connection before the writes."""

    def __init__(self, app: str) -> None:
        super().__init__()
        self.app = app
        self.kill_next = False

    def fence(self, tx: Tx) -> bool:
        if self.kill_next:
            self.kill_next = False
            tx.desired_versions()  # the transaction is open on the server now
            admin_execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                f"WHERE application_name = '{self.app}' AND state LIKE 'idle in transaction%'"
            )
        return True


async def test_postgres_connection_lost_inside_the_cycle_writes_nothing_and_recovers(
    pg_url: tuple[str, str],
) -> None:
    url, app = pg_url
    clock = VirtualClock(1_800_000_000.0)
    store = Store(url, clock)
    store.upgrade()
    agents = {f"r{i}": RouterAgent(router_id=f"r{i}", clock=clock) for i in range(3)}
    leader = ConnectionKillingLeader(app)
    config = cycle_config(interval_s=30.0, calibrate_every_s=None, min_training_windows=10_000,
                         min_policy_interval_s=0.0)
    cycle = Cycle(clock=clock, source=PolicyAwareSource(agents), store=store,
                  learner=ScriptedLearner(), reconciler=Reconciler(FakeRouterTransport(agents),
                                                                   clock, max_attempts=1),
                  metrics=ControllerMetrics(CollectorRegistry()), routers=list(agents),
                  config=config, leadership=leader)
    try:
        approve(store, P1, list(agents))
        clock.advance(30)
        assert (await cycle.run_once()).result == "ok"
        before = records(store)
        assert len(before["windows"]) == 1

        leader.kill_next = True
        clock.advance(30)
        failed = await cycle.run_once()
        assert failed.result == "failed" and "StoreUnavailable" in failed.reason
        assert records(store) == before  # not half a cycle: no window, no drift, no acks

        clock.advance(30)
        assert (await cycle.run_once()).result == "ok"  # a fresh connection, no restart
        after = records(store)
        assert len(after["windows"]) == 2
        assert after["windows"][:1] == before["windows"]
        assert {a.snapshot.version for a in agents.values() if a.snapshot} == {1}
    finally:
        store.close()


class JumpingWallClock(VirtualClock):
    """Virtual time whose wall-clock reading (``now``/``utcnow``) can be stepped either way
    by ``offset``, as NTP or an operator steps a real clock; ``monotonic`` never jumps."""

    def __init__(self, start: float) -> None:
        super().__init__(start)
        self.offset = 0.0

    def now(self) -> float:
        return super().now() + self.offset

    def utcnow(self) -> datetime:
        return datetime.fromtimestamp(self.now(), tz=UTC)


def _cycle_on_a_jumping_clock(
    tmp_path: Path, routers: int, min_policy_interval_s: float
) -> tuple[JumpingWallClock, Store, dict[str, RouterAgent], ScriptedLearner, Cycle]:
    """A real cycle (SQLite store, in-process agents, scripted learner) whose wall clock the
    test steps back and forth."""
    clock = JumpingWallClock(1_800_000_000.0)
    store = Store(f"sqlite:///{tmp_path / 'history.db'}", clock)
    store.upgrade()
    agents = {f"r{i}": RouterAgent(router_id=f"r{i}", clock=clock) for i in range(routers)}
    learner = ScriptedLearner()
    config = cycle_config(interval_s=30.0, calibrate_every_s=None, min_training_windows=2,
                         min_policy_interval_s=min_policy_interval_s, bake_windows=2,
                         bake_min_requests=100.0, max_bake_windows=6)
    cycle = Cycle(clock=clock, source=PolicyAwareSource(agents), store=store, learner=learner,
                  reconciler=Reconciler(FakeRouterTransport(agents), clock, max_attempts=1),
                  metrics=ControllerMetrics(CollectorRegistry()), routers=list(agents),
                  config=config)
    return clock, store, agents, learner, cycle


async def test_wall_clock_jumps_keep_versions_unique_and_routers_converged(
    tmp_path: Path,
) -> None:
    clock, store, agents, learner, cycle = _cycle_on_a_jumping_clock(tmp_path, 4, 0.0)
    try:
        results = []
        for step in range(14):
            if step == 4:
                clock.offset -= 3600  # back an hour
            if step == 9:
                clock.offset += 86_400  # forward a day
            learner.fire = step in (1, 10)
            clock.advance(30)
            results.append((await cycle.run_once()).result)
        assert results == ["ok"] * 14
        windows = store.windows()
        assert len(windows) == 14 and all(w.window.start < w.window.end for w in windows)
        versions = [p.version for p in store.policies()]
        assert versions == list(range(1, len(versions) + 1)) and len(versions) >= 2
        desired = store.desired_versions()
        # The newest approved version (a canary's refused refit is stored as rejected).
        approved = [p.version for p in store.policies(status="approved")]
        assert set(desired.values()) == {approved[-1]}
        assert {r: a.snapshot.version for r, a in agents.items() if a.snapshot} == desired
        assert store.next_version() == versions[-1] + 1
    finally:
        store.close()


async def test_drift_after_the_wall_clock_stepped_back_still_recalibrates(
    tmp_path: Path,
) -> None:
    """A policy approved 'in the future' (the clock was then stepped back) must not block
    the rate limit on policy changes until the wall clock catches up."""
    clock, store, _agents, learner, cycle = _cycle_on_a_jumping_clock(tmp_path, 2, 600.0)
    try:
        for step in range(30):
            if step == 8:
                clock.offset -= 3600  # back an hour, long after the first approval
            learner.fire = step == 1 or step >= 30 - 8
            clock.advance(30)
            await cycle.run_once()
        approved = [p for p in store.policies() if p.status == "approved"]
        assert len(approved) >= 2, [(p.version, p.status) for p in store.policies()]
    finally:
        store.close()
