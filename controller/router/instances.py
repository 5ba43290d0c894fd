"""The engines behind the router: P and D instance pools, health checks, P's queue.

* Entries are static URLs or ``dns+NAME:PORT`` names, expanded to one instance per address and
  expanded again every ``resolve_interval_s``. An instance that disappears leaves the rotation
  at once; streams already running on it are not cut (they hold their own connection), so a
  removed D drains.
* Every ``health_interval_s`` each instance is asked ``GET /health``; P instances also
  ``GET /metrics`` for ``vllm:num_requests_waiting`` (the least-waiting healthy P takes the
  next prefill leg). ``unhealthy_after`` consecutive failures (checks, or connection failures
  of real requests) take an instance out of rotation; one good check brings it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from controller.clock import Clock
from controller.config import DNS_PREFIX
from controller.errors import ConfigError, TransientError
from controller.observe.discovery import expand
from controller.rollout.prefill_watch import waiting_in

log = logging.getLogger(__name__)


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class Instance:
    url: str
    role: Role
    healthy: bool = True
    failures: int = 0
    waiting: float | None = None
    waiting_at: float = 0.0
    inflight: int = 0
    checked: bool = field(default=False)


def expand_entry(entry: str) -> list[str]:
    """URLs of one configured entry (``dns+`` names resolve to one URL per address)."""
    if entry.startswith(DNS_PREFIX):
        return [f"http://{addr}" for addr in expand(entry)]
    return [entry]


class Pool:
    """One role's instances. Readers get plain lists; the health loop mutates in place."""

    def __init__(self, role: Role, entries: Sequence[str], *, unhealthy_after: int,
                 waiting_stale_after_s: float, clock: Clock,
                 on_change: Callable[[Instance, bool], None] | None = None) -> None:
        self.role = role
        self.entries = list(entries)
        self.instances: dict[str, Instance] = {}
        self._unhealthy_after = unhealthy_after
        self._stale_s = waiting_stale_after_s
        self._clock = clock
        self._on_change = on_change
        self._healthy: list[str] = []

    def resolve(self) -> None:
        """Expand the entries again; keep the state of instances that stay."""
        urls: list[str] = []
        for entry in self.entries:
            try:
                urls.extend(expand_entry(entry))
            except (TransientError, ConfigError) as e:
                log.warning("router: %s instance %s: %s", self.role.value, entry, e)
        fresh = {}
        for url in dict.fromkeys(urls):
            fresh[url] = self.instances.get(url) or Instance(url, self.role)
        for url in self.instances.keys() - fresh.keys():
            log.info("router: %s instance %s left the rotation (no longer resolved)",
                     self.role.value, url)
        self.instances = fresh
        self._refresh()

    def _refresh(self) -> None:
        self._healthy = [u for u, i in self.instances.items() if i.healthy]

    def healthy(self) -> list[str]:
        return self._healthy

    def failed(self, url: str) -> None:
        """A failed check or request: out of rotation after ``unhealthy_after`` in a row."""
        inst = self.instances.get(url)
        if inst is None:
            return
        inst.failures += 1
        if inst.healthy and inst.failures >= self._unhealthy_after:
            inst.healthy = False
            self._refresh()
            log.warning("router: %s instance %s is out of rotation (%d failures)",
                        self.role.value, url, inst.failures)
            if self._on_change:
                self._on_change(inst, False)

    def succeeded(self, url: str) -> None:
        inst = self.instances.get(url)
        if inst is None:
            return
        inst.failures = 0
        if not inst.healthy:
            inst.healthy = True
            self._refresh()
            log.info("router: %s instance %s is back in rotation", self.role.value, url)
            if self._on_change:
                self._on_change(inst, True)

    def waiting(self, url: str) -> float | None:
        inst = self.instances.get(url)
        if inst is None or inst.waiting is None:
            return None
        if self._clock.monotonic() - inst.waiting_at > self._stale_s:
            return None
        return inst.waiting

    def by_least_waiting(self, exclude: Sequence[str] = ()) -> list[str]:
        """Healthy instances, least waiting first (unknown counts after known ones; ties by
        fewer requests in flight from this router)."""
        def key(url: str) -> tuple[float, int]:
            w = self.waiting(url)
            inst = self.instances[url]
            return (w if w is not None else float("inf"), inst.inflight)

        return sorted((u for u in self._healthy if u not in exclude), key=key)

    def min_waiting(self) -> float | None:
        known = [w for u in self._healthy if (w := self.waiting(u)) is not None]
        return min(known) if known else None


class HealthChecker:
    """Runs the checks of every pool until stopped."""

    def __init__(self, pools: Sequence[Pool], session: aiohttp.ClientSession, clock: Clock, *,
                 interval_s: float, resolve_interval_s: float, timeout_s: float) -> None:
        self.pools = list(pools)
        self._session = session
        self._clock = clock
        self._interval = interval_s
        self._resolve_interval = resolve_interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def check_once(self) -> None:
        jobs = [self._check(pool, inst) for pool in self.pools
                for inst in list(pool.instances.values())]
        await asyncio.gather(*jobs)

    async def _check(self, pool: Pool, inst: Instance) -> None:
        ok = await self._get_ok(inst.url + "/health")
        if ok and pool.role is Role.PREFILL:
            text = await self._get_text(inst.url + "/metrics")
            if text is not None:
                with contextlib.suppress(Exception):
                    waiting = waiting_in(text, inst.url)
                    if waiting is not None:
                        inst.waiting, inst.waiting_at = waiting, self._clock.monotonic()
        inst.checked = True
        if ok:
            pool.succeeded(inst.url)
        else:
            pool.failed(inst.url)

    async def _get_ok(self, url: str) -> bool:
        try:
            async with self._session.get(url, timeout=self._timeout) as r:
                await r.read()
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def _get_text(self, url: str) -> str | None:
        try:
            async with self._session.get(url, timeout=self._timeout) as r:
                return await r.text() if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, OSError, UnicodeDecodeError):
            return None

    async def run(self, stop: asyncio.Event) -> None:
        last_resolve = self._clock.monotonic()
        while not stop.is_set():
            now = self._clock.monotonic()
            if now - last_resolve >= self._resolve_interval:
                last_resolve = now
                for pool in self.pools:
                    await asyncio.to_thread(pool.resolve)
            await self.check_once()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._interval)
