"""``PrefillQueueWatch``: the ``prefill_waiting`` feature for routers that cannot report it.

Turn 1's busy override (``overrides.first_turn_busy_waiting``) needs the number of requests
waiting on the least-busy prefill worker. A router that tracks its prefill workers passes it
in :class:`controller.policy.Features`; for one that does not, the router agent polls the
prefill workers' ``/metrics`` itself (every ``interval_s``, default 1 s: a burst builds a
queue within seconds, the controller's 30 s scrape is far too slow) and fills the feature in
when a decision arrives without it.

The queue is the engine's waiting gauge (``vllm:num_requests_waiting``,
``sglang:num_queue_reqs``; summed over a worker's series, e.g. data-parallel engines, with
SGLang's rank replicas of one scheduler counted once: ``catalog.collapse_replicas``). A
worker whose last good answer is older than ``stale_after_s`` counts as unknown; the value
is the minimum over the known workers, and None (the override never fires) when none is
known: an unreachable pool must not send every first turn decode-local.

The HTTP client is injectable (an ``httpx`` transport is the seam tests use).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Sequence

import httpx

from controller.clock import Clock
from controller.core.catalog import ENGINES, once_per_scheduler
from controller.core.exposition import ExpositionError, parse_exposition
from controller.core.window import FailureKind

log = logging.getLogger(__name__)

# The waiting gauge of every engine we know, in catalog order.
WAITING_FAMILIES: tuple[str, ...] = tuple(
    dict.fromkeys(spec.gauges["waiting"].family for spec in ENGINES if "waiting" in spec.gauges)
)
_ACCEPT = "text/plain;version=0.0.4;q=1.0, */*;q=0.1"


def waiting_in(text: str, target: str) -> float | None:
    """Requests waiting on one worker from its exposition text (None: no waiting gauge)."""
    snap = parse_exposition(text, target=target, taken_at=0.0, keep=frozenset(WAITING_FAMILIES))
    for family in WAITING_FAMILIES:
        series = once_per_scheduler(
            family, {k: v for k, v in snap.series(family).items() if math.isfinite(v)})
        if series:
            return math.fsum(series.values())
    return None


class PrefillQueueWatch:
    """Polls ``urls`` (the prefill workers' ``/metrics``) and keeps each one's waiting count."""

    def __init__(
        self,
        urls: Sequence[str],
        clock: Clock,
        *,
        interval_s: float = 1.0,
        stale_after_s: float = 5.0,
        timeout_s: float = 0.5,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not interval_s > 0 or not stale_after_s > 0 or not timeout_s > 0:
            raise ValueError("interval_s, stale_after_s and timeout_s must be > 0")
        self.urls = list(urls)
        self._clock = clock
        self.interval_s = interval_s
        self.stale_after_s = stale_after_s
        self._timeout = timeout_s
        self._transport = transport
        self._last: dict[str, tuple[float, float]] = {}  # url -> (waiting, monotonic time)
        self._failing: set[str] = set()
        self._client: httpx.AsyncClient | None = None

    def value(self) -> float | None:
        """Requests waiting on the least-busy prefill worker with a fresh answer (None: no
        worker answered within ``stale_after_s``). Cheap: read on every first turn."""
        now = self._clock.monotonic()
        fresh = [w for w, at in self._last.values() if now - at <= self.stale_after_s]
        return min(fresh) if fresh else None

    async def poll_once(self) -> None:
        """Ask every worker once, concurrently; a failure leaves its last value to go stale."""
        if self._client is None:
            self._client = httpx.AsyncClient(
                transport=self._transport, timeout=httpx.Timeout(self._timeout),
                headers={"Accept": _ACCEPT}, follow_redirects=False, trust_env=False,
            )
        await asyncio.gather(*(self._poll(url) for url in self.urls))

    async def _poll(self, url: str) -> None:
        assert self._client is not None
        try:
            response = await self._client.get(url)
            response.raise_for_status()
            waiting = waiting_in(response.text, url)
            if waiting is None:
                raise ExpositionError(FailureKind.PARSE,
                                      f"no waiting gauge ({', '.join(WAITING_FAMILIES)})")
        except (httpx.HTTPError, ExpositionError) as e:
            if url not in self._failing:  # log a worker's failure once, not every second
                self._failing.add(url)
                log.warning("prefill queue watch: %s: %s", url, e)
            return
        if url in self._failing:
            self._failing.discard(url)
            log.info("prefill queue watch: %s answers again", url)
        self._last[url] = (waiting, self._clock.monotonic())

    async def run(self, stop: asyncio.Event) -> None:
        """Poll every ``interval_s`` until ``stop`` is set, then close the client."""
        try:
            while not stop.is_set():
                await self.poll_once()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval_s)
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
