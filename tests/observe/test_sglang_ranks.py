"""SGLang's parallel ranks: with ``--enable-metrics-for-all-schedulers`` every TP (PP, MoE-EP)
rank of one scheduler reports the same requests, transfers and queue. A production probe of a
TP 4 prefill node showed four copies of every KV-transfer histogram whose cumulative counts
differed only by sampling time (200/201/202/204). Every source must count such a scheduler
once, and still sum DP ranks, which are schedulers of their own."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pytest

from controller.clock import WallClock
from controller.core.catalog import REPLICA_RANK_LABELS, collapse_replicas
from controller.core.exposition import parse_exposition
from controller.core.window import Window, WorkerStats
from controller.observe.prometheus import PrometheusClient, PrometheusSource, build_queries
from controller.observe.scrape import ScrapeSource
from controller.observe.source import Target, TargetRole
from controller.observe.window_builder import diff_snapshots, worker_stats
from tests.conftest import require
from tests.observe.promserver import HOW_TO_INSTALL, PROMETHEUS, PromServer
from tests.observe.textserver import TextServer

CLOCK = WallClock()
EDGES_MS = (5.0, 50.0, 500.0)


def sglang_text(schedulers: Mapping[str, Mapping[str, tuple[int, int, int]]], requests: int
                ) -> str:
    """An SGLang prefill node's exposition. ``schedulers``: DP rank ("" for none) → TP rank
    → (KV transfers, of them under 50 ms, requests waiting). Each transfer under 50 ms took
    10 ms, each other one 100 ms. ``requests``: the tokenizer's finished requests (it has no
    rank labels)."""
    lines = ["# TYPE sglang:kv_transfer_latency_ms histogram"]
    for dp, ranks in schedulers.items():
        for tp, (count, fast, _) in ranks.items():
            labels = (f'dp_rank="{dp}",' if dp else "") + f'engine_type="prefill",tp_rank="{tp}"'
            cumulative = (0, fast, count)
            for le, c in zip(EDGES_MS, cumulative, strict=True):
                lines.append(f'sglang:kv_transfer_latency_ms_bucket{{{labels},le="{le}"}} {c}')
            lines.append(f'sglang:kv_transfer_latency_ms_bucket{{{labels},le="+Inf"}} {count}')
            lines.append(f"sglang:kv_transfer_latency_ms_count{{{labels}}} {count}")
            total = 10.0 * fast + 100.0 * (count - fast)
            lines.append(f"sglang:kv_transfer_latency_ms_sum{{{labels}}} {total}")
    lines.append("# TYPE sglang:num_queue_reqs gauge")
    for dp, ranks in schedulers.items():
        for tp, (_, _, waiting) in ranks.items():
            labels = (f'dp_rank="{dp}",' if dp else "") + f'engine_type="prefill",tp_rank="{tp}"'
            lines.append(f"sglang:num_queue_reqs{{{labels}}} {waiting}")
    lines += ["# TYPE sglang:token_usage gauge",
              'sglang:token_usage{engine_type="prefill",tp_rank="0"} 0.5',
              "# TYPE sglang:num_requests_total counter",
              f'sglang:num_requests_total{{engine_type="prefill"}} {requests}']
    return "\n".join(lines) + "\n"


# Before and after one window: four TP replicas of one scheduler, their counts a scrape apart.
TP4_BEFORE = {"": {"0": (100, 60, 0), "1": (100, 60, 0), "2": (99, 59, 0), "3": (100, 60, 0)}}
TP4_AFTER = {"": {"0": (200, 150, 3), "1": (201, 151, 3), "2": (202, 151, 4), "3": (204, 153, 3)}}
# Two DP ranks with two TP replicas each: the DP ranks are summed, the replicas are not.
DP2_BEFORE = {"0": {"0": (10, 10, 0), "1": (10, 10, 0)}, "1": {"2": (20, 0, 0), "3": (20, 0, 0)}}
DP2_AFTER = {"0": {"0": (40, 30, 2), "1": (40, 30, 2)}, "1": {"2": (30, 0, 5), "3": (30, 0, 5)}}


def _stats(before: str, after: str) -> WorkerStats:
    prev = parse_exposition(before, target="p", taken_at=0.0)
    cur = parse_exposition(after, target="p", taken_at=30.0)
    stats, _ = worker_stats(diff_snapshots(prev, cur), "prefill", 30.0)
    assert stats is not None and stats.engine == "sglang"
    return stats


def test_tp_replicas_count_each_transfer_once() -> None:
    stats = _stats(sglang_text(TP4_BEFORE, 1000), sglang_text(TP4_AFTER, 1100))
    # The largest replica's increase (rank 3: 104 transfers, 93 fast), not the four summed.
    kv = stats.kv_transfer_s
    assert kv is not None and kv.count == 104
    assert kv.mean == pytest.approx((10.0 * 93 + 100.0 * 11) / 104 / 1000)
    assert stats.waiting == 4  # the queue once, not 13
    assert stats.request_rate == pytest.approx(100 / 30)  # the tokenizer's: no ranks
    # The same node exposing rank 0 only (SGLang's default) reads within a scrape's skew.
    alone = _stats(sglang_text({"": {"0": TP4_BEFORE[""]["0"]}}, 1000),
                   sglang_text({"": {"0": TP4_AFTER[""]["0"]}}, 1100))
    assert alone.kv_transfer_s is not None and alone.kv_transfer_s.count == 100
    assert alone.waiting == 3


def test_dp_ranks_are_summed_and_their_tp_replicas_counted_once() -> None:
    stats = _stats(sglang_text(DP2_BEFORE, 0), sglang_text(DP2_AFTER, 40))
    kv = stats.kv_transfer_s
    assert kv is not None and kv.count == 30 + 10  # DP 0: +30, DP 1: +10
    assert kv.mean == pytest.approx((10.0 * 20 + 100.0 * 10 + 100.0 * 10) / 40 / 1000)
    assert stats.waiting == 2 + 5


def test_families_without_rank_labels_pass_through() -> None:
    vllm_engines = {(("engine", "0"),): 3.0, (("engine", "1"),): 4.0}
    assert collapse_replicas(vllm_engines) == vllm_engines
    replicas = {(("le", "1"), ("tp_rank", "0")): 2.0, (("le", "1"), ("tp_rank", "1")): 5.0,
                (("le", "2"), ("pp_rank", "1"), ("tp_rank", "0")): 7.0}
    assert collapse_replicas(replicas) == {(("le", "1"),): 5.0, (("le", "2"),): 7.0}


@pytest.mark.parametrize("window_ms", [None, 30_000])
def test_every_prometheus_term_takes_one_value_per_scheduler(window_ms: int | None) -> None:
    wrapper = f"max without ({', '.join(sorted(REPLICA_RANK_LABELS))})"
    for query in build_queries(window_ms):
        terms = query.promql.split(" or ")
        assert terms and all(wrapper in term for term in terms), query.name


@pytest.fixture
def sglang_node() -> Iterator[TextServer]:
    server = TextServer(sglang_text(TP4_BEFORE, 1000))
    try:
        yield server
    finally:
        server.close()


async def _scraped_and_through_prometheus(server: TextServer, role: TargetRole, after: str
                                         ) -> list[Window]:
    """One window of ``server`` from the scrape source and from a real Prometheus (edges),
    over which its text changes to ``after``."""
    require("prometheus", PROMETHEUS is not None, HOW_TO_INSTALL)
    node = Target(server.address, role, f"http://{server.address}/metrics")
    prom = PromServer([node])
    client = PrometheusClient(prom.url, timeout_s=5.0, retries=1)
    edges = PrometheusSource(client, [node], mode="edges")
    scrape = ScrapeSource([node], timeout_s=2.0)
    try:
        start = CLOCK.now()
        prom.wait_scraped_after(start)
        await scrape.window(start - 30, start)  # the scrape source's baseline
        start = CLOCK.now()
        prom.wait_scraped_after(start)
        server.default = after
        end = CLOCK.now()
        prom.wait_scraped_after(end)
        end = CLOCK.now()
        return [await scrape.window(start, end), await edges.window(start, end)]
    finally:
        await edges.aclose()
        await scrape.aclose()
        prom.stop()


@pytest.mark.integration
async def test_scrape_and_a_real_prometheus_count_tp_replicas_once(
        sglang_node: TextServer) -> None:
    windows = await _scraped_and_through_prometheus(
        sglang_node, "prefill", sglang_text(TP4_AFTER, 1100))
    for window in windows:
        assert window.failures == (), window.source
        [stats] = window.workers
        assert stats.kv_transfer_s is not None and stats.kv_transfer_s.count == 104, window.source
        assert stats.waiting == 4, window.source


def sglang_priority_text(running: int, requests: int) -> str:
    """SGLang with priority scheduling: each class (priority="0", "1") beside the total
    (priority=""), the classes 70/30 of it."""
    lines = ["# TYPE sglang:num_running_reqs gauge", "# TYPE sglang:num_requests_total counter"]
    for priority, share in (("", 10), ("0", 7), ("1", 3)):
        labels = f'model_name="m",priority="{priority}",tp_rank="0"'
        lines.insert(1, f"sglang:num_running_reqs{{{labels}}} {running * share // 10}")
        lines.append(f"sglang:num_requests_total{{{labels}}} {requests * share // 10}")
    return "\n".join(lines) + "\n"


@pytest.mark.integration
async def test_scrape_and_a_real_prometheus_count_priority_classes_once() -> None:
    """The classes are parts of the total: summed with it (both sources did), every count
    and gauge of an SGLang worker with priority scheduling came out doubled."""
    server = TextServer(sglang_priority_text(20, 1000))
    try:
        windows = await _scraped_and_through_prometheus(
            server, "decode", sglang_priority_text(20, 1300))
    finally:
        server.close()
    for window in windows:
        [stats] = window.workers
        assert stats.running == 20, window.source
        assert stats.request_rate is not None, window.source
        assert stats.request_rate * (window.end - window.start) == pytest.approx(300), \
            window.source
