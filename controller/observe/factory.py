"""Build the configured :class:`~controller.observe.source.MetricsSource` from settings."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from controller.clock import Clock
from controller.observe.discovery import (
    DNS_PREFIX,
    static_targets_async,
    targets_from_prometheus,
)
from controller.observe.rediscovery import Rediscovery
from controller.observe.source import MetricsSource, Target

if TYPE_CHECKING:
    from controller.config import Settings

SourceKind = Literal["scrape", "prometheus"]


async def source_from_settings(
    settings: Settings, kind: SourceKind | None = None, clock: Clock | None = None
) -> MetricsSource:
    """``[observe] source`` (or ``kind``) with its targets: the static lists (``dns+``
    names resolved now and again every minute) or, with ``[prometheus] discover_targets``,
    Prometheus' targets (discovered again every minute)."""
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

            targets = await discover()
            rediscovery = Rediscovery(discover, what="target discovery")
        else:
            targets = await resolve()
        return PrometheusSource(client, targets, mode=p.window_mode,
                                escaped_names=p.escaped_names, rediscovery=rediscovery)
    from controller.observe.scrape import ScrapeSource

    return ScrapeSource(await resolve(), timeout_s=settings.observe.scrape_timeout_s,
                        concurrency=settings.observe.scrape_concurrency, clock=clock,
                        rediscovery=rediscovery)
