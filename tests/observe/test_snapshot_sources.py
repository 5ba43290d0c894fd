"""Scrape and in-process sources: identical windows, garbage in → clear per-target errors,
counter resets, NaN, empty histograms, targets that stop answering and come back."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

import pytest
from prometheus_client import generate_latest

from controller.clock import VirtualClock
from controller.core.window import FailureKind
from controller.observe.inprocess import InProcessSource
from controller.observe.scrape import ScrapeSource
from controller.observe.source import Target
from tests.observe.cluster import Cluster, VllmWorker, serve_http, stop_http
from tests.observe.textserver import TextServer


def _comparable(d: dict) -> dict:  # type: ignore[type-arg]
    d = dict(d)
    d.pop("source")
    return d


@pytest.mark.integration
async def test_inprocess_and_scrape_agree_exactly_over_the_same_registries() -> None:
    cluster, servers = serve_http(Cluster.build(prefill=3, decode=3, routers=2))
    clock = VirtualClock(1_800_000_000.0)
    inproc = InProcessSource(cluster.targets, cluster.registries(), clock=clock)
    scrape = ScrapeSource(cluster.targets, timeout_s=2.0, concurrency=3, clock=clock)
    try:
        windows = []
        for i in range(3):
            start, end = clock.now() - 30, clock.now()
            a = await inproc.window(start, end)
            b = await scrape.window(start, end)
            windows.append((a, b))
            cluster.traffic(random.Random(i), requests_per_worker=5 + 10 * i)
            clock.advance(30)
        for a, b in windows:
            assert (a.source, b.source) == ("inprocess", "scrape")
            assert _comparable(a.to_dict()) == _comparable(b.to_dict())
        last = windows[-1][0]
        assert last.workers and last.outcomes and last.failures == ()
        assert any(w.ttft_s is not None and w.ttft_s.p50 is not None for w in last.workers)
    finally:
        await scrape.aclose()
        for s in servers.values():
            stop_http(s)


@pytest.fixture
def garbage_server() -> Iterator[tuple[TextServer, VllmWorker]]:
    worker = VllmWorker()
    worker.hist["ttft_s"].observe(0.2)
    good = generate_latest(worker.registry).decode()
    lines = good.splitlines(keepends=True)
    inf_line = next(i for i, line in enumerate(lines)
                    if line.startswith("vllm:time_to_first_token_seconds_bucket")
                    and "+Inf" in line)
    sample = next(line for line in lines if line.startswith("vllm:num_requests_running"))
    server = TextServer(good, content_type="text/plain")
    server.bodies = {
        "/truncated": (200, "text/plain", good[: len(good) // 2]),
        "/cut_at_line": (200, "text/plain", "".join(lines[: inf_line])),
        "/duplicate": (200, "text/plain", good + sample),
        "/non_numeric": (200, "text/plain", good.replace(sample, sample.rsplit(" ", 1)[0]
                                                         + " twelve\n")),
        "/html": (200, "text/html", "<html><body>login</body></html>\n"),
        "/html_as_text": (200, "text/plain", "<!DOCTYPE html>\n<html></html>\n"),
        "/error": (503, "text/plain", "overloaded\n"),
    }
    try:
        yield server, worker
    finally:
        server.close()


@pytest.mark.integration
async def test_garbage_in_is_a_per_target_failure_and_the_rest_is_computed(
    garbage_server: tuple[TextServer, VllmWorker],
) -> None:
    server, worker = garbage_server
    address = server.address
    expected = {
        "/truncated": FailureKind.PARSE, "/cut_at_line": FailureKind.PARSE,
        "/duplicate": FailureKind.DUPLICATE_SERIES, "/non_numeric": FailureKind.NON_NUMERIC,
        "/html": FailureKind.PARSE, "/html_as_text": FailureKind.PARSE,
        "/error": FailureKind.HTTP_STATUS,
    }
    targets = [Target(f"good-{i}", "decode", f"http://{address}/metrics") for i in range(2)]
    targets += [Target(p.strip("/"), "prefill", f"http://{address}{p}") for p in expected]
    source = ScrapeSource(targets, timeout_s=2.0)
    try:
        await source.window(0, 30)
        worker.hist["ttft_s"].observe(0.4)
        server.default = generate_latest(worker.registry).decode()
        w = await source.window(30, 60)
    finally:
        await source.aclose()
    assert list(w.answered) == ["good-0", "good-1"]
    assert {f.target: f.kind for f in w.failures} == {p.strip("/"): k for p, k in expected.items()}
    assert all(f.message for f in w.failures)
    for stats in w.workers:
        assert stats.ttft_s is not None and stats.ttft_s.count == 1
        assert stats.ttft_s.mean == pytest.approx(0.4)


async def test_counter_reset_is_reported_and_counts_restart_from_zero() -> None:
    cluster = Cluster.build(prefill=1, decode=1, routers=0)
    clock = VirtualClock()
    source = InProcessSource(cluster.targets, cluster.registries(), clock=clock)
    target = cluster.targets[1].name
    for v in (0.1, 0.2, 0.3):
        cluster.workers[target].hist["ttft_s"].observe(v)
    await source.window(0, 30)
    restarted = VllmWorker()
    restarted.hist["ttft_s"].observe(0.05)
    source.replace_registry(target, restarted.registry)
    w = await source.window(30, 60)
    stats = {s.worker: s for s in w.workers}[target]
    assert stats.ttft_s is not None and stats.ttft_s.count == 1
    assert stats.ttft_s.mean == pytest.approx(0.05)
    assert [(f.target, f.kind) for f in w.failures] == [(target, FailureKind.COUNTER_RESET)]
    assert "time_to_first_token" in w.failures[0].message
    assert target in w.answered


async def test_nan_and_empty_histograms_are_missing_values_not_zeros() -> None:
    cluster = Cluster.build(prefill=1, decode=0, routers=0)
    name = cluster.targets[0].name
    source = InProcessSource(cluster.targets, cluster.registries())
    await source.window(0, 30)
    cluster.workers[name].kv_usage.set(math.nan)
    w = await source.window(30, 60)
    (stats,) = w.workers
    assert stats.kv_cache_usage is None
    assert stats.running == 0.0  # a real zero stays a zero
    assert all(getattr(stats, k) is None for k in ("ttft_s", "tpot_s", "kv_transfer_s"))
    assert stats.request_rate == 0.0 and stats.generation_tokens == 0.0


async def test_a_target_that_comes_back_starts_a_fresh_baseline() -> None:
    cluster = Cluster.build(prefill=1, decode=1, routers=0)
    source = InProcessSource(cluster.targets, cluster.registries())
    name = cluster.targets[0].name
    await source.window(0, 30)
    source.set_down(name)
    cluster.workers[name].hist["ttft_s"].observe(1.0)  # during the outage: not attributable
    down = await source.window(30, 60)
    assert [(f.target, f.kind) for f in down.failures] == [(name, FailureKind.UNREACHABLE)]
    source.set_down(name, False)
    back = await source.window(60, 90)
    assert [(f.target, f.kind) for f in back.failures] == [(name, FailureKind.NO_BASELINE)]
    assert {s.worker: s for s in back.workers}[name].ttft_s is None
    cluster.workers[name].hist["ttft_s"].observe(2.0)
    later = await source.window(90, 120)
    stats = {s.worker: s for s in later.workers}[name]
    assert later.failures == ()
    assert stats.ttft_s is not None and stats.ttft_s.count == 1 and stats.ttft_s.mean == 2.0


async def test_forgotten_baselines_are_not_diffed_across_another_leaders_time() -> None:
    cluster = Cluster.build(prefill=1, decode=1, routers=0)
    source = InProcessSource(cluster.targets, cluster.registries())
    name = cluster.targets[0].name
    await source.window(0, 30)
    # another replica leads from 30 to 90 and stores those windows; this one leads again
    cluster.workers[name].hist["ttft_s"].observe(1.0)
    source.forget_baselines()
    back = await source.window(90, 120)
    assert {(f.target, f.kind) for f in back.failures} == {
        (t.name, FailureKind.NO_BASELINE) for t in cluster.targets}
    assert {s.worker: s for s in back.workers}[name].ttft_s is None  # not 1.0 over 30 s
    cluster.workers[name].hist["ttft_s"].observe(2.0)
    later = await source.window(120, 150)
    stats = {s.worker: s for s in later.workers}[name]
    assert stats.ttft_s is not None and stats.ttft_s.count == 1 and stats.ttft_s.mean == 2.0


@pytest.mark.integration
async def test_scrape_reports_a_refused_connection_and_a_timeout() -> None:
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        refused_port = closed.getsockname()[1]
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)  # accepts, never answers
    try:
        targets = [Target(f"127.0.0.1:{refused_port}", "prefill"),
                   Target(f"127.0.0.1:{silent.getsockname()[1]}", "decode")]
        source = ScrapeSource(targets, timeout_s=0.3)
        w = await source.window(0, 30)
        await source.aclose()
    finally:
        silent.close()
    assert [f.kind for f in w.failures] == ["unreachable", FailureKind.TIMEOUT]
    assert w.workers == () and w.answered == ()
