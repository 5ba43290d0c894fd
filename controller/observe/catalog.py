"""Engine catalog: which exposed series mean what, for each engine the controller reads.

Every source reads workers through this one table, so vLLM 0.33, older vLLM and SGLang 0.5
land in the same normalised keys (see ``reference/worker-metrics.md`` §5):

- histogram keys (a :class:`~controller.core.window.Summary` each): ``ttft_s``,
  ``inter_token_s``, ``tpot_s``, ``queue_s``, ``prefill_s``, ``kv_transfer_s``,
  ``kv_transfer_bytes``;
- counter keys: ``requests`` (finished requests), ``generation_tokens``, ``prompt_tokens``
  (by source where the engine says so);
- gauge keys: ``running``, ``waiting``, ``kv_cache_usage`` (0..1).

The engine is detected from the families present (:func:`detect_engine`). Router agents
(``pdrouter_*``) are described by :data:`ROUTER`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from controller.observe.exposition import LabelKey

HISTOGRAM_KEYS = (
    "ttft_s", "inter_token_s", "tpot_s", "queue_s", "prefill_s", "kv_transfer_s",
    "kv_transfer_bytes",
)
COUNTER_KEYS = ("requests", "generation_tokens", "prompt_tokens")
GAUGE_KEYS = ("running", "waiting", "kv_cache_usage")

GaugeAggregation = Literal["sum", "mean"]


@dataclass(frozen=True, slots=True)
class HistogramSpec:
    """A histogram family; ``scale`` converts its unit to the key's (ms → s: 1e-3)."""

    family: str
    scale: float = 1.0
    # Only series whose labels include these pairs (e.g. SGLang's stage="prefill_forward").
    match: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class CounterSpec:
    """A counter (sample name with ``_total``); ``by`` names the label that splits it."""

    sample: str
    by: str | None = None
    # When ``by`` is None the whole counter lands under this sub-key (``None``: plain number).
    as_source: str | None = None
    # Series with any of these label pairs are not counted (vLLM's aborted requests).
    excluded: tuple[tuple[str, str], ...] = ()

    def counts(self, labels: LabelKey) -> bool:
        """Whether a series with ``labels`` is part of this counter."""
        return not any(pair in self.excluded for pair in labels)


@dataclass(frozen=True, slots=True)
class GaugeSpec:
    family: str
    aggregate: GaugeAggregation = "sum"  # across a target's series (DP engines, ranks)
    scale: float = 1.0


@dataclass(frozen=True, slots=True)
class EngineSpec:
    name: str
    histograms: Mapping[str, HistogramSpec]
    counters: Mapping[str, CounterSpec]
    gauges: Mapping[str, GaugeSpec]
    # Families whose presence identifies this engine (any one of them).
    markers: tuple[str, ...] = ()
    # Families whose presence rules this engine out (newer names on an older spec).
    excludes: tuple[str, ...] = ()

    def families(self) -> frozenset[str]:
        """Names this engine's window needs: histogram and gauge families, counter samples."""
        names = {h.family for h in self.histograms.values()}
        names |= {g.family for g in self.gauges.values()}
        names |= {c.sample for c in self.counters.values()}
        return frozenset(names)


VLLM = EngineSpec(
    name="vllm",
    histograms={
        "ttft_s": HistogramSpec("vllm:time_to_first_token_seconds"),
        "inter_token_s": HistogramSpec("vllm:inter_token_latency_seconds"),
        "tpot_s": HistogramSpec("vllm:request_time_per_output_token_seconds"),
        "queue_s": HistogramSpec("vllm:request_queue_time_seconds"),
        "prefill_s": HistogramSpec("vllm:request_prefill_time_seconds"),
        "kv_transfer_s": HistogramSpec("vllm:nixl_xfer_time_seconds"),
        "kv_transfer_bytes": HistogramSpec("vllm:nixl_bytes_transferred"),
    },
    counters={
        # Every FinishReason is a label value, "abort" too: an aborted request was not served.
        "requests": CounterSpec("vllm:request_success_total",
                                excluded=(("finished_reason", "abort"),)),
        "generation_tokens": CounterSpec("vllm:generation_tokens_total"),
        "prompt_tokens": CounterSpec("vllm:prompt_tokens_by_source_total", by="source"),
    },
    gauges={
        "running": GaugeSpec("vllm:num_requests_running"),
        "waiting": GaugeSpec("vllm:num_requests_waiting"),
        "kv_cache_usage": GaugeSpec("vllm:kv_cache_usage_perc", aggregate="mean"),
    },
    markers=("vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds"),
)

# vLLM before the renames: time_per_output_token_seconds measured the inter-token latency
# (it is NOT per-request TPOT), gpu_cache_usage_perc is the KV usage, no per-source tokens.
VLLM_LEGACY = EngineSpec(
    name="vllm-legacy",
    histograms={
        **VLLM.histograms,
        "inter_token_s": HistogramSpec("vllm:time_per_output_token_seconds"),
    },
    counters={
        **VLLM.counters,
        "prompt_tokens": CounterSpec("vllm:prompt_tokens_total", as_source="total"),
    },
    gauges={
        **VLLM.gauges,
        "kv_cache_usage": GaugeSpec("vllm:gpu_cache_usage_perc", aggregate="mean"),
    },
    markers=("vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds"),
    excludes=("vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds"),
)

SGLANG = EngineSpec(
    name="sglang",
    histograms={
        "ttft_s": HistogramSpec("sglang:time_to_first_token_seconds"),
        "inter_token_s": HistogramSpec("sglang:inter_token_latency_seconds"),
        "tpot_s": HistogramSpec("sglang:request_time_per_output_token_seconds"),
        "queue_s": HistogramSpec("sglang:queue_time_seconds"),
        "prefill_s": HistogramSpec(
            "sglang:per_stage_req_latency_seconds", match=(("stage", "prefill_forward"),)
        ),
        "kv_transfer_s": HistogramSpec("sglang:kv_transfer_latency_ms", scale=1e-3),
        # SGLang's "MB" is 2**20 bytes: req_time_stats.py observes total_bytes / (1024 * 1024).
        "kv_transfer_bytes": HistogramSpec("sglang:kv_transfer_total_mb", scale=float(2**20)),
    },
    counters={
        "requests": CounterSpec("sglang:num_requests_total"),
        "generation_tokens": CounterSpec("sglang:generation_tokens_total"),
        "prompt_tokens": CounterSpec("sglang:prompt_tokens_total", as_source="total"),
    },
    gauges={
        "running": GaugeSpec("sglang:num_running_reqs"),
        "waiting": GaugeSpec("sglang:num_queue_reqs"),
        "kv_cache_usage": GaugeSpec("sglang:token_usage", aggregate="mean"),
    },
    markers=("sglang:num_running_reqs", "sglang:token_usage", "sglang:num_queue_reqs"),
)

ENGINES: tuple[EngineSpec, ...] = (VLLM, VLLM_LEGACY, SGLANG)

# SGLang labels a scheduler's series with its parallel ranks. The ranks of one attention
# group run the same batch, so with --enable-metrics-for-all-schedulers each of them reports
# the same requests, transfers and queue (seen on a TP 4 prefill node: four copies of every
# KV-transfer histogram). Series that differ only in these labels are one series (the
# largest counts it once); dp_rank, a scheduler of its own, is summed like vLLM's engine.
REPLICA_RANK_LABELS: frozenset[str] = frozenset({"tp_rank", "pp_rank", "moe_ep_rank"})
REPLICA_RANK_FAMILIES: tuple[str, ...] = ("sglang:",)  # the families that carry them

# The labels that tell a worker's processes apart within one target: vLLM's data-parallel
# engine, SGLang's scheduler ranks. A counter reset is decided per process: one rank that
# restarted alone counts from zero, the others from their own baselines.
PROCESS_LABELS: frozenset[str] = REPLICA_RANK_LABELS | {"engine", "dp_rank"}


def process_of(labels: LabelKey) -> LabelKey:
    """The :data:`PROCESS_LABELS` among ``labels`` (empty: the target is one process)."""
    return tuple(pair for pair in labels if pair[0] in PROCESS_LABELS)


def has_replica_ranks(family: str) -> bool:
    """Whether ``family``'s series may carry :data:`REPLICA_RANK_LABELS` (a prefix test, so
    the per-series work stays off every vLLM window)."""
    return family.startswith(REPLICA_RANK_FAMILIES)


# SGLang with priority scheduling reports each priority class (``priority="0"``, ...) beside
# the total (``priority=""``): the classes are parts of the total, not more requests.
PRIORITY_LABEL = "priority"


def _a_priority_class(labels: LabelKey) -> bool:
    return any(k == PRIORITY_LABEL and v != "" for k, v in labels)


def collapse_replicas(series: Mapping[LabelKey, float]) -> dict[LabelKey, float]:
    """Series that differ only in a replica rank label (:data:`REPLICA_RANK_LABELS`) as one
    series without those labels, valued at the largest: each replica reports the same
    scheduler, so summing them would count its requests once per rank. Per-priority series
    are dropped (their total, ``priority=""``, is kept: summed with it they doubled every
    count). A family without such labels comes back as it is."""
    if any(_a_priority_class(labels) for labels in series):
        series = {labels: v for labels, v in series.items() if not _a_priority_class(labels)}
    if not any(k in REPLICA_RANK_LABELS for labels in series for k, _ in labels):
        return dict(series)
    out: dict[LabelKey, float] = {}
    for labels, value in series.items():
        key = tuple(pair for pair in labels if pair[0] not in REPLICA_RANK_LABELS)
        before = out.get(key)
        out[key] = value if before is None or value > before else before
    return out


def once_per_scheduler(family: str, series: dict[LabelKey, float]) -> dict[LabelKey, float]:
    """``series`` of ``family`` with rank replicas counted once (:func:`collapse_replicas`);
    ``series`` itself for a family that cannot carry them."""
    return collapse_replicas(series) if has_replica_ranks(family) else series


ENGINES_BY_NAME: Mapping[str, EngineSpec] = {e.name: e for e in ENGINES}


@dataclass(frozen=True, slots=True)
class RouterSpec:
    requests: str = "pdrouter_requests_total"  # {route, ctx_bin, io_bin, slo}
    ttft: str = "pdrouter_ttft_seconds"  # histogram {route, ctx_bin}
    tpot: str = "pdrouter_tpot_seconds"
    context_tokens: str = "pdrouter_context_tokens"  # histogram, no labels
    io_ratio: str = "pdrouter_io_ratio"
    qps: str = "pdrouter_qps"
    met_label: str = "met"
    markers: tuple[str, ...] = field(default=("pdrouter_requests_total", "pdrouter_qps"))

    def families(self) -> frozenset[str]:
        return frozenset({
            self.requests, self.ttft, self.tpot, self.context_tokens,
            self.io_ratio, self.qps,
        })


ROUTER = RouterSpec()
ROUTER_ENGINE = "pdrouter"


def detect_engine(families: Iterable[str]) -> EngineSpec | None:
    """The engine whose marker families are present (``None``: not a known worker)."""
    present = set(families)
    for spec in ENGINES:
        if any(m in present for m in spec.markers) and not any(
            x in present for x in spec.excludes
        ):
            return spec
    return None


def is_router(families: Iterable[str]) -> bool:
    present = set(families)
    return any(m in present for m in ROUTER.markers)


def wanted_families() -> frozenset[str]:
    """Every family any engine or the router needs: the parser may skip all others."""
    out: set[str] = set(ROUTER.families())
    for spec in ENGINES:
        out |= spec.families()
        out |= set(spec.markers) | set(spec.excludes)
    return frozenset(out)
