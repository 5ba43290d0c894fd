"""Routers that are down, slow, restarting or failing while the controller pushes a policy.

Every case runs real ``grpc.aio`` servers on 127.0.0.1 and the real reconciler with
GrpcRouterTransport on the wall clock (short deadlines and backoffs keep the suite fast).
Expected everywhere: the healthy routers are unaffected, transient failures are retried
with bounded backoff, refused calls are not, nothing is applied twice, and every router
ends on the one desired version.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from controller.policy import Policy, Route, loads
from controller.rollout.agent import RouterAgent
from controller.rollout.client import GrpcRouterTransport
from tests.faults.harness import (
    APPLY,
    GET,
    RecordingClock,
    Routers,
    SlowAgent,
    applied_count,
    reconciler,
)

V1 = Policy.uniform(1, Route.PREFILL_NODE)
V2 = Policy.uniform(2, Route.DECODE_LOCAL)


@pytest.fixture
async def transport() -> AsyncIterator[GrpcRouterTransport]:
    t = GrpcRouterTransport(reconnect_backoff_max_s=0.2)
    yield t
    await t.close()


def policy_version_metric(agent: RouterAgent) -> float | None:
    return agent.registry.get_sample_value("pdrouter_policy_version")


async def started(tmp_path: Path, n: int, **kwargs: object) -> Routers:
    routers = Routers(tmp_path, n, **kwargs)  # type: ignore[arg-type]
    await routers.start()
    return routers


async def test_router_down_when_the_push_starts_converges_once_it_comes_up(
    tmp_path: Path, transport: GrpcRouterTransport
) -> None:
    routers = await started(tmp_path, 3)
    try:
        down = routers.addresses[0]
        await routers.stop(down)
        clock = RecordingClock()
        rec = reconciler(transport, clock, max_attempts=3)

        first = await rec.reconcile(dict.fromkeys(routers.addresses, V1))
        assert first[down].ok is False and first[down].outcome == "unreachable"
        assert first[down].attempts == 3 and "UNAVAILABLE" in (first[down].last_error or "")
        assert first[down].acked_version is None
        for other in routers.addresses[1:]:
            assert first[other].ok and first[other].outcome == "applied"
            assert first[other].attempts == 2  # one GetPolicy, one ApplyPolicy: no retries
        assert len(clock.slept) == 2 and all(0 <= s <= 0.4 for s in clock.slept)

        agent = await routers.restart(down)
        assert agent.snapshot is None  # it never saw v1
        second = await rec.reconcile(dict.fromkeys(routers.addresses, V1))
        assert second[down].ok and second[down].outcome == "applied"
        assert [second[r].outcome for r in routers.addresses[1:]] == ["in_sync", "in_sync"]
        assert set(routers.versions().values()) == {1}
    finally:
        await routers.close()


async def test_router_that_comes_up_during_the_retries_is_reached_in_the_same_pass(
    tmp_path: Path, transport: GrpcRouterTransport
) -> None:
    routers = await started(tmp_path, 2)
    try:
        late = routers.addresses[1]
        await routers.stop(late)
        rec = reconciler(transport, RecordingClock(), max_attempts=30, backoff_max_s=0.1)
        push = asyncio.create_task(rec.reconcile(dict.fromkeys(routers.addresses, V1)))
        await asyncio.sleep(0.3)
        assert not push.done()
        await routers.restart(late)
        statuses = await asyncio.wait_for(push, 30)
        assert statuses[late].ok and statuses[late].acked_version == 1
        assert statuses[late].attempts > 2  # it failed first, then got through
        assert set(routers.versions().values()) == {1}
    finally:
        await routers.close()


async def test_router_slower_than_the_deadline_is_retried_and_applies_once(
    tmp_path: Path, transport: GrpcRouterTransport
) -> None:
    routers = await started(tmp_path, 3, agent_factory=SlowAgent)
    try:
        slow = routers.addresses[0]
        agent = routers.agent(slow)
        assert isinstance(agent, SlowAgent)
        agent.slow_applies, agent.delay_s = 1, 2.5
        rec = reconciler(transport, RecordingClock(), deadline_s=1.0, max_attempts=8)

        statuses = await rec.reconcile(dict.fromkeys(routers.addresses, V1))
        assert statuses[slow].ok and statuses[slow].acked_version == 1
        assert statuses[slow].attempts >= 3  # GetPolicy, the timed-out push, the retry
        # The late first update went through on the router; the retry found it there.
        assert applied_count(agent) == 1
        for other in routers.addresses[1:]:
            assert statuses[other].ok and statuses[other].attempts == 2
        assert set(routers.versions().values()) == {1}
    finally:
        await routers.close()


async def test_router_restarted_in_the_middle_of_an_update_converges(
    tmp_path: Path, transport: GrpcRouterTransport
) -> None:
    routers = await started(tmp_path, 4, agent_factory=SlowAgent)
    try:
        rec = reconciler(transport, RecordingClock(), deadline_s=2.0, max_attempts=10)
        warm = await rec.reconcile(dict.fromkeys(routers.addresses, V1))
        assert all(s.ok for s in warm.values())

        victim = routers.addresses[2]
        agent = routers.agent(victim)
        assert isinstance(agent, SlowAgent)
        agent.slow_applies, agent.delay_s = 1, 10.0
        push = asyncio.create_task(rec.reconcile(dict.fromkeys(routers.addresses, V2)))
        assert await asyncio.to_thread(agent.entered.wait, 10)
        await routers.stop(victim)  # the router dies with the update half-way
        agent.release.set()  # the old process's last write may or may not land
        await asyncio.sleep(0.2)
        fresh = await routers.restart(victim)
        statuses = await asyncio.wait_for(push, 30)

        assert all(s.ok for s in statuses.values()), statuses
        assert fresh.snapshot is not None and fresh.snapshot.version == 2
        assert set(routers.versions().values()) == {2}
        on_disk = loads(routers.state_file(victim).read_bytes())
        assert (on_disk.version, on_disk.checksum) == (2, V2.checksum)
    finally:
        await routers.close()


async def test_unavailable_answers_are_retried_internal_errors_are_not(
    tmp_path: Path, transport: GrpcRouterTransport
) -> None:
    routers = await started(tmp_path, 3)
    try:
        flaky, broken, healthy = routers.addresses
        routers.faults[flaky].fail[APPLY] = 2  # UNAVAILABLE twice, then fine
        routers.faults[broken].code = grpc.StatusCode.INTERNAL
        routers.faults[broken].fail[GET] = 1
        rec = reconciler(transport, RecordingClock(), max_attempts=4)

        statuses = await rec.reconcile(dict.fromkeys(routers.addresses, V1))
        assert statuses[flaky].ok and statuses[flaky].attempts == 4  # get + 3 pushes
        assert applied_count(routers.agent(flaky)) == 1
        assert statuses[broken].ok is False and statuses[broken].outcome == "refused"
        assert statuses[broken].attempts == 1 and "INTERNAL" in (statuses[broken].last_error or "")
        assert routers.agent(broken).snapshot is None  # nothing reached it
        assert statuses[healthy].ok and statuses[healthy].attempts == 2

        # The fault was one-off: the next pass converges without special handling.
        again = await rec.reconcile(dict.fromkeys(routers.addresses, V1))
        assert again[broken].ok and again[broken].outcome == "applied"
        assert [again[r].outcome for r in (flaky, healthy)] == ["in_sync", "in_sync"]
        assert set(routers.versions().values()) == {1}
    finally:
        await routers.close()


async def test_one_router_unreachable_for_a_long_stretch_leaves_the_others_alone(
    tmp_path: Path, transport: GrpcRouterTransport
) -> None:
    """12 routers at v1; one goes away; v2 is approved meanwhile; passes run every 0.5 s for
    about 6 s (bounded); the router comes back still holding v1 and is brought to v2."""
    routers = await started(tmp_path, 12)
    try:
        clock = RecordingClock()
        rec = reconciler(transport, clock, max_attempts=3, backoff_max_s=0.2)
        warm = await rec.reconcile(dict.fromkeys(routers.addresses, V1))
        assert all(s.ok for s in warm.values())
        gone = routers.addresses[5]
        others = [r for r in routers.addresses if r != gone]
        await routers.stop(gone)

        passes = 0
        started_at = clock.monotonic()
        while clock.monotonic() - started_at < 6.0 and passes < 40:
            clock.slept.clear()
            statuses = await rec.reconcile(dict.fromkeys(routers.addresses, V2))
            passes += 1
            down = statuses[gone]
            assert not down.ok and down.outcome == "unreachable" and down.acked_version is None
            assert down.attempts == 3 and len(clock.slept) == 2  # only the missing one sleeps
            assert all(0 <= s <= 0.2 for s in clock.slept)
            for r in others:  # statuses and the routers' own metrics stay true for the rest
                assert statuses[r].ok and statuses[r].acked_version == 2
                assert statuses[r].outcome == ("applied" if passes == 1 else "in_sync")
                assert policy_version_metric(routers.agent(r)) == 2
            await asyncio.sleep(0.5)
        assert passes >= 3

        back = await routers.restart(gone)
        assert back.snapshot is not None and back.snapshot.version == 1  # its last good policy
        assert policy_version_metric(back) == 1
        final = await rec.reconcile(dict.fromkeys(routers.addresses, V2))
        assert final[gone].ok and final[gone].outcome == "applied"
        assert applied_count(back) == 1 and policy_version_metric(back) == 2
        assert all(final[r].outcome == "in_sync" for r in others)
        assert set(routers.versions().values()) == {2}
    finally:
        await routers.close()
