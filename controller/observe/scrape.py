"""``ScrapeSource``: GET every target's ``/metrics`` directly and diff consecutive snapshots.

One small ``httpx.AsyncClient`` per target (keep-alive), at most ``concurrency`` scrapes in
flight. Each target gets one TOTAL deadline (``timeout_s``: connect, headers and the whole
body together, not per read, so a body trickling a byte a second still ends on time) and a
cap of ``MAX_BODY_BYTES`` on its decoded body, enforced while streaming
(:mod:`controller.observe.bounded_body`), so one target costs at most that time and memory
whatever it sends. A target that refuses, times out, answers non-2xx or answers
something that is not exposition text is a reported failure for this window; its previous
snapshot is dropped so the next answer starts a fresh baseline instead of a diff across
the gap.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import httpx

from controller.clock import Clock
from controller.core.window import FailureKind
from controller.observe.bounded_body import ACCEPT_ENCODING, BodyRefused, read_bounded
from controller.observe.rediscovery import Rediscovery
from controller.observe.snapshot import FetchError, SnapshotSource
from controller.observe.source import Target

_ACCEPT = "text/plain;version=0.0.4;q=1.0, */*;q=0.1"
MAX_BODY_BYTES = 32 * 1024 * 1024


class ScrapeSource(SnapshotSource):
    name = "scrape"

    def __init__(
        self,
        targets: Sequence[Target],
        *,
        timeout_s: float = 5.0,
        concurrency: int = 32,
        clock: Clock | None = None,
        client: httpx.AsyncClient | None = None,
        rediscovery: Rediscovery | None = None,
    ) -> None:
        super().__init__(targets, clock, rediscovery)
        self._timeout = timeout_s
        self._semaphore = asyncio.Semaphore(max(1, concurrency))
        # One small client per target, each keeping its connection alive: httpcore scans its
        # whole pool (and polls every socket) on each request, so one shared pool of 72
        # connections costs O(targets^2) per window; 72 pools of one cost O(targets).
        # The semaphore, not the pools, bounds how many scrapes are in flight.
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._shared = client

    def _client_for(self, target: Target) -> httpx.AsyncClient:
        if self._shared is not None:
            return self._shared
        client = self._clients.get(target.name)
        if client is None:
            client = self._clients[target.name] = httpx.AsyncClient(
                timeout=httpx.Timeout(self._timeout),
                limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
                headers={"Accept": _ACCEPT}, follow_redirects=False, trust_env=False,
            )
        return client

    async def fetch_all(self, targets: Sequence[Target]) -> list[str | FetchError]:
        return list(await asyncio.gather(*(self._fetch(t) for t in targets)))

    async def _fetch(self, target: Target) -> str | FetchError:
        async with self._semaphore:
            try:
                async with asyncio.timeout(self._timeout):
                    return await self._fetch_within(target)
            except TimeoutError:
                return FetchError(FailureKind.TIMEOUT,
                                  f"no whole answer within {self._timeout:g} s")
            except BodyRefused as e:
                return FetchError(FailureKind.PARSE, str(e))
            except httpx.HTTPError as e:
                return FetchError(FailureKind.UNREACHABLE, f"{type(e).__name__}: {e}")

    async def _fetch_within(self, target: Target) -> str | FetchError:
        """One GET, its body read raw and decoded by our bounded decoders."""
        headers = {"Accept": _ACCEPT, "Accept-Encoding": ACCEPT_ENCODING}
        async with self._client_for(target).stream(
            "GET", target.metrics_url, headers=headers, timeout=self._timeout
        ) as response:
            if response.status_code // 100 != 2:
                return FetchError(
                    FailureKind.HTTP_STATUS,
                    f"HTTP {response.status_code} from {target.metrics_url}"
                )
            ctype = response.headers.get("content-type", "")
            if "html" in ctype.lower():
                return FetchError(FailureKind.PARSE, f"the answer is {ctype}, not exposition text")
            body = await read_bounded(response.aiter_raw(),
                                      response.headers.get("content-encoding", ""),
                                      MAX_BODY_BYTES)
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError:
            return FetchError(FailureKind.PARSE, "the answer is not UTF-8 text")

    async def forget_targets(self, names: set[str]) -> None:
        for name in names:
            client = self._clients.pop(name, None)
            if client is not None:
                await client.aclose()

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            await c.aclose()
