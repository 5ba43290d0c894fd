"""Signals to a real `pdctl run` on the real PostgreSQL (issue 39, class 6).

SIGTERM, SIGINT and SIGQUIT each stop the daemon gracefully: logged, exit 0, the lease row
released, so another replica leads at once (the lease lives 60 s here: no expiry explains
the takeover). SIGHUP is logged and ignored: the daemon keeps leading and healthy."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest

from controller.clock import WallClock
from controller.loop.leader import leadership_for, replica_name
from controller.store import Store
from tests.support.daemon import write_config
from tests.support.postgres import fresh_schema
from tests.support.processes import free_port, http_get, start_daemon, wait_for

pytestmark = [pytest.mark.integration]

LEASE_TTL_S = 60


def _holder(store: Store) -> str | None:
    lease = store.lease()
    if lease is None or not lease.holder or lease.expires_at is None:
        return None
    return replica_name(lease.holder) if lease.expires_at > WallClock().utcnow() else None


def _logged(log: Path, fragment: str) -> bool:
    for line in log.read_text(errors="replace").splitlines():
        try:
            if fragment in json.loads(line).get("msg", ""):
                return True
        except ValueError:
            continue
    return False


async def _other_replica_leads(store: Store) -> bool:
    other = leadership_for(store, WallClock(), "other/0", LEASE_TTL_S)
    try:
        return await other.ensure()
    finally:
        await other.release()


@pytest.mark.parametrize("sequence", [
    [signal.SIGTERM], [signal.SIGINT], [signal.SIGQUIT], [signal.SIGHUP, signal.SIGQUIT],
], ids=["term", "int", "quit", "hup-then-quit"])
def test_every_terminating_signal_releases_the_lease_and_sighup_is_ignored(
    tmp_path: Path, sequence: list[signal.Signals]
) -> None:
    with fresh_schema() as url:
        store = Store(url)
        store.upgrade()
        listen = f"127.0.0.1:{free_port()}"
        config = write_config(tmp_path / "c.toml", listen, url, {
            "routers": {"targets": [f"127.0.0.1:{free_port()}"]},  # nobody there
            "controller": {"replica_id": "signalled", "interval_s": 1.0,
                           "lease_ttl_s": LEASE_TTL_S, "shutdown_timeout_s": 5},
            "rollout": {"push_deadline_s": 0.5, "max_attempts": 1},
        })
        log = tmp_path / "run.log"
        proc = start_daemon(config, log)
        try:
            wait_for("the daemon leading", lambda: _holder(store) == "signalled", 60, log)
            for sig in sequence[:-1]:  # not terminating: logged, ignored
                proc.send_signal(sig)
                wait_for(f"{sig.name} logged", lambda s=sig: _logged(log, f"{s.name} received"
                                                                     " and ignored"), 10, log)
                assert proc.poll() is None
                assert _holder(store) == "signalled"
                r = http_get(f"http://{listen}/readyz")
                assert r is not None and r.status_code == 200
            last = sequence[-1]
            proc.send_signal(last)
            code = proc.wait(30)
            assert code == 0, log.read_text(errors="replace")[-3000:]
            assert _logged(log, f"{last.name} received: stopping")
            assert _logged(log, "released leadership")
            assert _holder(store) is None
            assert asyncio.run(_other_replica_leads(store))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
            store.close()

