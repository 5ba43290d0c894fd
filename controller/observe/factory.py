"""Build the configured :class:`~controller.observe.source.MetricsSource` from settings."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Literal

from controller.clock import Clock
from controller.config import DNS_PREFIX
from controller.errors import TransientError
from controller.observe.discovery import static_targets_async, targets_from_prometheus
from controller.observe.rediscovery import Rediscovery
from controller.observe.source import MetricsSource, Target

if TYPE_CHECKING:
    from controller.config import Settings

SourceKind = Literal["scrape", "prometheus"]

_log = logging.getLogger(__name__)


async def _first_targets(
    find: Callable[[], Awaitable[list[Target]]], rediscovery: Rediscovery | None, wait: bool
) -> list[Target]:
    try:
        return await find()
    except TransientError as e:
        if not wait or rediscovery is None:
            raise
        # A daemon that exited here would crash-loop through a Prometheus or DNS outage
        # (or start before its workers' headless service has an address) and stop
        # reconciling routers meanwhile; its cycles are skipped until the targets are found.
        _log.warning("%s failed at the start, asking again every cycle: %s",
                     rediscovery.what, e)
        return []


async def source_from_settings(
    settings: Settings, kind: SourceKind | None = None, clock: Clock | None = None,
    *, wait_for_targets: bool = False,
) -> MetricsSource:
    """``[observe] source`` (or ``kind``) with its targets: the static lists (``dns+``
    names resolved now and again every minute) or, with ``[prometheus] discover_targets``,
    Prometheus' targets (discovered again every minute).

    A discovery or ``dns+`` lookup that fails at the start raises, unless
    ``wait_for_targets`` (the daemon): then the source starts with no targets and asks
    again every window, which raises :class:`~controller.observe.source.NoTargets` until
    some are found."""
    chosen = kind or settings.observe.source
    lists = (settings.prefill_pool.nodes, settings.decode_pool.nodes,
             settings.routers.metrics_targets)

    async def resolve() -> list[Target]:
        return await static_targets_async(*lists)

    rediscovery = None
    if any(a.startswith(DNS_PREFIX) for addresses in lists for a in addresses):
        rediscovery = Rediscovery(resolve, what="DNS")
    if chosen == "prometheus":
        from controller.observe.prometheus import PrometheusClient, PrometheusSource

        p = settings.prometheus
        client = PrometheusClient(p.url, timeout_s=p.timeout_s, retries=p.retries)
        if p.discover_targets:
            async def discover() -> list[Target]:
                return targets_from_prometheus(await client.targets(), p.role_label)

            rediscovery = Rediscovery(discover, what="target discovery")
            targets = await _first_targets(discover, rediscovery, wait_for_targets)
        else:
            targets = await _first_targets(resolve, rediscovery, wait_for_targets)
        return PrometheusSource(client, targets, mode=p.window_mode,
                                escaped_names=p.escaped_names, rediscovery=rediscovery)
    from controller.observe.scrape import ScrapeSource

    return ScrapeSource(await _first_targets(resolve, rediscovery, wait_for_targets),
                        timeout_s=settings.observe.scrape_timeout_s,
                        concurrency=settings.observe.scrape_concurrency, clock=clock,
                        rediscovery=rediscovery)
