"""Engine catalog: which exposed series mean what, for each engine the controller reads.

Every source reads workers through this one table, so every vLLM release from 0.9 to 0.34
and SGLang 0.4.9 to 0.5.23 land in the same normalised keys (``docs/engines.md`` lists the
releases and the source file of every name):

- histogram keys (a :class:`~controller.core.window.Summary` each): ``ttft_s``,
  ``inter_token_s``, ``tpot_s``, ``queue_s``, ``prefill_s``, ``kv_transfer_s``,
  ``kv_transfer_bytes``;
- counter keys: ``requests`` (finished requests, split into served, aborted and errored by
  :class:`RequestOutcome`), ``generation_tokens``, ``prompt_tokens`` (by source where the
  engine says so);
- gauge keys: ``running``, ``waiting``, ``kv_cache_usage`` (0..1).

A key names the family of the newest release; ``alternates`` name the families an older
release (or another KV connector) exports for the same key, read when the newer one is
absent (:meth:`EngineSpec.resolve`). The engine is detected from the families present
(:func:`detect_engine`). Router agents (``pdrouter_*``) are described by :data:`ROUTER`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Literal, TypeVar

from controller.core.exposition import LabelKey
from controller.core.window import Family

HISTOGRAM_KEYS = (
    "ttft_s", "inter_token_s", "tpot_s", "queue_s", "prefill_s", "kv_transfer_s",
    "kv_transfer_bytes",
)
COUNTER_KEYS = ("requests", "generation_tokens", "prompt_tokens")
GAUGE_KEYS = ("running", "waiting", "kv_cache_usage")

GaugeAggregation = Literal["sum", "mean"]


class RequestOutcome(StrEnum):
    """How a finished request ended: only ``SERVED`` counts in a worker's request rate."""

    SERVED = "served"  # finished normally: stop, length, or another non-failure reason
    ABORTED = "aborted"  # the client (or the engine on its behalf) gave up on it
    ERRORED = "errored"  # an engine failure (e.g. a KV load that failed)


# Each learning Family and the keys whose families provide it (a Family is missing when none
# of its keys' families, alternates included, is exported).
FAMILY_KEYS: Mapping[Family, tuple[str, ...]] = {
    Family.TTFT: ("ttft_s",),
    Family.SUCCESS: ("requests",),
    Family.INTER_TOKEN: ("inter_token_s",),
    Family.KV_TRANSFER: ("kv_transfer_s",),
}


@dataclass(frozen=True, slots=True)
class HistogramSpec:
    """A histogram family; ``scale`` converts its unit to the key's (ms → s: 1e-3)."""

    family: str
    scale: float = 1.0
    # Only series whose labels include these pairs (e.g. SGLang's stage="prefill_forward").
    match: tuple[tuple[str, str], ...] = ()
    # The family is a gauge holding the latest value, not a histogram (SGLang 0.5.3-0.5.9's
    # kv_transfer_latency_ms): read as a mean with no count; 0 (nothing measured yet) is
    # no value.
    gauge: bool = False


@dataclass(frozen=True, slots=True)
class CounterSpec:
    """A counter (sample name with ``_total``); ``by`` names the label that splits it."""

    sample: str
    by: str | None = None
    # When ``by`` is None the whole counter lands under this sub-key (``None``: plain number).
    as_source: str | None = None
    # Values of ``by`` that are not served requests (vLLM's finished_reason "abort" and
    # "error"); any other value (stop, length, repetition, a reason added later) is served.
    outcomes: Mapping[str, RequestOutcome] = field(default_factory=dict)

    def outcome(self, labels: LabelKey) -> RequestOutcome:
        """The outcome of the requests a series with ``labels`` counts."""
        if self.by is None:
            return RequestOutcome.SERVED
        for k, v in labels:
            if k == self.by:
                return self.outcomes.get(v, RequestOutcome.SERVED)
        return RequestOutcome.SERVED


@dataclass(frozen=True, slots=True)
class GaugeSpec:
    family: str
    aggregate: GaugeAggregation = "sum"  # across a target's series (DP engines, ranks)
    scale: float = 1.0


AnySpec = HistogramSpec | CounterSpec | GaugeSpec


def spec_name(spec: AnySpec) -> str:
    """The family (histogram, gauge) or sample (counter) a spec reads."""
    return spec.sample if isinstance(spec, CounterSpec) else spec.family


@dataclass(frozen=True, slots=True)
class EngineSpec:
    name: str
    histograms: Mapping[str, HistogramSpec]
    counters: Mapping[str, CounterSpec]
    gauges: Mapping[str, GaugeSpec]
    # Families whose presence identifies this engine (any one of them).
    markers: tuple[str, ...] = ()
    # Per key, the specs read when the key's own family is absent, in order of preference.
    alternates: Mapping[str, tuple[AnySpec, ...]] = field(default_factory=dict)
    # Counters of requests that the ``requests`` counter also counts but that are not
    # served (SGLang counts every finished request, aborted ones too, in num_requests).
    failure_counters: Mapping[RequestOutcome, tuple[str, ...]] = field(default_factory=dict)

    def candidates(self, key: str) -> tuple[AnySpec, ...]:
        """The key's own spec, then its alternates."""
        own: AnySpec | None = (self.histograms.get(key) or self.counters.get(key)
                               or self.gauges.get(key))
        if own is None:
            raise KeyError(key)
        return (own, *self.alternates.get(key, ()))

    def all_specs(self) -> Iterator[AnySpec]:
        """Every spec of every key, alternates included."""
        for key in (*self.histograms, *self.counters, *self.gauges):
            yield from self.candidates(key)

    def resolve(self, present: Callable[[AnySpec], bool]) -> EngineSpec:
        """This engine with each key read from its first candidate that is ``present`` (the
        key's own spec when none is: it then reads as ``None``)."""
        chosen: dict[str, AnySpec] = {}
        for key in (*self.histograms, *self.counters, *self.gauges):
            own, *rest = self.candidates(key)
            chosen[key] = next((c for c in rest if not present(own) and present(c)), own)
        return replace(
            self,
            histograms={k: _as(HistogramSpec, chosen[k]) for k in self.histograms},
            counters={k: _as(CounterSpec, chosen[k]) for k in self.counters},
            gauges={k: _as(GaugeSpec, chosen[k]) for k in self.gauges},
            alternates={},
        )

    def missing(self, present: Callable[[AnySpec], bool]) -> tuple[Family, ...]:
        """The learning families none of whose candidate specs is ``present``."""
        return tuple(
            family for family, keys in FAMILY_KEYS.items()
            if not any(present(c) for key in keys for c in self.candidates(key))
        )

    def families(self) -> frozenset[str]:
        """Names this engine's window needs: histogram and gauge families, counter samples."""
        names = {spec_name(s) for s in self.all_specs()}
        names |= {s for samples in self.failure_counters.values() for s in samples}
        return frozenset(names)


_S = TypeVar("_S", HistogramSpec, CounterSpec, GaugeSpec)


def _as(kind: type[_S], spec: AnySpec) -> _S:
    if not isinstance(spec, kind):  # an alternate of another kind than its key: a bug here
        raise TypeError(f"{spec!r} is not a {kind.__name__}")
    return spec


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
        # Every FinishReason is a label value: "abort" and "error" (0.34.0, not 0.11.2) finish
        # without being served; stop, length and repetition (0.34) are served.
        "requests": CounterSpec(
            "vllm:request_success_total", by="finished_reason",
            outcomes={"abort": RequestOutcome.ABORTED, "error": RequestOutcome.ERRORED},
        ),
        "generation_tokens": CounterSpec("vllm:generation_tokens_total"),
        "prompt_tokens": CounterSpec("vllm:prompt_tokens_by_source_total", by="source"),
    },
    gauges={
        "running": GaugeSpec("vllm:num_requests_running"),
        "waiting": GaugeSpec("vllm:num_requests_waiting"),
        "kv_cache_usage": GaugeSpec("vllm:kv_cache_usage_perc", aggregate="mean"),
    },
    markers=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
             "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    alternates={
        # 0.9-0.11: time_per_output_token_seconds is the inter-token latency under its old
        # name (NOT per-request TPOT, which 0.9-0.10 do not export at all).
        "inter_token_s": (HistogramSpec("vllm:time_per_output_token_seconds"),),
        # Other KV connectors (mooncake/stats.py, 0.34): the same meaning, push-based.
        "kv_transfer_s": (HistogramSpec("vllm:mooncake_xfer_time_seconds"),),
        "kv_transfer_bytes": (HistogramSpec("vllm:mooncake_bytes_transferred"),),
        # 0.9-0.10 (and 0.11 with hidden metrics shown): the KV usage's old name.
        "kv_cache_usage": (GaugeSpec("vllm:gpu_cache_usage_perc", aggregate="mean"),),
        # Before prompt_tokens_by_source: the total only.
        "prompt_tokens": (CounterSpec("vllm:prompt_tokens_total", as_source="total"),),
    },
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
        # Every finished request, aborted ones too (tokenizer_manager.collect_metrics).
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
    alternates={
        # 0.5.3-0.5.9 export the KV-transfer latency as a gauge of the same name (the
        # latest transfer's, on the prefill side); 0.5.10+ as a histogram.
        "kv_transfer_s": (HistogramSpec("sglang:kv_transfer_latency_ms", scale=1e-3,
                                        gauge=True),),
    },
    failure_counters={
        RequestOutcome.ABORTED: ("sglang:num_aborted_requests_total",),
        # PD: a failed bootstrap or KV transfer finishes the request with an abort.
        RequestOutcome.ERRORED: ("sglang:num_bootstrap_failed_reqs_total",
                                 "sglang:num_transfer_failed_reqs_total"),
    },
)

ENGINES: tuple[EngineSpec, ...] = (VLLM, SGLANG)

# SGLang labels a scheduler's series with its parallel ranks. The ranks of one attention
# group run the same batch, so with --enable-metrics-for-all-schedulers each of them reports
# the same requests, transfers and queue (a TP 4 prefill node reports four copies of every
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
    are dropped (their total, ``priority=""``, is kept: summed with it they would double
    every count). A family without such labels comes back as it is."""
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
        if any(m in present for m in spec.markers):
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
        out |= set(spec.markers)
    return frozenset(out)
