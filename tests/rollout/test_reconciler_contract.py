"""One contract suite for the reconciler, run against both transports: the in-memory fake
over RouterAgent objects and the real gRPC transport over grpc.aio servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from controller.clock import Clock, VirtualClock
from controller.policy import Policy, Route
from controller.rollout.reconciler import (
    ApplyReply,
    Reconciler,
    RouterState,
    RouterTransport,
    reissued_versions,
)
from tests.rollout.grpc_support import FakeCluster, InstantClock, RealCluster

Cluster = FakeCluster | RealCluster
N_ROUTERS = 4


def policy(version: int, route: Route = Route.DECODE_LOCAL, score: float = 0.0) -> Policy:
    p = Policy.uniform(version, route)
    if score:
        t = p.table
        p = replace(p, table=replace(t, scores=(score, *t.scores[1:])))
    return p


@pytest.fixture(params=["fake", "grpc"])
async def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Cluster]:
    c: Cluster = (
        FakeCluster(tmp_path, N_ROUTERS) if request.param == "fake"
        else RealCluster(tmp_path, N_ROUTERS)
    )
    await c.start()
    yield c
    await c.close()


def reconciler(c: Cluster, clock: Clock | None = None, **kw: object) -> Reconciler:
    options: dict[str, object] = {
        "deadline_s": 2.0, "max_attempts": 3, "backoff_initial_s": 0.01, "backoff_max_s": 0.05,
    }
    options.update(kw)
    return Reconciler(c.transport, clock or InstantClock(), **options)  # type: ignore[arg-type]


def everywhere(c: Cluster, p: Policy) -> dict[str, Policy]:
    return dict.fromkeys(c.routers, p)


def running(c: Cluster) -> dict[str, tuple[int, str]]:
    out = {}
    for r in c.routers:
        snap = c.agent(r).snapshot
        out[r] = (snap.version, snap.checksum) if snap is not None else (0, "")
    return out


async def test_converges_then_the_next_pass_pushes_nothing(cluster: Cluster) -> None:
    v1 = policy(1)
    rec = reconciler(cluster)
    first = await rec.reconcile(everywhere(cluster, v1))
    assert {s.outcome for s in first.values()} == {"applied"}
    assert all(s.ok and s.pushed for s in first.values())
    assert all((s.acked_version, s.acked_checksum) == (1, v1.checksum) for s in first.values())
    assert running(cluster) == dict.fromkeys(cluster.routers, (1, v1.checksum))

    second = await rec.reconcile(everywhere(cluster, v1))
    assert {s.outcome for s in second.values()} == {"in_sync"}
    assert not any(s.pushed for s in second.values())
    assert all(s.attempts == 1 for s in second.values())  # one GetPolicy each, no ApplyPolicy


async def test_each_router_gets_its_own_desired_policy(cluster: Cluster) -> None:
    canary, rest = cluster.routers[0], cluster.routers[1:]
    v1, v2 = policy(1), policy(2, Route.PREFILL_NODE)
    statuses = await reconciler(cluster).reconcile({canary: v2, **dict.fromkeys(rest, v1)})
    assert all(s.ok for s in statuses.values())
    assert running(cluster)[canary] == (2, v2.checksum)
    assert {running(cluster)[r] for r in rest} == {(1, v1.checksum)}


async def test_converges_after_a_router_restart(cluster: Cluster) -> None:
    v1 = policy(1)
    rec = reconciler(cluster)
    await rec.reconcile(everywhere(cluster, v1))
    kept, lost = cluster.routers[0], cluster.routers[1]
    for r in (kept, lost):
        await cluster.stop_router(r)
    await cluster.restart_router(kept)  # state file kept: comes back with v1
    await cluster.restart_router(lost, lose_state=True)  # disk wiped: comes back empty

    statuses = await rec.reconcile(everywhere(cluster, v1))
    assert statuses[kept].outcome == "in_sync"
    assert statuses[lost].outcome == "applied"
    assert all(s.ok for s in statuses.values())
    assert running(cluster) == dict.fromkeys(cluster.routers, (1, v1.checksum))


async def test_a_router_down_for_a_while_fails_alone_then_catches_up(cluster: Cluster) -> None:
    v1, v2 = policy(1), policy(2, Route.PREFILL_NODE)
    rec = reconciler(cluster, max_attempts=3)
    await rec.reconcile(everywhere(cluster, v1))
    down = cluster.routers[2]
    await cluster.stop_router(down)

    statuses = await rec.reconcile(everywhere(cluster, v2))
    failed = statuses[down]
    assert (failed.ok, failed.outcome, failed.attempts) == (False, "unreachable", 3)
    assert failed.last_error and "gave up after 3" in failed.last_error
    assert failed.acked_version is None
    for r in cluster.routers:
        if r != down:
            assert statuses[r].ok and statuses[r].acked_version == 2

    # Several passes while it is still down change nothing for the others.
    for _ in range(2):
        again = await rec.reconcile(everywhere(cluster, v2))
        assert not again[down].ok
        assert all(again[r].outcome == "in_sync" for r in cluster.routers if r != down)

    await cluster.restart_router(down)  # back on the same address, still running v1
    assert running(cluster)[down] == (1, v1.checksum)
    statuses = await rec.reconcile(everywhere(cluster, v2))
    assert statuses[down].ok and statuses[down].outcome == "applied"
    assert running(cluster) == dict.fromkeys(cluster.routers, (2, v2.checksum))


class AckRecorder:
    """Wraps a transport (our seam) to record which routers' ApplyPolicy replies came back."""

    def __init__(self, inner: RouterTransport) -> None:
        self.inner = inner
        self.acked: set[str] = set()

    async def apply(
        self, router: str, policy: Policy, rollback: bool, deadline_s: float
    ) -> ApplyReply:
        reply = await self.inner.apply(router, policy, rollback, deadline_s)
        self.acked.add(router)
        return reply

    async def get(self, router: str, deadline_s: float) -> RouterState:
        return await self.inner.get(router, deadline_s)


async def test_an_unreachable_router_does_not_delay_the_others(cluster: Cluster) -> None:
    """The others are acknowledged while the dead router still sleeps in its backoff."""
    v1 = policy(1)
    dead = cluster.routers[0]
    await cluster.stop_router(dead)
    clock = VirtualClock()  # frozen: the dead router's backoff cannot pass on its own
    recorder = AckRecorder(cluster.transport)
    rec = Reconciler(
        recorder, clock, deadline_s=2.0, max_attempts=3, backoff_initial_s=10.0,
        backoff_max_s=10.0,
    )
    task = asyncio.ensure_future(rec.reconcile(everywhere(cluster, v1)))
    others = set(cluster.routers) - {dead}
    for _ in range(2000):  # bounded wait for real I/O (at most ~20 s)
        if recorder.acked >= others:
            break
        await asyncio.sleep(0.01)
    assert recorder.acked == others
    assert all(running(cluster)[r] == (1, v1.checksum) for r in others)
    assert not task.done() and clock.pending_sleepers == 1
    for _ in range(100):  # let the dead router run out of attempts
        if task.done():
            break
        clock.advance(10.0)
        await asyncio.sleep(0.01)
    statuses = task.result()
    assert not statuses[dead].ok
    assert all(statuses[r].ok for r in others)
    # Measured on the virtual clock: the others finished before any backoff passed.
    assert all(statuses[r].latency_s == 0.0 for r in others)
    assert statuses[dead].latency_s >= 10.0


async def test_a_router_ahead_of_the_store_gets_the_desired_policy_reissued(
    cluster: Cluster,
) -> None:
    v3 = policy(3)
    rec = reconciler(cluster)
    await rec.reconcile(everywhere(cluster, v3))
    # The store was restored from a backup: it wants v2 while one router already ran v7.
    ahead = cluster.routers[1]
    cluster.agent(ahead).apply(policy(7, Route.PREFILL_NODE))
    v2 = policy(2, score=4.0)

    statuses = await rec.reconcile(everywhere(cluster, v2))
    assert all(s.ok for s in statuses.values())
    assert reissued_versions(statuses) == dict.fromkeys(cluster.routers, 8)  # max(7, 3, 2) + 1
    assert running(cluster) == dict.fromkeys(cluster.routers, (8, v2.checksum))
    assert statuses[ahead].outcome == "applied"

    # Recorded as v8 (same content), the next pass is a no-op.
    again = await rec.reconcile(everywhere(cluster, v2.with_version(8)))
    assert {s.outcome for s in again.values()} == {"in_sync"}
    assert reissued_versions(again) == {}


async def test_same_version_other_content_is_reissued_not_left_in_conflict(
    cluster: Cluster,
) -> None:
    v4 = policy(4)
    rec = reconciler(cluster)
    await rec.reconcile(everywhere(cluster, v4))
    other = policy(4, Route.PREFILL_NODE)  # another controller's v4
    statuses = await rec.reconcile(everywhere(cluster, other))
    assert all(s.ok and s.reissued_as == 5 for s in statuses.values())
    assert running(cluster) == dict.fromkeys(cluster.routers, (5, other.checksum))


async def test_a_router_at_the_last_version_is_refused_a_reissue_with_the_way_out(
    cluster: Cluster,
) -> None:
    """v2^63-1 then another table: the re-issue above it failed as "error: ValueError: Value
    out of range" (the proto's int64) with every attempt."""
    from controller.policy.validation import MAX_VERSION

    rec = reconciler(cluster)
    await rec.reconcile(everywhere(cluster, policy(MAX_VERSION)))
    statuses = await rec.reconcile(everywhere(cluster, policy(2, Route.PREFILL_NODE)))
    assert {s.outcome for s in statuses.values()} == {"refused"}
    assert all("--rollback" in (s.last_error or "") for s in statuses.values())
    assert running(cluster) == dict.fromkeys(cluster.routers,
                                             (MAX_VERSION, policy(MAX_VERSION).checksum))
    back = await rec.reconcile(everywhere(cluster, policy(2, Route.PREFILL_NODE)), rollback=True)
    assert all(s.ok for s in back.values())


async def test_routers_in_sync_stay_in_sync_when_a_reissue_cannot_be_made(
    cluster: Cluster,
) -> None:
    """One router at the last version, the others on the desired v1: only that one is
    refused (the others were reported refused too, though they run the desired policy)."""
    from controller.policy.validation import MAX_VERSION

    rec = reconciler(cluster)
    v1 = policy(1)
    await rec.reconcile(everywhere(cluster, v1))
    ahead = cluster.routers[0]
    cluster.agent(ahead).apply(policy(MAX_VERSION, Route.PREFILL_NODE))
    statuses = await rec.reconcile(everywhere(cluster, v1))
    assert statuses[ahead].outcome == "refused"
    assert {r: s.outcome for r, s in statuses.items() if r != ahead} == dict.fromkeys(
        [r for r in cluster.routers if r != ahead], "in_sync")


async def test_rollback_pushes_the_lower_version_instead_of_reissuing(cluster: Cluster) -> None:
    v5, v3 = policy(5), policy(3, Route.PREFILL_NODE)
    rec = reconciler(cluster)
    await rec.reconcile(everywhere(cluster, v5))
    statuses = await rec.reconcile(everywhere(cluster, v3), rollback=True)
    assert all(s.ok and s.reissued_as is None for s in statuses.values())
    assert running(cluster) == dict.fromkeys(cluster.routers, (3, v3.checksum))


async def test_an_invalid_policy_is_refused_everywhere_and_nothing_changes(
    cluster: Cluster,
) -> None:
    v1 = policy(1)
    rec = reconciler(cluster)
    await rec.reconcile(everywhere(cluster, v1))
    t = v1.table
    broken = replace(policy(2), table=replace(t, exploration=(0.9, *t.exploration[1:])))
    statuses = await rec.reconcile(everywhere(cluster, broken))
    assert {s.outcome for s in statuses.values()} == {"invalid"}
    assert all(not s.ok and s.attempts == 2 for s in statuses.values())  # get + one apply
    assert all("exploration[0]" in (s.last_error or "") for s in statuses.values())
    assert all(s.acked_version == 1 for s in statuses.values())
    assert running(cluster) == dict.fromkeys(cluster.routers, (1, v1.checksum))


async def test_empty_desired_set_is_a_no_op(cluster: Cluster) -> None:
    assert await reconciler(cluster).reconcile({}) == {}


async def test_running_policy_is_the_one_every_router_runs(cluster: Cluster) -> None:
    """What a controller with nothing stored adopts: the policy itself, only when every
    router runs the same; otherwise why not (nothing to say when none runs one)."""
    rec = reconciler(cluster)
    nothing = await rec.running_policy(cluster.routers)
    assert nothing.policy is None and nothing.why == ""
    own = policy(5, Route.PREFILL_NODE, score=-0.25)
    await rec.reconcile({cluster.routers[0]: own})
    some = await rec.running_policy(cluster.routers)
    assert some.policy is None and some.why == "some routers run no policy"
    await rec.reconcile(everywhere(cluster, own))
    found = await rec.running_policy(cluster.routers)
    assert found.policy is not None and found.policy.checksum == own.checksum
    assert found.policy.version == 5 and found.policy.table == own.table
    await rec.reconcile({cluster.routers[1]: policy(6)})
    split = await rec.running_policy(cluster.routers)
    assert split.policy is None and split.why.startswith("the routers run different")
    await cluster.stop_router(cluster.routers[3])
    down = await rec.running_policy(cluster.routers)
    assert down.policy is None and down.why.startswith("not every router answered")
