"""Two `pdctl run` replicas on the real PostgreSQL (127.0.0.1:5432) against a live simulated
cluster: one leads; killing it hands calibration and approval to the other within the lease
time, and every decision is approved exactly once."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from controller.loop.leader import replica_name
from controller.store import Store
from tests.daemon.test_run_live import _all_acked, _config
from tests.support.processes import (
    PDCTL,
    REPO,
    free_port,
    http_get,
    start_daemon,
    stop_daemon,
    wait_for,
)


def _holder(store: Store) -> str | None:
    lease = store.lease()
    return replica_name(lease.holder) if lease is not None and lease.holder else None


@pytest.mark.integration
@pytest.mark.slow
def test_killing_the_leader_hands_over_within_the_lease_time(
    tmp_path: Path, live_sim: dict[str, Any], pg_url: str
) -> None:
    upgrade = subprocess.run([*PDCTL, "db", "upgrade", "--url", pg_url], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert upgrade.returncode == 0, upgrade.stderr
    store = Store(pg_url)
    listen = {name: f"127.0.0.1:{free_port()}" for name in ("a", "b")}
    configs = {name: _config(tmp_path, live_sim, listen[name], pg_url, name)
               for name in ("a", "b")}
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b")}
    a = start_daemon(configs["a"], logs["a"])
    b: subprocess.Popen[bytes] | None = None
    try:
        wait_for("replica a leading", lambda: _holder(store) == "a", 60, logs["a"])
        b = start_daemon(configs["b"], logs["b"])
        wait_for("every router acknowledging a's policy", lambda: _all_acked(store), 90, logs["a"])
        # The routers' own policy is adopted at once; a has calibrated too before it dies.
        wait_for("a's first calibration", store.calibrations, 60, logs["a"])
        wait_for("replica b healthy (as a follower)",
              lambda: (r := http_get(f"http://{listen['b']}/healthz")) is not None
              and r.status_code == 200, 60, logs["b"])
        assert _holder(store) == "a"
        metrics_b = http_get(f"http://{listen['b']}/metrics")
        assert metrics_b is not None and "pdctl_leader 0.0" in metrics_b.text

        a.send_signal(signal.SIGKILL)  # no release: the lock goes with the connection
        a.wait(10)
        killed_at = time.monotonic()
        wait_for("replica b taking over", lambda: _holder(store) == "b", 30, logs["b"])
        took_s = time.monotonic() - killed_at
        lease = store.lease()
        assert lease is not None and lease.term >= 2
        # Lease ttl 10 s + one 2 s interval + process scheduling slack.
        assert took_s < 10 + 2 * 2 + 5, f"takeover took {took_s:.1f} s"
        rid = store.add_request("recalibrate", {"force": True}, "test@failover", "after failover")
        wait_for("b acting on a request", lambda: (r := store.request(rid)) is not None
              and r.status in ("done", "failed"), 60, logs["b"])
        request = store.request(rid)
        assert request is not None and request.claimed_by is not None
        assert replica_name(request.claimed_by) == "b"
        metrics_b = http_get(f"http://{listen['b']}/metrics")
        assert metrics_b is not None and "pdctl_leader 1.0" in metrics_b.text
    finally:
        if a.poll() is None:
            a.kill()
            a.wait(5)
        if b is not None and b.poll() is None:
            assert stop_daemon(b, 15) == 0
    # Exactly one approval per decision: each approved policy that came from a calibration
    # has one calibration, and no calibration approved two policies.
    calibrations = store.calibrations()
    versions = [c.policy_version for c in calibrations if (c.details or {}).get("approved")
                and c.policy_version is not None]
    assert len(versions) == len(set(versions))
    approved_by_fit = [p for p in store.policies() if p.version in set(versions)]
    assert len(approved_by_fit) == len(versions) >= 1
    store.close()
