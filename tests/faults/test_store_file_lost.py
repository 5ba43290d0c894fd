"""The SQLite store's file removed or replaced under a running `pdctl run` (issue 39, class 3).

A real daemon (0.5 s cycles) on a real SQLite file; the test deletes the file with its
``-wal`` and ``-shm`` (or puts another file at its path). Expected: detected within a cycle,
writes stop (nothing written to the unlinked file, no new file created at the path),
``/healthz`` fails with the reason, the daemon exits 3 after ``STORE_GONE_GRACE_S``; a
restart refuses to start an empty history there unless asked (``--init``)."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from controller.daemon import STORE_GONE_GRACE_S
from tests.support.daemon import write_config
from tests.support.processes import PDCTL, REPO, free_port, http_get, start_daemon, wait_for

pytestmark = [pytest.mark.integration]


def _windows(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute("SELECT count(*) FROM windows").fetchone()[0])


def _log_messages(log: Path) -> list[str]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            out.append(str(json.loads(line).get("msg", "")))
        except ValueError:
            continue
    return out


def _start(tmp_path: Path) -> tuple[Path, Path, str, Path]:
    db = tmp_path / "history.db"
    listen = f"127.0.0.1:{free_port()}"
    config = write_config(tmp_path / "c.toml", listen, f"sqlite:///{db}", {
        "routers": {"targets": [f"127.0.0.1:{free_port()}"]},  # nobody there: windows only
        "controller": {"interval_s": 0.5, "lease_ttl_s": 3, "shutdown_timeout_s": 5},
        "rollout": {"push_deadline_s": 0.5, "max_attempts": 1},
    })
    return db, config, listen, tmp_path / "run.log"


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_lost_store_file_stops_writes_fails_health_and_exits(tmp_path: Path, how: str) -> None:
    db, config, listen, log = _start(tmp_path)
    proc = start_daemon(config, log)  # the first start at a new path creates the store
    try:
        wait_for("/healthz ok", lambda: (r := http_get(f"http://{listen}/healthz")) is not None
                 and r.status_code == 200, 60, log)
        wait_for("windows stored", lambda: _windows(db) >= 2, 30, log)
        if how == "removed":
            for suffix in ("", "-wal", "-shm"):
                Path(f"{db}{suffix}").unlink(missing_ok=True)
        else:  # another database file at its path (a restore done wrongly, a deploy)
            other = tmp_path / "other.db"
            shutil.copy(db, other)
            os.replace(other, db)
            kept = _windows(db)
        lost_at = time.monotonic()
        r = wait_for("/healthz failing", lambda: (r := http_get(f"http://{listen}/healthz"))
                     is not None and r.status_code == 503 and r, 10, log)
        assert how in r.json()["status"], r.json()
        detected_s = time.monotonic() - lost_at
        code = proc.wait(STORE_GONE_GRACE_S + 20)
        exited_s = time.monotonic() - lost_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert code == 3, log.read_text(errors="replace")[-3000:]
    assert detected_s < 3.0  # within a cycle or two of 0.5 s (plus process scheduling)
    assert STORE_GONE_GRACE_S - 1 <= exited_s <= STORE_GONE_GRACE_S + 15
    messages = _log_messages(log)
    lost = next(i for i, m in enumerate(messages) if f"was {how}" in m)
    assert not any(m.startswith("cycle ok") for m in messages[lost + 1:])
    if how == "removed":
        assert not db.exists()  # no empty store created in its place
    else:
        assert _windows(db) == kept  # nothing written to the new file either


def test_a_restart_refuses_to_start_an_empty_history_unless_asked(tmp_path: Path) -> None:
    db, config, listen, log = _start(tmp_path)

    def run_until_healthy(*args: str) -> None:
        proc = start_daemon(config, log) if not args else subprocess.Popen(
            [*PDCTL, "run", "--config", str(config), *args], cwd=REPO,
            stdout=subprocess.DEVNULL, stderr=log.open("ab"))
        try:
            wait_for("/healthz ok", lambda: (r := http_get(f"http://{listen}/healthz"))
                     is not None and r.status_code == 200, 60, log)
        finally:
            proc.terminate()
            assert proc.wait(20) == 0

    run_until_healthy()  # the first start at a new path creates the store (and its marker)
    assert db.exists() and _windows(db) >= 1
    for suffix in ("", "-wal", "-shm"):  # removed while the daemon was stopped
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    refused = subprocess.run([*PDCTL, "run", "--config", str(config)], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 3, refused.stderr
    assert f"no store at {db}" in refused.stderr and "--init" in refused.stderr
    assert not db.exists()
    run_until_healthy("--init")  # asked: a new, empty history
    assert _windows(db) >= 1
    for suffix in ("", "-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    upgrade = subprocess.run([*PDCTL, "db", "upgrade", "--config", str(config)], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert upgrade.returncode == 0, upgrade.stderr
    run_until_healthy()  # `pdctl db upgrade` created it: the daemon starts on it
