"""The simulator's SGLang exposition (``controller.sim.sglang_metrics``) read through the
engine catalog gives the window its vLLM exposition gives, for the same traffic: the SGLang
row of the catalog (names, ms and MB units, the prefill stage, rank replicas) is checked end
to end against the vLLM row."""

from __future__ import annotations

import asyncio

import pytest

from controller.core.window import Summary, Window, WorkerStats
from controller.observe.inprocess import InProcessSource, sim_cluster_provider
from controller.policy import Route
from controller.sim.cluster import SimCluster
from controller.sim.scenario import parse_scenario
from controller.sim.sglang_metrics import SglangView
from tests.sim._synthetic import drive

SUMMARIES = ("ttft_s", "inter_token_s", "tpot_s", "queue_s", "prefill_s", "kv_transfer_s",
             "kv_transfer_bytes")


def _windows(tp_size: int) -> tuple[Window, Window]:
    """The same P/D traffic read once through vLLM's exposition, once through SGLang's."""
    sources: dict[str, InProcessSource] = {}

    def attach(cluster: SimCluster) -> None:
        targets, vllm = sim_cluster_provider(cluster)()
        views = {e.name: SglangView(e.metrics, tp_size=tp_size) for e in cluster.engines}
        sglang = {**vllm, **{name: v.registry for name, v in views.items()}}
        sources["vllm"] = InProcessSource(targets, vllm, clock=cluster.clock)
        sources["sglang"] = InProcessSource(targets, sglang, clock=cluster.clock)
        for source in sources.values():
            asyncio.run(source.window(-30.0, 0.0))  # baselines before any traffic

    cluster, done, _ = drive(route=Route.PREFILL_NODE, sessions=16, turns=2,
                             before_run=attach)
    assert done
    end = cluster.clock.now()
    return (asyncio.run(sources["vllm"].window(0.0, end)),
            asyncio.run(sources["sglang"].window(0.0, end)))


def _same_summary(a: Summary | None, b: Summary | None, key: str, worker: str) -> None:
    assert (a is None) == (b is None), (key, worker)
    if a is None or b is None:
        return
    assert b.count == a.count, (key, worker)
    for q in ("mean", "p50", "p90", "p99"):
        va, vb = getattr(a, q), getattr(b, q)
        assert (va is None) == (vb is None), (key, worker, q)
        if va is not None:
            assert vb == pytest.approx(va, rel=1e-9), (key, worker, q)


def _compare(vllm: WorkerStats, sglang: WorkerStats) -> None:
    assert (vllm.engine, sglang.engine) == ("vllm", "sglang")
    for key in SUMMARIES:
        _same_summary(getattr(vllm, key), getattr(sglang, key), key, vllm.worker)
    assert sglang.request_rate == pytest.approx(vllm.request_rate)
    assert sglang.generation_tokens == pytest.approx(vllm.generation_tokens)
    assert sum((sglang.prompt_tokens_by_source or {}).values()) == pytest.approx(
        sum((vllm.prompt_tokens_by_source or {}).values()))
    assert (sglang.running, sglang.waiting) == (vllm.running, vllm.waiting)
    assert sglang.kv_cache_usage == pytest.approx(vllm.kv_cache_usage)
    assert (sglang.aborted, sglang.errored) == (vllm.aborted, vllm.errored) == (0.0, 0.0)
    assert sglang.missing == vllm.missing == ()


@pytest.mark.parametrize("tp_size", [1, 4])
def test_sglang_and_vllm_expositions_give_the_same_worker_stats(tp_size: int) -> None:
    vllm, sglang = _windows(tp_size)
    assert vllm.failures == () and sglang.failures == ()
    by_worker = {s.worker: s for s in sglang.workers}
    assert sorted(by_worker) == sorted(s.worker for s in vllm.workers)
    for stats in vllm.workers:
        _compare(stats, by_worker[stats.worker])
    # The traffic went through a prefill node: transfers were seen, in seconds and bytes.
    moved = [s for s in sglang.workers if s.kv_transfer_s is not None]
    assert moved and all(s.kv_transfer_bytes is not None for s in moved)
    assert sglang.outcomes == vllm.outcomes  # the routers' own series are untouched


def test_a_view_needs_at_least_one_rank() -> None:
    cluster, _, _ = drive(sessions=1, turns=1)
    with pytest.raises(ValueError, match="tp_size must be >= 1"):
        SglangView(cluster.engines[0].metrics, tp_size=0)


def test_a_cluster_configured_for_sglang_serves_its_exposition() -> None:
    """``[cluster] metrics_engine = "sglang"``: every worker's /metrics (live.py and the
    in-process source read ``Engine.registry``) is the SGLang view, rank replicas included."""
    sources: list[InProcessSource] = []

    def attach(cluster: SimCluster) -> None:
        source = InProcessSource.following(sim_cluster_provider(cluster), clock=cluster.clock)
        asyncio.run(source.window(-30.0, 0.0))
        sources.append(source)

    cluster, done, _ = drive(route=Route.PREFILL_NODE, sessions=8, turns=2, before_run=attach,
                             cfg={"metrics_engine": "sglang", "sglang_tp_ranks": 2})
    text = cluster.engines[0].registry.collect()
    names = {family.name for family in text}
    assert "sglang:num_queue_reqs" in names and not any(n.startswith("vllm:") for n in names)
    w = asyncio.run(sources[0].window(0.0, cluster.clock.now()))
    assert {s.engine for s in w.workers} == {"sglang"}
    decode = [s for s in w.workers if s.role == "decode"]
    finished = [r for r in done if not r.rejected]
    assert sum(s.ttft_s.count for s in decode if s.ttft_s is not None) == len(finished)
    transfers = sum(s.kv_transfer_s.count for s in w.workers if s.kv_transfer_s is not None)
    assert 0 < transfers <= len(finished)  # each counted once, not once per rank


def test_a_scenario_selects_the_exposition() -> None:
    base = {"name": "s", "duration_s": 10, "workload": {"source": "synthetic"}}
    assert parse_scenario(base).cluster.metrics_engine == "vllm"
    sc = parse_scenario({**base, "cluster": {"metrics_engine": "sglang", "sglang_tp_ranks": 4}})
    assert (sc.cluster.metrics_engine, sc.cluster.sglang_tp_ranks) == ("sglang", 4)


def test_an_sglang_cluster_has_sglang_s_bucket_edges() -> None:
    """Its exposition carries SGLang 0.5.23's default edges (metrics_collector.py), in ms and
    MB where SGLang counts in them; a vLLM cluster keeps vLLM's."""
    from prometheus_client import generate_latest

    cluster, done, _ = drive(route=Route.PREFILL_NODE, sessions=4, turns=1,
                             cfg={"metrics_engine": "sglang"})
    assert done
    text = generate_latest(cluster.prefill[0].registry).decode()

    def edges(family: str) -> list[str]:
        return [line.split('le="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith(family + "_bucket")]

    assert edges("sglang:time_to_first_token_seconds")[:3] == ["0.1", "0.2", "0.4"]
    assert edges("sglang:inter_token_latency_seconds")[0] == "0.002"
    assert edges("sglang:queue_time_seconds")[:2] == ["0.0", "0.001"]
    assert [float(e) for e in edges("sglang:kv_transfer_latency_ms")[:-1]] == pytest.approx(
        [1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000])
    assert [float(e) for e in edges("sglang:kv_transfer_total_mb")[:-1]] == pytest.approx(
        [1, 5, 10, 50, 100, 500, 1000, 5000, 10000])
    stage = edges("sglang:per_stage_req_latency_seconds")
    assert len(stage) == 31 and float(stage[0]) == pytest.approx(0.001)
    assert float(stage[-2]) == pytest.approx(0.001 * 1.62**29)
    vllm, _, _ = drive(route=Route.PREFILL_NODE, sessions=1, turns=1)
    assert "vllm:time_to_first_token_seconds_bucket" in generate_latest(
        vllm.prefill[0].registry).decode()


def test_sglang_buckets_are_set_before_any_observation() -> None:
    from controller.sim.sglang_metrics import use_sglang_buckets
    from controller.sim.vllm_metrics import WorkerMetrics

    m = WorkerMetrics(model_name="m", num_gpu_blocks=10, block_size=16, max_model_len=1024)
    m.h_ttft.observe(0.5)
    with pytest.raises(ValueError, match="h_ttft has observations"):
        use_sglang_buckets(m)
