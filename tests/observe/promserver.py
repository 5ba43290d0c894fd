"""A real Prometheus (Debian's 2.42 binary) on loopback for tests and benchmarks.

Started from a temporary directory with a generated config that scrapes the given targets
every second; each target carries a ``role`` label. No systemd, no network beyond 127.0.0.1.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from controller.observe.source import Target
from tests.support.processes import free_port

PROMETHEUS = shutil.which("prometheus")
HOW_TO_INSTALL = "apt-get install -y --no-install-recommends prometheus"


def _ts(text: str) -> float:
    # "2026-11-30T05:20:00.123456789Z" (nanoseconds) -> epoch seconds
    m = re.match(r"(.*T\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)$", text)
    if not m:
        return 0.0
    base = datetime.fromisoformat(m.group(1) + ("+00:00" if m.group(3) == "Z" else m.group(3)))
    frac = float("0" + m.group(2)) if m.group(2) else 0.0
    return base.timestamp() + frac


class PromServer:
    def __init__(self, targets: Sequence[Target], scrape_interval_s: int = 1,
                 also: Sequence[tuple[str, str]] = (), port: int | None = None) -> None:
        """``also``: (HOST:PORT, role) scraped too that are not observation targets (the
        controller's own /metrics). ``port``: where to listen (a free one by default)."""
        assert PROMETHEUS is not None
        self.targets = list(targets)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._dir = Path(tempfile.mkdtemp(prefix="pdctl-prom-"))
        groups = [
            {"targets": [t.name], "labels": {"role": t.role}} for t in self.targets
        ] + [{"targets": [name], "labels": {"role": role}} for name, role in also]
        config = {
            "global": {"scrape_interval": f"{scrape_interval_s}s",
                       "evaluation_interval": f"{scrape_interval_s}s",
                       "scrape_timeout": f"{scrape_interval_s}s"},
            "scrape_configs": [{"job_name": "pd", "static_configs": groups}],
        }
        # JSON is YAML: no YAML library needed.
        (self._dir / "prometheus.yml").write_text(json.dumps(config, indent=1))
        self._log = open(self._dir / "prometheus.log", "wb")  # noqa: SIM115
        self._proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={self._dir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self._dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle",
             "--storage.tsdb.retention.time=1h", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError("prometheus exited: " + self.log())
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("prometheus did not become ready in 20 s: " + self.log())

    def log(self) -> str:
        return (self._dir / "prometheus.log").read_text(errors="replace")[-2000:]

    def _get(self, path: str) -> dict:  # type: ignore[type-arg]
        with urllib.request.urlopen(self.url + path, timeout=5) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def active_targets(self) -> list[dict]:  # type: ignore[type-arg]
        return list(self._get("/api/v1/targets?state=active")["data"]["activeTargets"])

    def wait_scraped_after(self, t: float, timeout_s: float = 15.0,
                           expect_down: Sequence[str] = ()) -> None:
        """Until every target was scraped after epoch ``t`` (and those named are down)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            active = self.active_targets()
            done = len(active) == len(self.targets)
            for a in active:
                instance = a["labels"]["instance"]
                if _ts(a.get("lastScrape", "")) <= t:
                    done = False
                if instance in expect_down and a.get("health") != "down":
                    done = False
            if done:
                return
            time.sleep(0.1)
        raise TimeoutError(f"Prometheus did not scrape every target after {t}")

    def http_requests(self) -> dict[str, float]:
        """Prometheus' own count of API requests it served, by handler."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("prometheus_http_requests_total{"):
                handler = re.search(r'handler="([^"]*)"', line)
                if handler:
                    out[handler.group(1)] = out.get(handler.group(1), 0.0) + float(
                        line.rsplit(" ", 1)[1])
        return out

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        self._log.close()
        shutil.rmtree(self._dir, ignore_errors=True)
