"""``pdctl run`` as a real process against a live simulated cluster (``pdctl sim serve``):
scrape source, gRPC pushes, SQLite store, 2 s control interval. Every wait is bounded."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from controller.loop.leader import replica_name
from controller.observe.source import Target
from controller.store import Store
from controller.store.kinds import ADOPTED_PREFIX
from tests.conftest import require
from tests.observe.promserver import HOW_TO_INSTALL, PROMETHEUS, PromServer
from tests.support.daemon import write_config
from tests.support.processes import (
    PDCTL,
    REPO,
    free_port,
    hostport,
    http_get,
    sim_serve,
    start_daemon,
    stop_daemon,
    wait_for,
)

SCENARIO = """
name = "daemon-live"
seed = 3
duration_s = 600

[cluster]
prefill_workers = 1
decode_workers = 2
profile = "llama-3.1-8b-h100"
kv_link_gbps = 100
routers = 2
prefill_prefix_cache = true
transfer_missing_only = true

[workload]
source = "synthetic"

[workload.params]
qps = 6
turns = 4
turn1_input = 1024
turn1_output = 64
append_input = 256
append_output = 64
think_s = 1.0

[slo]
ttft_s = 0.5
tpot_s = 0.05
"""


@pytest.fixture
def live_sim(tmp_path: Path) -> Iterator[dict[str, Any]]:
    scenario = tmp_path / "scenario.toml"
    scenario.write_text(SCENARIO)
    with sim_serve(scenario) as (addresses, _):
        yield addresses


def _config(tmp_path: Path, sim: dict[str, Any], listen: str, store_url: str | None = None,
            replica: str | None = None) -> Path:
    prefill = [hostport(w["metrics"]) for w in sim["workers"] if w["role"] == "prefill"]
    decode = [hostport(w["metrics"]) for w in sim["workers"] if w["role"] == "decode"]
    routers = [r["grpc"] for r in sim["routers"]]
    router_metrics = [hostport(r["metrics"]) for r in sim["routers"]]
    return write_config(
        tmp_path / f"pd-controller-{replica or 'single'}.toml",
        listen,
        store_url or f"sqlite:///{tmp_path / 'history.db'}",
        {
            "prefill_pool": {"nodes": prefill},
            "decode_pool": {"nodes": decode},
            "routers": {"targets": routers, "metrics_targets": router_metrics},
            "slo": {"ttft_s": 0.5, "tpot_s": 0.05},
            "controller": {
                "replica_id": replica,
                "interval_s": 2.0,
                "min_training_windows": 2,
                "min_policy_interval_s": 0,
                "calibrate_every_s": 3600,
                "bake_windows": 2,
                "bake_min_requests": 5,
                "promote_margin": 0.5,
                "lease_ttl_s": 10,
                "shutdown_timeout_s": 5,
            },
            "rollout": {"push_deadline_s": 2.0, "max_attempts": 2},
            "capacity": {"interval_s": 4.0},
        },
    )


def _recommended(metrics: httpx.Response | None) -> dict[str, int] | None:
    """``pdctl_recommended_workers`` by role from an exposition (None: not both roles)."""
    if metrics is None:
        return None
    found = {}
    for line in metrics.text.splitlines():
        for role in ("prefill", "decode"):
            if line.startswith(f'pdctl_recommended_workers{{role="{role}"}} '):
                found[role] = int(float(line.rsplit(" ", 1)[1]))
    return found if len(found) == 2 else None


def _all_acked(store: Store) -> dict[str, int] | None:
    desired = store.desired_versions()
    acked = {r.router_id: r.acked_version for r in store.routers()}
    if len(desired) < 2 or any(acked.get(r) != v for r, v in desired.items()):
        return None
    return desired


@pytest.mark.integration
@pytest.mark.slow
def test_pdctl_run_controls_a_live_simulated_cluster(
    tmp_path: Path, live_sim: dict[str, Any]
) -> None:
    listen = f"127.0.0.1:{free_port()}"
    config = _config(tmp_path, live_sim, listen)
    log = tmp_path / "run.log"
    store = Store(f"sqlite:///{tmp_path / 'history.db'}")
    notify_path = str(tmp_path / "notify.sock")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    notify.settimeout(0.2)
    messages: list[str] = []
    listening = threading.Event()
    listening.set()

    def drain() -> None:  # as systemd does: read every datagram as it comes
        while listening.is_set():
            try:
                messages.append(notify.recv(4096).decode())
            except TimeoutError:
                continue

    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()
    proc = start_daemon(config, log, notify_path)
    try:
        wait_for("/healthz 200 after the first cycle",
              lambda: (r := http_get(f"http://{listen}/healthz")) is not None
              and r.status_code == 200, 60, log)
        assert (r := http_get(f"http://{listen}/readyz")) is not None and r.status_code == 200
        metrics = http_get(f"http://{listen}/metrics")
        assert metrics is not None and 'pdctl_cycles_total{result="ok"}' in metrics.text
        desired = wait_for("every router acknowledging its desired policy",
                        lambda: _all_acked(store), 90, log)
        assert set(desired) == {r["grpc"] for r in live_sim["routers"]}
        # Nothing stored: the routers' own policy is adopted as the fleet's, and the first
        # calibration is judged against it (docs/operations.md, "First start").
        policies = store.policies(status="approved")
        assert policies and policies[0].reason.startswith(ADOPTED_PREFIX), policies[0].reason
        calibrations = wait_for("a calibration recorded", store.calibrations, 60, log)
        assert calibrations[0].predicted_goodput_current is not None
        metrics = http_get(f"http://{listen}/metrics")
        assert metrics is not None and "pdctl_router_acked_version" in metrics.text
        # The capacity recommendation: stored with its inputs, exported for autoscalers.
        recs = wait_for("a stored capacity recommendation", store.recommendations, 30, log)
        assert recs[-1].body["demand"]["qps"] > 0 and recs[-1].window_ids
        assert (recs[-1].current_prefill, recs[-1].current_decode) == (1, 2)
        exported = wait_for("pdctl_recommended_workers exported",
                         lambda: _recommended(http_get(f"http://{listen}/metrics")), 30, log)
        stored = {(r.prefill_workers, r.decode_workers) for r in store.recommendations()}
        assert (exported["prefill"], exported["decode"]) in stored

        # An operator recalibration goes through canary → bake → promotion, live.
        before = max(desired.values())
        asked = subprocess.run(
            [*PDCTL, "recalibrate", "--force", "--reason", "live test", "--wait",
             "--timeout", "60", "--json", "--url", f"sqlite:///{tmp_path / 'history.db'}"],
            cwd=REPO, capture_output=True, text=True, timeout=90)
        assert asked.returncode == 0, asked.stdout + asked.stderr
        outcome = json.loads(asked.stdout)
        assert outcome["status"] == "done" and "guardrail" in outcome["outcome"]
        promoted = wait_for("the new version promoted and acknowledged everywhere",
                         lambda: (d := _all_acked(store)) and min(d.values()) > before and d,
                         60, log)
        version = max(promoted.values())
        first_push: dict[str, Any] = {}
        for p in store.pushes():
            if p.version == version and p.result == "ok":
                first_push.setdefault(p.router_id, p.at)
        canary_router = min(first_push, key=lambda r: first_push[r])
        assert len(first_push) == 2 and first_push[canary_router] < max(first_push.values())
    finally:
        code = stop_daemon(proc, 15)
    assert code == 0, log.read_text(errors="replace")[-3000:]
    assert '"stopped"' in log.read_text()
    time.sleep(0.5)
    listening.clear()
    drainer.join(5)
    notify.close()
    assert messages and messages[0].startswith("READY=1"), messages
    assert "WATCHDOG=1" in messages and messages[-1] == "STOPPING=1", messages

    acked_before = {r.router_id: r.acked_version for r in store.routers()}
    pushes_before = len(store.pushes())
    proc = start_daemon(config, log)
    try:
        wait_for("/healthz 200 after the restart",
              lambda: (r := http_get(f"http://{listen}/healthz")) is not None
              and r.status_code == 200, 60, log)
        # The restarted leader exports a recommendation again (the stored one or a new one;
        # test_cycle_capacity checks the re-export of the stored one by itself).
        assert wait_for("a recommendation exported after the restart",
                     lambda: _recommended(http_get(f"http://{listen}/metrics")), 10, log)
        time.sleep(5)  # a couple more cycles
    finally:
        code = stop_daemon(proc, 15)
    assert code == 0
    newest_acked = max(v for v in acked_before.values() if v is not None)
    repushed = [p for p in store.pushes()[pushes_before:] if p.version <= newest_acked]
    assert repushed == [], f"re-pushed acknowledged versions: {repushed}"
    store.close()


@pytest.mark.integration
@pytest.mark.slow
def test_pdctl_run_started_before_prometheus_observes_once_it_answers(
    tmp_path: Path, live_sim: dict[str, Any]
) -> None:
    """`[prometheus] discover_targets` with Prometheus not there yet (nothing listens on its
    port: a Deployment rolled out before Prometheus). The daemon stays up (it exited 3),
    skips its cycles with the reason and keeps /livez 200; once a real Prometheus starts on
    that port, the daemon discovers the workers and routers from it and stores windows."""
    require("Prometheus", PROMETHEUS is not None, HOW_TO_INSTALL)
    listen = f"127.0.0.1:{free_port()}"
    prometheus_port = free_port()
    config = _config(tmp_path, live_sim, listen)
    config.write_text(config.read_text() + (
        f'[prometheus]\nurl = "http://127.0.0.1:{prometheus_port}"\n'
        'discover_targets = true\nretries = 0\ntimeout_s = 1.0\n'
        '[observe]\nsource = "prometheus"\n'))
    log = tmp_path / "run.log"
    store = Store(f"sqlite:///{tmp_path / 'history.db'}")
    proc = start_daemon(config, log)
    prom = None
    try:
        wait_for("cycles skipped for want of targets",
                 lambda: "no targets to observe yet: target discovery failed"
                 in log.read_text(errors="replace"), 60, log)
        time.sleep(2 * 2.0)
        assert proc.poll() is None, log.read_text()[-2000:]
        live, health = http_get(f"http://{listen}/livez"), http_get(f"http://{listen}/healthz")
        assert live is not None and live.status_code == 200
        assert health is not None and health.status_code == 503
        assert store.windows() == []

        targets = [Target(hostport(w["metrics"]), w["role"]) for w in live_sim["workers"]]
        targets += [Target(hostport(r["metrics"]), "router") for r in live_sim["routers"]]
        prom = PromServer(targets, port=prometheus_port)
        windows = wait_for("windows observed through Prometheus", lambda: [
            w for w in store.windows() if len(w.window.answered) == len(targets)], 60, log)
        assert all(w.window.source.startswith("prometheus") for w in windows)
        assert "target discovery again" in log.read_text(errors="replace")
    finally:
        assert stop_daemon(proc, 20) == 0
        if prom is not None:
            prom.stop()
        store.close()


@pytest.mark.integration
def test_the_lease_outlives_a_control_interval_longer_than_itself(tmp_path: Path) -> None:
    """Two replicas on one SQLite file, a 6 s interval and a 1.5 s lease: leadership stays
    with the first replica (renewed on its own clock), it does not alternate."""
    listen = {name: f"127.0.0.1:{free_port()}" for name in ("a", "b")}
    configs = {}
    for name in ("a", "b"):
        configs[name] = tmp_path / f"{name}.toml"
        configs[name].write_text(f"""
[routers]
targets = ["127.0.0.1:9"]
[metrics]
listen = "{listen[name]}"
[store]
url = "sqlite:///{tmp_path / 'history.db'}"
[controller]
replica_id = "{name}"
interval_s = 6.0
lease_ttl_s = 1.5
""")
    log = tmp_path / "run.log"
    store = Store(f"sqlite:///{tmp_path / 'history.db'}")
    a = start_daemon(configs["a"], log)
    b = None
    try:
        wait_for("a leading", lambda: (r := http_get(f"http://{listen['a']}/healthz")) is not None
              and r.status_code == 200, 60, log)
        b = start_daemon(configs["b"], log)
        wait_for("b running", lambda: (r := http_get(f"http://{listen['b']}/healthz")) is not None
              and r.status_code == 200, 60, log)
        terms = set()
        for _ in range(16):  # 8 s: more than one interval, five lease lifetimes
            lease = store.lease()
            assert lease is not None
            assert lease.holder is not None
            terms.add((replica_name(lease.holder), lease.term))
            time.sleep(0.5)
        assert terms == {("a", 1)}, terms
    finally:
        assert stop_daemon(a, 15) == 0
        if b is not None:
            assert stop_daemon(b, 15) == 0
    store.close()
