"""A simulated worker's series as SGLang 0.5 names them (``reference/worker-metrics.md`` §3).

:class:`SglangView` renders the state of a :class:`~controller.sim.vllm_metrics.WorkerMetrics`
into a registry of its own, so the same traffic can be read through the vLLM and the SGLang
rows of the engine catalog and the two windows compared. What it keeps of SGLang:

- names and units: KV-transfer latency in ms (``kv_transfer_latency_ms``), size in MB of
  2**20 bytes (``kv_transfer_total_mb``), prefill time as
  ``per_stage_req_latency_seconds{stage="prefill_forward"}``;
- labels: tokenizer series (TTFT, inter-token latency, TPOT, end-to-end, request and token
  counters) carry ``model_name`` and ``engine_type``; scheduler series (queue time, stages,
  KV transfers, running/queue/token-usage gauges) also ``tp_rank``, ``pp_rank`` and
  ``moe_ep_rank``. With ``tp_size`` > 1 every rank reports the scheduler's series, as SGLang
  does with ``--enable-metrics-for-all-schedulers``.

Bucket edges are vLLM's, converted to SGLang's units (SGLang's own defaults differ; the
reader takes whatever edges it is given).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from controller.sim.vllm_metrics import Hist, WorkerMetrics

MB = float(2**20)
_ENGINE_TYPE = {"kv_producer": "prefill", "kv_consumer": "decode", None: "unified"}


def _scaled(h: Hist, scale: float) -> tuple[list[tuple[str, float]], float]:
    """``h``'s cumulative buckets and sum in a unit ``scale`` times the original."""
    buckets = [(le if le == "+Inf" else repr(float(le) * scale), c) for le, c in h.cumulative()]
    return buckets, h.sum * scale


class SglangView:
    """The SGLang exposition of one simulated worker (``registry``), read live."""

    def __init__(self, metrics: WorkerMetrics, *, tp_size: int = 1) -> None:
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        self.metrics = metrics
        self.tp_size = tp_size
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    def families(self) -> Iterator[Metric]:
        m = self.metrics
        tokenizer = {"model_name": m.labels["model_name"],
                     "engine_type": _ENGINE_TYPE.get(m.kv_role, "unified")}
        ranks = [{**tokenizer, "tp_rank": str(r), "pp_rank": "0", "moe_ep_rank": "0"}
                 for r in range(self.tp_size)]

        def hist(name: str, doc: str, h: Hist, labelsets: list[dict[str, str]],
                 scale: float = 1.0, **extra: str) -> HistogramMetricFamily:
            names = [*labelsets[0], *extra]
            f = HistogramMetricFamily(name, doc, labels=names)
            buckets, total = _scaled(h, scale)
            for labels in labelsets:
                f.add_metric([*labels.values(), *extra.values()], buckets, total)
            return f

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=list(ranks[0]))
            for labels in ranks:
                g.add_metric(list(labels.values()), value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=list(tokenizer))
            c.add_metric(list(tokenizer.values()), value)
            return c

        yield hist("sglang:time_to_first_token_seconds", "Time to first token.", m.h_ttft,
                   [tokenizer])
        yield hist("sglang:inter_token_latency_seconds", "Inter-token latency.", m.h_itl,
                   [tokenizer])
        yield hist("sglang:request_time_per_output_token_seconds",
                   "Time per output token per request.", m.h_tpot, [tokenizer])
        yield hist("sglang:e2e_request_latency_seconds", "End-to-end request latency.",
                   m.h_e2e, [tokenizer])
        yield counter("sglang:num_requests", "Finished requests.", sum(m.success.values()))
        yield counter("sglang:prompt_tokens", "Prefill tokens.", m.prompt_tokens)
        yield counter("sglang:generation_tokens", "Generation tokens.", m.generation_tokens)
        yield hist("sglang:queue_time_seconds", "Time in the waiting queue.", m.h_queue, ranks)
        yield hist("sglang:per_stage_req_latency_seconds", "Request latency per stage.",
                   m.h_prefill, ranks, stage="prefill_forward")
        yield gauge("sglang:num_running_reqs", "Running requests.", m.running)
        yield gauge("sglang:num_queue_reqs", "Requests in the waiting queue.", m.waiting)
        yield gauge("sglang:token_usage", "KV token usage.", m.kv_usage)
        if m.kv_role is not None:
            yield hist("sglang:kv_transfer_latency_ms", "KV transfer latency in ms.", m.h_xfer,
                       ranks, scale=1e3)
            yield hist("sglang:kv_transfer_total_mb", "KV transfer size in MB.", m.h_bytes,
                       ranks, scale=1.0 / MB)


class _Collector:
    def __init__(self, view: SglangView) -> None:
        self._view = view

    def collect(self) -> Iterable[Metric]:
        return list(self._view.families())
