"""HTTP traffic driver: a scenario's workload as real OpenAI chat requests to a router URL.

The sessions are the ones the in-simulation routers get (:func:`controller.sim.run.session_feed`:
same seed, rate-scale events and workload switches applied). Each session is one
conversation sent with header ``X-Session-Id``: turn k's request is turn k-1's messages, the
assistant's answer to it, and a new user message whose length (:func:`fill_message`) makes the
chat prompt the turn's ``prompt_tokens`` by the tokenizer (turn 1's opens with
``[<session>]``, so conversations differ from their first tokens) (the bundled one unless given) —
never shorter than the history already is. ``max_tokens`` is the turn's ``output_tokens``
(the simulated engine generates exactly ``max_tokens``, so the cluster sees the workload's
true output lengths). Requests stream, with ``stream_options.include_usage``.

Pacing (wall clock, :mod:`controller.clock`): turn 1 of a session at its start time after
the driver's start; a later turn ``think_s`` after the previous answer ended (closed loop,
as :class:`controller.sim.run.ScenarioDriver`). A failed turn ends its session.

Bounds: sessions start only before ``duration_s``; at most ``max_concurrency`` requests in
flight and ``max_requests`` sent; every request has a timeout; ``drain_s`` after
``duration_s`` (or when ``stop`` is set: SIGTERM, Ctrl-C) what is still in flight is
cancelled and counted failed, reason ``stopped``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import httpx

from controller.clock import WallClock
from controller.sim.run import session_feed
from controller.sim.scenario import Scenario
from controller.sim.workloads.base import SessionSpec
from controller.tokenize import Tokenizer, bundled_tokenizer_dir, fill_message, load_tokenizer

log = logging.getLogger(__name__)

SESSION_HEADER = "X-Session-Id"
DECODE_HEADER = "x-pdrouter-decode"  # the D ``pdctl router serve`` sent a request to


class FailReason(StrEnum):
    """Why a request counts as failed."""

    HTTP_STATUS = "http_status"  # an answer other than 200 (the codes: ``DriveStats.statuses``)
    TIMEOUT = "timeout"  # no complete answer within ``request_timeout_s``
    TRANSPORT = "transport"  # connection refused or reset
    STREAM_ERROR = "stream_error"  # an ``error`` event in the stream
    INCOMPLETE = "incomplete"  # the stream ended without ``[DONE]`` or without usage
    STOPPED = "stopped"  # in flight when the driver stopped (signal or drain limit)


@dataclass(frozen=True, slots=True)
class DriveLimits:
    duration_s: float  # sessions start before this (seconds after the driver starts)
    max_concurrency: int = 64
    max_requests: int = 100_000
    request_timeout_s: float = 120.0
    drain_s: float = 60.0  # after duration_s, how long later turns may still run

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.max_concurrency < 1 or self.max_requests < 1 \
                or self.request_timeout_s <= 0 or self.drain_s < 0:
            raise ValueError(f"drive limits out of range: {self}")


@dataclass(slots=True)
class DriveStats:
    sessions: int = 0
    sent: int = 0
    ok: int = 0
    failed: Counter[FailReason] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    prompt_tokens: int = 0  # as the answers' usage reports them
    completion_tokens: int = 0
    stopped_by: str = ""  # "signal", "drain limit", "request budget" or "" (ran out)
    split_sessions: int = 0  # sessions whose answers named more than one D (DECODE_HEADER)

    def as_dict(self) -> dict[str, Any]:
        return {"sessions": self.sessions, "sent": self.sent, "ok": self.ok,
                "failed": sum(self.failed.values()),
                "failed_by_reason": {str(k): v for k, v in sorted(self.failed.items())},
                "http_statuses": {str(k): v for k, v in sorted(self.statuses.items())},
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "stopped_by": self.stopped_by,
                "split_sessions": self.split_sessions}


def chat_url(target: str) -> str:
    """``.../v1/chat/completions`` of a router given as ``http://host:port`` or ``.../v1``."""
    base = target.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    return base + "/chat/completions"


class TrafficDriver:
    """Replays ``scenario``'s sessions against ``target`` (see the module docstring)."""

    def __init__(self, scenario: Scenario, target: str | Sequence[str], limits: DriveLimits,
                 *, tokenizer: Tokenizer | None = None, model: str | None = None,
                 session_prefix: str = "drive", clock: WallClock | None = None) -> None:
        self.scenario = scenario
        targets = [target] if isinstance(target, str) else list(target)
        if not targets:
            raise ValueError("drive: no target")
        # several routers: each session goes to one, in turn (all its turns to that one)
        self.urls = [chat_url(t) for t in targets]
        self.limits = limits
        self.tokenizer = tokenizer or load_tokenizer(bundled_tokenizer_dir())
        self.model = model or scenario.profile.model_name
        self.prefix = session_prefix
        self.clock = clock or WallClock()
        self.stats = DriveStats()
        self._gate = asyncio.Semaphore(limits.max_concurrency)
        self._t0 = 0.0

    def sessions(self) -> Iterator[tuple[float, SessionSpec]]:
        """(start offset, session) in start order, those starting before ``duration_s``."""
        for start, spec in session_feed(self.scenario, random.Random(self.scenario.seed)):
            if start >= self.limits.duration_s:
                return
            yield start, spec

    async def run(self, stop: asyncio.Event | None = None) -> DriveStats:
        """Drive until the sessions are done, ``stop`` is set, or ``duration_s + drain_s``."""
        stop = stop or asyncio.Event()
        self._t0 = self.clock.monotonic()
        timeout = httpx.Timeout(self.limits.request_timeout_s, connect=10.0)
        pool = httpx.Limits(max_connections=self.limits.max_concurrency,
                            max_keepalive_connections=self.limits.max_concurrency)
        async with httpx.AsyncClient(timeout=timeout, limits=pool, trust_env=False) as http:
            tasks: set[asyncio.Task[None]] = set()
            feeder = asyncio.create_task(self._start_sessions(http, stop, tasks))
            await self._wait_done(feeder, tasks, stop)
        return self.stats

    async def _wait_done(self, feeder: asyncio.Task[None], tasks: set[asyncio.Task[None]],
                         stop: asyncio.Event) -> None:
        hard = self._t0 + self.limits.duration_s + self.limits.drain_s
        stopper = asyncio.create_task(stop.wait())
        try:
            while True:
                pending = {t for t in (feeder, *tasks) if not t.done()}
                if not pending:
                    return
                left = hard - self.clock.monotonic()
                if left <= 0 or stop.is_set():
                    break
                await asyncio.wait({*pending, stopper}, timeout=left,
                                   return_when=asyncio.FIRST_COMPLETED)
            self.stats.stopped_by = self.stats.stopped_by or (
                "signal" if stop.is_set() else "drain limit")
            for t in (feeder, *tasks):
                t.cancel()
            await asyncio.gather(feeder, *tasks, return_exceptions=True)
        finally:
            stopper.cancel()

    async def _start_sessions(self, http: httpx.AsyncClient, stop: asyncio.Event,
                              tasks: set[asyncio.Task[None]]) -> None:
        for start, spec in self.sessions():
            if await self._sleep_until(self._t0 + start, stop):
                return
            if self.stats.sent >= self.limits.max_requests:
                self.stats.stopped_by = "request budget"
                return
            url = self.urls[self.stats.sessions % len(self.urls)]
            self.stats.sessions += 1
            tasks.add(asyncio.create_task(self._session(http, spec, stop, url)))

    async def _sleep_until(self, at: float, stop: asyncio.Event) -> bool:
        """Wait until monotonic time ``at``; True when ``stop`` was set first."""
        delay = at - self.clock.monotonic()
        if delay > 0 and not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=delay)
        return stop.is_set()

    async def _session(self, http: httpx.AsyncClient, spec: SessionSpec,
                       stop: asyncio.Event, url: str) -> None:
        session = f"{self.prefix}-{spec.session_id}"
        messages: list[dict[str, str]] = []
        decodes: set[str] = set()
        try:
            await self._turns(http, spec, session, messages, decodes, stop, url)
        finally:
            self.stats.split_sessions += len(decodes) > 1

    async def _turns(self, http: httpx.AsyncClient, spec: SessionSpec, session: str,
                     messages: list[dict[str, str]], decodes: set[str],
                     stop: asyncio.Event, url: str) -> None:
        for i, turn in enumerate(spec.turns):
            if i > 0 and await self._sleep_until(self.clock.monotonic() + turn.think_s, stop):
                return
            if self.stats.sent >= self.limits.max_requests:
                self.stats.stopped_by = self.stats.stopped_by or "request budget"
                return
            # the session id leads the conversation: without it every conversation would
            # open with the same tokens, and a prefix cache keyed by them (vLLM's, the
            # simulated workers') would take one conversation's KV for another's
            lead = f"[{session}] " if i == 0 else ""
            content = fill_message(self.tokenizer, messages, turn.prompt_tokens, lead=lead)
            messages.append({"role": "user", "content": content})
            reply = await self._request(http, url, session, messages, turn.output_tokens,
                                        decodes)
            if reply is None:
                return  # a failed turn ends its session (ScenarioDriver does the same)
            messages.append({"role": "assistant", "content": reply})

    async def _request(self, http: httpx.AsyncClient, url: str, session: str,
                       messages: list[dict[str, str]], max_tokens: int,
                       decodes: set[str]) -> str | None:
        """One streamed chat request; the assistant's text, or None (counted failed)."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                "stream": True, "stream_options": {"include_usage": True}}
        async with self._gate:
            self.stats.sent += 1
            try:
                async with http.stream("POST", url, json=body,
                                       headers={SESSION_HEADER: session}) as resp:
                    if resp.status_code != 200:
                        self.stats.statuses[resp.status_code] += 1
                        return self._fail(FailReason.HTTP_STATUS)
                    if DECODE_HEADER in resp.headers:
                        decodes.add(resp.headers[DECODE_HEADER])
                    text, failure = await self._read_stream(resp)
            except httpx.TimeoutException:
                return self._fail(FailReason.TIMEOUT)
            except httpx.HTTPError:
                return self._fail(FailReason.TRANSPORT)
            except asyncio.CancelledError:
                self._fail(FailReason.STOPPED)
                raise
        if failure is not None:
            return self._fail(failure)
        self.stats.ok += 1
        return text

    def _fail(self, reason: FailReason) -> str | None:
        """Count a failed request; None, the failed turn's (absent) answer."""
        self.stats.failed[reason] += 1
        return None

    async def _read_stream(self, resp: httpx.Response) -> tuple[str, FailReason | None]:
        """(assistant text, None) for a complete stream with usage, else the failure."""
        parts: list[str] = []
        usage: dict[str, Any] | None = None
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                if usage is None:
                    return "", FailReason.INCOMPLETE
                self.stats.prompt_tokens += int(usage.get("prompt_tokens") or 0)
                self.stats.completion_tokens += int(usage.get("completion_tokens") or 0)
                return "".join(parts), None
            try:
                chunk = json.loads(data)
            except ValueError:
                return "", FailReason.STREAM_ERROR
            if not isinstance(chunk, dict) or "error" in chunk:
                return "", FailReason.STREAM_ERROR
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                parts.append(str((choice.get("delta") or {}).get("content") or ""))
        return "", FailReason.INCOMPLETE


async def wait_ready(target: str, stop: asyncio.Event, limit_s: float = 600.0,
                     clock: WallClock | None = None) -> bool:
    """Poll ``target``'s ``/health`` until it answers 200 (False: ``stop`` set, or not
    within ``limit_s``; logged as a warning)."""
    clock = clock or WallClock()
    url = target.rstrip("/").removesuffix("/v1") + "/health"
    deadline = clock.monotonic() + limit_s
    async with httpx.AsyncClient(timeout=2.0, trust_env=False) as http:
        while not stop.is_set() and clock.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(url)).status_code == 200:
                    return True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=0.5)
    why = "stopped" if stop.is_set() else f"not within {limit_s:.0f}s"
    log.warning("drive: %s did not answer 200 (%s)", url, why)
    return False
