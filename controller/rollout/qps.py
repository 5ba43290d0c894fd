"""The router's own arrival rate over a sliding window (DESIGN §2: ``qps``).

Not a cumulative average: a burst shows within one window and fades after it, which is
what the lookup table's ``qps`` axis was calibrated on.
"""

from __future__ import annotations

import threading
from collections import deque

from controller.clock import Clock


class QpsMeter:
    """Arrivals in the last ``window_s`` seconds divided by ``window_s``.

    Keeps one timestamp per arrival inside the window (memory grows with rate x window) and
    drops expired ones as it goes, so each call costs O(1) amortized. Safe from many threads:
    the expiry scan and the append are serialised by a lock (a check-then-pop race could
    otherwise drop an arrival that is still inside the window).
    """

    def __init__(self, clock: Clock, window_s: float = 10.0) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self._clock = clock
        self._window_s = float(window_s)
        self._arrivals: deque[float] = deque()
        self._lock = threading.Lock()

    @property
    def window_s(self) -> float:
        return self._window_s

    def note_arrival(self) -> None:
        now = self._clock.monotonic()
        with self._lock:
            self._arrivals.append(now)
            self._expire(now)

    def rate(self) -> float:
        """Arrivals per second over the window ending now (arrivals in ``(now - window, now]``)."""
        now = self._clock.monotonic()
        with self._lock:
            self._expire(now)
            return len(self._arrivals) / self._window_s

    def _expire(self, now: float) -> None:
        cutoff = now - self._window_s
        arrivals = self._arrivals
        while arrivals and arrivals[0] <= cutoff:
            arrivals.popleft()
