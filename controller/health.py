"""``/healthz``, ``/readyz`` and ``/metrics`` on one small asyncio HTTP server.

- ``/livez`` (liveness) says the control loop turns: 200 while a cycle *ended*, whatever
  its result, within ``stalled_after_s``. A wedged loop turns it 503 and a restart is the
  cure. A cycle skipped or failed because Prometheus, the workers or the database are down
  still ended: restarting would not bring them back, and would stop the reconciling of
  routers (and leave the pod crash-looping, in backoff, when they return).
- ``/healthz`` says the loop succeeds: 200 only while a cycle completed ``ok`` within
  ``stalled_after_s`` (what ``PdControllerStalled`` alerts on). For people and monitoring,
  not for a liveness probe.
- Before the first cycle ``/healthz`` is 503; ``/livez`` is 200 for ``stalled_after_s``
  from the start (a sidecar has no startup probe to cover its start: see
  ``deploy/kubernetes/sidecar.yaml``), then 503 until a cycle ends.
- ``/readyz`` is 200 once the daemon's own loop is up (config loaded, store reachable and
  at the schema head, scheduler started). It never depends on reaching a router. The
  standalone Deployment's startup and readiness probe; the native sidecar has neither, so
  that its router never waits on it (``deploy/kubernetes/sidecar.yaml``).
- ``/metrics`` renders the injected registry (never a global one).

Only GET and HEAD; one request per connection; bodies are small JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from controller.clock import Clock

log = logging.getLogger("pdctl.health")

_MAX_REQUEST_BYTES = 8192
_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 400: "Bad Request",
            503: "Service Unavailable"}


class Health:
    """What the probes answer from: readiness set by the daemon, progress by the loop."""

    def __init__(self, clock: Clock, stalled_after_s: float,
                 last_cycle: Callable[[], float | None] | None = None,
                 last_ended: Callable[[], float | None] | None = None,
                 started_at: float | None = None) -> None:
        self.clock = clock
        self.stalled_after_s = stalled_after_s
        self.started_at = clock.now() if started_at is None else started_at
        self._last_cycle = last_cycle or (lambda: None)  # the last ok cycle
        self._last_ended = last_ended or self._last_cycle  # the last cycle, any result
        self.ready = False
        self.ready_reason = "starting"
        self.failure: str | None = None  # fatal: every probe fails with it (the store lost)
        self.details: Callable[[], dict[str, Any]] = dict

    def last_cycle_at(self) -> float | None:
        return self._last_cycle()

    def healthy(self) -> tuple[bool, dict[str, Any]]:
        """``/healthz``: a cycle completed ok within ``stalled_after_s``."""
        if self.failure is not None:
            return False, {"status": f"failing: {self.failure}", **self.details()}
        return self._fresh(self.last_cycle_at(), "completed", "last_cycle_age_s")

    def live(self) -> tuple[bool, dict[str, Any]]:
        """``/livez``: a cycle ended, whatever its result, within ``stalled_after_s``."""
        if self.failure is not None:
            return False, {"status": f"failing: {self.failure}", **self.details()}
        ended = self._last_ended()
        since_start = self.clock.now() - self.started_at
        if ended is None and since_start <= self.stalled_after_s:
            doc: dict[str, Any] = {"stalled_after_s": self.stalled_after_s, **self.details()}
            return True, {**doc, "status": f"starting: no cycle ended yet ({since_start:.0f} s "
                          "since the start)"}
        ok, doc = self._fresh(ended, "ended", "last_cycle_end_age_s")
        last_ok = self.last_cycle_at()
        if last_ok is not None:
            doc["last_cycle_age_s"] = round(self.clock.now() - last_ok, 3)
        return ok, doc

    def _fresh(self, last: float | None, what: str, key: str) -> tuple[bool, dict[str, Any]]:
        doc: dict[str, Any] = {"stalled_after_s": self.stalled_after_s, **self.details()}
        if last is None:
            return False, {**doc, "status": f"no cycle {what} yet"}
        age = self.clock.now() - last
        doc[key] = round(age, 3)
        if age > self.stalled_after_s:
            return False, {**doc, "status": f"stalled: no cycle {what} for {age:.0f} s"}
        return True, {**doc, "status": "ok"}

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        if self.failure is not None:
            return False, {"status": f"failing: {self.failure}"}
        return self.ready, {"status": "ready" if self.ready else self.ready_reason}


class HealthServer:
    def __init__(self, health: Health, registry: CollectorRegistry, listen: str) -> None:
        host, _, port = listen.rpartition(":")
        self.health = health
        self.registry = registry
        self.host = host.strip("[]") or "127.0.0.1"
        self.port = int(port)
        self._server: asyncio.base_events.Server | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        sock = self._server.sockets[0]
        self.port = int(sock.getsockname()[1])  # port 0: the one the OS chose

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError,
                ConnectionError):
            writer.close()
            return
        try:
            status, ctype, body, head_only = self._route(head[:_MAX_REQUEST_BYTES])
            writer.write(
                f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            )
            if not head_only:
                writer.write(body)
            await writer.drain()
        except Exception:
            log.exception("health endpoint failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _route(self, head: bytes) -> tuple[int, str, bytes, bool]:
        try:
            method, target, _ = head.split(b"\r\n", 1)[0].decode("ascii").split(" ", 2)
        except (UnicodeDecodeError, ValueError):
            return 400, "text/plain", b"bad request\n", False
        path = target.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"GET or HEAD only\n", False
        head_only = method == "HEAD"
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry), head_only
        if path == "/livez":
            ok, doc = self.health.live()
        elif path == "/healthz":
            ok, doc = self.health.healthy()
        elif path == "/readyz":
            ok, doc = self.health.readiness()
        else:
            return 404, "text/plain", b"not found: /livez /healthz /readyz /metrics\n", head_only
        body = (json.dumps(doc, default=str) + "\n").encode()
        return (200 if ok else 503), "application/json", body, head_only
