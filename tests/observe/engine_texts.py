"""Small exposition texts shaped as real engine releases export them.

Names, types, labels and bucket edges are copied from each release's definitions (the
files are listed in docs/engines.md); the values are made up. ``baseline(text)`` is the same
exposition with every sample at 0: the snapshot before a window.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# vllm/v1/metrics/loggers.py (0.9.2, 0.10.2, 0.11.2), vllm/v1/metrics/buckets.py (0.34.0)
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                     2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# nixl_connector.py (0.11.2) / nixl/stats.py (0.34.0): buckets[1:] of the post-time list
VLLM_NIXL_XFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
# sglang/srt/observability/metrics_collector.py (0.5.23)
SGLANG_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200,
                       400)
SGLANG_ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035,
                      0.040, 0.060, 0.080, 0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8)
SGLANG_KV_TRANSFER_MS_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)

VLLM_LABELS = {"model_name": "m", "engine": "0"}
SGLANG_TOKENIZER = {"model_name": "m", "engine_type": "decode"}
SGLANG_SCHEDULER = {**SGLANG_TOKENIZER, "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}


def _labels(labels: Mapping[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def gauge(name: str, labels: Mapping[str, str], value: float) -> str:
    return f"# TYPE {name} gauge\n{name}{_labels(labels)} {value}\n"


def counter(name: str, series: Sequence[tuple[Mapping[str, str], float]]) -> str:
    """A counter as prometheus_client writes it: TYPE and samples named ``name_total``."""
    out = [f"# TYPE {name}_total counter"]
    out += [f"{name}_total{_labels(labels)} {value}" for labels, value in series]
    return "\n".join(out) + "\n"


def histogram(name: str, labels: Mapping[str, str], edges: Sequence[float],
              observations: Sequence[float]) -> str:
    out = [f"# TYPE {name} histogram"]
    for le in edges:
        n = sum(1 for o in observations if o <= le)
        out.append(f"{name}_bucket{_labels({**labels, 'le': repr(float(le))})} {n}")
    out.append(f"{name}_bucket{_labels({**labels, 'le': '+Inf'})} {len(observations)}")
    out.append(f"{name}_count{_labels(labels)} {len(observations)}")
    out.append(f"{name}_sum{_labels(labels)} {sum(observations)}")
    return "\n".join(out) + "\n"


def baseline(text: str) -> str:
    """``text`` with every sample 0 (the families announced, nothing counted yet)."""
    return "".join(
        line + "\n" if line.startswith("#") else line.rsplit(" ", 1)[0] + " 0\n"
        for line in text.splitlines()
    )


def _success(reasons: Mapping[str, float]) -> str:
    return counter("vllm:request_success", [
        ({**VLLM_LABELS, "finished_reason": r}, v) for r, v in reasons.items()])


def _vllm_common() -> str:
    return (gauge("vllm:num_requests_running", VLLM_LABELS, 3)
            + gauge("vllm:num_requests_waiting", VLLM_LABELS, 1)
            + counter("vllm:generation_tokens", [(VLLM_LABELS, 400)])
            + histogram("vllm:time_to_first_token_seconds", VLLM_LABELS, VLLM_TTFT_BUCKETS,
                        [0.05, 0.15]))


# vLLM 0.9.2: both KV usage names (gpu_cache_usage_perc deprecated, still shown), ITL only
# under its old name time_per_output_token_seconds, no per-request TPOT, no per-source prompt
# tokens, FinishReason stop/length/abort, no NIXL series (nixl_connector.py has none).
VLLM_0_9 = (
    _vllm_common()
    + gauge("vllm:gpu_cache_usage_perc", VLLM_LABELS, 0.25)
    + gauge("vllm:kv_cache_usage_perc", VLLM_LABELS, 0.25)
    + counter("vllm:prompt_tokens", [(VLLM_LABELS, 900)])
    + _success({"stop": 6, "length": 2, "abort": 2})
    + histogram("vllm:time_per_output_token_seconds", VLLM_LABELS, VLLM_ITL_BUCKETS,
                [0.02, 0.02, 0.02, 0.02])
)

# vLLM 0.9.2's V0 engine (VLLM_USE_V1=0; vllm/engine/metrics.py): gpu_cache_usage_perc and
# time_per_output_token_seconds only, and no "engine" label.
V0_LABELS = {"model_name": "m"}
VLLM_0_9_V0 = (
    gauge("vllm:num_requests_running", V0_LABELS, 3)
    + gauge("vllm:num_requests_waiting", V0_LABELS, 1)
    + gauge("vllm:gpu_cache_usage_perc", V0_LABELS, 0.25)
    + counter("vllm:generation_tokens", [(V0_LABELS, 400)])
    + counter("vllm:prompt_tokens", [(V0_LABELS, 900)])
    + counter("vllm:request_success", [({**V0_LABELS, "finished_reason": r}, v)
                                        for r, v in (("stop", 3), ("length", 1), ("abort", 1))])
    + histogram("vllm:time_to_first_token_seconds", V0_LABELS, VLLM_TTFT_BUCKETS, [0.05, 0.15])
    + histogram("vllm:time_per_output_token_seconds", V0_LABELS, VLLM_ITL_BUCKETS, [0.02, 0.04])
)

# vLLM 0.10.2: both ITL names (inter_token_latency_seconds new, time_per_output_token_seconds
# deprecated), still no per-request TPOT nor per-source prompt tokens.
VLLM_0_10 = (
    _vllm_common()
    + gauge("vllm:gpu_cache_usage_perc", VLLM_LABELS, 0.5)
    + gauge("vllm:kv_cache_usage_perc", VLLM_LABELS, 0.5)
    + counter("vllm:prompt_tokens", [(VLLM_LABELS, 900)])
    + _success({"stop": 5, "length": 0, "abort": 0})
    + histogram("vllm:time_per_output_token_seconds", VLLM_LABELS, VLLM_ITL_BUCKETS,
                [0.04, 0.04])
    + histogram("vllm:inter_token_latency_seconds", VLLM_LABELS, VLLM_ITL_BUCKETS,
                [0.04, 0.04])
)

# vLLM 0.11.2 with a NIXL connector: gpu_cache_usage_perc hidden (shown only with
# --show-hidden-metrics-for-version=0.10), per-request TPOT present, NIXL histograms.
VLLM_0_11 = (
    _vllm_common()
    + gauge("vllm:kv_cache_usage_perc", VLLM_LABELS, 0.75)
    + counter("vllm:prompt_tokens", [(VLLM_LABELS, 900)])
    + _success({"stop": 4, "length": 0, "abort": 1})
    + histogram("vllm:time_per_output_token_seconds", VLLM_LABELS, VLLM_ITL_BUCKETS, [0.03])
    + histogram("vllm:inter_token_latency_seconds", VLLM_LABELS, VLLM_ITL_BUCKETS, [0.03])
    + histogram("vllm:request_time_per_output_token_seconds", VLLM_LABELS, VLLM_ITL_BUCKETS,
                [0.035])
    + histogram("vllm:nixl_xfer_time_seconds", VLLM_LABELS, VLLM_NIXL_XFER_BUCKETS,
                [0.02, 0.04])
)

# vLLM 0.34.0: FinishReason stop/length/abort/error/repetition, old names gone, per-source
# prompt tokens, NIXL (nixl/stats.py).
VLLM_0_34 = (
    _vllm_common()
    + gauge("vllm:kv_cache_usage_perc", VLLM_LABELS, 0.5)
    + counter("vllm:prompt_tokens", [(VLLM_LABELS, 900)])
    + counter("vllm:prompt_tokens_by_source", [
        ({**VLLM_LABELS, "source": "local_compute"}, 600),
        ({**VLLM_LABELS, "source": "local_cache_hit"}, 100),
        ({**VLLM_LABELS, "source": "external_kv_transfer"}, 200)])
    + _success({"stop": 10, "length": 3, "abort": 2, "error": 4, "repetition": 1})
    + histogram("vllm:inter_token_latency_seconds", VLLM_LABELS, VLLM_ITL_BUCKETS, [0.03])
    + histogram("vllm:request_time_per_output_token_seconds", VLLM_LABELS, VLLM_ITL_BUCKETS,
                [0.035])
    + histogram("vllm:nixl_xfer_time_seconds", VLLM_LABELS, VLLM_NIXL_XFER_BUCKETS, [0.05])
)


def _sglang_common(is_streaming: bool = True) -> str:
    # is_streaming labels the tokenizer's request series in 0.5.19 and 0.5.23 (not 0.5.15).
    streaming = {**SGLANG_TOKENIZER, **({"is_streaming": "true"} if is_streaming else {})}
    return (gauge("sglang:num_running_reqs", SGLANG_SCHEDULER, 4)
            + gauge("sglang:num_queue_reqs", SGLANG_SCHEDULER, 2)
            + gauge("sglang:token_usage", SGLANG_SCHEDULER, 0.5)
            + counter("sglang:prompt_tokens", [(streaming, 1000)])
            + counter("sglang:generation_tokens", [(streaming, 200)])
            + counter("sglang:num_requests", [(streaming, 10)])
            + counter("sglang:num_aborted_requests", [(SGLANG_TOKENIZER, 2)])
            + histogram("sglang:time_to_first_token_seconds", streaming, SGLANG_TTFT_BUCKETS,
                        [0.3, 0.5])
            + histogram("sglang:inter_token_latency_seconds", SGLANG_TOKENIZER,
                        SGLANG_ITL_BUCKETS, [0.01, 0.01, 0.01]))


# SGLang 0.4.9.post6 (sglang/srt/metrics/collector.py): no KV-transfer latency family at
# all; the failure counters are defined without "_total" (exposed with it).
SGLANG_0_4_9 = (
    _sglang_common(is_streaming=False)
    + counter("sglang:num_transfer_failed_reqs", [(SGLANG_SCHEDULER, 1)])
    + counter("sglang:num_bootstrap_failed_reqs", [(SGLANG_SCHEDULER, 0)])
)

# SGLang 0.5.3 (sglang/srt/metrics/collector.py): kv_transfer_latency_ms is a GAUGE (the
# latest transfer's latency on the prefill side, 0 until one is measured; a gauge through
# 0.5.9, a histogram from 0.5.10), no request_time_per_output_token (0.5.23 has it, 0.5.19 not).
SGLANG_0_5_3 = (
    _sglang_common(is_streaming=False)
    + gauge("sglang:kv_transfer_latency_ms", SGLANG_SCHEDULER, 12.0)
    + counter("sglang:num_transfer_failed_reqs", [(SGLANG_SCHEDULER, 1)])
    + counter("sglang:num_bootstrap_failed_reqs", [(SGLANG_SCHEDULER, 0)])
)

# SGLang 0.5.23 (sglang/srt/observability/metrics_collector.py): a histogram in ms.
SGLANG_0_5_23 = (
    _sglang_common()
    + histogram("sglang:kv_transfer_latency_ms", SGLANG_SCHEDULER,
                SGLANG_KV_TRANSFER_MS_BUCKETS, [10.0, 30.0])
    + counter("sglang:num_transfer_failed_reqs", [(SGLANG_SCHEDULER, 1)])
    + counter("sglang:num_bootstrap_failed_reqs", [(SGLANG_SCHEDULER, 1)])
)
