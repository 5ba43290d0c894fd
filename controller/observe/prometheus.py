"""``PrometheusSource``: windows from PromQL over the standard HTTP API.

A handful of queries per window, whatever the number of workers: every histogram bucket
family in one union query, every ``_sum`` in one, every ``_count`` in one, the counters in
one, the gauges in one, plus ``up`` and its sample times (an instant query answers with a
sample up to 5 minutes old: freshness is checked per target, see ``_down``). Each
aggregates ``by (instance, ...)`` and tags its rows with ``pd_series`` (``label_replace``)
so one answer carries many families. Only ``/api/v1/query`` and ``/api/v1/targets`` are
used, so Thanos and Mimir work too.

Two ways to turn counters into window increases (``[prometheus] window_mode``):

- ``increase`` (this class's default; the config's is ``edges``): ``increase(x[<W>ms])``
  evaluated at the window end, which extrapolates to the window edges, so counts are
  estimates (means, being ratios of equally extrapolated sums and counts, are not affected).
  ``increase()`` reads EVERY fall of a counter as a restart and counts the value after it
  whole (a fall of 0.001 counted a lifetime), so one more query asks ``resets()`` of every
  cumulative series: a target none of whose series fell is read from ``increase()``; a
  target one of whose series fell in the window (jitter, a restart) is read at the edges
  and diffed by the rules of :mod:`controller.observe.counters`, as a scrape is.
- ``edges`` (``[prometheus] window_mode``'s default): the aggregated cumulative values at
  ``start`` and at ``end`` (two evaluations of the same queries), diffed with the same code
  as a direct scrape: exact counts, resets detected only at the edges.

Both read ``process_start_time_seconds`` (its maximum per target) with the gauges, so a
restart is told from a counter that fell, as for a scrape.

The client speaks the HTTP API over ``httpx``: every call within one TOTAL deadline
(``timeout_s``: connect, headers, body and retries together: a read timeout restarts on
each byte, so alone it would let a trickling Prometheus hold the loop as long as it
trickled), and a
window's calls within one more (:meth:`PrometheusSource.window`); bounded retries on
connection errors and HTTP 429/502/503/504; answers read by the bounded decoders of
:mod:`controller.observe.bounded_body` and capped; values read with ``float()`` (``"NaN"``,
``"+Inf"``). Every failure is :class:`PrometheusUnavailable` (transient) or
:class:`PrometheusQueryError` (terminal), both :class:`PrometheusError`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from controller.core.catalog import (
    ENGINES,
    PRIORITY_LABEL,
    REPLICA_RANK_LABELS,
    ROUTER,
    CounterSpec,
    GaugeSpec,
    HistogramSpec,
    has_replica_ranks,
)
from controller.core.exposition import LabelKey, Snapshot, base_name
from controller.core.window import FailureKind, TargetFailure, Window
from controller.errors import ControllerError, TerminalError, TransientError
from controller.observe.bounded_body import ACCEPT_ENCODING, BodyRefused, read_bounded
from controller.observe.counters import PROCESS_START
from controller.observe.rediscovery import Rediscovery
from controller.observe.source import Target
from controller.observe.window_builder import (
    TargetDelta,
    TargetResult,
    assemble_window,
    diff_snapshots,
)
from controller.policy.bins import CONTEXT_BINS, IO_RATIO_BINS

WindowMode = Literal["increase", "edges"]
_log = logging.getLogger("pdctl.observe")
SERIES_LABEL = "pd_series"
_ROUTER_CELL = ("route", "ctx_bin", "io_bin")


class PrometheusError(ControllerError):
    """Prometheus could not answer a query; subclasses say whether to retry."""


class PrometheusUnavailable(PrometheusError, TransientError):
    """Connection refused, timeout, 5xx/429 after the retries: try again next cycle."""


class PrometheusQueryError(PrometheusError, TerminalError):
    """Prometheus refused the query (4xx, e.g. ``bad_data``) or answered no API JSON."""

    def __init__(self, message: str, error_type: str | None = None) -> None:
        super().__init__(message)
        self.error_type = error_type


# An API answer larger than this is refused (decoded or as sent): a window's answers are a
# few MB for hundreds of targets.
MAX_ANSWER_BYTES = 128 * 1024 * 1024
_RETRIED_STATUSES = (429, 502, 503, 504)


def _answer_error(status: int, body: bytes) -> PrometheusError:
    """The error for a non-200 answer: 429 and 5xx transient, anything else a refusal."""
    detail, error_type = _error_json(body)
    if status == 429 or status >= 500:
        return PrometheusUnavailable(f"Prometheus answered HTTP {status}: {detail}")
    return PrometheusQueryError(f"Prometheus refused the query (HTTP {status}, "
                                f"{error_type or 'error'}): {detail}", error_type)


def _error_json(body: bytes) -> tuple[str, str | None]:
    text = body.decode("utf-8", "replace")
    try:
        d = json.loads(text)
        return str(d.get("error", text))[:500], d.get("errorType")
    except (ValueError, AttributeError):
        return text[:500], None


def _api_data(body: bytes) -> Any:
    """``data`` of a successful API answer, or :class:`PrometheusQueryError`."""
    try:
        doc = json.loads(body)
        if doc.get("status") != "success":
            raise ValueError(f"status {doc.get('status')!r}")
        return doc["data"]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise PrometheusQueryError(
            f"Prometheus answered something that is not API JSON: {e!r}") from None


def parse_value(raw: Any) -> float:
    """A Prometheus sample value: strings, including ``"NaN"``, ``"+Inf"``, ``"-Inf"``."""
    return float(raw)


class PrometheusClient:
    """The HTTP API over ``httpx``: one TOTAL deadline per call (``timeout_s``: connect,
    headers, the whole body and every retry together, so a Prometheus that trickles its
    answer or never finishes its headers costs at most that), bounded retries on connection
    errors and HTTP 429/502/503/504, answers capped at :data:`MAX_ANSWER_BYTES` while
    streaming, and one error type: :class:`PrometheusUnavailable` (transient) or
    :class:`PrometheusQueryError` (terminal)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 10.0,
        retries: int = 2,
        backoff_s: float = 0.2,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.requests_sent = 0  # answers received, retried ones included
        self._headers = {"Accept": "application/json", "Accept-Encoding": ACCEPT_ENCODING,
                         **(headers or {})}
        self._http: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._http is None or self._loop is not loop:  # connections belong to one loop
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s),
                                           headers=self._headers, trust_env=False,
                                           follow_redirects=False)
            self._loop = loop
        return self._http

    async def query(self, promql: str, at: float) -> list[dict[str, Any]]:
        data = await self._get("/api/v1/query", {"query": promql, "time": f"{at:.3f}"})
        result = data.get("result") if isinstance(data, dict) else None
        if not isinstance(result, list):
            raise PrometheusQueryError(f"expected a vector result, got {type(result).__name__}")
        return result

    async def targets(self) -> list[dict[str, Any]]:
        """``/api/v1/targets`` active targets (labels, health, lastError)."""
        data = await self._get("/api/v1/targets", {"state": "active"})
        try:
            return list(data["activeTargets"])
        except (KeyError, TypeError) as e:
            raise PrometheusQueryError(
                f"Prometheus answered something that is not API JSON: {e!r}") from None

    async def _get(self, path: str, params: Mapping[str, str]) -> Any:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._attempts(path, params)
        except TimeoutError:
            raise PrometheusUnavailable(f"Prometheus did not answer in time: no whole answer "
                                        f"within {self.timeout_s:g} s") from None

    async def _attempts(self, path: str, params: Mapping[str, str]) -> Any:
        last: PrometheusError | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                status, body = await self._once(path, params)
            except httpx.TransportError as e:
                last = PrometheusUnavailable(
                    f"cannot reach Prometheus: {type(e).__name__}: {e}")
                continue
            except BodyRefused as e:
                raise PrometheusUnavailable(f"Prometheus' answer refused: {e}") from None
            if status == 200:
                return _api_data(body)
            last = _answer_error(status, body)
            if status not in _RETRIED_STATUSES:
                raise last
        assert last is not None
        raise last

    async def _once(self, path: str, params: Mapping[str, str]) -> tuple[int, bytes]:
        async with self._client().stream("GET", self.url + path, params=dict(params)
                                         ) as response:
            self.requests_sent += 1
            body = await read_bounded(response.aiter_raw(),
                                      response.headers.get("content-encoding", ""),
                                      MAX_ANSWER_BYTES)
            return response.status_code, body

    async def aclose(self) -> None:
        http, self._http = self._http, None
        if http is not None:
            await http.aclose()


@dataclass(frozen=True, slots=True)
class _Query:
    name: str
    promql: str


def _catalog_series() -> tuple[dict[tuple[str, tuple[tuple[str, str], ...]], HistogramSpec],
                               dict[str, CounterSpec], dict[str, str]]:
    """Every series the catalog may read (alternates included): histograms by (family,
    match), counters by sample, gauges with their aggregation across a target's series."""
    hist_specs: dict[tuple[str, tuple[tuple[str, str], ...]], HistogramSpec] = {}
    counters: dict[str, CounterSpec] = {}
    gauges: dict[str, str] = {}
    for engine in ENGINES:
        for spec in engine.all_specs():
            if isinstance(spec, HistogramSpec) and spec.gauge:
                gauges[spec.family] = "avg"  # a latest value per process: averaged
            elif isinstance(spec, HistogramSpec):
                hist_specs[(spec.family, spec.match)] = spec
            elif isinstance(spec, CounterSpec):
                # Split by its label, so a failure reason is told apart from served ones.
                counters[spec.sample] = spec
            else:
                gauges[spec.family] = "avg" if spec.aggregate == "mean" else "sum"
        for samples in engine.failure_counters.values():
            counters.update((n, CounterSpec(n)) for n in samples)
        histogram_families = {f for f, _ in hist_specs}
        for m in engine.markers:
            if m not in histogram_families:
                gauges.setdefault(m, "sum")  # presence is all that matters for markers
    gauges[ROUTER.qps] = "sum"
    # Tells a restart from a counter that fell (observe.counters), as for a scrape.
    gauges[PROCESS_START] = "max"
    return hist_specs, counters, gauges


def build_queries(window_ms: int | None, *, escaped_names: bool = False) -> list[_Query]:
    """The window's queries; ``window_ms`` None: cumulative values (edges mode).

    ``escaped_names``: Prometheus stored ``vllm:x`` as ``vllm_x`` (prometheus_client 0.22+
    escapes colons when a Prometheus before 2.49 negotiates OpenMetrics). Rows are still
    tagged with the catalog's names.
    """
    hist_specs, counters, gauges = _catalog_series()

    def selector(name: str, match: tuple[tuple[str, str], ...] = ()) -> str:
        return _selector(name, match, escaped_names)

    def term(series: str, labels: tuple[str, ...], match: tuple[tuple[str, str], ...] = (),
             aggregate: str = "sum", cumulative: bool = True) -> str:
        inner = selector(series, match)
        if cumulative and window_ms is not None:
            inner = f"increase({inner}[{window_ms}ms])"
        # One value per scheduler before summing: SGLang's rank replicas report the same
        # requests (catalog.collapse_replicas does the same for the direct sources).
        inner = f"max without ({', '.join(sorted(REPLICA_RANK_LABELS))}) ({inner})"
        grouped = f"{aggregate} by ({', '.join(('instance', *labels))}) ({inner})"
        return f'label_replace({grouped}, "{SERIES_LABEL}", "{series}", "instance", ".*")'

    buckets: list[str] = []
    sums: list[str] = []
    counts: list[str] = []
    for spec in hist_specs.values():
        extra = tuple(k for k, _ in spec.match)
        buckets.append(term(spec.family + "_bucket", ("le", *extra), spec.match))
        sums.append(term(spec.family + "_sum", extra, spec.match))
        counts.append(term(spec.family + "_count", extra, spec.match))
    for family in (ROUTER.context_tokens, ROUTER.io_ratio):
        buckets.append(term(family + "_bucket", ("le",)))
    for family in (ROUTER.ttft, ROUTER.tpot):
        sums.append(term(family + "_sum", _ROUTER_CELL))
        counts.append(term(family + "_count", _ROUTER_CELL))
    counter_terms = [term(c.sample, (c.by,) if c.by else ()) for c in counters.values()]
    counter_terms.append(term(ROUTER.requests, (*_ROUTER_CELL, "slo")))
    gauge_terms = [term(name, (), aggregate=agg, cumulative=False)
                   for name, agg in gauges.items()]
    return [
        _Query("buckets", " or ".join(buckets)),
        _Query("sums", " or ".join(sums)),
        _Query("counts", " or ".join(counts)),
        _Query("counters", " or ".join(counter_terms)),
        _Query("gauges", " or ".join(gauge_terms)),
    ]


def _selector(name: str, match: tuple[tuple[str, str], ...], escaped_names: bool) -> str:
    stored = name.replace(":", "_") if escaped_names else name
    if has_replica_ranks(name):  # the total, not the priority classes beside it (also
        match = (*match, (PRIORITY_LABEL, ""))  # the series without the label)
    matchers = [f'{k}="{v}"' for k, v in match]
    return stored + "{" + ",".join(matchers) + "}" if matchers else stored


def _cumulative_series() -> list[tuple[str, tuple[tuple[str, str], ...]]]:
    """Every cumulative series the window queries read, with its label matchers."""
    hist_specs, counters, _ = _catalog_series()
    out: list[tuple[str, tuple[tuple[str, str], ...]]] = []
    for spec in hist_specs.values():
        out += [(spec.family + suffix, spec.match) for suffix in ("_bucket", "_sum", "_count")]
    out += [(f + "_bucket", ()) for f in (ROUTER.context_tokens, ROUTER.io_ratio)]
    out += [(f + suffix, ()) for f in (ROUTER.ttft, ROUTER.tpot) for suffix in ("_sum", "_count")]
    out += [(c.sample, ()) for c in counters.values()]
    out.append((ROUTER.requests, ()))
    return list(dict.fromkeys(out))


def build_resets_query(window_ms: int, *, escaped_names: bool = False) -> str:
    """Per instance and series: how many times a cumulative series fell between two of its
    samples in the window (``resets()``). Where none did, ``increase()`` read it right;
    where one did, ``increase()`` took the fall for a restart and counted the value after
    it whole (a fall of 0.001 counted a lifetime)."""
    terms = [
        f'label_replace(sum by (instance) (resets({_selector(name, match, escaped_names)}'
        f'[{window_ms}ms])), "{SERIES_LABEL}", "{name}", "instance", ".*")'
        for name, match in _cumulative_series()
    ]
    return " or ".join(terms)


def _fell(rows: Sequence[Mapping[str, Any]]) -> set[str]:
    """The instances some cumulative series of which fell in the window."""
    return {str(r["metric"].get("instance", "")) for r in rows
            if parse_value(r["value"][1]) > 0}


# Per series (instance and job): each one's value and the time of its newest sample. An
# instant query answers with a sample up to 5 minutes old (the lookback): old data read as
# live (a Prometheus down, behind or slower than the window), and a frozen or second job
# answered for the target.
UP_SERIES_QUERY = "up"
UP_TIMES_QUERY = "timestamp(up)"
BASELINE_TIMES_QUERY = "max by (instance) (timestamp(up))"


@dataclass(frozen=True, slots=True)
class _UpSeries:
    job: str
    value: float
    sampled_at: float


def _up_series(values: Sequence[Mapping[str, Any]], times: Sequence[Mapping[str, Any]]
               ) -> dict[str, list[_UpSeries]]:
    def key(row: Mapping[str, Any]) -> tuple[str, str]:
        m = row.get("metric", {})
        return m.get("instance", ""), m.get("job", "")

    when = {key(r): parse_value(r["value"][1]) for r in times}
    out: dict[str, list[_UpSeries]] = {}
    for r in values:
        instance, job = key(r)
        if instance:
            out.setdefault(instance, []).append(_UpSeries(
                job, parse_value(r["value"][1]), when.get((instance, job), math.nan)))
    return out


def _rows_by_instance(
    rows: Sequence[Mapping[str, Any]],
) -> dict[str, dict[str, dict[LabelKey, float]]]:
    out: dict[str, dict[str, dict[LabelKey, float]]] = {}
    for row in rows:
        metric = dict(row.get("metric", {}))
        instance = metric.pop("instance", None)
        series = metric.pop(SERIES_LABEL, None)
        if instance is None or series is None:
            continue
        value = parse_value(row["value"][1])
        labels: LabelKey = tuple(sorted(metric.items()))
        out.setdefault(instance, {}).setdefault(series, {})[labels] = value
    return out


class PrometheusSource:
    name = "prometheus"

    def __init__(
        self,
        client: PrometheusClient,
        targets: Sequence[Target],
        *,
        mode: WindowMode = "increase",
        escaped_names: bool = False,
        rediscovery: Rediscovery | None = None,
    ) -> None:
        self._client = client
        self._targets = list(targets)
        self._mode = mode
        self._escaped = escaped_names
        # ``[prometheus] discover_targets`` or ``dns+`` names: found again as it runs.
        self._rediscovery = rediscovery

    def targets(self) -> Sequence[Target]:
        return list(self._targets)

    async def _collect(self, at: float, window_ms: int | None) -> Samples:
        merged: Samples = {}
        answers = await asyncio.gather(
            *(self._client.query(q.promql, at)
              for q in build_queries(window_ms, escaped_names=self._escaped))
        )
        for rows in answers:
            for instance, samples in _rows_by_instance(rows).items():
                merged.setdefault(instance, {}).update(samples)
        return merged

    async def _refresh_targets(self, now: float) -> None:
        if self._rediscovery is not None:
            found = await self._rediscovery.refresh(self._targets, now)
            if found is not None:
                self._targets = found
            self._rediscovery.require(self._targets)

    async def window(self, start: float, end: float) -> Window:
        """The window ``[start, end]``, within ONE total deadline (``[prometheus]
        timeout_s``) for every query and discovery call it makes: past it the window fails
        with :class:`PrometheusUnavailable` naming the deadline (the cycle skips with that
        reason and the loop goes on), whatever Prometheus sends and however slowly."""
        deadline = self._client.timeout_s
        try:
            async with asyncio.timeout(deadline):
                return await self._window(start, end)
        except TimeoutError:
            raise PrometheusUnavailable(
                f"Prometheus did not answer this window's queries within {deadline:g} s "
                "(a total deadline: [prometheus] timeout_s)") from None

    async def _window(self, start: float, end: float) -> Window:
        await self._refresh_targets(end)
        up_values, up_times = await asyncio.gather(
            self._client.query(UP_SERIES_QUERY, end), self._client.query(UP_TIMES_QUERY, end))
        series = _up_series(up_values, up_times)
        fresh = {name: [s for s in rows if s.sampled_at > start]
                 for name, rows in series.items()}
        up = {name: rows[0].value for name, rows in fresh.items() if len(rows) == 1}
        down = [t for t in self._targets if up.get(t.name) != 1.0]
        counted = await self._counted(start, end, {t.name for t in self._targets
                                                   if t not in down})
        errors: dict[str, str] = {}
        if down:
            errors = await self._scrape_errors()
        results: list[TargetResult] = []
        for t in self._targets:
            if t in down:
                results.append(TargetResult(t.name, t.role, failure=_down(
                    t.name, series.get(t.name, []), fresh.get(t.name, []), errors, end)))
            else:
                results.append(TargetResult(t.name, t.role, delta=self._target_delta(
                    t, counted, start, end)))
        return assemble_window(
            start, end, results, source=f"{self.name}:{self._mode}",
            ctx_labels=CONTEXT_BINS.labels, io_labels=IO_RATIO_BINS.labels,
        )

    async def _counted(self, start: float, end: float, live: set[str]) -> _Counted:
        """The window's counter readings: the edges' cumulative values (``edges`` mode);
        ``increase()`` at the end and, for the live targets a cumulative series of which
        fell in the window, the edges too (``increase`` mode)."""
        if self._mode == "edges":
            return _Counted(edges=await self._edges(start, end))
        window_ms = max(1, round((end - start) * 1000))
        increases, resets = await asyncio.gather(
            self._collect(end, window_ms),
            self._client.query(build_resets_query(window_ms, escaped_names=self._escaped),
                               end))
        fell = frozenset(_fell(resets) & live)
        edges = await self._edges(start, end) if fell else None
        return _Counted(increases=increases, fell=fell, edges=edges)

    async def _edges(self, start: float, end: float) -> _Edges:
        at_end, at_start, baseline_rows = await asyncio.gather(
            self._collect(end, None), self._collect(start, None),
            self._client.query(BASELINE_TIMES_QUERY, start))
        baseline_at = {r["metric"].get("instance", ""): parse_value(r["value"][1])
                       for r in baseline_rows}
        return _Edges(at_end, at_start, baseline_at)

    def _target_delta(self, t: Target, counted: _Counted, start: float, end: float
                      ) -> TargetDelta:
        worker = t.role != "router"
        if counted.increases is not None and t.name not in counted.fell:
            return _increase_delta(t.name, counted.increases.get(t.name, {}), worker=worker)
        # The edges diffed like two scrapes, by the same rules (observe.counters): edges
        # mode, or increase mode where a series fell (jitter, a restart) in the window.
        assert counted.edges is not None
        edges = counted.edges
        start_samples = edges.at_start.get(t.name, {})
        # The start edge's sample from before a gap (Prometheus down or behind): the diff
        # would put the gap's traffic in this window (12x the rate in one). Gauges only, as
        # after a restart.
        if not edges.baseline_at.get(t.name, -math.inf) >= start - max(end - start, 1.0):
            start_samples = {}
        end_samples = edges.at_end.get(t.name, {})
        prev = Snapshot(t.name, start, start_samples, frozenset(start_samples))
        cur = Snapshot(t.name, end, end_samples, frozenset(base_name(s) for s in end_samples))
        return diff_snapshots(prev if start_samples else None, cur, announced=False)

    async def _scrape_errors(self) -> dict[str, str]:
        try:
            active = await self._client.targets()
        except PrometheusError:
            return {}
        out: dict[str, str] = {}
        for t in active:
            instance = t.get("labels", {}).get("instance")
            if instance and t.get("lastError"):
                out[instance] = str(t["lastError"])[:300]
        return out

    def forget_baselines(self) -> None:
        return None  # each window is a range query over exactly [start, end]

    async def aclose(self) -> None:
        await self._client.aclose()


Samples = dict[str, dict[str, dict[LabelKey, float]]]  # instance -> series -> labels -> value


@dataclass(frozen=True, slots=True)
class _Edges:
    at_end: Samples
    at_start: Samples
    baseline_at: dict[str, float]  # instance -> its newest sample's time at the start edge


@dataclass(frozen=True, slots=True)
class _Counted:
    increases: Samples | None = None  # increase mode: increase() at the end
    fell: frozenset[str] = frozenset()  # increase mode: read at the edges instead
    edges: _Edges | None = None


def _increase_delta(instance: str, end_samples: dict[str, dict[LabelKey, float]], *,
                    worker: bool) -> TargetDelta:
    """A target's delta from ``increase()`` rows (already window increases) and gauges."""
    families = frozenset(base_name(s) for s in end_samples)
    gauges: dict[str, dict[LabelKey, float]] = {}
    increases: dict[str, dict[LabelKey, float]] = {}
    gauge_names = _gauge_names()
    for series, values in end_samples.items():
        clean = {k: v for k, v in values.items() if not math.isnan(v)}
        (gauges if series in gauge_names else increases)[series] = clean
    # A worker exports counters from its start (vLLM and SGLang create their series up
    # front): none at all means fewer than two samples in the window (increase() needs
    # two), a first window, not families the engine lacks.
    sampled = bool(increases) or not worker
    notes = [] if sampled else [TargetFailure(
        instance, FailureKind.NO_BASELINE, "no counter has two samples in the window (increase() "
        "needs two): scraped less often than the window, or just started")]
    return TargetDelta(target=instance, families=families, increases=increases,
                       gauges=gauges, has_baseline=sampled, families_known=sampled,
                       notes=notes)


def _gauge_names() -> frozenset[str]:
    names = {ROUTER.qps, PROCESS_START}
    for engine in ENGINES:
        names |= {spec.family for spec in engine.all_specs()
                  if isinstance(spec, GaugeSpec)
                  or (isinstance(spec, HistogramSpec) and spec.gauge)}
        names |= set(engine.markers)
    return frozenset(names)


def _down(name: str, series: Sequence[_UpSeries], fresh: Sequence[_UpSeries],
          errors: Mapping[str, str], end: float) -> TargetFailure:
    """Why a target counts as not answering this window."""
    if not series:
        return TargetFailure(name, FailureKind.UNREACHABLE,
                             "not among Prometheus' scrape targets (instance label)")
    if len(fresh) > 1:
        jobs = ", ".join(sorted(s.job for s in fresh))
        return TargetFailure(name, FailureKind.DUPLICATE_SERIES,
                             f"scraped by {len(fresh)} jobs ({jobs}): "
                             "its counts would be summed twice; scrape it in one job")
    if not fresh:
        newest = max((s.sampled_at for s in series if not math.isnan(s.sampled_at)),
                     default=math.nan)
        age = f"{end - newest:.0f} s old" if not math.isnan(newest) else "of unknown age"
        return TargetFailure(name, FailureKind.STALE,
                             f"Prometheus' newest sample is {age}: none in "
                             "this window (Prometheus behind, or scraping less often than "
                             "[controller] interval_s)")
    return TargetFailure(name, FailureKind.UNREACHABLE,
                         "Prometheus' last scrape failed: " + errors.get(name, "up == 0"))
