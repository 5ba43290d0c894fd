"""Reconciler retries, backoff and concurrency, on transports of our own (the seam)."""

from __future__ import annotations

import asyncio
from itertools import cycle
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from controller.config import RolloutConfig
from controller.errors import TransientError
from controller.policy import Policy, Route
from controller.rollout.agent import ApplyOutcome, RouterAgent
from controller.rollout.reconciler import (
    ApplyReply,
    FakeRouterTransport,
    Reconciler,
    RouterState,
)
from tests.rollout.grpc_support import InstantClock

V1 = Policy.uniform(1, Route.DECODE_LOCAL)


class FlakyTransport(FakeRouterTransport):
    """Fails the first ``failures[router]`` calls to each router with a transient error,
    and tracks how many calls are in flight at once (each call yields a few times)."""

    def __init__(self, agents: dict[str, RouterAgent], failures: dict[str, int]) -> None:
        super().__init__(agents)
        self.failures = dict(failures)
        self.in_flight = 0
        self.max_in_flight = 0

    async def _enter(self, router: str) -> None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            for _ in range(3):
                await asyncio.sleep(0)
            if self.failures.get(router, 0) > 0:
                self.failures[router] -= 1
                raise TransientError(f"router {router}: flaky")
        finally:
            self.in_flight -= 1

    async def apply(
        self, router: str, policy: Policy, rollback: bool, deadline_s: float
    ) -> ApplyReply:
        await self._enter(router)
        return await super().apply(router, policy, rollback, deadline_s)

    async def get(self, router: str, deadline_s: float) -> RouterState:
        await self._enter(router)
        return await super().get(router, deadline_s)


def agents(n: int) -> dict[str, RouterAgent]:
    return {f"r{i}": RouterAgent(router_id=f"r{i}", registry=CollectorRegistry()) for i in range(n)}


@pytest.mark.parametrize("draw_value", [0.0, 0.5, 0.999])
async def test_backoff_is_exponential_with_full_jitter_and_capped(draw_value: float) -> None:
    clock = InstantClock()
    transport = FlakyTransport(agents(1), {"r0": 5})
    rec = Reconciler(
        transport, clock, max_attempts=6, backoff_initial_s=0.1, backoff_max_s=0.5,
        draw=lambda: draw_value,
    )
    statuses = await rec.reconcile({"r0": V1})
    status = statuses["r0"]
    # 5 failed GetPolicy calls, the 6th succeeds, then one ApplyPolicy.
    assert status.ok and status.attempts == 7
    caps = [0.1, 0.2, 0.4, 0.5, 0.5]
    assert clock.slept == pytest.approx([draw_value * c for c in caps])
    assert status.latency_s == pytest.approx(sum(draw_value * c for c in caps))


async def test_jitter_spreads_retries_within_the_cap() -> None:
    draws = cycle([0.9, 0.1, 0.6, 0.3])
    rec = Reconciler(
        FakeRouterTransport(), InstantClock(), backoff_initial_s=1.0, backoff_max_s=4.0,
        draw=lambda: next(draws),
    )
    delays = [rec.backoff_s(a) for a in range(1, 9)]
    caps = [1.0, 2.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0]
    assert all(0.0 <= d < c for d, c in zip(delays, caps, strict=True))
    assert len(set(delays)) > 4


async def test_attempts_are_bounded_and_the_last_error_is_kept() -> None:
    clock = InstantClock()
    transport = FlakyTransport(agents(2), {"r0": 100})
    rec = Reconciler(transport, clock, max_attempts=4, backoff_initial_s=0.01)
    statuses = await rec.reconcile({"r0": V1, "r1": V1})
    assert statuses["r0"].attempts == 4 and not statuses["r0"].ok
    assert "flaky" in (statuses["r0"].last_error or "")
    assert len(clock.slept) == 3  # no sleep after the last attempt
    assert statuses["r1"].ok and statuses["r1"].attempts == 2


async def test_concurrency_is_bounded() -> None:
    transport = FlakyTransport(agents(40), {f"r{i}": 1 for i in range(0, 40, 3)})
    rec = Reconciler(transport, InstantClock(), max_concurrency=5, backoff_initial_s=0.01)
    statuses = await rec.reconcile({r: V1 for r in transport.agents})
    assert all(s.ok for s in statuses.values())
    assert transport.max_in_flight == 5


async def test_persist_failure_is_retried_and_reported() -> None:
    failures = {"n": 2}

    def flaky_disk(path: object, data: bytes) -> None:
        if failures["n"] > 0:
            failures["n"] -= 1
            raise OSError(28, "No space left on device")

    agent = RouterAgent(registry=CollectorRegistry(), state_file=Path("/nonexistent/x.json"),
                        writer=flaky_disk)
    transport = FakeRouterTransport({"r": agent})
    statuses = await Reconciler(transport, InstantClock(), max_attempts=5).reconcile({"r": V1})
    assert statuses["r"].ok and statuses["r"].outcome == "applied"
    assert statuses["r"].attempts == 1 + 3  # get, two refused applies, one that lands

    failures["n"] = 100
    v2 = V1.with_version(2)
    statuses = await Reconciler(transport, InstantClock(), max_attempts=3).reconcile({"r": v2})
    assert not statuses["r"].ok and statuses["r"].outcome == ApplyOutcome.PERSIST_FAILED.value
    assert "No space left" in (statuses["r"].last_error or "")
    assert agent.policy == V1


async def test_a_refusal_to_persist_then_an_outage_reads_as_the_outage() -> None:
    """The router's disk was full at the first attempt, then the router went away: the
    status said persist_failed with the first reply's message, hiding the outage."""
    class DiskFullThenGone(FakeRouterTransport):
        applies = 0

        async def apply(self, router: str, policy: Policy, rollback: bool,
                        deadline_s: float) -> ApplyReply:
            self.applies += 1
            if self.applies == 1:
                return ApplyReply(ApplyOutcome.PERSIST_FAILED, 0, "", "No space left on device")
            raise TransientError(f"router {router}: UNAVAILABLE: connection refused")

    transport = DiskFullThenGone({"r": RouterAgent(registry=CollectorRegistry())})
    statuses = await Reconciler(transport, InstantClock(), max_attempts=3).reconcile({"r": V1})
    assert statuses["r"].outcome == "unreachable", statuses["r"]
    assert "connection refused" in (statuses["r"].last_error or "")


async def test_a_reissue_whose_replies_are_lost_still_names_its_number() -> None:
    """The router ahead applied the re-issue but every reply was lost: the failed status
    named no number, so the store never learnt it and the next pass saw a router ahead at
    an unknown version and re-issued once more."""
    class LostReplies(FakeRouterTransport):
        async def apply(self, router: str, policy: Policy, rollback: bool,
                        deadline_s: float) -> ApplyReply:
            await super().apply(router, policy, rollback, deadline_s)
            raise TransientError(f"router {router}: DEADLINE_EXCEEDED (applied, reply lost)")

    agent = RouterAgent(registry=CollectorRegistry())
    agent.apply(Policy.uniform(7, Route.PREFILL_NODE))  # ahead of the store (a backup)
    transport = LostReplies({"r": agent})
    rec = Reconciler(transport, InstantClock(), max_attempts=2)
    status = (await rec.reconcile({"r": V1.with_version(2)}))["r"]
    assert (status.ok, status.outcome, status.reissued_as) == (False, "unreachable", 8)
    assert agent.policy is not None and agent.policy.version == 8
    again = await Reconciler(FakeRouterTransport({"r": agent}), InstantClock()).reconcile(
        {"r": V1.with_version(2).with_version(8)})  # as the cycle records it
    assert (again["r"].outcome, again["r"].reissued_as) == ("in_sync", None)


async def test_a_transport_bug_fails_one_router_not_the_pass() -> None:
    class Broken(FakeRouterTransport):
        async def get(self, router: str, deadline_s: float) -> RouterState:
            if router == "r1":
                raise RuntimeError("boom")
            return await super().get(router, deadline_s)

    statuses = await Reconciler(Broken(agents(3)), InstantClock()).reconcile(
        {f"r{i}": V1 for i in range(3)}
    )
    assert statuses["r1"].outcome == "error" and "boom" in (statuses["r1"].last_error or "")
    assert statuses["r0"].ok and statuses["r2"].ok


def test_from_config_uses_the_rollout_section() -> None:
    cfg = RolloutConfig(max_attempts=2, backoff_initial_s=0.5, backoff_max_s=0.75)
    rec = Reconciler.from_config(FakeRouterTransport(), InstantClock(), cfg, draw=lambda: 1.0)
    assert [rec.backoff_s(a) for a in (1, 2, 3)] == [0.5, 0.75, 0.75]
