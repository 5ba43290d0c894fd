"""Build the configured :class:`~controller.observe.source.MetricsSource` from settings."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from controller.clock import Clock
from controller.observe.discovery import static_targets_async, targets_from_prometheus
from controller.observe.source import MetricsSource, Target

if TYPE_CHECKING:
    from controller.config import Settings

SourceKind = Literal["scrape", "prometheus"]


async def source_from_settings(
    settings: Settings, kind: SourceKind | None = None, clock: Clock | None = None
) -> MetricsSource:
    """``[observe] source`` (or ``kind``) with its targets: the static lists (``dns+``
    names resolved now) or, with ``[prometheus] discover_targets``, Prometheus' targets."""
    chosen = kind or settings.observe.source
    if chosen == "prometheus":
        from controller.observe.prometheus import PrometheusClient, PrometheusSource

        p = settings.prometheus
        client = PrometheusClient(p.url, timeout_s=p.timeout_s, retries=p.retries)
        rediscover = None
        if p.discover_targets:
            async def rediscover() -> list[Target]:
                return targets_from_prometheus(await client.targets(), p.role_label)

            targets = await rediscover()
        else:
            targets = await static_targets_async(
                settings.prefill_pool.nodes, settings.decode_pool.nodes,
                settings.routers.metrics_targets)
        return PrometheusSource(client, targets, mode=p.window_mode,
                                escaped_names=p.escaped_names, rediscover=rediscover)
    from controller.observe.scrape import ScrapeSource

    targets = await static_targets_async(
        settings.prefill_pool.nodes, settings.decode_pool.nodes, settings.routers.metrics_targets)
    return ScrapeSource(targets, timeout_s=settings.observe.scrape_timeout_s,
                        concurrency=settings.observe.scrape_concurrency, clock=clock)
