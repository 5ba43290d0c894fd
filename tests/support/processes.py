"""The real processes the integration tests start: ``pdctl sim serve`` (the live simulated
cluster: workers' and routers' /metrics, the routers' gRPC, its OpenAI endpoint) and
``pdctl run`` (the daemon), with bounded waits."""

from __future__ import annotations

import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
PDCTL = [sys.executable, "-c", "from controller.cli import main; main()"]
READY_TIMEOUT_S = 60.0


# Below Linux's ephemeral range (32768-60999): a port picked here and bound later by a
# subprocess was taken meanwhile by some other test's bind(0) or outgoing connection, which
# draw from that range ("address already in use" when tests ran side by side).
_PICK_FROM = range(20000, 32000)
_random = random.Random()  # not the tests' seeded global generator: two runs pick apart


def free_port() -> int:
    """A loopback TCP port that was free a moment ago, outside the ephemeral range."""
    for _ in range(200):
        port = _random.choice(_PICK_FROM)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free loopback port in {_PICK_FROM.start}-{_PICK_FROM.stop - 1}")


def hostport(url: str) -> str:
    """``http://127.0.0.1:9400/metrics`` -> ``127.0.0.1:9400``."""
    return url.split("//", 1)[1].split("/", 1)[0]


@contextmanager
def sim_serve(
    scenario: Path, *args: str
) -> Iterator[tuple[dict[str, Any], subprocess.Popen[str]]]:
    """Start ``pdctl sim serve SCENARIO --json ARGS...``; yield the addresses it prints once
    everything listens, and the process. Stopped with SIGTERM (then SIGKILL) on exit.

    Raises RuntimeError, with the end of its stderr, when no address line comes within
    ``READY_TIMEOUT_S``.
    """
    # stderr goes to a file, not a pipe: nobody reads it while the tests run, and a full pipe
    # would block the simulator.
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([*PDCTL, "sim", "serve", str(scenario), "--json", *args],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT_S)
            line = proc.stdout.readline() if ready else ""
            if not line:
                proc.kill()
                proc.wait(5)
                log.seek(0)
                err = log.read()[-2000:].decode(errors="replace")
                raise RuntimeError(f"pdctl sim serve printed no addresses: {err}")
            yield json.loads(line), proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)


def start_daemon(config: Path, log: Path, notify: str | None = None, *, init: bool = False
                 ) -> subprocess.Popen[bytes]:
    """``pdctl run --config CONFIG --log-json`` (``--init``: a missing SQLite store is
    created), its log appended to ``log``; with ``notify``, as systemd would run it
    (Type=notify, WatchdogSec=2)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if notify is not None:
        env.update(NOTIFY_SOCKET=notify, WATCHDOG_USEC="2000000")
    args = [*PDCTL, "run", "--config", str(config), "--log-json", *(["--init"] if init else [])]
    return subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=log.open("ab"),
                            env=env)


def wait_for(what: str, check: Any, timeout_s: float, log: Path) -> Any:
    """Poll ``check()`` until it returns something true; past ``timeout_s``, fail with the end
    of ``log``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.25)
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{tail}")


def http_get(url: str) -> httpx.Response | None:
    """GET with a 2 s timeout; None when nothing answers."""
    try:
        return httpx.get(url, timeout=2.0, trust_env=False)
    except httpx.HTTPError:
        return None


def stop_daemon(proc: subprocess.Popen[bytes], within_s: float) -> int:
    """SIGTERM and the exit code; fails (after a SIGKILL) when it takes over ``within_s``."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(within_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
        raise AssertionError(f"pdctl run did not exit within {within_s} s of SIGTERM") from None
