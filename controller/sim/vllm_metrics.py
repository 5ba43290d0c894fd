"""Per-worker metrics with vLLM 0.34's families, names, labels and bucket boundaries.

The engine updates plain Python numbers (cheap, and histograms take ``n`` samples at once so
runs of identical decode steps are recorded in bulk); a custom collector renders them into a
per-worker ``prometheus_client`` registry, so an in-process reader and an HTTP scrape see the
same exposition a vLLM API server would produce (see ``docs/engines.md``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TypeVar

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.samples import Sample

# vllm/v1/metrics/buckets.py (0.33.0, 0.34.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
# vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py
NIXL_XFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
NIXL_POST_BUCKETS = (0.001, *NIXL_XFER_BUCKETS)
NIXL_BYTES_BUCKETS = tuple(float(2 ** e) for e in range(11, 34, 2))
NIXL_DESCRIPTOR_BUCKETS = (10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000,
                           50000)

# Families --custom-histogram-buckets may replace (keyed as vLLM keys them).
BUCKET_FAMILIES = ("time_to_first_token", "inter_token_latency", "request_latency",
                   "iteration_tokens", "request_tokens", "request_params_n",
                   "request_num_preemptions")

KV_FETCH_STAGES = ("waiting_to_start", "in_progress", "completed_waiting")
# The per-request histograms, in exposition order: (family, help, WorkerMetrics attribute).
REQUEST_HISTOGRAMS: tuple[tuple[str, str, str], ...] = (
    ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", "h_prompt"),
    ("vllm:request_generation_tokens", "Number of generation tokens processed.",
     "h_generation"),
    ("vllm:request_max_num_generation_tokens", "Maximum number of requested generation tokens.",
     "h_max_generation"),
    ("vllm:request_params_max_tokens", "The max_tokens request parameter.", "h_max_tokens"),
    ("vllm:request_params_n", "The n request parameter.", "h_n"),
    ("vllm:request_prefill_kv_computed_tokens",
     "New KV tokens computed during prefill (excluding cached tokens).", "h_kv_computed"),
    ("vllm:iteration_tokens_total", "Number of tokens per engine_step.", "h_iter"),
    ("vllm:time_to_first_token_seconds", "Time to first token in seconds.", "h_ttft"),
    ("vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", "h_itl"),
    ("vllm:request_time_per_output_token_seconds",
     "Time per output token per request in seconds.", "h_tpot"),
    ("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.", "h_e2e"),
    ("vllm:request_queue_time_seconds", "Time spent in WAITING phase for request.", "h_queue"),
    ("vllm:request_inference_time_seconds", "Time spent in RUNNING phase for request.",
     "h_inference"),
    ("vllm:request_prefill_time_seconds", "Time spent in PREFILL phase for request.",
     "h_prefill"),
    ("vllm:request_decode_time_seconds", "Time spent in DECODE phase for request.", "h_decode"),
    ("vllm:request_num_preemptions", "Number of preemptions per request.", "h_preempt"),
)
_F = TypeVar("_F", GaugeMetricFamily, CounterMetricFamily)
# vllm/v1/engine/__init__.py (0.34.0) FINISH_REASON_STRINGS: every value is a label of
# vllm:request_success, created at start-up.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """vLLM's request_tokens buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exponent
            if v > max_value:
                return tuple(out)
            out.append(float(v))
        exponent += 1


class Hist:
    """A histogram that takes ``n`` equal samples at once."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += n
        self.sum += value * n

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        acc = 0
        for b, c in zip(self.bounds, self.counts, strict=False):
            acc += c
            out.append((_fmt(b), float(acc)))
        out.append(("+Inf", float(acc + self.counts[-1])))
        return out


def _fmt(b: float) -> str:
    return repr(float(b))


class WorkerMetrics:
    """The series of one vLLM worker (one API server, one DP engine)."""

    def __init__(
        self,
        *,
        model_name: str,
        engine: str = "0",
        kv_role: str | None = None,
        num_gpu_blocks: int,
        block_size: int,
        max_model_len: int,
        gpu_memory_utilization: float = 0.9,
        enable_prefix_caching: bool = True,
        custom_buckets: Mapping[str, Sequence[float]] | None = None,
    ) -> None:
        unknown = set(custom_buckets or {}) - set(BUCKET_FAMILIES)
        if unknown:
            raise ValueError(f"unknown histogram bucket family: {', '.join(sorted(unknown))}")
        cb = dict(custom_buckets or {})
        ttft = cb.get("time_to_first_token", TTFT_BUCKETS)
        itl = cb.get("inter_token_latency", ITL_BUCKETS)
        lat = cb.get("request_latency", REQUEST_LATENCY_BUCKETS)
        itok = cb.get("iteration_tokens", ITERATION_TOKENS_BUCKETS)
        rtok = cb.get("request_tokens", build_1_2_5_buckets(max_model_len))
        self.labels = {"model_name": model_name, "engine": engine}
        self._les: dict[tuple[float, ...], list[str]] = {}  # bucket bounds -> "le" texts
        self.kv_role = kv_role  # "kv_producer" on P, "kv_consumer" on D, None colocated
        self.cache_info = {
            "block_size": str(block_size),
            "num_gpu_blocks": str(num_gpu_blocks),
            "kv_cache_size_tokens": str(num_gpu_blocks * block_size),
            "kv_cache_max_concurrency": f"{num_gpu_blocks * block_size / max_model_len:.2f}",
            "gpu_memory_utilization": str(gpu_memory_utilization),
            "enable_prefix_caching": str(enable_prefix_caching),
            "cache_dtype": "auto",
        }
        # gauges
        self.running = 0
        self.waiting_capacity = 0
        self.waiting_deferred = 0
        self.kv_fetch = dict.fromkeys(KV_FETCH_STAGES, 0)
        self.kv_usage = 0.0
        # counters
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.external_queries = 0
        self.external_hits = 0
        self.preemptions = 0
        self.prompt_tokens = 0
        self.prompt_by_source = {"local_compute": 0, "local_cache_hit": 0,
                                 "external_kv_transfer": 0}
        self.generation_tokens = 0
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.nixl_failed = 0
        self.nixl_expired = 0
        # histograms
        self.h_prompt = Hist(rtok)
        self.h_generation = Hist(rtok)
        self.h_max_generation = Hist(rtok)
        self.h_max_tokens = Hist(rtok)
        self.h_kv_computed = Hist(rtok)
        self.h_n = Hist(cb.get("request_params_n", PARAMS_N_BUCKETS))
        self.h_preempt = Hist(cb.get("request_num_preemptions", NUM_PREEMPTIONS_BUCKETS))
        self.h_iter = Hist(itok)
        self.h_ttft = Hist(ttft)
        self.h_itl = Hist(itl)
        self.h_tpot = Hist(itl)
        self.h_e2e = Hist(lat)
        self.h_queue = Hist(lat)
        self.h_prefill = Hist(lat)
        self.h_decode = Hist(lat)
        self.h_inference = Hist(lat)
        self.h_xfer = Hist(NIXL_XFER_BUCKETS)
        self.h_post = Hist(NIXL_POST_BUCKETS)
        self.h_bytes = Hist(NIXL_BYTES_BUCKETS)
        self.h_desc = Hist(NIXL_DESCRIPTOR_BUCKETS)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    @property
    def waiting(self) -> int:
        return self.waiting_capacity + self.waiting_deferred

    def families(self) -> Iterator[Metric]:
        """Every family of one worker, in the order vLLM's exposition lists them."""
        yield from self._state_families()
        yield from self._token_families()
        for name, doc, attr in REQUEST_HISTOGRAMS:
            yield self._hist(name, doc, getattr(self, attr))
        names = [*sorted(self.cache_info), "engine"]
        g = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                              labels=names)
        g.add_metric([*(self.cache_info[k] for k in sorted(self.cache_info)),
                      self.labels["engine"]], 1.0)
        yield g
        if self.kv_role is not None:
            yield from self._nixl_families()

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self.labels))
        g.add_metric(list(self.labels.values()), value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=list(self.labels))
        c.add_metric(list(self.labels.values()), value)
        return c

    def _hist(self, name: str, doc: str, h: Hist) -> HistogramMetricFamily:
        """The family ``add_metric(labels, h.cumulative(), h.sum)`` builds, sample for
        sample; the bucket bounds' text is formatted once per histogram."""
        f = HistogramMetricFamily(name, doc, labels=list(self.labels))
        les = self._les.get(h.bounds)
        if les is None:
            les = self._les[h.bounds] = [*(_fmt(b) for b in h.bounds), "+Inf"]
        base = self.labels
        bucket = f.name + "_bucket"
        samples = f.samples
        acc = 0
        for le, c in zip(les, h.counts, strict=True):
            acc += c
            samples.append(Sample(bucket, {**base, "le": le}, float(acc), None, None))
        if float(les[0]) >= 0:  # add_metric leaves out sum and count after a negative bound
            samples.append(Sample(f.name + "_count", dict(base), float(acc), None))
            samples.append(Sample(f.name + "_sum", dict(base), h.sum, None))
        return f

    def _labelled(self, kind: type[_F], name: str, doc: str, label: str,
                  values: Iterable[tuple[str, float]]) -> _F:
        """One family with an extra label: one sample per (label value, value)."""
        f = kind(name, doc, labels=[*self.labels, label])
        for v, x in values:
            f.add_metric([*self.labels.values(), v], x)
        return f

    def _state_families(self) -> Iterator[Metric]:
        """Scheduler state: running, waiting (by reason and KV-fetch stage), sleep, KV usage."""
        yield self._gauge("vllm:num_requests_running",
                          "Number of requests in model execution batches.", self.running)
        yield self._gauge("vllm:num_requests_waiting",
                          "Number of requests waiting to be processed.", self.waiting)
        yield self._labelled(GaugeMetricFamily, "vllm:num_requests_waiting_by_reason",
                             "Number of requests waiting, by reason.", "reason",
                             [("capacity", self.waiting_capacity),
                              ("deferred", self.waiting_deferred)])
        if self.kv_role == "kv_consumer":
            yield self._labelled(GaugeMetricFamily, "vllm:num_requests_kv_fetch_by_stage",
                                 "Waiting requests by async KV-load stage.", "stage",
                                 [(stage, self.kv_fetch[stage]) for stage in KV_FETCH_STAGES])
        yield self._labelled(GaugeMetricFamily, "vllm:engine_sleep_state", "Engine sleep state.",
                             "sleep_state",
                             [("awake", 1), ("weights_offloaded", 0), ("discard_all", 0)])
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                          self.kv_usage)

    def _token_families(self) -> Iterator[Metric]:
        """Prefix-cache and token counters, preemptions and finished requests."""
        by_source = self.prompt_by_source
        yield self._counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.",
                            self.prefix_queries)
        yield self._counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.",
                            self.prefix_hits)
        yield self._counter("vllm:external_prefix_cache_queries",
                            "External prefix cache queries, in tokens.", self.external_queries)
        yield self._counter("vllm:external_prefix_cache_hits",
                            "External prefix cache hits, in tokens.", self.external_hits)
        yield self._labelled(CounterMetricFamily, "vllm:prompt_tokens_cached_by_source",
                             "Cached prompt tokens by source.", "source",
                             [("device", by_source["local_cache_hit"]),
                              ("p2p", by_source["external_kv_transfer"])])
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemptions.",
                            self.preemptions)
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                            self.prompt_tokens)
        yield self._labelled(CounterMetricFamily, "vllm:prompt_tokens_by_source",
                             "Prompt tokens by source.", "source", by_source.items())
        yield self._counter("vllm:prompt_tokens_cached",
                            "Cached prompt tokens (local and external).",
                            by_source["local_cache_hit"] + by_source["external_kv_transfer"])
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.",
                            self.generation_tokens)
        yield self._labelled(CounterMetricFamily, "vllm:request_success",
                             "Count of successfully processed requests.", "finished_reason",
                             self.success.items())

    def _nixl_families(self) -> Iterator[Metric]:
        """The NIXL connector's KV-transfer metrics (a P/D worker only)."""
        yield self._hist("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for KV "
                         "cache.", self.h_xfer)
        yield self._hist("vllm:nixl_post_time_seconds", "Histogram of transfer post time for KV "
                         "cache.", self.h_post)
        yield self._hist("vllm:nixl_bytes_transferred", "Histogram of bytes transferred per KV "
                         "transfer.", self.h_bytes)
        yield self._hist("vllm:nixl_num_descriptors", "Histogram of descriptors per KV transfer.",
                         self.h_desc)
        yield self._counter("vllm:nixl_num_failed_transfers", "Failed NIXL KV transfers.",
                            self.nixl_failed)
        yield self._counter("vllm:nixl_num_failed_notifications", "Failed NIXL notifications.", 0)
        yield self._counter("vllm:nixl_num_kv_expired_reqs",
                            "Requests whose KV lease expired before the decoder read it.",
                            self.nixl_expired)
        yield self._counter("vllm:nixl_num_notifications_after_expiry",
                            "Notifications that arrived after lease expiry.", 0)


class _Collector:
    def __init__(self, metrics: WorkerMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterable[Metric]:
        return list(self._m.families())
