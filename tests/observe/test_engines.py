"""Engine releases as they ship (tests/observe/engine_texts.py): every key read under the
name the release exports, finished requests split into served, aborted and errored, and a
learning family the release does not export named in ``missing`` — through the direct
scrape (a real HTTP server on loopback) and through the PromQL path."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import pytest

from controller.clock import VirtualClock
from controller.core.catalog import SGLANG, VLLM, RequestOutcome, detect_engine
from controller.core.exposition import LabelKey, parse_exposition
from controller.core.window import FailureKind, Family, Window, WorkerStats
from controller.observe.prometheus import PrometheusSource, build_queries
from controller.observe.scrape import ScrapeSource
from controller.observe.source import Target
from controller.observe.window_builder import diff_snapshots, worker_stats
from tests.observe import engine_texts as t
from tests.observe.textserver import TextServer

INTERVAL = 30.0
K = Family.KV_TRANSFER


def _stats(text: str, role: str = "decode") -> WorkerStats:
    prev = parse_exposition(t.baseline(text), target="w", taken_at=0.0)
    cur = parse_exposition(text, target="w", taken_at=INTERVAL)
    stats, notes = worker_stats(diff_snapshots(prev, cur), role, INTERVAL)  # type: ignore[arg-type]
    assert stats is not None and notes == []
    return stats


def _mean(s: Any) -> float | None:
    return None if s is None else s.mean


# text, served, aborted, errored, ITL mean, TPOT mean, KV usage, KV transfer mean, missing
CASES = {
    "vllm-0.9.2": (t.VLLM_0_9, 8, 2, None, 0.02, None, 0.25, None, (K,)),
    "vllm-0.9.2-v0": (t.VLLM_0_9_V0, 4, 1, None, 0.03, None, 0.25, None, (K,)),
    "vllm-0.10.2": (t.VLLM_0_10, 5, 0, None, 0.04, None, 0.5, None, (K,)),
    "vllm-0.11.2": (t.VLLM_0_11, 4, 1, None, 0.03, 0.035, 0.75, 0.03, ()),
    "vllm-0.34.0": (t.VLLM_0_34, 14, 2, 4, 0.03, 0.035, 0.5, 0.05, ()),
    "sglang-0.4.9": (t.SGLANG_0_4_9, 7, 2, 1, 0.01, None, 0.5, None, (K,)),
    "sglang-0.5.3": (t.SGLANG_0_5_3, 7, 2, 1, 0.01, None, 0.5, 0.012, ()),
    "sglang-0.5.23": (t.SGLANG_0_5_23, 6, 2, 2, 0.01, None, 0.5, 0.02, ()),
}


def _check(stats: WorkerStats, case: tuple[Any, ...]) -> None:
    _, served, aborted, errored, itl, tpot, kv, xfer, missing = case
    assert stats.request_rate == pytest.approx(served / INTERVAL)
    assert stats.aborted == aborted
    assert stats.errored == errored
    assert _mean(stats.inter_token_s) == pytest.approx(itl)
    assert _mean(stats.tpot_s) == (None if tpot is None else pytest.approx(tpot))
    assert stats.kv_cache_usage == pytest.approx(kv)
    assert _mean(stats.kv_transfer_s) == (None if xfer is None else pytest.approx(xfer))
    assert stats.missing == missing
    assert stats.ttft_s is not None and stats.ttft_s.count == 2


@pytest.mark.parametrize("release", sorted(CASES))
def test_each_release_is_read_under_its_own_names(release: str) -> None:
    case = CASES[release]
    assert detect_engine(parse_exposition(case[0], target="w", taken_at=0).families) is (
        SGLANG if release.startswith("sglang") else VLLM)
    _check(_stats(case[0]), case)


def test_vllm_finish_reasons_error_is_not_served() -> None:
    """0.34's FinishReason: error (a retryable internal failure, answered 500) and abort are
    apart; stop, length and repetition are served."""
    rc = VLLM.counters["requests"]
    outcome = {r: rc.outcome((("finished_reason", r),))
               for r in ("stop", "length", "repetition", "abort", "error")}
    assert outcome == {"stop": RequestOutcome.SERVED, "length": RequestOutcome.SERVED,
                       "repetition": RequestOutcome.SERVED, "abort": RequestOutcome.ABORTED,
                       "error": RequestOutcome.ERRORED}
    stats = _stats(t.VLLM_0_34)
    assert stats.request_rate == pytest.approx((10 + 3 + 1) / INTERVAL)  # not 20/30


def test_old_prompt_tokens_and_the_legacy_itl_name_are_read() -> None:
    stats = _stats(t.VLLM_0_9)
    assert stats.prompt_tokens_by_source == {"total": 900.0}
    assert stats.inter_token_s is not None and stats.inter_token_s.count == 4
    assert _stats(t.VLLM_0_34).prompt_tokens_by_source == {
        "local_compute": 600.0, "local_cache_hit": 100.0, "external_kv_transfer": 200.0}


def test_a_recognised_engine_without_a_learning_family_says_so() -> None:
    lines = [line for line in t.VLLM_0_34.splitlines(keepends=True)
             if "time_to_first_token" not in line and "request_success" not in line]
    stats = _stats("".join(lines))
    assert stats.missing == (Family.TTFT, Family.SUCCESS)
    assert stats.ttft_s is None and stats.request_rate is None and stats.aborted is None


def test_a_family_with_no_observation_is_not_missing() -> None:
    stats = _stats(t.baseline(t.VLLM_0_34))  # every family exported, nothing happened
    assert stats.missing == ()
    assert stats.ttft_s is None and stats.request_rate == 0.0 and stats.errored == 0.0


def test_sglang_gauge_at_zero_is_no_kv_transfer_value() -> None:
    zero = re.sub(r"(sglang:kv_transfer_latency_ms\{[^}]*\}) 12\.0", r"\1 0.0", t.SGLANG_0_5_3)
    assert zero != t.SGLANG_0_5_3
    stats = _stats(zero)
    assert stats.kv_transfer_s is None and stats.missing == ()


def test_missing_and_outcomes_survive_both_stored_forms() -> None:
    stats = _stats(t.VLLM_0_9)
    w = Window.build(start=0.0, end=INTERVAL, interval_s=INTERVAL, workers=[stats])
    for compact in (False, True):
        back = Window.from_dict(w.to_dict(compact=compact))
        assert back == w
        assert back.workers[0].missing == (Family.KV_TRANSFER,)
        assert back.workers[0].aborted == 2.0


# --- the direct scrape ---------------------------------------------------------------------

@pytest.mark.integration
@pytest.mark.parametrize("release", sorted(CASES))
async def test_scrape_path(release: str) -> None:
    case = CASES[release]
    server = TextServer(t.baseline(case[0]))
    clock = VirtualClock(1_800_000_000.0)
    source = ScrapeSource([Target(server.address, "decode")], timeout_s=2.0, clock=clock)
    try:
        await source.window(clock.now() - INTERVAL, clock.now())
        server.default = case[0]
        clock.advance(INTERVAL)
        window = await source.window(clock.now() - INTERVAL, clock.now())
    finally:
        await source.aclose()
        server.close()
    assert window.failures == ()
    _check(window.workers[0], case)


# --- the PromQL path -----------------------------------------------------------------------

_TERM = re.compile(r'(sum|avg|max) by \(([^)]*)\) \(max without \([^)]*\) \((increase\()?'
                   r'([^{\[ )]+)(\{[^}]*\})?.*?"pd_series", "([^"]+)"')


class _AnsweringClient:
    """Answers the source's queries as Prometheus would for one target whose samples went
    from 0 to ``samples`` in the window (increase mode): each union term is evaluated on the
    samples (its selector's matchers, then aggregated by its labels)."""

    timeout_s = 10.0

    def __init__(self, instance: str, samples: Mapping[str, Mapping[LabelKey, float]]) -> None:
        self.instance = instance
        self.samples = samples
        self.queries: list[str] = []

    async def query(self, promql: str, at: float) -> list[dict[str, Any]]:
        self.queries.append(promql)
        if "(resets(" in promql:
            return []  # no series fell: every target is read from increase()
        if promql == "up":
            return [{"metric": {"instance": self.instance, "job": "pd"}, "value": [at, "1"]}]
        if promql == "timestamp(up)":
            return [{"metric": {"instance": self.instance, "job": "pd"},
                     "value": [at, str(at - 0.5)]}]
        rows: list[dict[str, Any]] = []
        for term in promql.split(" or "):
            m = _TERM.search(term)
            assert m is not None, term
            how, by, _, name, matchers, tag = m.groups()
            want = dict(re.findall(r'(\w+)="([^"]*)"', matchers or ""))
            groups: dict[tuple[tuple[str, str], ...], list[float]] = {}
            for labels, value in self.samples.get(name, {}).items():
                d = dict(labels)
                if all(d.get(k, "") == v for k, v in want.items()):
                    key = tuple((k, d[k]) for k in by.split(", ")[1:] if k in d)
                    groups.setdefault(key, []).append(value)
            for key, values in groups.items():
                v = max(values) if how == "max" else \
                    sum(values) / (len(values) if how == "avg" else 1)
                rows.append({"metric": {"instance": self.instance, "pd_series": tag, **dict(key)},
                             "value": [at, repr(v)]})
        return rows

    async def targets(self) -> list[dict[str, Any]]:
        return []

    async def aclose(self) -> None:
        return None


@pytest.mark.parametrize("release", sorted(CASES))
async def test_promql_path(release: str) -> None:
    case = CASES[release]
    snap = parse_exposition(case[0], target="w:1", taken_at=INTERVAL)
    client = _AnsweringClient("w:1", snap.samples)
    source = PrometheusSource(client, [Target("w:1", "decode")], mode="increase")  # type: ignore[arg-type]
    window = await source.window(0.0, INTERVAL)
    assert window.failures == ()
    _check(window.workers[0], case)


def test_promql_keeps_the_finish_reason_and_asks_for_the_failure_counters() -> None:
    counters = next(q.promql for q in build_queries(30_000) if q.name == "counters")
    assert re.search(r'sum by \(instance, finished_reason\) \(max without \([^)]*\) '
                     r'\(increase\(vllm:request_success_total\[', counters)
    assert "finished_reason!=" not in counters  # no reason is dropped before the split
    for name in ("sglang:num_aborted_requests_total", "sglang:num_transfer_failed_reqs_total",
                 "sglang:num_bootstrap_failed_reqs_total"):
        assert f'"pd_series", "{name}"' in counters
    gauges = next(q.promql for q in build_queries(30_000) if q.name == "gauges")
    assert '"pd_series", "sglang:kv_transfer_latency_ms"' in gauges  # 0.5.3's gauge
    assert '"pd_series", "vllm:gpu_cache_usage_perc"' in gauges


# --- pdctl observe -------------------------------------------------------------------------

def test_observe_table_shows_outcomes_and_missing_families() -> None:
    from controller.cli.observe_cmd import render_window

    w = Window.build(start=0.0, end=INTERVAL, interval_s=INTERVAL,
                     workers=[_stats(t.VLLM_0_34), _stats(t.VLLM_0_9)])
    lines = render_window(w).splitlines()
    header = lines[2].split()
    row = dict(zip(header, lines[3].split(), strict=False))
    assert (row["req/s"], row["aborted"], row["errored"]) == ("0.47", "2", "4")
    old = dict(zip(header, lines[4].split(), strict=False))
    assert (old["aborted"], old["errored"]) == ("2", "-")  # 0.9 has no "error" reason
    assert "w: missing_family: kv_transfer" in render_window(w)


@pytest.mark.integration
def test_pdctl_observe_once_names_the_missing_family(tmp_path: Any) -> None:
    import json

    from typer.testing import CliRunner

    from controller.cli import app

    server = TextServer(t.VLLM_0_9)
    try:
        cfg = tmp_path / "pd.toml"
        cfg.write_text(f'[decode_pool]\nnodes = ["{server.address}"]\n')
        runner = CliRunner()
        table = runner.invoke(app, ["observe", "--once", "--config", str(cfg),
                                    "--interval", "0.1"])
        assert table.exit_code == 0, table.output
        assert f"{server.address}: missing_family: kv_transfer" in table.stdout
        as_json = runner.invoke(app, ["observe", "--once", "--json", "--config", str(cfg),
                                      "--interval", "0.1"])
        worker = json.loads(as_json.stdout)["workers"][0]
        assert worker["missing"] == ["kv_transfer"]
        assert (worker["aborted"], worker["errored"]) == (0.0, None)
    finally:
        server.close()


# --- the PromQL path against a real Prometheus ---------------------------------------------

@pytest.mark.integration
async def test_promql_path_through_a_real_prometheus() -> None:
    """One Prometheus scraping a worker of every release (text format, names with colons):
    the edges window reads each exactly as the scrape does; the increase window (which
    extrapolates counts) names the same missing families and outcomes where it has them."""
    import asyncio
    import time

    from controller.observe.prometheus import PrometheusClient
    from tests.conftest import require
    from tests.observe.promserver import HOW_TO_INSTALL, PROMETHEUS, PromServer

    require("prometheus", PROMETHEUS is not None, HOW_TO_INSTALL)
    releases = sorted(CASES)
    servers = [TextServer(t.baseline(CASES[r][0])) for r in releases]
    targets = [Target(s.address, "decode") for s in servers]
    prom = PromServer(targets)
    client = PrometheusClient(prom.url, timeout_s=5.0, retries=1)
    try:
        prom.wait_scraped_after(time.time())
        start = time.time()
        for server, release in zip(servers, releases, strict=True):
            server.default = CASES[release][0]
        await asyncio.sleep(3.5)  # increase() needs two samples of a series in the window
        prom.wait_scraped_after(time.time())
        end = time.time() + 0.1
        edges = await PrometheusSource(client, targets, mode="edges").window(start, end)
        increase = await PrometheusSource(client, targets, mode="increase").window(start, end)
    finally:
        await client.aclose()
        prom.stop()
        for s in servers:
            s.close()
    assert edges.failures == () and increase.failures == ()
    for i, release in enumerate(releases):
        case = CASES[release]
        exact = next(w for w in edges.workers if w.worker == targets[i].name)
        _check(replace_rate(exact, end - start), case)
        rough = next(w for w in increase.workers if w.worker == targets[i].name)
        assert rough.missing == exact.missing == case[-1], release
        assert (rough.errored is None) == (exact.errored is None), release
        assert rough.kv_cache_usage == exact.kv_cache_usage, release


def replace_rate(stats: WorkerStats, interval: float) -> WorkerStats:
    """``stats`` with its request rate over :data:`INTERVAL` (the cases' unit)."""
    from dataclasses import replace

    rate = None if stats.request_rate is None else stats.request_rate * interval / INTERVAL
    return replace(stats, request_rate=rate)


async def test_promql_increase_window_without_two_samples_is_no_baseline() -> None:
    """Too short a window for increase(): no counter rows. Said as a first window, not as
    every learning family missing."""
    snap = parse_exposition(t.VLLM_0_34, target="w:1", taken_at=INTERVAL)
    gauges_only = {k: v for k, v in snap.samples.items()
                   if not k.endswith(("_total", "_bucket", "_sum", "_count"))}
    source = PrometheusSource(_AnsweringClient("w:1", gauges_only),  # type: ignore[arg-type]
                              [Target("w:1", "decode")], mode="increase")
    window = await source.window(0.0, INTERVAL)
    (stats,) = window.workers
    assert stats.missing == () and stats.request_rate is None and stats.running == 3
    assert [(f.kind, "two samples" in f.message) for f in window.failures] == [
        (FailureKind.NO_BASELINE, True)]
