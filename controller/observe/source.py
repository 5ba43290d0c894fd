"""The ``MetricsSource`` seam and its fake.

Every source answers ``await source.window(start, end)`` with the
:class:`~controller.core.window.Window` for ``[start, end]``, called at ``end``. Rates are
increases divided by ``end - start``. Sources that diff snapshots (scrape, in-process) keep
the previous snapshot between calls, so the first call has no baseline: its window has
gauges but no counts, and says so (``no_baseline``).

:class:`FakeSource` keeps exact ledgers in plain Python (no exposition text, no
prometheus_client) so the contract suite can hold the real sources against an independent
computation of the same traffic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from controller.core.catalog import HISTOGRAM_KEYS
from controller.core.window import (
    FailureKind,
    Histogram,
    Role,
    RouteOutcome,
    Summary,
    TargetFailure,
    Window,
    WorkerStats,
    Workload,
)
from controller.errors import TransientError
from controller.observe.window_builder import ALL_BINS
from controller.policy.model import Route

TargetRole = Literal["prefill", "decode", "router"]


@dataclass(frozen=True, slots=True)
class Target:
    """A worker or router to observe. ``name`` is its ``HOST:PORT`` (Prometheus' instance)."""

    name: str
    role: TargetRole
    url: str = ""  # scrape URL; default ``http://{name}/metrics``

    @property
    def metrics_url(self) -> str:
        return self.url or f"http://{self.name}/metrics"


class NoTargets(TransientError):
    """A source with nothing to observe yet: its discovery (Prometheus' targets, ``dns+``
    names) has not answered or found anything since the start. The cycle is skipped, not
    planned on an empty window."""


@runtime_checkable
class MetricsSource(Protocol):
    """Where windows come from (Prometheus, direct scrapes, the simulator's registries)."""

    name: str

    def targets(self) -> Sequence[Target]:
        """The workers and routers this source observes."""

    async def window(self, start: float, end: float) -> Window:
        """The window ``[start, end]``; call it at ``end``."""

    def forget_baselines(self) -> None:
        """Drop any counter baselines: the next window starts fresh. Called when this
        replica leads again after another one did (its baselines are from before)."""

    async def aclose(self) -> None:
        """Release connections."""


@dataclass
class _HistLedger:
    count: float = 0.0
    total: float = 0.0


@dataclass
class _WorkerLedger:
    hist: dict[str, _HistLedger] = field(default_factory=dict)
    requests: float = 0.0
    aborted: float = 0.0
    errored: float = 0.0
    generation: float = 0.0
    prompt: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)


@dataclass
class _RouterLedger:
    cells: dict[tuple[Route, int, int], list[float]] = field(default_factory=dict)
    context: dict[float, float] = field(default_factory=dict)  # edge -> count in bucket
    io: dict[float, float] = field(default_factory=dict)
    qps: float | None = None


class FakeSource:
    """Exact in-memory ledgers; each ``window()`` reports what was recorded since the last.

    Workers and routers marked down are reported as ``unreachable`` failures and are left
    out of the window (no zeros).
    """

    name = "fake"

    def __init__(self, targets: Sequence[Target], engine: str = "vllm") -> None:
        self._targets = list(targets)
        self._engine = engine
        self._workers = {t.name: _WorkerLedger() for t in targets if t.role != "router"}
        self._routers = {t.name: _RouterLedger() for t in targets if t.role == "router"}
        self._down: set[str] = set()
        self._primed = False

    def targets(self) -> Sequence[Target]:
        return list(self._targets)

    # --- recording -------------------------------------------------------------------
    def observe(self, target: str, key: str, value: float) -> None:
        if key not in HISTOGRAM_KEYS:
            raise KeyError(key)
        h = self._workers[target].hist.setdefault(key, _HistLedger())
        h.count += 1
        h.total += value

    def finish_request(self, target: str, generation_tokens: float,
                       prompt_tokens: dict[str, float]) -> None:
        w = self._workers[target]
        w.requests += 1
        w.generation += generation_tokens
        for src, n in prompt_tokens.items():
            w.prompt[src] = w.prompt.get(src, 0.0) + n

    def fail_requests(self, target: str, *, aborted: float = 0.0, errored: float = 0.0
                      ) -> None:
        """Requests that finished without being served (not in the request rate)."""
        w = self._workers[target]
        w.aborted += aborted
        w.errored += errored

    def set_gauge(self, target: str, key: str, value: float) -> None:
        self._workers[target].gauges[key] = value

    def route_request(self, router: str, route: Route, ctx_bin: int, io_bin: int,
                      ttft_s: float, tpot_s: float, met: bool) -> None:
        r = self._routers[router]
        requests = r.cells.setdefault((route, ctx_bin, io_bin), [0.0] * 6)
        requests[0] += 1
        requests[1] += 1 if met else 0
        lat = r.cells.setdefault((route, ctx_bin, ALL_BINS), [0.0] * 6)
        lat[2] += ttft_s
        lat[3] += 1
        lat[4] += tpot_s
        lat[5] += 1

    def feature(self, router: str, context_edge: float, io_edge: float) -> None:
        """Count one request in the context and io-ratio buckets whose upper edge is given."""
        r = self._routers[router]
        r.context[context_edge] = r.context.get(context_edge, 0.0) + 1
        r.io[io_edge] = r.io.get(io_edge, 0.0) + 1

    def set_qps(self, router: str, qps: float) -> None:
        self._routers[router].qps = qps

    def set_down(self, target: str, down: bool = True) -> None:
        (self._down.add if down else self._down.discard)(target)

    # --- the seam ----------------------------------------------------------------------
    async def window(self, start: float, end: float) -> Window:
        interval = end - start if end > start else 1.0
        workers: list[WorkerStats] = []
        outcomes: list[RouteOutcome] = []
        failures: list[TargetFailure] = []
        answered: list[str] = []
        ctx: dict[float, float] = {}
        io: dict[float, float] = {}
        qps: dict[str, float] = {}
        baseline = self._primed
        for t in self._targets:
            if t.name in self._down:
                failures.append(TargetFailure(t.name, FailureKind.UNREACHABLE, "marked down"))
                continue
            answered.append(t.name)
            if not baseline:
                failures.append(TargetFailure(t.name, FailureKind.NO_BASELINE, "first window"))
            if t.role == "router":
                r = self._routers[t.name]
                if baseline:
                    outcomes.extend(
                        RouteOutcome(t.name, route, c, i, *v)
                        for (route, c, i), v in sorted(
                            r.cells.items(), key=lambda kv: (kv[0][0].value, *kv[0][1:]))
                    )
                    for e, n in r.context.items():
                        ctx[e] = ctx.get(e, 0.0) + n
                    for e, n in r.io.items():
                        io[e] = io.get(e, 0.0) + n
                if r.qps is not None:
                    qps[t.name] = r.qps
                self._routers[t.name] = _RouterLedger(qps=r.qps)
                continue
            w = self._workers[t.name]
            role: Role = "prefill" if t.role == "prefill" else "decode"
            summaries: dict[str, Any] = {
                k: (Summary(mean=h.total / h.count, count=h.count)
                    if baseline and (h := w.hist.get(k)) is not None and h.count > 0 else None)
                for k in HISTOGRAM_KEYS
            }
            workers.append(WorkerStats(
                worker=t.name, role=role, engine=self._engine,
                request_rate=w.requests / interval if baseline else None,
                running=w.gauges.get("running"), waiting=w.gauges.get("waiting"),
                kv_cache_usage=w.gauges.get("kv_cache_usage"),
                prompt_tokens_by_source=dict(w.prompt) if baseline else None,
                generation_tokens=w.generation if baseline else None,
                aborted=w.aborted if baseline else None,
                errored=w.errored if baseline else None,
                **summaries,
            ))
            self._workers[t.name] = _WorkerLedger(gauges=dict(w.gauges))
        self._primed = True
        return Window.build(
            start=start, end=end, interval_s=interval, workers=workers, outcomes=outcomes,
            workload=Workload(context_tokens=_hist(ctx), io_ratio=_hist(io), qps_by_router=qps),
            answered=answered, failures=failures, source=self.name,
        )

    def forget_baselines(self) -> None:
        return None  # every window is its own ledger

    async def aclose(self) -> None:
        return None


def _hist(counts: dict[float, float]) -> Histogram | None:
    if not counts or not math.fsum(counts.values()) > 0:
        return None
    edges = tuple(sorted(counts))
    return Histogram(edges=edges, counts=tuple(counts[e] for e in edges))
