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
  evaluated at the window end. Prometheus
  handles counter resets between every pair of samples; it extrapolates to the window edges,
  so counts are estimates (means, being ratios of equally extrapolated sums and counts, are
  not affected).
- ``edges`` (``[prometheus] window_mode``'s default): the aggregated cumulative values at
  ``start`` and at ``end`` (two evaluations of the same queries), diffed with the same code
  as a direct scrape: exact counts, resets detected only at the edges.

The client is ``prometheus-api-client`` wrapped: a request timeout, bounded retries with
``raise_on_status=False``, calls made off the event loop, values read with ``float()``
(``"NaN"``, ``"+Inf"``), and its three failure shapes (``PrometheusApiClientException``
holding the HTTP status and error JSON in its message, ``requests`` connection errors,
``RetryError``) mapped to :class:`PrometheusUnavailable` (transient) or
:class:`PrometheusQueryError` (terminal), both :class:`PrometheusError`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import requests
from prometheus_api_client.exceptions import PrometheusApiClientException
from prometheus_api_client.prometheus_connect import PrometheusConnect
from urllib3.util.retry import Retry

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


_STATUS = re.compile(r"HTTP Status Code (\d{3}) \((.*)\)\Z", re.S)


def map_client_error(exc: BaseException) -> PrometheusError:
    """One domain error for every way the client fails."""
    if isinstance(exc, PrometheusApiClientException):
        text = str(exc)
        m = _STATUS.match(text)
        status = int(m.group(1)) if m else 0
        detail, error_type = _error_json(m.group(2) if m else text)
        if status == 429 or status >= 500 or status == 0:
            return PrometheusUnavailable(f"Prometheus answered HTTP {status}: {detail}")
        return PrometheusQueryError(f"Prometheus refused the query (HTTP {status}, "
                                    f"{error_type or 'error'}): {detail}", error_type)
    if isinstance(exc, requests.exceptions.JSONDecodeError):  # also a RequestException
        return PrometheusQueryError(f"Prometheus answered something that is not API JSON: "
                                    f"{exc}")
    if isinstance(exc, requests.exceptions.RetryError):
        return PrometheusUnavailable(f"Prometheus kept failing after the retries: {exc}")
    if isinstance(exc, requests.exceptions.Timeout):
        return PrometheusUnavailable(f"Prometheus did not answer in time: {exc}")
    if isinstance(exc, requests.exceptions.RequestException):
        return PrometheusUnavailable(f"cannot reach Prometheus: {type(exc).__name__}: {exc}")
    if isinstance(exc, (ValueError, KeyError, TypeError)):
        return PrometheusQueryError(f"Prometheus answered something that is not API JSON: "
                                    f"{exc!r}")
    return PrometheusUnavailable(f"Prometheus query failed: {exc!r}")


def _error_json(raw: str) -> tuple[str, str | None]:
    # The client puts repr(response.content) in the message: b'{"status":"error",...}'.
    body = raw
    if len(raw) >= 3 and raw[0] == "b" and raw[1] in "'\"":
        body = raw[2:-1].encode("latin-1", "backslashreplace").decode("unicode_escape")
    try:
        d = json.loads(body)
        return str(d.get("error", body))[:500], d.get("errorType")
    except (ValueError, AttributeError):
        return body[:500], None


def parse_value(raw: Any) -> float:
    """A Prometheus sample value: strings, including ``"NaN"``, ``"+Inf"``, ``"-Inf"``."""
    return float(raw)


class PrometheusClient:
    """``PrometheusConnect`` with a timeout, bounded retries and one error type."""

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
        self.requests_sent = 0  # final answers seen (urllib3 retries are not counted here)
        self._session = requests.Session()
        self._session.trust_env = False
        self._session.hooks["response"].append(self._count)
        retry = Retry(
            total=retries, connect=retries, read=retries, backoff_factor=backoff_s,
            status_forcelist=(429, 502, 503, 504), allowed_methods=("GET", "POST"),
            raise_on_status=False,
        )
        # The client's annotations say int/dict; requests takes a float timeout and None.
        self._api = PrometheusConnect(
            self.url, headers=dict(headers) if headers else None,  # type: ignore[arg-type]
            retry=retry, timeout=timeout_s, session=self._session,  # type: ignore[arg-type]
        )

    def _count(self, response: requests.Response, *args: Any, **kwargs: Any) -> None:
        self.requests_sent += 1

    def query_sync(self, promql: str, at: float) -> list[dict[str, Any]]:
        try:
            result = self._api.custom_query(promql, params={"time": f"{at:.3f}"})
        except Exception as e:  # every client failure becomes one domain error
            raise map_client_error(e) from e
        if not isinstance(result, list):
            raise PrometheusQueryError(f"expected a vector result, got {type(result).__name__}")
        return result

    async def query(self, promql: str, at: float) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.query_sync, promql, at)

    def targets_sync(self) -> list[dict[str, Any]]:
        """``/api/v1/targets`` active targets (labels, health, lastError)."""
        try:
            r = self._session.get(f"{self.url}/api/v1/targets", params={"state": "active"},
                                  timeout=self.timeout_s)
            if r.status_code != 200:
                raise PrometheusApiClientException(
                    f"HTTP Status Code {r.status_code} ({r.content!r})")
            active = r.json()["data"]["activeTargets"]
        except PrometheusError:
            raise
        except Exception as e:
            raise map_client_error(e) from e
        return list(active)

    async def targets(self) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.targets_sync)

    def close(self) -> None:
        self._session.close()


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
    return hist_specs, counters, gauges


def build_queries(window_ms: int | None, *, escaped_names: bool = False) -> list[_Query]:
    """The window's queries; ``window_ms`` None: cumulative values (edges mode).

    ``escaped_names``: Prometheus stored ``vllm:x`` as ``vllm_x`` (prometheus_client 0.22+
    escapes colons when a Prometheus before 2.49 negotiates OpenMetrics). Rows are still
    tagged with the catalog's names.
    """
    hist_specs, counters, gauges = _catalog_series()

    def selector(name: str, match: tuple[tuple[str, str], ...] = ()) -> str:
        stored = name.replace(":", "_") if escaped_names else name
        if has_replica_ranks(name):  # the total, not the priority classes beside it (also
            match = (*match, (PRIORITY_LABEL, ""))  # the series without the label)
        matchers = [f'{k}="{v}"' for k, v in match]
        return stored + "{" + ",".join(matchers) + "}" if matchers else stored

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

    async def _collect(
        self, at: float, window_ms: int | None
    ) -> dict[str, dict[str, dict[LabelKey, float]]]:
        merged: dict[str, dict[str, dict[LabelKey, float]]] = {}
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
        await self._refresh_targets(end)
        up_values, up_times = await asyncio.gather(
            self._client.query(UP_SERIES_QUERY, end), self._client.query(UP_TIMES_QUERY, end))
        series = _up_series(up_values, up_times)
        fresh = {name: [s for s in rows if s.sampled_at > start]
                 for name, rows in series.items()}
        up = {name: rows[0].value for name, rows in fresh.items() if len(rows) == 1}
        baseline_at: dict[str, float] = {}
        if self._mode == "increase":
            window_ms = max(1, round((end - start) * 1000))
            at_end = await self._collect(end, window_ms)
            at_start: dict[str, dict[str, dict[LabelKey, float]]] | None = None
        else:
            at_end, at_start, baseline_rows = await asyncio.gather(
                self._collect(end, None), self._collect(start, None),
                self._client.query(BASELINE_TIMES_QUERY, start))
            baseline_at = {r["metric"].get("instance", ""): parse_value(r["value"][1])
                           for r in baseline_rows}
        down = [t for t in self._targets if up.get(t.name) != 1.0]
        errors: dict[str, str] = {}
        if down:
            errors = await self._scrape_errors()
        results: list[TargetResult] = []
        for t in self._targets:
            if t in down:
                results.append(TargetResult(t.name, t.role, failure=_down(
                    t.name, series.get(t.name, []), fresh.get(t.name, []), errors, end)))
                continue
            start_samples = None if at_start is None else at_start.get(t.name, {})
            # The start edge's sample from before a gap (Prometheus down or behind): the
            # diff would put the gap's traffic in this window (12x the rate in one). Gauges
            # only, as after a restart.
            if start_samples is not None \
                    and not baseline_at.get(t.name, -math.inf) >= start - max(end - start, 1.0):
                start_samples = {}
            results.append(TargetResult(t.name, t.role, delta=self._delta(
                t.name, at_end.get(t.name, {}), start_samples, start, end,
                worker=t.role != "router")))
        return assemble_window(
            start, end, results, source=f"{self.name}:{self._mode}",
            ctx_labels=CONTEXT_BINS.labels, io_labels=IO_RATIO_BINS.labels,
        )

    def _delta(
        self,
        instance: str,
        end_samples: dict[str, dict[LabelKey, float]],
        start_samples: dict[str, dict[LabelKey, float]] | None,
        start: float,
        end: float,
        *,
        worker: bool = True,
    ) -> TargetDelta:
        families = frozenset(base_name(s) for s in end_samples)
        if start_samples is None:  # increase mode: rows are already window increases
            gauges: dict[str, dict[LabelKey, float]] = {}
            increases: dict[str, dict[LabelKey, float]] = {}
            gauge_names = _gauge_names()
            for series, values in end_samples.items():
                clean = {k: v for k, v in values.items() if not math.isnan(v)}
                (gauges if series in gauge_names else increases)[series] = clean
            # A worker exports counters from its start (vLLM and SGLang create their
            # series up front): none at all means fewer than two samples in the window
            # (increase() needs two), a first window, not families the engine lacks.
            sampled = bool(increases) or not worker
            notes = [] if sampled else [TargetFailure(
                instance, FailureKind.NO_BASELINE,
                "no counter has two samples in the window (increase() "
                "needs two): scraped less often than the window, or just started")]
            return TargetDelta(target=instance, families=families, increases=increases,
                               gauges=gauges, has_baseline=sampled, families_known=sampled,
                               notes=notes)
        # edges mode: the cumulative values at both edges, diffed like two scrapes
        prev = Snapshot(instance, start, start_samples, frozenset(start_samples))
        cur = Snapshot(instance, end, end_samples, families)
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
        await asyncio.to_thread(self._client.close)


def _gauge_names() -> frozenset[str]:
    names = {ROUTER.qps}
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
