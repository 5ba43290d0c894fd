"""Property: from any mix of router states, one pass converges every reachable router to the
desired content under one version, re-issuing above every router only when one was ahead
or in conflict; unreachable routers are left untouched; the next pass pushes nothing."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from controller.policy import Axes, LookupTable, Policy, Route
from controller.rollout.agent import RouterAgent
from controller.rollout.reconciler import FakeRouterTransport, Reconciler
from tests.rollout.grpc_support import InstantClock

AXES = Axes((1000.0,), (1.0,), (10.0,))  # one cell: applying is cheap, content still differs


def content(kind: int, version: int) -> Policy:
    route = Route.DECODE_LOCAL if kind % 2 else Route.PREFILL_NODE
    table = LookupTable(AXES, (route,), (float(kind),), (0.0,))
    return Policy(version=version, table=table)


router_state = st.none() | st.tuples(st.integers(1, 12), st.integers(0, 2))


@settings(max_examples=120, deadline=None)
@given(
    states=st.lists(st.tuples(router_state, st.booleans()), min_size=1, max_size=6),
    desired_version=st.integers(1, 12),
    desired_kind=st.integers(0, 2),
)
def test_one_pass_converges_from_any_state(
    states: list[tuple[tuple[int, int] | None, bool]], desired_version: int, desired_kind: int
) -> None:
    agents: dict[str, RouterAgent] = {}
    transport = FakeRouterTransport()
    for i, (state, down) in enumerate(states):
        router = f"r{i}"
        agent = RouterAgent(router_id=router, registry=CollectorRegistry())
        if state is not None:
            agent.apply(content(state[1], state[0]))
        agents[router] = agent
        if down:
            transport.down.add(router)
    transport.agents.update(agents)
    desired = content(desired_kind, desired_version)
    before = {r: (a.snapshot.version, a.checksum) if a.snapshot else (0, "")
              for r, a in agents.items()}
    reachable = [r for r in agents if r not in transport.down]

    rec = Reconciler(transport, InstantClock(), max_attempts=2, backoff_initial_s=0.01)
    statuses = asyncio.run(rec.reconcile(dict.fromkeys(agents, desired)))

    for r in transport.down:
        assert not statuses[r].ok and statuses[r].outcome == "unreachable"
        assert (agents[r].snapshot.version if agents[r].snapshot else 0, agents[r].checksum) == (
            before[r]
        )
    if not reachable:
        return
    diverged = [
        r for r in reachable
        if before[r][0] > desired_version
        or (before[r][0] == desired_version and before[r][1] != desired.checksum)
    ]
    expected_version = desired_version
    if diverged:
        expected_version = max([desired_version, *(before[r][0] for r in reachable)]) + 1
    for r in reachable:
        s = statuses[r]
        assert s.ok, s
        assert (s.acked_version, s.acked_checksum) == (expected_version, desired.checksum)
        assert agents[r].policy == desired.with_version(expected_version)
        assert s.reissued_as == (expected_version if diverged else None)
        assert s.pushed == (before[r] != (expected_version, desired.checksum))

    # The store records the re-issued version; the next pass finds nothing to do.
    again = asyncio.run(
        rec.reconcile({r: desired.with_version(expected_version) for r in reachable})
    )
    assert all(s.outcome == "in_sync" and not s.pushed for s in again.values())
