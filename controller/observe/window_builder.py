"""Cumulative metrics → a :class:`~controller.core.window.Window`.

Two steps shared by every source:

1. :func:`diff_snapshots` turns two cumulative snapshots of one target into a
   :class:`TargetDelta` (increases of counters and histogram series, gauges at the end).
   Counter rules (restarts, decreases within a tolerance, series first seen) are
   :mod:`controller.observe.counters`': never a rate from a lifetime total. A series that
   vanished is ignored. NaN samples are missing values, never zeros.
   :class:`~controller.observe.prometheus.PrometheusSource` builds the same delta from
   ``increase()`` results instead.
2. :func:`worker_stats` / :func:`router_stats` read a delta through the engine catalog. A
   histogram with no new observations in the window is ``None`` (not a zero mean); quantiles
   come from bucket increases and are flagged ``interpolated`` where the buckets do not
   resolve them.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from controller.core.catalog import (
    HISTOGRAM_KEYS,
    ROUTER,
    AnySpec,
    CounterSpec,
    EngineSpec,
    GaugeSpec,
    HistogramSpec,
    RequestOutcome,
    detect_engine,
    is_router,
    once_per_scheduler,
)
from controller.core.exposition import (
    ExpositionError,
    LabelKey,
    Snapshot,
    base_name,
)
from controller.core.window import (
    FailureKind,
    Histogram,
    Role,
    RouteOutcome,
    Summary,
    TargetFailure,
    Window,
    WindowError,
    WorkerStats,
    Workload,
)
from controller.observe.counters import CounterNotes, family_increases
from controller.policy.model import Route

CUMULATIVE_SUFFIXES = ("_total", "_bucket", "_sum", "_count")
# RouteOutcome bins that are not a bin of the fixed feature axes.
ALL_BINS = -1  # the series has no such label: the row sums over every bin of that axis
UNKNOWN_BIN = -2  # the router could not bin the request (label "unknown")
QUANTILES = (0.5, 0.9, 0.99)
# A quantile inside a bucket wider than this ratio (upper/lower edge) is only an estimate.
RESOLVING_BUCKET_RATIO = 2.0


def is_cumulative(sample: str) -> bool:
    return sample.endswith(CUMULATIVE_SUFFIXES)


@dataclass(slots=True)
class TargetDelta:
    """One target over one window: increases of cumulative series, gauges at the end."""

    target: str
    families: frozenset[str]
    increases: dict[str, dict[LabelKey, float]] = field(default_factory=dict)
    gauges: dict[str, dict[LabelKey, float]] = field(default_factory=dict)
    has_baseline: bool = True
    notes: list[TargetFailure] = field(default_factory=list)
    # ``families`` is every family the target exports (an exposition's TYPE lines, or a
    # Prometheus window with samples): a family not in it is missing, not merely unseen.
    families_known: bool = True


def check_histograms(snapshot: Snapshot) -> None:
    """Every histogram series needs a ``+Inf`` bucket equal to its ``_count`` and buckets
    that never decrease; a text cut off at a line boundary usually breaks one of these."""
    for name, series in snapshot.samples.items():
        if not name.endswith("_bucket"):
            continue
        family = name[: -len("_bucket")]
        groups: dict[LabelKey, list[tuple[float, float]]] = {}
        for labels, value in series.items():
            rest, le = split_le(labels, name)
            groups.setdefault(rest, []).append((le, value))
        counts = snapshot.series(family + "_count")
        for rest, buckets in groups.items():
            buckets.sort()
            if buckets[-1][0] != math.inf:
                raise ExpositionError(
                    FailureKind.PARSE, f"{family}: +Inf bucket missing (truncated exposition?)"
                )
            values = [v for _, v in buckets]
            if any(b < a for a, b in itertools.pairwise(values)):
                raise ExpositionError(FailureKind.PARSE,
                                      f"{family}: bucket counts decrease with le")
            count = counts.get(rest)
            if count is not None and not math.isnan(count) and count != values[-1]:
                raise ExpositionError(
                    FailureKind.PARSE,
                    f"{family}: _count {count} differs from the +Inf bucket {values[-1]}"
                )


_LE_CACHE: dict[LabelKey, tuple[LabelKey, float]] = {}


def split_le(labels: LabelKey, name: str) -> tuple[LabelKey, float]:
    """A bucket's labels without ``le``, and ``le`` as a number (cached: sets repeat)."""
    hit = _LE_CACHE.get(labels)
    if hit is not None:
        return hit
    le_text = None
    rest = []
    for pair in labels:
        if pair[0] == "le":
            le_text = pair[1]
        else:
            rest.append(pair)
    if le_text is None:
        raise ExpositionError(FailureKind.PARSE, f"{name}: a bucket has no 'le' label")
    try:
        le = float(le_text)
    except ValueError:
        raise ExpositionError(FailureKind.NON_NUMERIC, f"{name}: bad le={le_text!r}") from None
    if len(_LE_CACHE) > 100_000:
        _LE_CACHE.clear()
    hit = _LE_CACHE[labels] = (tuple(rest), le)
    return hit


def diff_snapshots(prev: Snapshot | None, cur: Snapshot, *, announced: bool = True
                   ) -> TargetDelta:
    """Increases from ``prev`` to ``cur`` (``prev`` None: gauges only, no baseline).

    ``announced``: the snapshots are exposition texts, which announce every family (its
    TYPE line) before it has a series, so a family absent from ``prev`` was not read then.
    Prometheus has no series for a family with none yet: there (False), absent is new."""
    delta = TargetDelta(target=cur.target, families=cur.families, has_baseline=prev is not None)
    by_family: dict[str, list[str]] = {}
    for name, series in cur.samples.items():
        if not is_cumulative(name):
            delta.gauges[name] = once_per_scheduler(
                name, {k: v for k, v in series.items() if not math.isnan(v)})
            continue
        by_family.setdefault(base_name(name), []).append(name)
    if prev is None:
        return delta
    notes = CounterNotes()
    for family, names in by_family.items():
        if announced and family not in prev.families \
                and not any(n in prev.samples for n in names):
            # Not even announced in the previous snapshot (an answer cut after a whole
            # family, a process that changed): its series' lifetime values are no window's
            # increase. Counted from the next window.
            notes.unbaselined.append(family)
            continue
        for name, inc in family_increases(prev, cur, family, names, notes).items():
            # Increases per replica, then one per scheduler: a replica that restarted alone
            # still counts from its own baseline.
            delta.increases[name] = once_per_scheduler(name, inc)
    delta.notes.extend(notes.failures(cur.target))
    return delta


def _matches(labels: LabelKey, match: tuple[tuple[str, str], ...]) -> bool:
    if not match:
        return True
    d = dict(labels)
    return all(d.get(k) == v for k, v in match)


def histogram_summary(delta: TargetDelta, spec: HistogramSpec) -> Summary | None:
    """Mean from ``_sum/_count`` increases, quantiles from bucket increases; ``None`` when
    the family is absent or saw no observation in the window."""
    counts = delta.increases.get(spec.family + "_count")
    if not counts:
        return None
    sums = delta.increases.get(spec.family + "_sum", {})
    count = math.fsum(v for k, v in counts.items() if _matches(k, spec.match))
    total = math.fsum(v for k, v in sums.items() if _matches(k, spec.match))
    if not count > 0:
        return None
    buckets: dict[float, float] = {}
    for labels, v in delta.increases.get(spec.family + "_bucket", {}).items():
        if not _matches(labels, spec.match):
            continue
        edge = split_le(labels, spec.family)[1] * spec.scale
        buckets[edge] = buckets.get(edge, 0.0) + v
    q, interpolated = quantiles(sorted(buckets.items()), QUANTILES)
    # No _sum increase beside the counts (NaN, or the series missing): no mean, not 0.
    has_sum = any(_matches(k, spec.match) for k in sums)
    mean = total / count * spec.scale if has_sum else math.nan
    return Summary(
        mean=mean if math.isfinite(mean) else None, count=count,
        p50=q[0], p90=q[1], p99=q[2], interpolated=interpolated,
    )


def quantiles(
    cumulative: Sequence[tuple[float, float]], qs: Sequence[float]
) -> tuple[list[float | None], bool]:
    """Prometheus-style quantiles from cumulative ``(le, count)`` pairs.

    Returns the values and whether any of them is only an estimate: it fell in the first
    bucket (nothing known below the lowest edge), in the ``+Inf`` bucket (clamped to the
    highest finite edge) or in a bucket more than :data:`RESOLVING_BUCKET_RATIO` wide.
    """
    if not cumulative or cumulative[-1][0] != math.inf or not cumulative[-1][1] > 0:
        return [None] * len(qs), False
    total = cumulative[-1][1]
    out: list[float | None] = []
    interpolated = False
    for q in qs:
        rank = q * total
        prev_le, prev_count = 0.0, 0.0
        value: float | None = None
        for i, (le, count) in enumerate(cumulative):
            if count >= rank and count > prev_count:
                if le == math.inf:
                    # Clamped to the highest finite edge; with none, nothing is known (as
                    # Prometheus' NaN), never a quantile of 0.
                    value = prev_le if i > 0 else None
                    interpolated = True
                else:
                    lower = prev_le if i > 0 else min(0.0, le)  # first bucket starts at 0
                    value = lower + (le - lower) * (rank - prev_count) / (count - prev_count)
                    # A bucket from 0 (SGLang's start at le=0) resolves nothing either.
                    if i == 0 or lower <= 0 or le / lower > RESOLVING_BUCKET_RATIO:
                        interpolated = True
                break
            prev_le, prev_count = le, count
        out.append(value)
    return out, interpolated


def _gauge(delta: TargetDelta, spec: GaugeSpec) -> float | None:
    series = delta.gauges.get(spec.family)
    if not series:
        return None
    values = list(series.values())
    total = math.fsum(values)
    v = total if spec.aggregate == "sum" else total / len(values)
    return v * spec.scale


def _counter(delta: TargetDelta, spec: CounterSpec) -> dict[LabelKey, float] | None:
    if not delta.has_baseline:
        return None
    return delta.increases.get(spec.sample)


def exported(delta: TargetDelta, spec: AnySpec) -> bool:
    """Whether the target exports ``spec``'s family (whatever it observed in the window).

    A histogram is announced by its family name (the exposition's TYPE line) or its series;
    a family of that name that is a gauge is not the histogram (SGLang's
    ``kv_transfer_latency_ms`` is a gauge in 0.5.3-0.5.9, a histogram from 0.5.10)."""
    if isinstance(spec, GaugeSpec):
        return spec.family in delta.gauges
    if isinstance(spec, CounterSpec):
        bare = spec.sample.removesuffix("_total")
        return (spec.sample in delta.families or bare in delta.families
                or spec.sample in delta.increases)
    if spec.gauge:
        return spec.family in delta.gauges
    return (spec.family in delta.families or spec.family + "_count" in delta.increases) \
        and spec.family not in delta.gauges


def _summary(delta: TargetDelta, spec: HistogramSpec) -> Summary | None:
    if not delta.has_baseline:
        return None
    if not spec.gauge:
        return histogram_summary(delta, spec)
    value = _gauge(delta, GaugeSpec(spec.family, aggregate="mean", scale=spec.scale))
    return Summary(mean=value) if value else None  # 0: nothing measured yet


@dataclass(frozen=True, slots=True)
class Requests:
    """Finished requests of one target in the window, by :class:`RequestOutcome` (``None``:
    the engine does not tell, or there is no baseline)."""

    served: float | None = None
    aborted: float | None = None
    errored: float | None = None


def finished_requests(delta: TargetDelta, spec: EngineSpec) -> Requests:
    """The ``requests`` counter split by outcome. A label value the catalog marks as a
    failure (vLLM's ``finished_reason``) goes to its outcome; an engine's failure counters
    (SGLang) are taken out of its total. Served is never below 0 (the counters move at
    different moments, so a window edge can split a request's two counts)."""
    rc = spec.counters["requests"]
    series = _counter(delta, rc)
    if series is None:
        return Requests()
    counts: dict[RequestOutcome, float] = {}
    for labels, v in series.items():
        outcome = rc.outcome(labels)
        counts[outcome] = counts.get(outcome, 0.0) + v
    served = counts.pop(RequestOutcome.SERVED, 0.0)
    for outcome, samples in spec.failure_counters.items():
        found = [s for s in (_counter(delta, CounterSpec(n)) for n in samples) if s is not None]
        if found:
            n = math.fsum(v for s in found for v in s.values())
            counts[outcome] = counts.get(outcome, 0.0) + n
            served -= n
    known = set(rc.outcomes.values()) | set(spec.failure_counters)
    seen = {rc.outcome(labels) for labels in series} | set(counts)

    def of(outcome: RequestOutcome) -> float | None:
        return counts.get(outcome, 0.0) if outcome in known and outcome in seen else None

    return Requests(served=max(0.0, served), aborted=of(RequestOutcome.ABORTED),
                    errored=of(RequestOutcome.ERRORED))


def worker_stats(
    delta: TargetDelta, role: Role, interval_s: float, engine: EngineSpec | None = None
) -> tuple[WorkerStats | None, list[TargetFailure]]:
    """The worker's stats, or ``None`` plus a failure when no known engine is exposed.

    Each key is read from the first of its catalog names the target exports (older
    releases' names included); a learning family it exports under no name is listed in
    ``missing``, so a ``None`` there means "not exported", not "nothing happened"."""
    detected = engine or detect_engine(delta.families)
    notes = list(delta.notes)
    if detected is None:
        notes.append(TargetFailure(
            target=delta.target, kind=FailureKind.MISSING_FAMILY,
            message="no vLLM or SGLang families found (is metrics export enabled?)",
        ))
        return None, notes
    if not delta.has_baseline and not any(n.kind == FailureKind.NO_BASELINE for n in notes):
        notes.append(TargetFailure(
            target=delta.target, kind=FailureKind.NO_BASELINE,
            message="first snapshot of this target: counters need a previous one",
        ))
    present = functools.partial(exported, delta)
    spec = detected.resolve(present)
    summaries = {key: _summary(delta, spec.histograms[key]) for key in HISTOGRAM_KEYS}
    requests = finished_requests(delta, spec)
    generation = _counter(delta, spec.counters["generation_tokens"])
    stats = WorkerStats(
        worker=delta.target,
        role=role,
        engine=spec.name,
        request_rate=None if requests.served is None else requests.served / interval_s,
        running=_gauge(delta, spec.gauges["running"]),
        waiting=_gauge(delta, spec.gauges["waiting"]),
        kv_cache_usage=_gauge(delta, spec.gauges["kv_cache_usage"]),
        prompt_tokens_by_source=_prompt_tokens(delta, spec.counters["prompt_tokens"]),
        generation_tokens=None if generation is None else math.fsum(generation.values()),
        aborted=requests.aborted,
        errored=requests.errored,
        missing=detected.missing(present) if delta.families_known else (),
        **summaries,
    )
    return stats, notes


def _prompt_tokens(delta: TargetDelta, spec: CounterSpec) -> dict[str, float] | None:
    prompt = _counter(delta, spec)
    if prompt is None:
        return None
    by_source: dict[str, float] = {}
    for labels, v in prompt.items():
        key = dict(labels).get(spec.by, "") if spec.by else spec.as_source or "total"
        by_source[key] = by_source.get(key, 0.0) + v
    return by_source


@dataclass(slots=True)
class RouterStats:
    outcomes: list[RouteOutcome]
    context_tokens: list[tuple[float, float]] | None  # cumulative (le, count) increases
    io_ratio: list[tuple[float, float]] | None
    qps: float | None
    notes: list[TargetFailure]


def bin_index(label: str | None, edge_labels: Sequence[str]) -> int:
    """Index of a ``pdrouter_*`` bin label on its fixed axis (``+Inf``: the overflow bin)."""
    if label is None:
        return ALL_BINS
    try:
        return list(edge_labels).index(label)
    except ValueError:
        return UNKNOWN_BIN


def router_stats(
    delta: TargetDelta, ctx_labels: Sequence[str], io_labels: Sequence[str]
) -> RouterStats:
    """Per-route outcome cells, feature distributions and qps of one router.

    Request counts are per (route, context bin, io bin). The latency histograms are only
    labelled by (route, context bin) unless the router adds ``io_bin``: their sums then go
    to rows with ``io_bin = ALL_BINS`` and zero requests, so summing any column over rows
    stays correct.
    """
    cells = _router_cells(delta, ctx_labels, io_labels) if delta.has_baseline else {}
    outcomes = [
        RouteOutcome(router=delta.target, route=route, ctx_bin=c, io_bin=i, requests=r[0],
                     met=r[1], ttft_sum=r[2], ttft_count=r[3], tpot_sum=r[4], tpot_count=r[5])
        for (route, c, i), r in sorted(cells.items(), key=lambda kv: (kv[0][0].value, *kv[0][1:]))
        if any(x > 0 for x in r)
    ]
    qps_series = delta.gauges.get(ROUTER.qps)
    return RouterStats(
        outcomes=outcomes,
        context_tokens=_buckets(delta, ROUTER.context_tokens),
        io_ratio=_buckets(delta, ROUTER.io_ratio),
        qps=math.fsum(qps_series.values()) if qps_series else None,
        notes=_router_notes(delta),
    )


def _router_notes(delta: TargetDelta) -> list[TargetFailure]:
    """The delta's notes, plus why this router's window counts no requests: not a router's
    metrics, or no baseline yet."""
    notes = list(delta.notes)
    if not is_router(delta.families):
        # A router target that is not one (a worker's port, the wrong port) answers with no
        # traffic: flagged, so the window and the canary judge do not read it as idle.
        notes.append(TargetFailure(
            target=delta.target, kind=FailureKind.MISSING_FAMILY,
            message="no pdrouter_* families found (is this the router's metrics address?)",
        ))
    if not delta.has_baseline:
        # Flagged as for a worker: a canary judge must not count this window's (absent)
        # requests as a bake window of its routers.
        notes.append(TargetFailure(
            target=delta.target, kind=FailureKind.NO_BASELINE,
            message="first snapshot of this router: counters need a previous one",
        ))
    return notes


def _router_cells(delta: TargetDelta, ctx_labels: Sequence[str], io_labels: Sequence[str]
                  ) -> dict[tuple[Route, int, int], list[float]]:
    """(route, ctx bin, io bin) -> [requests, met, ttft sum, ttft count, tpot sum, tpot
    count] from the counters' increases; series with an unknown route are left out."""
    cells: dict[tuple[Route, int, int], list[float]] = {}

    def cell(route_label: str | None, labels: Mapping[str, str]) -> list[float] | None:
        try:
            route = Route[route_label or ""]
        except KeyError:
            return None
        key = (route, bin_index(labels.get("ctx_bin"), ctx_labels),
               bin_index(labels.get("io_bin"), io_labels))
        return cells.setdefault(key, [0.0] * 6)

    for labels, v in delta.increases.get(ROUTER.requests, {}).items():
        d = dict(labels)
        row = cell(d.get("route"), d)
        if row is None:
            continue
        row[0] += v
        if d.get("slo") == ROUTER.met_label:
            row[1] += v
    for offset, family in ((2, ROUTER.ttft), (4, ROUTER.tpot)):
        sums = delta.increases.get(family + "_sum", {})
        for labels, count in delta.increases.get(family + "_count", {}).items():
            d = dict(labels)
            row = cell(d.get("route"), d)
            if row is None:
                continue
            row[offset] += sums.get(labels, 0.0)
            row[offset + 1] += count
    return cells


def _buckets(delta: TargetDelta, family: str) -> list[tuple[float, float]] | None:
    if not delta.has_baseline:
        return None
    series = delta.increases.get(family + "_bucket")
    if not series:
        return None
    out: dict[float, float] = {}
    for labels, v in series.items():
        le = split_le(labels, family)[1]
        out[le] = out.get(le, 0.0) + v
    return sorted(out.items())


def merge_histograms(parts: Iterable[list[tuple[float, float]] | None]) -> Histogram | None:
    """Sum cumulative bucket increases of several routers into per-bucket counts; ``None``
    when no router had the family or nothing was observed (never an all-zero histogram)."""
    total: dict[float, float] = {}
    seen = False
    for part in parts:
        if part is None:
            continue
        seen = True
        for le, c in part:
            total[le] = total.get(le, 0.0) + c
    if not seen:
        return None
    edges = sorted(total)
    cumulative = [total[e] for e in edges]
    if not cumulative or not cumulative[-1] > 0:
        return None
    counts = [cumulative[0], *(b - a for a, b in itertools.pairwise(cumulative))]
    return Histogram(edges=tuple(edges), counts=tuple(max(0.0, c) for c in counts))


@dataclass(frozen=True, slots=True)
class TargetResult:
    """What a source got from one target: a delta, or the failure that replaced it."""

    target: str
    role: str  # "prefill" | "decode" | "router"
    delta: TargetDelta | None = None
    failure: TargetFailure | None = None


def invalid_value(target: str, error: WindowError) -> TargetFailure:
    """A target whose values no window can hold (a non-finite or negative count): it fails
    alone, as an unreachable one would; the other targets' window is unaffected."""
    return TargetFailure(target=target, kind=FailureKind.INVALID_VALUE, message=str(error))


def assemble_window(
    start: float,
    end: float,
    results: Sequence[TargetResult],
    *,
    source: str,
    ctx_labels: Sequence[str],
    io_labels: Sequence[str],
    engine: EngineSpec | None = None,
) -> Window:
    """The window from every target's result, in the order of ``results``."""
    interval = end - start if end > start else 1.0
    workers: list[WorkerStats] = []
    outcomes: list[RouteOutcome] = []
    ctx_parts: list[list[tuple[float, float]] | None] = []
    io_parts: list[list[tuple[float, float]] | None] = []
    qps: dict[str, float] = {}
    answered: list[str] = []
    failures: list[TargetFailure] = []
    for r in results:
        if r.delta is None:
            if r.failure is not None:
                failures.append(r.failure)
            continue
        answered.append(r.target)
        if r.role == "router":
            try:
                rs = router_stats(r.delta, ctx_labels, io_labels)
            except WindowError as e:
                answered.pop()
                failures.append(invalid_value(r.target, e))
                continue
            outcomes.extend(rs.outcomes)
            ctx_parts.append(rs.context_tokens)
            io_parts.append(rs.io_ratio)
            if rs.qps is not None:
                qps[r.target] = rs.qps
            failures.extend(rs.notes)
            continue
        role: Role = "prefill" if r.role == "prefill" else "decode"
        try:
            stats, notes = worker_stats(r.delta, role, interval, engine)
        except WindowError as e:
            answered.pop()
            failures.append(invalid_value(r.target, e))
            continue
        if stats is not None:
            workers.append(stats)
        failures.extend(notes)
    workload = Workload(
        context_tokens=merge_histograms(ctx_parts),
        io_ratio=merge_histograms(io_parts),
        qps_by_router=qps,
    )
    return Window.build(
        start=start, end=end, interval_s=interval, workers=workers, outcomes=outcomes,
        workload=workload, answered=answered, failures=failures, source=source,
    )
