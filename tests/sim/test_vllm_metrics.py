from __future__ import annotations

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from controller.policy import Route
from controller.sim.engine import Engine
from controller.sim.profiles import load_profile
from controller.sim.vllm_metrics import ITL_BUCKETS, TTFT_BUCKETS, Hist, build_1_2_5_buckets
from tests.sim._synthetic import drive


def _families(engine: Engine) -> dict[str, object]:
    text = generate_latest(engine.metrics.registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _samples(fams: dict[str, object], name: str) -> list[tuple[str, dict[str, str], float]]:
    fam = fams[name]
    return [(s.name, s.labels, s.value) for s in fam.samples]  # type: ignore[attr-defined]


CORE = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_waiting_by_reason": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter", "vllm:prompt_tokens": "counter",
    "vllm:prompt_tokens_by_source": "counter", "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter", "vllm:iteration_tokens_total": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram", "vllm:cache_config_info": "gauge",
    "vllm:nixl_xfer_time_seconds": "histogram", "vllm:nixl_bytes_transferred": "histogram",
    "vllm:nixl_num_kv_expired_reqs": "counter",
}


def test_families_names_types_labels_and_buckets() -> None:
    cluster, _, _ = drive(route=Route.PREFILL_NODE, sessions=10)
    d = cluster.decode[0]
    fams = _families(d)
    for name, typ in CORE.items():
        assert name in fams, name
        assert fams[name].type == typ, name  # type: ignore[attr-defined]
    assert "vllm:num_requests_kv_fetch_by_stage" in fams
    assert "vllm:num_requests_kv_fetch_by_stage" not in _families(cluster.prefill[0])
    for name in CORE:
        if name == "vllm:cache_config_info":
            continue
        for _, labels, _ in _samples(fams, name):
            assert labels["model_name"] == d.profile.model_name
            assert labels["engine"] == "0"
    ttft_les = [float(lbl["le"]) for n, lbl, _ in _samples(fams, "vllm:time_to_first_token_seconds")
                if n.endswith("_bucket") and lbl["le"] != "+Inf"]
    assert tuple(ttft_les) == TTFT_BUCKETS
    itl_les = [float(lbl["le"]) for n, lbl, _ in _samples(fams, "vllm:inter_token_latency_seconds")
               if n.endswith("_bucket") and lbl["le"] != "+Inf"]
    assert tuple(itl_les) == ITL_BUCKETS
    info = _samples(fams, "vllm:cache_config_info")[0][1]
    assert info["num_gpu_blocks"] == str(d.profile.num_gpu_blocks)
    assert info["kv_cache_size_tokens"] == str(d.profile.num_gpu_blocks * 16)
    # scraped with the _total suffix, like vLLM
    text = generate_latest(d.metrics.registry).decode()
    assert "vllm:prompt_tokens_total{" in text
    assert "vllm:iteration_tokens_total_bucket{" in text


def test_request_tokens_buckets_follow_the_1_2_5_series() -> None:
    assert build_1_2_5_buckets(8192)[-1] == 5000
    assert build_1_2_5_buckets(131072)[-1] == 100000
    assert build_1_2_5_buckets(100)[:4] == (1.0, 2.0, 5.0, 10.0)


def test_decode_side_counts_the_kv_fetch_wait_as_queue_time() -> None:
    # a very slow link: the fetch dominates, and it must land in queue time, not prefill time
    cluster, done, _ = drive(route=Route.PREFILL_NODE, sessions=6, turns=1,
                             cfg={"kv_link_gbps": 1.0})
    m = cluster.decode[0].metrics
    assert m.h_xfer.count > 0
    assert m.h_queue.sum > 5 * m.h_prefill.sum
    xfer = sum(r.xfer_s for r in done if r.decode_worker == "decode-0")
    assert m.h_queue.sum >= xfer
    # P sees one-token requests
    p = cluster.prefill[0].metrics
    assert p.generation_tokens == p.h_generation.count == len(done)


def test_deferred_waits_show_while_fetching() -> None:
    seen: list[tuple[int, int, int]] = []

    def watch(cluster) -> None:  # type: ignore[no-untyped-def]
        def probe() -> None:
            m = cluster.decode[0].metrics
            seen.append((m.waiting_deferred, sum(m.kv_fetch.values()), m.waiting))
            if cluster.loop.now < 5:
                cluster.loop.at(cluster.loop.now + 0.01, probe)
        cluster.loop.at(0.0, probe)

    drive(route=Route.PREFILL_NODE, sessions=6, turns=1, cfg={"kv_link_gbps": 1.0},
          before_run=watch)
    assert any(deferred > 0 for deferred, _, _ in seen)
    assert all(deferred == stages and deferred <= waiting for deferred, stages, waiting in seen)


def test_usage_and_gauges_return_to_idle() -> None:
    cluster, _, _ = drive(route=Route.DECODE_LOCAL, sessions=10)
    for e in cluster.engines:
        m = e.metrics
        assert m.running == 0 and m.waiting == 0 and m.kv_usage == 0.0
    prof = load_profile("llama-3.1-8b-h100")
    assert prof.kv_capacity_tokens == 29205 * 16


def test_custom_histogram_buckets_from_the_scenario() -> None:
    import pytest

    from controller.sim.scenario import ScenarioError, parse_scenario

    base = {"name": "b", "duration_s": 5, "workload": {"source": "synthetic"}}
    fine = (0.002, 0.004, 0.006, 0.008, 0.01, 0.02)
    sc = parse_scenario({**base, "cluster": {"custom_histogram_buckets": {
        "inter_token_latency": list(fine)}}})
    cluster, _, _ = drive(sessions=4, turns=1, cfg={
        "custom_histogram_buckets": sc.cluster.custom_histogram_buckets})
    d = cluster.decode[0]
    fams = _families(d)
    les = [float(lbl["le"]) for n, lbl, _ in _samples(fams, "vllm:inter_token_latency_seconds")
           if n.endswith("_bucket") and lbl["le"] != "+Inf"]
    assert tuple(les) == fine
    # an 8B H100 decode step (~7.5-10 ms) is now resolved below the default 10 ms floor
    counts = d.metrics.h_itl.counts
    assert counts[0] == 0 and sum(counts[2:4]) > 0
    ttft_les = [float(lbl["le"]) for n, lbl, _ in
                _samples(fams, "vllm:time_to_first_token_seconds")
                if n.endswith("_bucket") and lbl["le"] != "+Inf"]
    assert tuple(ttft_les) == TTFT_BUCKETS  # other families keep vLLM's defaults
    for bad in ({"inter_token_latency": [0.2, 0.1]}, {"itl": [0.1]}):
        with pytest.raises(ScenarioError, match=r"cluster\.custom_histogram_buckets"):
            parse_scenario({**base, "cluster": {"custom_histogram_buckets": bad}})


def test_histogram_families_are_those_add_metric_builds() -> None:
    cluster, done, _ = drive(route=Route.PREFILL_NODE, sessions=8, turns=2)
    assert done
    checked = 0
    for eng in cluster.engines:
        m = eng.metrics
        extra = Hist((-1.0, 0.0, 2.5))  # a negative bound: no sum and count, as add_metric
        extra.observe(-3.0)
        extra.observe(1.0, 4)
        for h in [*(v for v in vars(m).values() if isinstance(v, Hist)), extra]:
            for _ in range(2):  # the second build reads the memoized bucket texts
                ours = m._hist("vllm:some_seconds", "doc", h)
                ref = HistogramMetricFamily("vllm:some_seconds", "doc", labels=list(m.labels))
                ref.add_metric(list(m.labels.values()), h.cumulative(), h.sum)
                assert ours.samples == ref.samples
                assert [list(s.labels.items()) for s in ours.samples] == [
                    list(s.labels.items()) for s in ref.samples]
                assert [type(s.value) for s in ours.samples] == [
                    type(s.value) for s in ref.samples]
            checked += h.count > 0
    assert checked > len(cluster.engines)
