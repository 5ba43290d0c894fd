"""The store under faults: SQLite locked by another process, a PostgreSQL connection killed
in the middle of a cycle's transaction, and a router whose policy file cannot be written.

Every case compares everything the store holds before and after: nothing recorded is lost,
and nothing of the failed cycle is half-written.
"""

from __future__ import annotations

import os
import random
import resource
import signal
import subprocess
import sys
import textwrap
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from controller.clock import VirtualClock
from controller.errors import TransientError
from controller.policy import Axes, Policy, Route, loads
from controller.rollout.client import GrpcRouterTransport
from controller.store import Store, migrate
from controller.store.repository import StoreUnavailable
from tests.faults.harness import RecordingClock, reconciler
from tests.store.factories import sample_window
from tests.support.postgres import admin_execute

REPO = Path(__file__).resolve().parents[2]
AT = datetime(2027, 1, 1, tzinfo=UTC)


def everything(store: Store) -> dict[str, Any]:
    """Every record the store holds, in comparable form."""
    return {
        "windows": [(w.id, w.window) for w in store.windows()],
        "policies": [(p.version, p.checksum, p.status, p.reason) for p in store.policies()],
        "desired": store.desired_versions(),
        "routers": [(r.router_id, r.acked_version, r.acked_checksum) for r in store.routers()],
        "drift": [(d.id, d.kind) for d in store.drift_events()],
        "pushes": [(p.id, p.router_id, p.version) for p in store.pushes()],
    }


def seed(store: Store) -> None:
    store.add_window(sample_window(random.Random(1), 1_899_999_970.0))
    store.add_policy(1, "aa" * 32, "{}", "approved", "before", at=AT)
    store.set_desired("r1", 1)
    store.record_ack("r1", 1, "aa" * 32)


def half_a_cycle(tx: Any) -> None:
    wid = tx.add_window(sample_window(random.Random(2), 1_900_000_000.0))
    tx.add_drift_event("workload", 0.9, 0.2, [wid])
    tx.add_policy(2, "bb" * 32, "{}", "approved", "the cycle that fails")
    tx.set_desired("r1", 2)


# -- SQLite locked by another process ----------------------------------------------------

LOCKER = textwrap.dedent(
    """
    import sqlite3, sys
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("BEGIN EXCLUSIVE")
    print("locked", flush=True)
    sys.stdin.readline()  # hold the lock until the test says so
    conn.execute("ROLLBACK")
    print("released", flush=True)
    """
)


def test_sqlite_locked_by_another_process_is_a_bounded_transient_error(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'history.db'}"
    migrate.upgrade(url)
    with Store(url, VirtualClock(start=1_800_000_000.0), busy_timeout_ms=300) as store:
        seed(store)
        before = everything(store)
        locker = subprocess.Popen(
            [sys.executable, "-c", LOCKER, str(tmp_path / "history.db")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        try:
            assert locker.stdout is not None and locker.stdin is not None
            assert locker.stdout.readline().strip() == "locked"
            with pytest.raises(StoreUnavailable, match="locked") as caught, store.cycle() as tx:
                half_a_cycle(tx)
            assert isinstance(caught.value, TransientError)  # the daemon retries next cycle
            locker.stdin.write("go\n")
            locker.stdin.flush()
            assert locker.stdout.readline().strip() == "released"
        finally:
            locker.kill()
            locker.wait(timeout=10)

        assert everything(store) == before  # nothing of the failed cycle, nothing lost
        with store.cycle() as tx:  # the retry goes through once the lock is gone
            half_a_cycle(tx)
        after = everything(store)
        assert after["desired"] == {"r1": 2}
        assert after["policies"][:1] == before["policies"]
        assert after["windows"][:1] == before["windows"]


# -- PostgreSQL connection killed mid-transaction ----------------------------------------


def test_postgres_connection_killed_mid_cycle_rolls_the_cycle_back(
    pg_url: tuple[str, str],
) -> None:
    url, app = pg_url
    migrate.upgrade(url)
    with Store(url, VirtualClock(start=1_800_000_000.0)) as store:
        seed(store)
        before = everything(store)
        with pytest.raises(StoreUnavailable) as caught, store.cycle() as tx:
            half_a_cycle(tx)
            tx.flush()  # the rows are on the server, uncommitted
            admin_execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                f"WHERE application_name = '{app}' AND state LIKE 'idle in transaction%'"
            )
            tx.record_ack("r1", 2, "bb" * 32)
            tx.flush()
        assert isinstance(caught.value, TransientError)

        assert everything(store) == before  # the killed cycle left nothing; earlier rows intact
        with store.cycle() as tx:  # a fresh connection: the next cycle commits
            half_a_cycle(tx)
            tx.record_ack("r1", 2, "bb" * 32)
        after = everything(store)
        assert after["desired"] == {"r1": 2}
        assert after["routers"] == [("r1", 2, "bb" * 32)]
        assert after["policies"][:1] == before["policies"]


# -- a router's policy file on a full disk -------------------------------------------------

FSIZE_LIMIT = 256 * 1024


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, FSIZE_LIMIT))


def start_agent(state_file: Path, cwd: Path) -> tuple[subprocess.Popen[str], str]:
    """``pdctl router-agent`` in a process that may not write files over 256 KiB."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", "from controller.cli import main; main()", "router-agent",
         "--listen", "127.0.0.1:0", "--state-file", str(state_file), "--router-id", "full-disk"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env,
        preexec_fn=_limit_file_size,
    )
    assert proc.stdout is not None
    for _ in range(200):
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("router-agent listening on "):
            return proc, line.split()[3]
    proc.kill()
    raise AssertionError(f"router-agent did not start: {proc.communicate(timeout=10)[0]}")


def stop_agent(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    return out


async def test_full_disk_refuses_the_update_and_the_router_keeps_its_last_good_policy(
    tmp_path: Path,
) -> None:
    small = Policy.uniform(1, Route.DECODE_LOCAL)
    # About 64,000 cells: its JSON is far over the process's 256 KiB file size limit.
    edges = tuple(float(2**i) for i in range(1, 41))
    big = Policy.uniform(
        2, Route.PREFILL_NODE,
        axes=Axes(context_tokens=edges, io_ratio=tuple(e / 1e6 for e in edges), qps=edges),
    )
    state = tmp_path / "router.json"
    proc, address = start_agent(state, tmp_path)
    transport = GrpcRouterTransport()
    rec = reconciler(transport, RecordingClock(), deadline_s=20.0, max_attempts=2)
    try:
        first = await rec.reconcile({address: small})
        assert first[address].ok and first[address].acked_version == 1
        refused = await rec.reconcile({address: big})
        status = refused[address]
        assert not status.ok and status.outcome == "persist_failed"
        assert status.attempts == 3  # GetPolicy + two pushes: a disk may recover, so retried
        assert (status.acked_version, status.acked_checksum) == (1, small.checksum)
        assert "File too large" in (status.last_error or "")
        live = await transport.get(address, 5.0)
        assert (live.version, live.checksum) == (1, small.checksum)  # still serving v1
    finally:
        await transport.close()
        stop_agent(proc)

    assert loads(state.read_bytes()).checksum == small.checksum  # the file is the old one, whole
    assert sorted(os.listdir(tmp_path)) == ["router.json"]  # no temporary file left behind

    proc, address = start_agent(state, tmp_path)  # restarted: v1 from its file
    transport = GrpcRouterTransport()
    try:
        live = await transport.get(address, 5.0)
        assert (live.version, live.checksum) == (1, small.checksum)
    finally:
        await transport.close()
        stop_agent(proc)
