"""The only place that reads time.

Production code takes a :class:`Clock`; tests, replays and the bench pass a
:class:`VirtualClock` so hours of traffic run in seconds and every run is repeatable.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from datetime import UTC, datetime
from typing import Protocol, runtime_checkable


@runtime_checkable
class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the Unix epoch (wall time; virtual on a VirtualClock)."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards (for durations and deadlines)."""

    def perf_counter_ns(self) -> int:
        """High-resolution counter for timing hot paths (nanoseconds)."""

    def utcnow(self) -> datetime:
        """Timezone-aware UTC datetime of :meth:`now`."""

    async def sleep(self, seconds: float) -> None:
        """Sleep on this clock."""


class WallClock:
    """The real clock."""

    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def perf_counter_ns(self) -> int:
        return time.perf_counter_ns()

    def utcnow(self) -> datetime:
        return datetime.fromtimestamp(time.time(), tz=UTC)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class VirtualClock:
    """A clock that only moves when told to.

    ``advance(dt)`` moves time forward and wakes every sleeper whose deadline passed, in
    deadline order. ``now()`` and ``monotonic()`` are the same virtual value;
    ``perf_counter_ns()`` follows it too, so a timed hot path measures zero unless the test
    advances the clock on purpose.
    """

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._t = float(start)
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._t

    def monotonic(self) -> float:
        return self._t

    def perf_counter_ns(self) -> int:
        return int(self._t * 1e9)

    def utcnow(self) -> datetime:
        return datetime.fromtimestamp(self._t, tz=UTC)

    def set(self, t: float) -> None:
        """Jump to ``t`` (forward only: a virtual clock never runs backwards)."""
        if t < self._t:
            raise ValueError(f"VirtualClock cannot go backwards ({t} < {self._t})")
        self.advance(t - self._t)

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("VirtualClock.advance needs a non-negative duration")
        self._t += seconds
        while self._sleepers and self._sleepers[0][0] <= self._t:
            _, _, fut = heapq.heappop(self._sleepers)
            if not fut.done():
                fut.set_result(None)

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._t + seconds, next(self._seq), fut))
        await fut

    @property
    def pending_sleepers(self) -> int:
        return sum(1 for _, _, f in self._sleepers if not f.done())
