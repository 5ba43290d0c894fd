"""A simulated worker's series as SGLang 0.5 names them (``docs/engines.md``).

:class:`SglangView` renders the state of a :class:`~controller.sim.vllm_metrics.WorkerMetrics`
into a registry of its own, so the same traffic can be read through the vLLM and the SGLang
rows of the engine catalog and the two windows compared. What it keeps of SGLang:

- names and units: KV-transfer latency in ms (``kv_transfer_latency_ms``), size in MB of
  2**20 bytes (``kv_transfer_total_mb``), prefill time as
  ``per_stage_req_latency_seconds{stage="prefill_forward"}``;
- labels: tokenizer series (TTFT, inter-token latency, TPOT, end-to-end, request and token
  counters) carry ``model_name`` and ``engine_type`` (and ``is_streaming`` where 0.5.23 has
  it); scheduler series (queue time, stages, KV transfers and their failures,
  running/queue/token-usage gauges) also ``tp_rank``, ``pp_rank`` and ``moe_ep_rank``. With
  ``tp_size`` > 1 every rank reports the scheduler's series, as SGLang does with
  ``--enable-metrics-for-all-schedulers``;
- request counts: ``num_requests`` counts every finished request, aborted ones too, as
  SGLang's tokenizer manager does; ``num_aborted_requests`` the aborted ones;
  ``num_transfer_failed_reqs`` the requests vLLM's exposition reports as
  ``finished_reason="error"`` (a KV transfer that failed).

Bucket edges are whatever the worker's histograms hold: SGLang 0.5.23's own defaults
(:data:`SGLANG_BUCKETS`) for a worker set up with :func:`use_sglang_buckets` (a cluster with
``metrics_engine = "sglang"``), vLLM's otherwise (a view over a vLLM worker, to compare the
two expositions of the same traffic bucket by bucket), in SGLang's units either way.
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

# sglang/srt/observability/metrics_collector.py (0.5.23) defaults, in seconds and bytes (the
# view converts to SGLang's ms and MB). Keys are WorkerMetrics' histogram attributes.
_SGLANG_ITL = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040,
               0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0)
SGLANG_BUCKETS: dict[str, tuple[float, ...]] = {
    "h_ttft": (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400),
    "h_itl": _SGLANG_ITL,
    "h_tpot": _SGLANG_ITL,  # request_time_per_output_token_seconds uses the ITL buckets
    "h_e2e": (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600,
              1200, 1800, 2400),
    "h_queue": (0.0, 0.001, 0.005, 0.010, 0.050, 0.100, 0.200, 0.500, 1, 2, 3, 4, 5, 10, 15,
                20, 30, 40, 50, 60, 70, 80, 90, 100, 200, 300, 400, 500, 600, 700, 800, 900,
                1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000),
    # per_stage_req_latency_seconds: exponential_buckets(start=0.001, width=1.62, length=30)
    "h_prefill": tuple(0.001 * 1.62**i for i in range(30)),
    # kv_transfer_latency_ms (ms) and kv_transfer_total_mb (MB of 2**20 bytes)
    "h_xfer": tuple(ms / 1e3 for ms in (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)),
    "h_bytes": tuple(mb * MB for mb in (1, 5, 10, 50, 100, 500, 1000, 5000, 10000)),
}


def use_sglang_buckets(metrics: WorkerMetrics) -> None:
    """Give ``metrics``' histograms SGLang's bucket edges (before it observes anything: the
    counts of other edges cannot be re-binned)."""
    for attr, edges in SGLANG_BUCKETS.items():
        h: Hist = getattr(metrics, attr)
        if h.count:
            raise ValueError(f"{attr} has observations already: set the buckets first")
        setattr(metrics, attr, Hist(edges))


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

        def counter(name: str, doc: str, value: float,
                    labelset: dict[str, str] = tokenizer) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=list(labelset))
            c.add_metric(list(labelset.values()), value)
            return c

        streaming = {**tokenizer, "is_streaming": "true"}
        yield hist("sglang:time_to_first_token_seconds", "Time to first token.", m.h_ttft,
                   [streaming])
        yield hist("sglang:inter_token_latency_seconds", "Inter-token latency.", m.h_itl,
                   [tokenizer])
        yield hist("sglang:request_time_per_output_token_seconds",
                   "Time per output token per request.", m.h_tpot, [streaming])
        yield hist("sglang:e2e_request_latency_seconds", "End-to-end request latency.",
                   m.h_e2e, [streaming])
        yield counter("sglang:num_requests", "Number of requests processed.",
                      sum(m.success.values()), streaming)
        yield counter("sglang:num_aborted_requests", "Number of requests aborted.",
                      m.success["abort"])
        yield counter("sglang:prompt_tokens", "Prefill tokens.", m.prompt_tokens, streaming)
        yield counter("sglang:generation_tokens", "Generation tokens.", m.generation_tokens,
                      streaming)
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
            yield from _transfer_failures(m, ranks)


def _transfer_failures(m: WorkerMetrics, ranks: list[dict[str, str]]
                       ) -> Iterator[CounterMetricFamily]:
    """P/D failures, on every rank: vLLM's finished_reason="error" as failed transfers."""
    for name, doc, value in (
        ("sglang:num_bootstrap_failed_reqs", "Bootstrap failures.", 0),
        ("sglang:num_transfer_failed_reqs", "KV transfer failures.", m.success["error"]),
    ):
        c = CounterMetricFamily(name, doc, labels=list(ranks[0]))
        for labels in ranks:
            c.add_metric(list(labels.values()), value)
        yield c


class _Collector:
    def __init__(self, view: SglangView) -> None:
        self._view = view

    def collect(self) -> Iterable[Metric]:
        return list(self._view.families())
