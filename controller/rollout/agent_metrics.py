"""The router agent's Prometheus metrics (``pdrouter_*``), built in one place.

Every bucket edge and every bin label here is fixed: it does not depend on the policy the
router runs, so series stay comparable across policy versions and the controller can learn
the workload distribution and per-route outcomes from Prometheus alone.

``pdrouter_decisions_total`` sits on the decision hot path (budget: a few microseconds per
call), so it is not a ``prometheus_client.Counter`` (whose ``inc`` takes a lock and costs
about a microsecond here): each (route, reason) pair is a :class:`Tally`, a lock-free counter
read at scrape time by a small custom collector.

The regular counters and histograms keep their ``_created`` series; this module does not
call ``prometheus_client.disable_created_metrics()`` because that switch is process-global
and belongs to whoever owns the process (the daemon or the embedding router).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from controller.policy.bins import FEATURE_CONTEXT_EDGES, FEATURE_IO_RATIO_EDGES
from controller.policy.decide import Reason
from controller.policy.model import Route

# Latency buckets (seconds). They include the default SLOs (TTFT 2 s, TPOT 0.1 s) as edges.
TTFT_BUCKETS_S: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
)
TPOT_BUCKETS_S: tuple[float, ...] = (
    0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0,
)

SLO_LABELS = ("met", "ttft_miss", "tpot_miss", "both_miss")


def slo_label(ttft_met: bool, tpot_met: bool) -> str:
    if ttft_met:
        return "met" if tpot_met else "tpot_miss"
    return "ttft_miss" if tpot_met else "both_miss"


class Tally:
    """A lock-free event counter for hot paths.

    ``tick`` is ``next`` of an ``itertools.count``: one C call that cannot be interrupted by
    another Python thread, so concurrent ticks are never lost (unlike ``x += 1``).
    """

    __slots__ = ("_count", "tick")

    def __init__(self) -> None:
        self._count = itertools.count()
        self.tick: Callable[[], int] = self._count.__next__

    def value(self) -> int:
        # itertools.count shows its next value only in its repr, "count(N)"; N = ticks so far.
        text = repr(self._count)
        return int(text[text.index("(") + 1 : -1])


class _DecisionsCollector(Collector):
    """Exposes the decision tallies as the counter ``pdrouter_decisions_total{route,reason}``."""

    def __init__(self, tallies: dict[tuple[Route, Reason], Tally]) -> None:
        self._tallies = tallies

    def _family(self, with_samples: bool) -> CounterMetricFamily:
        family = CounterMetricFamily(
            "pdrouter_decisions",
            "Routing decisions made by this router, by route and reason.",
            labels=["route", "reason"],
        )
        if with_samples:
            for (route, reason), tally in self._tallies.items():
                family.add_metric([route.name, reason.value], tally.value())
        return family

    def describe(self) -> Iterable[Metric]:
        return [self._family(with_samples=False)]

    def collect(self) -> Iterator[Metric]:
        yield self._family(with_samples=True)


class RouterMetrics:
    """Every ``pdrouter_*`` metric of one router agent, registered on ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.decision_tallies: dict[tuple[Route, Reason], Tally] = {
            (route, reason): Tally() for route in Route for reason in Reason
        }
        registry.register(_DecisionsCollector(self.decision_tallies))

        self.updates = Counter(
            "pdrouter_updates",
            "Policy updates received, by outcome (applied, noop, conflict, stale, invalid, "
            "persist_failed).",
            ["result"],
            registry=registry,
        )
        self._request_metrics(registry)
        self._policy_gauges(registry)
        for result in ("applied", "noop", "conflict", "stale", "invalid", "persist_failed"):
            self.updates.labels(result)
        self._request_children: dict[tuple[str, str, str, str], Callable[[], None]] = {}
        self._ttft_children: dict[tuple[str, str], Callable[[float], None]] = {}
        self._tpot_children: dict[tuple[str, str], Callable[[float], None]] = {}

    def _request_metrics(self, registry: CollectorRegistry) -> None:
        """The completed requests' counter and histograms, registered in exposition order."""
        self.requests = Counter(
            "pdrouter_requests",
            "Completed requests by route, fixed context bin, fixed io-ratio bin and SLO outcome "
            "(met, ttft_miss, tpot_miss, both_miss) against the running policy's SLOs.",
            ["route", "ctx_bin", "io_bin", "slo"],
            registry=registry,
        )
        self.ttft = Histogram(
            "pdrouter_ttft_seconds",
            "Time to first token by route and fixed context bin.",
            ["route", "ctx_bin"],
            buckets=TTFT_BUCKETS_S,
            registry=registry,
        )
        self.tpot = Histogram(
            "pdrouter_tpot_seconds",
            "Time per output token (after the first) by route and fixed context bin.",
            ["route", "ctx_bin"],
            buckets=TPOT_BUCKETS_S,
            registry=registry,
        )
        self.context_tokens = Histogram(
            "pdrouter_context_tokens",
            "Cached context tokens of completed requests (fixed bins).",
            buckets=FEATURE_CONTEXT_EDGES,
            registry=registry,
        )
        self.io_ratio = Histogram(
            "pdrouter_io_ratio",
            "append_tokens / expected_output_tokens of completed requests (fixed bins).",
            buckets=FEATURE_IO_RATIO_EDGES,
            registry=registry,
        )

    def _policy_gauges(self, registry: CollectorRegistry) -> None:
        """The arrival rate and the running policy's gauges, registered in exposition order."""
        self.qps = Gauge(
            "pdrouter_qps",
            "The router's windowed arrival rate, as last passed to decide() (requests/s).",
            registry=registry,
        )
        self.policy_version = Gauge(
            "pdrouter_policy_version",
            "Version of the policy this router runs (0: none).",
            registry=registry,
        )
        self.policy_age = Gauge(
            "pdrouter_policy_age_seconds",
            "Seconds since the running policy was applied or loaded (-1: no policy).",
            registry=registry,
        )
        self.policy_stale = Gauge(
            "pdrouter_policy_stale",
            "1 when no policy update came for longer than the staleness limit, else 0.",
            registry=registry,
        )

    def decisions(self, route: Route, reason: Reason) -> int:
        return self.decision_tallies[(route, reason)].value()

    def count_request(self, route: str, ctx_bin: str, io_bin: str, slo: str) -> None:
        key = (route, ctx_bin, io_bin, slo)
        inc = self._request_children.get(key)
        if inc is None:
            inc = self._request_children[key] = self.requests.labels(*key).inc
        inc()

    def observe_ttft(self, route: str, ctx_bin: str, seconds: float) -> None:
        key = (route, ctx_bin)
        observe = self._ttft_children.get(key)
        if observe is None:
            observe = self._ttft_children[key] = self.ttft.labels(*key).observe
        observe(seconds)

    def observe_tpot(self, route: str, ctx_bin: str, seconds: float) -> None:
        key = (route, ctx_bin)
        observe = self._tpot_children.get(key)
        if observe is None:
            observe = self._tpot_children[key] = self.tpot.labels(*key).observe
        observe(seconds)
