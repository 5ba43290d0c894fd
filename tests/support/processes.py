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


# ``pdctl sim serve --port-base N`` of a one-router, one-P, two-D scenario listens on these
# offsets from N: the router, its gRPC, prefill-0, decode-0 and decode-1, the daemon's metrics.
LAYOUT_OFFSETS = (0, 100, 200, 300, 301, 400)


def port_free(port: int) -> bool:
    """Whether a loopback TCP port can be bound now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_base(offsets: tuple[int, ...] = LAYOUT_OFFSETS) -> int:
    """A ``--port-base`` below the ephemeral range whose ports (``offsets`` from it) could
    all be bound together a moment ago."""
    import contextlib

    for _ in range(200):
        base = _random.randrange(_PICK_FROM.start, _PICK_FROM.stop - max(offsets), 10)
        try:
            with contextlib.ExitStack() as stack:
                for offset in offsets:
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
    raise AssertionError(f"no free port base in {_PICK_FROM.start}-{_PICK_FROM.stop - 1}")


def write_scenario(path: Path, name: str, seed: int, *, duration_s: float = 600,
                   routers: int = 1, qps: float = 4, think_s: float = 0.5,
                   turn1: tuple[int, int] = (512, 32), append: tuple[int, int] = (64, 32),
                   extra: str = "") -> Path:
    """A synthetic three-turn scenario on one prefill and two decode workers at ``path``:
    ``turn1`` and ``append`` are (input, output) tokens; ``extra`` is appended TOML."""
    path.write_text(f"""
name = "{name}"
seed = {seed}
duration_s = {duration_s}
[cluster]
prefill_workers = 1
decode_workers = 2
routers = {routers}
[workload]
source = "synthetic"
[workload.params]
qps = {qps}
turns = 3
turn1_input = {turn1[0]}
turn1_output = {turn1[1]}
append_input = {append[0]}
append_output = {append[1]}
think_s = {think_s}
{extra}""")
    return path


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


# A read waits as long as a Prometheus scrape would (its default timeout): on a loaded
# machine a healthy daemon may take over 2 s to answer.
SCRAPE_TIMEOUT_S = 10.0


def http_get(url: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> httpx.Response | None:
    """GET; None when nothing answers within ``timeout_s``."""
    try:
        return httpx.get(url, timeout=timeout_s, trust_env=False)
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
