"""A router that never acknowledges (issue 39, class 7): real ``grpc.aio`` routers in this
process, one of which answers a different checksum on every call (``GetPolicy`` and
``ApplyPolicy``), and `pdctl run` as a real process on SQLite.

Expected: the honest routers acknowledge at once; the hostile one is pushed on the held-off
schedule (``unacked_hold_initial_s`` doubling up to ``unacked_hold_max_s``), not every cycle;
no cycle's log line lists it among the "acked"; once it answers honestly it is acknowledged
and left alone."""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
from pathlib import Path
from typing import Any

import pytest

from controller.policy import Policy
from controller.rollout.agent import ApplyOutcome, ApplyResult, PolicySnapshot, RouterAgent
from controller.rollout.reconciler import Reconciler
from controller.store import Store
from tests.faults.harness import Routers
from tests.support.daemon import acked_everywhere, operator_decision, write_config
from tests.support.processes import free_port, http_get, start_daemon, stop_daemon, wait_for

pytestmark = [pytest.mark.integration]

HOSTILE = "router-2"
INTERVAL_S = 0.5
HOLD_S, HOLD_MAX_S = 1.0, 4.0
RUN_S = 12.0


class NeverAcks(RouterAgent):
    """Reports a fresh random checksum for whatever it runs, on every call, while hostile."""

    hostile = True
    applies = 0

    @property
    def snapshot(self) -> PolicySnapshot | None:
        snap = super().snapshot
        if snap is None or not self.hostile:
            return snap
        return PolicySnapshot(snap.policy, secrets.token_hex(32), snap.applied_at,
                              lambda route, reason: lambda: 0)

    def apply(self, policy: Policy, *, rollback: bool = False) -> ApplyResult:
        self.applies += 1
        result = super().apply(policy, rollback=rollback)
        if not self.hostile:
            return result
        return ApplyResult(ApplyOutcome.APPLIED, result.applied_version, secrets.token_hex(32),
                           result.message)


def _factory(**kwargs: Any) -> RouterAgent:
    cls = NeverAcks if kwargs["router_id"] == HOSTILE else RouterAgent
    return cls(**kwargs)


def _cycle_lines(log: Path) -> list[str]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            msg = json.loads(line).get("msg", "")
        except ValueError:
            continue
        if msg.startswith("cycle "):
            out.append(msg)
    return out


def test_the_hold_schedule_doubles_and_is_capped() -> None:
    from controller.clock import VirtualClock
    from controller.rollout.reconciler import FakeRouterTransport

    rec = Reconciler(FakeRouterTransport(), VirtualClock(), unacked_hold_initial_s=10,
                     unacked_hold_max_s=900)
    assert [rec.hold_s(n) for n in (1, 2, 3, 4, 5, 6, 7, 100, 10**6)] == [
        10, 20, 40, 80, 160, 320, 640, 900, 900]


async def test_a_router_that_never_acknowledges_is_held_off_and_never_listed_as_acked(
    tmp_path: Path,
) -> None:
    routers = Routers(tmp_path, 3, agent_factory=_factory)
    await routers.start()
    hostile_address = next(a for a, n in routers.names.items() if n == HOSTILE)
    hostile = routers.agent(hostile_address)
    assert isinstance(hostile, NeverAcks)
    honest = [a for a in routers.addresses if a != hostile_address]
    url = f"sqlite:///{tmp_path / 'history.db'}"
    store = Store(url)
    store.upgrade()
    listen = f"127.0.0.1:{free_port()}"
    config = write_config(tmp_path / "c.toml", listen, url, {
        "routers": {"targets": routers.addresses},
        "controller": {"interval_s": INTERVAL_S, "lease_ttl_s": 3, "shutdown_timeout_s": 5},
        "rollout": {"push_deadline_s": 2, "max_attempts": 2,
                    "unacked_hold_initial_s": HOLD_S, "unacked_hold_max_s": HOLD_MAX_S},
    })
    log = tmp_path / "run.log"
    proc = start_daemon(config, log)
    try:
        await asyncio.to_thread(wait_for, "/healthz", lambda: (r := http_get(
            f"http://{listen}/healthz")) is not None and r.status_code == 200, 60, log)
        await asyncio.to_thread(operator_decision, url, "decision 1")
        await asyncio.to_thread(wait_for, "v1 acknowledged by the honest routers",
                                lambda: acked_everywhere(store, 1, honest), 30, log)
        first = len(_cycle_lines(log))
        await asyncio.sleep(RUN_S)  # about 24 cycles
        cycles = len(_cycle_lines(log)) - first
        pushes = [p for p in store.pushes() if p.router_id == hostile_address]
        applies = hostile.applies
        hostile.hostile = False  # it starts answering honestly: acknowledged again
        await asyncio.to_thread(
            wait_for, "the router acknowledged once honest",
            lambda: (r := {x.router_id: x for x in store.routers()}[hostile_address])
            and r.acked_version is not None
            and r.acked_version == store.desired_versions()[hostile_address],
            HOLD_MAX_S + 10, log)
        assert await asyncio.to_thread(stop_daemon, proc, 20) == 0
        proc = None
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(5)
        await routers.close()
    assert cycles >= RUN_S / INTERVAL_S / 2, cycles
    # Holds of 1, 2, 4, 4, ... s after each unacknowledged push: over the first push and
    # RUN_S s at most 1 + 5 more pushes (every cycle: about 24 more).
    assert 2 <= len(pushes) <= 7, [(p.at, p.result) for p in pushes]
    assert applies <= 7 * 2  # two attempts at most per push
    gaps = [(b.at - a.at).total_seconds() for a, b in itertools.pairwise(pushes)]
    assert all(g >= HOLD_S * 0.9 for g in gaps), gaps
    for line in _cycle_lines(log):
        acked = line.partition("acked: ")[2]
        assert hostile_address not in acked.split(";")[0], line
    store.close()
