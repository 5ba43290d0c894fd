"""SIGKILL of `pdctl run` with a push in flight, as a real process, then a restart (issue 8).

Three router agents are real ``grpc.aio`` servers in this test's process (each persisting
to its own state file); one of them is slow on purpose (:class:`SlowAgent`: its next update
blocks until the test releases it). `pdctl run` runs as a subprocess on SQLite and on the
real PostgreSQL. An operator decision (`pdctl fallback prefill`, through the real CLI) makes
the daemon approve v1, which every router acknowledges; a second decision approves v2, and
while the slow router holds that push the daemon is killed with SIGKILL. The two fast
routers already run v2 but the dead daemon never recorded it. The daemon restarts with the
slow router still stuck in the dead controller's call; only after the restart has converged
is that stale call released, and it lands as a no-op.

Expected: no version duplicated or skipped (v1, v2, next 3), exactly one approval per
decision, every router (and its state file) on the desired v2 with its checksum, every row
the store held at the kill still there unchanged, nothing already running re-pushed, and a
clean SIGTERM exit after the restart.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controller.policy import loads
from controller.store import Store
from tests.faults.harness import Routers, SlowAgent, applied_count
from tests.support.daemon import (
    acked_everywhere,
    decide_with_push_held,
    operator_decision,
    write_config,
)
from tests.support.postgres import fresh_schema
from tests.support.processes import free_port, http_get, start_daemon, stop_daemon, wait_for

pytestmark = [pytest.mark.integration]


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'history.db'}"
    else:
        with fresh_schema() as url:
            yield url


def _config(tmp_path: Path, routers: list[str], listen: str, store_url: str) -> Path:
    return write_config(tmp_path / "pd-controller.toml", listen, store_url, {
        "routers": {"targets": routers},
        "controller": {"replica_id": "killed", "interval_s": 1.0, "lease_ttl_s": 3,
                       "shutdown_timeout_s": 5},
        "rollout": {"push_deadline_s": 30, "max_attempts": 2},
    })


def _records(store: Store) -> dict[str, Any]:
    return {
        "policies": [(p.version, p.checksum, p.status, p.reason) for p in store.policies()],
        "requests": [(r.id, r.kind, r.status, r.outcome) for r in store.requests()],
        "pushes": [(p.id, p.router_id, p.version, p.result) for p in store.pushes()],
        "windows": [w.id for w in store.windows()],
        "drift": [e.id for e in store.drift_events()],
        "calibrations": [c.id for c in store.calibrations()],
    }


async def test_pdctl_run_killed_mid_push_and_restarted_converges_with_nothing_lost(
    tmp_path: Path, store_url: str
) -> None:
    routers = Routers(tmp_path, 3, agent_factory=SlowAgent)
    await routers.start()
    store = Store(store_url)
    store.upgrade()
    listen = f"127.0.0.1:{free_port()}"
    config = _config(tmp_path, routers.addresses, listen, store_url)
    log = tmp_path / "run.log"
    slow_address = routers.addresses[1]
    slow = routers.agent(slow_address)
    assert isinstance(slow, SlowAgent)
    proc = None
    try:
        # The routers are served by this event loop: every blocking wait runs in a thread.
        proc = start_daemon(config, log)
        await asyncio.to_thread(wait_for, "/healthz", lambda: (r := http_get(
            f"http://{listen}/healthz")) is not None and r.status_code == 200, 60, log)
        await asyncio.to_thread(operator_decision, store_url, "decision 1")
        await asyncio.to_thread(wait_for, "v1 acknowledged everywhere",
                                lambda: acked_everywhere(store, 1, routers.addresses), 30, log)

        fast = await decide_with_push_held(routers, slow_address, store_url, 2)
        os.kill(proc.pid, signal.SIGKILL)  # the controller dies with the push in flight
        assert await asyncio.to_thread(proc.wait, 10) == -signal.SIGKILL
        proc = None

        at_kill = _records(store)
        versions = routers.versions()
        # The decision was committed before the push; the fast routers took v2 but the
        # dead daemon never recorded their acknowledgements.
        assert [p[:3] for p in at_kill["policies"]] == [
            (1, at_kill["policies"][0][1], "approved"), (2, at_kill["policies"][1][1], "approved")
        ]
        assert versions[slow_address] == 1
        assert {a: versions[a] for a in fast} == dict.fromkeys(fast, 2)
        assert not any(r.acked_version == 2 for r in store.routers())

        proc = start_daemon(config, log)  # the restart; the stale call is still stuck
        await asyncio.to_thread(wait_for, "v2 acknowledged everywhere after the restart",
                                lambda: acked_everywhere(store, 2, routers.addresses), 30, log)
        slow.release.set()  # the dead controller's call now lands: a no-op
        await asyncio.sleep(2.5)  # two more cycles
        code = await asyncio.to_thread(stop_daemon, proc, 20)
        proc = None
        assert code == 0, log.read_text(errors="replace")[-3000:]

        after = _records(store)
        # Nothing recorded before the kill was lost or changed.
        for key, rows in at_kill.items():
            assert after[key][: len(rows)] == rows, key
        # No duplicated or skipped version; exactly one approval per operator decision.
        assert [p[0] for p in after["policies"]] == [1, 2]
        assert store.next_version() == 3
        assert [(r[1], r[2]) for r in after["requests"]] == [("rollback", "done")] * 2
        assert [p[2] for p in after["policies"]] == ["approved", "approved"]
        # Every router runs v2 with the stored checksum, and persisted it.
        v2 = store.policy(2)
        assert v2 is not None
        assert routers.versions() == dict.fromkeys(routers.addresses, 2)
        for address in routers.addresses:
            assert routers.agent(address).checksum == v2.checksum
            persisted = loads(routers.state_file(address).read_text())
            assert (persisted.version, persisted.checksum) == (2, v2.checksum)
        assert {(r.acked_version, r.acked_checksum) for r in store.routers()} == {
            (2, v2.checksum)}
        # Routers already on v2 were not pushed again; v1 never again. Each router applied
        # v1 and v2 once (the slow router's stale call was a no-op).
        new_pushes = after["pushes"][len(at_kill["pushes"]):]
        assert all(p[2] == 2 for p in new_pushes), new_pushes
        assert {p[1] for p in new_pushes} <= {slow_address}, new_pushes
        assert [applied_count(routers.agent(a)) for a in routers.addresses] == [2.0] * 3
    except AssertionError as e:  # say what the store, the routers and the daemon saw
        log_tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
        raise AssertionError(f"{e}\nrouters: {routers.versions()}\nstore: {_records(store)}"
                             f"\nrun.log tail:\n{log_tail}") from None
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(5)
        slow.release.set()
        store.close()
        await routers.close()
