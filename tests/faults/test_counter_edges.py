"""Counters that go backwards by a little, restarts and label changes (issue 39, class 4):
a real HTTP server serving a vLLM worker's exposition, scraped by the real ScrapeSource;
the PromQL ``edges`` path runs the same diff (``announced=False``), checked on the same
snapshots; the PromQL ``increase`` path through a real Prometheus scraping the server. Never
a rate from a lifetime total."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from prometheus_client import generate_latest

from controller.clock import WallClock
from controller.core.exposition import parse_exposition
from controller.core.window import FailureKind, Window
from controller.observe.counters import decrease_tolerance
from controller.observe.prometheus import PrometheusClient, PrometheusSource
from controller.observe.scrape import ScrapeSource
from controller.observe.source import Target
from controller.observe.window_builder import diff_snapshots
from tests.conftest import require
from tests.observe.cluster import VllmWorker
from tests.observe.promserver import HOW_TO_INSTALL, PROMETHEUS, PromServer
from tests.observe.textserver import TextServer

pytestmark = [pytest.mark.integration]

WINDOW_S = 30.0
LIFETIME = 27_000  # requests before the test's first scrape
CLOCK = WallClock()


def _worker(model: str = "llama-3.1-8b", requests: int = LIFETIME) -> VllmWorker:
    w = VllmWorker(model=model)
    w.success["stop"].inc(requests)
    for _ in range(3):
        w.hist["ttft_s"].observe(0.2)
    return w


def _text(w: VllmWorker, started: float, sum_shift: float = 0.0) -> str:
    text = generate_latest(w.registry).decode()
    if sum_shift:  # the TTFT histogram's _sum moved by ``sum_shift`` (negative: fell)
        def shift(m: re.Match[str]) -> str:
            return f"{m.group(1)} {float(m.group(2)) + sum_shift!r}"
        text = re.sub(r"^(vllm:time_to_first_token_seconds_sum\{[^}]*\}) (\S+)$", shift,
                      text, flags=re.M)
    return text + ("# TYPE process_start_time_seconds gauge\n"
                   f"process_start_time_seconds {started}\n")


@pytest.fixture
def served() -> Iterator[TextServer]:
    server = TextServer()
    try:
        yield server
    finally:
        server.close()


class Scraper:
    def __init__(self, server: TextServer) -> None:
        self.server = server
        self.source = ScrapeSource([Target("w", "decode", f"http://{server.address}/metrics")],
                                   timeout_s=2.0)
        self.t = 0.0

    async def window(self, text: str) -> Window:
        self.server.default = text
        start, self.t = self.t, self.t + WINDOW_S
        return await self.source.window(start, self.t)


def _rate(w: Window) -> float | None:
    [stats] = w.workers
    return stats.request_rate


def _kinds(w: Window) -> list[str]:
    return sorted(f.kind for f in w.failures)


async def test_a_counter_falling_by_a_little_counts_no_increase(served: TextServer) -> None:
    worker, scraper = _worker(), Scraper(served)
    try:
        await scraper.window(_text(worker, 100.0))
        for k in range(1, 4):  # 9 requests/s; the TTFT _sum falls by 0.001 per scrape
            worker.success["stop"].inc(9 * WINDOW_S)
            w = await scraper.window(_text(worker, 100.0, sum_shift=-0.001 * k))
            assert _rate(w) == pytest.approx(9.0)
            assert _kinds(w) == ["counter_decrease"], w.failures
            assert "within the tolerance" in w.failures[0].message
    finally:
        await scraper.source.aclose()


async def test_a_restart_counts_from_zero_and_a_fall_without_one_counts_nothing(
    served: TextServer,
) -> None:
    worker, scraper = _worker(), Scraper(served)
    try:
        await scraper.window(_text(worker, 100.0))
        restarted = _worker(requests=45)  # a new process: 45 requests since its start
        w = await scraper.window(_text(restarted, 5000.0))
        assert _rate(w) == pytest.approx(45 / WINDOW_S)
        assert _kinds(w) == ["counter_reset"]
        assert "process_start_time_seconds changed" in w.failures[0].message
        # Then it falls by far more than the tolerance with the same start time: no restart,
        # so its value counts from nothing we know: no rate at all (not its lifetime).
        fallen = _worker(requests=20)
        w = await scraper.window(_text(fallen, 5000.0))
        assert _rate(w) is None
        kinds = _kinds(w)
        assert FailureKind.COUNTER_DECREASE in kinds and FailureKind.COUNTER_RESET not in kinds
        fallen.success["stop"].inc(60)  # the next window counts from the new baseline
        w = await scraper.window(_text(fallen, 5000.0))
        assert _rate(w) == pytest.approx(60 / WINDOW_S)
        assert _kinds(w) == []
    finally:
        await scraper.source.aclose()


async def test_a_changed_label_value_sets_a_baseline_instead_of_counting_a_lifetime(
    served: TextServer,
) -> None:
    worker, scraper = _worker(), Scraper(served)
    try:
        await scraper.window(_text(worker, 100.0))
        worker.success["stop"].inc(90)
        renamed = _worker(model="llama-3.1-8b-instruct", requests=LIFETIME + 90)
        w = await scraper.window(_text(renamed, 100.0))  # same process, new label value
        assert _rate(w) is None  # was 900 requests/s: the lifetime in one window
        assert FailureKind.NO_BASELINE in _kinds(w)
        assert any("new series" in f.message for f in w.failures)
        renamed.success["stop"].inc(90)
        w = await scraper.window(_text(renamed, 100.0))
        assert _rate(w) == pytest.approx(3.0)
        assert _kinds(w) == []
    finally:
        await scraper.source.aclose()


def test_the_promql_edges_path_follows_the_same_rules() -> None:
    """Prometheus' edges mode diffs the two edges' values with ``announced=False``."""
    def snap(text: str, at: float):  # type: ignore[no-untyped-def]
        s = parse_exposition(text, target="w", taken_at=at)
        return s.__class__(s.target, s.taken_at, s.samples, frozenset())

    worker = _worker()
    base = snap(_text(worker, 100.0), 0)
    worker.success["stop"].inc(270)
    jitter = diff_snapshots(base, snap(_text(worker, 100.0, -0.001), 30), announced=False)
    assert sum(jitter.increases["vllm:request_success_total"].values()) == 270
    assert [n.kind for n in jitter.notes] == ["counter_decrease"]
    renamed = _worker(model="other", requests=LIFETIME + 270)
    label = diff_snapshots(base, snap(_text(renamed, 100.0), 30), announced=False)
    assert "vllm:request_success_total" not in label.increases
    assert [n.kind for n in label.notes] == ["no_baseline"]


def test_the_tolerance_is_relative_with_a_floor() -> None:
    assert decrease_tolerance(0.5) == 0.01
    assert decrease_tolerance(27_000.0) == pytest.approx(2.7)


class DriftingWorker:
    """A vLLM worker served per scrape: 9 requests/s finished (``stop``) on the wall clock;
    with ``falling``, the ``length`` count (5,000 of its lifetime) falls by 0.001 at every
    scrape, as an exporter summing floats in another order may. ``restart`` makes it a new
    process (a new start time, 45 requests since)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.worker, self.started = _worker(), 100.0
        self.worker.success["length"].inc(5000)
        self.since, self.falling, self.scrapes = time.monotonic(), False, 0

    def restart(self) -> None:
        with self.lock:
            self.worker, self.started = _worker(requests=45), 5000.0
            self.since, self.falling = time.monotonic(), False

    def render(self) -> str:
        with self.lock:
            now = time.monotonic()
            self.worker.success["stop"].inc(9 * (now - self.since))
            self.since = now
            self.scrapes += 1
            text = _text(self.worker, self.started)
            if self.falling:
                fall = 0.001 * self.scrapes
                text = re.sub(r'^(vllm:request_success_total\{[^}]*finished_reason="length"'
                              r'[^}]*\}) (\S+)$',
                              lambda m: f"{m.group(1)} {float(m.group(2)) - fall!r}",
                              text, flags=re.M)
            return text


PROM_WINDOW_S = 5.0


async def _prom_window(prom: PromServer, source: PrometheusSource, during: float = 0.0,
                       then: Callable[[], None] | None = None) -> Window:
    """A window of PROM_WINDOW_S on the wall clock, ``then`` called ``during`` s into it."""
    start = CLOCK.now()
    if then is not None:
        await asyncio.sleep(during)
        then()
    await asyncio.sleep(PROM_WINDOW_S - during)
    end = CLOCK.now()
    prom.wait_scraped_after(end)
    return await source.window(start, end)


async def test_the_promql_increase_mode_follows_the_same_rules(served: TextServer) -> None:
    """A real Prometheus scraping the worker every second, read in ``increase`` mode:
    PromQL's increase() takes each fall of 0.001 for a restart and counts the value after it
    whole (5,000 per scrape: about 5,000 requests/s for 9)."""
    require("prometheus", PROMETHEUS is not None, HOW_TO_INSTALL)
    drifting = DriftingWorker()
    served.render = drifting.render
    target = Target(served.address, "decode")
    prom = PromServer([target])
    source = PrometheusSource(PrometheusClient(prom.url, timeout_s=5.0, retries=0), [target],
                              mode="increase")
    try:
        prom.wait_scraped_after(CLOCK.now() + 1.0, timeout_s=30)
        steady = await _prom_window(prom, source)  # nothing fell: increase() as it reads
        assert _rate(steady) == pytest.approx(9.0, rel=0.25) and _kinds(steady) == []
        drifting.falling = True
        await _prom_window(prom, source)  # the fall starts at this window's first scrape
        fell = await _prom_window(prom, source)
        assert _rate(fell) == pytest.approx(9.0, rel=0.25), fell.to_dict()
        assert _kinds(fell) == ["counter_decrease"], fell.failures
        assert "within the tolerance" in fell.failures[0].message
        restarted = await _prom_window(prom, source, 1.5, drifting.restart)
        assert _kinds(restarted) == ["counter_reset"], restarted.failures
        assert "process_start_time_seconds changed" in restarted.failures[0].message
        # counted from the restart: 45 and what followed (never the 27,000 before it)
        rate = _rate(restarted)
        assert rate is not None and 45 / PROM_WINDOW_S <= rate <= (45 + 9 * 5) / PROM_WINDOW_S
    finally:
        await source.aclose()
        prom.stop()
