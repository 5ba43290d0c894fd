"""Real processes for the router's tests: ``tests/router/fake_vllm.py`` engines and
``pdctl router serve``, with bounded waits."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.support.processes import PDCTL, REPO, free_port

FAKE = REPO / "tests" / "router" / "fake_vllm.py"
READY_S = 30.0


class Engine:
    """One fake engine process."""

    def __init__(self, engine_id: str, interval_ms: float = 0.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.engine_id = engine_id
        self.proc = subprocess.Popen(
            [sys.executable, str(FAKE), "--port", str(self.port), "--engine-id", engine_id,
             "--interval-ms", str(interval_ms)], cwd=REPO, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fake engine {engine_id} exited {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0, trust_env=False).status_code:
                    return
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError(f"fake engine {engine_id} did not start")

    def behave(self, **behaviour: Any) -> None:
        httpx.post(self.url + "/_fake/behaviour", json=behaviour, timeout=5.0,
                   trust_env=False).raise_for_status()

    def log(self) -> list[dict[str, Any]]:
        return list(httpx.get(self.url + "/_fake/log", timeout=5.0, trust_env=False).json())

    def stats(self) -> dict[str, int]:
        return dict(httpx.get(self.url + "/_fake/stats", timeout=5.0, trust_env=False).json())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


@contextmanager
def engines(*ids: str, interval_ms: float = 0.0) -> Iterator[list[Engine]]:
    started: list[Engine] = []
    try:
        for i in ids:
            started.append(Engine(i, interval_ms))
        yield started
    finally:
        for e in started:
            e.kill()


def router_toml(prefill: Sequence[str], decode: Sequence[str], *, http_port: int,
                grpc_port: int, extra: str = "", http_extra: str = "",
                grpc_extra: str = "") -> str:
    def lst(xs: Sequence[str]) -> str:
        return "[" + ", ".join(f'"{x}"' for x in xs) + "]"

    return (f'[http]\nlisten = "127.0.0.1:{http_port}"\n{http_extra}'
            f'[grpc]\nlisten = "127.0.0.1:{grpc_port}"\n{grpc_extra}'
            f"[instances]\nprefill = {lst(prefill)}\ndecode = {lst(decode)}\n"
            "health_interval_s = 0.2\n" + extra)


class RouterProc:
    def __init__(self, proc: subprocess.Popen[str], url: str, grpc: str, log: Any,
                 line: str = "") -> None:
        self.proc, self.url, self.grpc, self._log = proc, url, grpc, log
        self.line = line  # what it printed when ready

    def worker_pids(self) -> list[int]:
        """The worker processes' ids ([http] processes > 1)."""
        part = self.line.split("processes: ", 1)[1].split(";", 1)[0]
        return [int(x) for x in part.split(",")]

    def log_text(self) -> str:
        self._log.seek(0)
        return str(self._log.read().decode(errors="replace"))

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=5.0, trust_env=False).text


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 when none)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


@contextmanager
def router_serve(toml: str, tmp: Path) -> Iterator[RouterProc]:
    """``pdctl router serve`` on ``toml``; yields once it prints its listening line."""
    cfg = tmp / f"router-{time.monotonic_ns()}.toml"
    cfg.write_text(toml)
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([*PDCTL, "router", "serve", "--config", str(cfg)], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=log, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], READY_S)
            line = proc.stdout.readline() if ready else ""
            if "router listening on" not in line:
                proc.kill()
                proc.wait(5)
                log.seek(0)
                raise RuntimeError(f"router did not start: {line}\n"
                                   f"{log.read()[-3000:].decode(errors='replace')}")
            url = line.split("router listening on ", 1)[1].split(" ", 1)[0]
            grpc = line.split("policy gRPC on ", 1)[1].split(";", 1)[0]
            yield RouterProc(proc, url, grpc, log, line)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
