"""End to end with real processes: `pdctl sim serve`, a real Prometheus (Debian package)
scraping it, `pdctl run` observing through Prometheus' HTTP API and storing in the real
PostgreSQL. Bootstrap calibration, an operator recalibration through canary and promotion,
SIGTERM, and a restart that re-pushes nothing acknowledged. Every wait is bounded."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from controller.observe.source import Target
from controller.store import Store
from tests.conftest import require
from tests.daemon.test_run_live import (
    PDCTL,
    REPO,
    _all_acked,
    _config,
    _free_port,
    _get,
    _hostport,
    _start,
    _stop,
    _wait,
)
from tests.observe.promserver import HOW_TO_INSTALL, PROMETHEUS, PromServer


@pytest.mark.integration
@pytest.mark.slow
def test_sim_prometheus_daemon_on_postgresql(
    tmp_path: Path, live_sim: dict[str, Any], pg_url: str
) -> None:
    require("Prometheus", PROMETHEUS is not None, HOW_TO_INSTALL)
    targets = [Target(_hostport(w["metrics"]), w["role"]) for w in live_sim["workers"]]
    targets += [Target(_hostport(r["metrics"]), "router") for r in live_sim["routers"]]
    prom = PromServer(targets)
    store = Store(pg_url)
    try:
        upgrade = subprocess.run([*PDCTL, "db", "upgrade", "--url", pg_url], cwd=REPO,
                                 capture_output=True, text=True, timeout=60)
        assert upgrade.returncode == 0, upgrade.stderr
        listen = f"127.0.0.1:{_free_port()}"
        config = _config(tmp_path, live_sim, listen, pg_url, "e2e")
        text = config.read_text().replace("interval_s = 2.0", "interval_s = 3.0")
        config.write_text(text + f"""
[observe]
source = "prometheus"
[prometheus]
url = "{prom.url}"
timeout_s = 5
""")
        log = tmp_path / "e2e.log"
        proc = _start(config, log)
        try:
            _wait("/healthz", lambda: (r := _get(f"http://{listen}/healthz")) is not None
                  and r.status_code == 200, 60, log)
            desired = _wait("every router acknowledging the bootstrap policy",
                            lambda: _all_acked(store), 120, log)
            windows = store.windows()
            assert windows and all(w.window.source.startswith("prometheus") for w in windows)
            assert any(w.window.outcomes for w in windows)
            before = max(desired.values())
            asked = subprocess.run(
                [*PDCTL, "recalibrate", "--force", "--reason", "e2e", "--wait", "--timeout",
                 "90", "--json", "--url", pg_url],
                cwd=REPO, capture_output=True, text=True, timeout=120)
            assert asked.returncode == 0, asked.stdout + asked.stderr
            assert json.loads(asked.stdout)["claimed_by"] == "e2e"
            _wait("the recalibrated policy promoted and acknowledged everywhere",
                  lambda: (d := _all_acked(store)) and min(d.values()) > before, 120, log)
            canary_reports = [line for line in log.read_text().splitlines()
                              if '"canary": "baking' in line]
            assert canary_reports, "no canary stage in the daemon's log"
        finally:
            assert _stop(proc, 20) == 0
        acked = max(r.acked_version or 0 for r in store.routers())
        pushes = len(store.pushes())
        proc = _start(config, log)
        try:
            _wait("/healthz after the restart",
                  lambda: (r := _get(f"http://{listen}/healthz")) is not None
                  and r.status_code == 200, 60, log)
            time.sleep(6)  # two more cycles
        finally:
            assert _stop(proc, 20) == 0
        assert [p for p in store.pushes()[pushes:] if p.version <= acked] == []
    finally:
        store.close()
        prom.stop()
