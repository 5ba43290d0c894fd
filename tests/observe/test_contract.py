"""One contract, every MetricsSource: fake, in-process, direct scrape, a real Prometheus.

The same traffic goes into prometheus_client registries (vLLM 0.33 families, the router
agent's real ``pdrouter_*`` metrics) and into the test's own ledger (``Cluster.truth``);
every source's window must agree with the ledger: counts exactly (Prometheus ``increase``
mode: within its extrapolation), means within 2 %, gauges, per-route cells, feature
distributions and qps exactly. Then one worker stops answering: it is reported, not zeroed.
"""

from __future__ import annotations

import math
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from controller.clock import WallClock
from controller.core.catalog import HISTOGRAM_KEYS
from controller.core.window import FailureKind, Window
from controller.observe.discovery import targets_from_prometheus
from controller.observe.inprocess import InProcessSource
from controller.observe.prometheus import PrometheusClient, PrometheusSource
from controller.observe.scrape import ScrapeSource
from controller.observe.source import MetricsSource
from controller.observe.window_builder import ALL_BINS
from tests.conftest import require
from tests.observe.cluster import Cluster, Truth, serve_http, stop_http
from tests.observe.promserver import HOW_TO_INSTALL, PROMETHEUS, PromServer

CLOCK = WallClock()


@dataclass
class Harness:
    cluster: Cluster
    sources: list[tuple[MetricsSource, str]]  # (source, "exact" | "extrapolated")
    settle: Callable[[], Awaitable[float]]  # returns a time at which everything so far is seen
    stop: Callable[[str], Awaitable[None]]
    extra: dict[str, Any] = field(default_factory=dict)


async def _now() -> float:
    return CLOCK.now()


@pytest.fixture(params=["fake", "inprocess", "scrape", "prometheus"])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    kind = request.param
    base = Cluster.build(prefill=2, decode=2, routers=2)
    if kind in ("fake", "inprocess"):
        if kind == "fake":
            assert base.fake is not None
            fake = base.fake

            async def stop_fake(name: str) -> None:
                fake.set_down(name)

            yield Harness(base, [(fake, "exact")], _now, stop_fake)
        else:
            src = InProcessSource(base.targets, base.registries(), clock=CLOCK)

            async def stop_inproc(name: str) -> None:
                src.set_down(name)

            yield Harness(base, [(src, "exact")], _now, stop_inproc)
        return
    cluster, servers = serve_http(base)
    prom: PromServer | None = None
    sources: list[tuple[MetricsSource, str]] = []
    try:
        if kind == "scrape":
            scrape = ScrapeSource(cluster.targets, timeout_s=2.0, concurrency=4, clock=CLOCK)
            sources.append((scrape, "exact"))

            async def stop_scrape(name: str) -> None:
                stop_http(servers.pop(name))

            yield Harness(cluster, sources, _now, stop_scrape)
            return
        require("prometheus", PROMETHEUS is not None, HOW_TO_INSTALL)
        prom = PromServer(cluster.targets)
        client = PrometheusClient(prom.url, timeout_s=5.0, retries=1)
        # prometheus_client answers Prometheus 2.42's OpenMetrics request with escaped names
        sources = [
            (PrometheusSource(client, cluster.targets, mode="edges", escaped_names=True),
             "exact"),
            (PrometheusSource(client, cluster.targets, mode="increase", escaped_names=True),
             "extrapolated"),
        ]
        server = prom

        async def settle() -> float:
            t = CLOCK.now()
            server.wait_scraped_after(t)
            return CLOCK.now()

        async def stop_prom(name: str) -> None:
            stop_http(servers.pop(name))
            server.wait_scraped_after(CLOCK.now(), expect_down=[name])

        yield Harness(cluster, sources, settle, stop_prom, extra={"prom": prom})
    finally:
        for s, _ in sources:
            await s.aclose()
        if prom is not None:
            prom.stop()
        for server_ in servers.values():
            stop_http(server_)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def assert_window_matches(w: Window, truth: Truth, cluster: Cluster, how: str) -> None:
    exact = how == "exact"
    names = [t.name for t in cluster.targets]
    assert list(w.answered) == names
    assert w.failures == ()
    by_worker = {s.worker: s for s in w.workers}
    assert sorted(by_worker) == sorted(cluster.workers)
    for t in cluster.targets:
        if t.role == "router":
            continue
        stats = by_worker[t.name]
        assert stats.role == t.role
        assert stats.engine == "vllm"
        for key in HISTOGRAM_KEYS:
            summary = getattr(stats, key)
            expected = truth.hist.get((t.name, key))
            if expected is None:
                # an empty histogram is "no data", never a zero mean
                assert summary is None, (t.name, key)
                continue
            assert summary is not None and summary.count is not None and summary.mean is not None
            count, total = expected
            if exact:
                assert summary.count == count, (t.name, key)
            else:  # increase() extrapolates to the window edges: never below the truth
                assert count <= summary.count <= count * 3, (t.name, key)
            assert _rel(summary.mean, total / count) < 0.02, (t.name, key)
        gauges = truth.gauges[t.name]
        assert stats.running == gauges["running"]
        assert stats.waiting == gauges["waiting"]
        assert stats.kv_cache_usage == gauges["kv_cache_usage"]
        if exact:
            assert stats.request_rate == truth.requests[t.name] / w.interval_s
            assert stats.aborted == truth.aborted.get(t.name, 0.0)
            assert stats.errored == truth.errored.get(t.name, 0.0)
            assert stats.generation_tokens == truth.generation[t.name]
            assert stats.prompt_tokens_by_source is not None
            assert {k: v for k, v in stats.prompt_tokens_by_source.items() if v} == {
                k: v for k, v in truth.prompt[t.name].items() if v}
    assert w.workload.qps_by_router == truth.qps
    if not exact:
        return  # new router series: increase() cannot see their first samples (docs/observe.md)
    cells: dict[tuple[str, str, int, int], list[float]] = {}
    latency: dict[tuple[str, str, int], list[float]] = {}
    for o in w.outcomes:
        if o.io_bin == ALL_BINS:
            assert o.requests == 0
            lat = latency.setdefault((o.router, o.route.name, o.ctx_bin), [0.0] * 4)
            lat[0] += o.ttft_count
            lat[1] += o.ttft_sum
            lat[2] += o.tpot_count
            lat[3] += o.tpot_sum
        else:
            assert o.ttft_count == 0
            cell = cells.setdefault((o.router, o.route.name, o.ctx_bin, o.io_bin), [0.0, 0.0])
            cell[0] += o.requests
            cell[1] += o.met
    assert cells == truth.cells
    assert latency.keys() == truth.latency.keys()
    for key, (n1, s1, n2, s2) in truth.latency.items():
        got = latency[key]
        assert (got[0], got[2]) == (n1, n2)
        assert math.isclose(got[1], s1, rel_tol=1e-9) and math.isclose(got[3], s2, rel_tol=1e-9)
    for hist, expected in ((w.workload.context_tokens, truth.context),
                           (w.workload.io_ratio, truth.io)):
        assert hist is not None
        got = {e: c for e, c in zip(hist.edges, hist.counts, strict=True) if c}
        assert got == expected


@pytest.mark.integration
async def test_every_source_agrees_with_the_traffic(harness: Harness) -> None:
    c = harness.cluster
    t0 = CLOCK.now()
    for source, _ in harness.sources:
        first = await source.window(t0 - 1, t0)  # baseline: gauges, no counts
        assert all(w.ttft_s is None for w in first.workers)
        if not isinstance(source, PrometheusSource):  # a range query needs no baseline
            # Routers too: a canary judge counted a restart's first window (no requests
            # seen) as one of the bake's windows when only the workers said so.
            assert {(f.target, f.kind) for f in first.failures} == {
                (t.name, FailureKind.NO_BASELINE) for t in c.targets}
            assert first.outcomes == ()
    c.mark()
    start = await harness.settle()
    await harness.settle()  # a pre-traffic sample inside the increase() range
    c.traffic(random.Random(7))
    end = await harness.settle()
    truth = c.mark()
    for source, how in harness.sources:
        window = await source.window(start, end)
        assert window.start == start and window.end == end
        assert_window_matches(window, truth, c, how)

    # A worker that stops answering is reported, and left out rather than zeroed.
    victim = next(t.name for t in c.targets if t.role == "decode")
    await harness.stop(victim)
    c.traffic(random.Random(8), requests_per_worker=3)
    end2 = await harness.settle()
    for source, _ in harness.sources:
        window = await source.window(end, end2)
        assert victim not in window.answered
        assert [f.target for f in window.failures] == [victim]
        assert window.failures[0].kind == FailureKind.UNREACHABLE
        assert victim not in {s.worker for s in window.workers}
        others = [s for s in window.workers if s.worker != victim]
        assert len(others) == len(c.workers) - 1
        assert all(s.ttft_s is not None and s.ttft_s.count for s in others)
    if "prom" in harness.extra:
        discovered = targets_from_prometheus(harness.extra["prom"].active_targets())
        assert sorted(discovered, key=lambda t: t.name) == sorted(
            (t.__class__(t.name, t.role, f"http://{t.name}/metrics") for t in c.targets),
            key=lambda t: t.name)
