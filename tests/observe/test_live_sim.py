"""A live simulated cluster (``pdctl sim serve``), observed by direct scrape and by a real
Prometheus scraping it: the same interval gives the same counts and means."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from controller.clock import WallClock
from controller.core.catalog import HISTOGRAM_KEYS
from controller.core.window import Window
from controller.observe.prometheus import PrometheusClient, PrometheusSource
from controller.observe.scrape import ScrapeSource
from controller.observe.source import Target
from tests.conftest import require
from tests.observe.promserver import HOW_TO_INSTALL, PROMETHEUS, PromServer
from tests.support.processes import REPO, hostport, sim_serve

SCENARIO = REPO / "scenarios" / "ppd-2p2d.toml"
CLOCK = WallClock()


@pytest.fixture(params=["vllm", "sglang"])
def live_sim(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The cluster serving vLLM's exposition, or SGLang's with every scheduler series on two
    TP ranks (``--enable-metrics-for-all-schedulers``)."""
    scenario = SCENARIO
    if request.param == "sglang":
        scenario = tmp_path / "sglang.toml"
        scenario.write_text(SCENARIO.read_text().replace(
            "[cluster]\n", '[cluster]\nmetrics_engine = "sglang"\nsglang_tp_ranks = 2\n', 1))
    with sim_serve(scenario, "--no-traffic") as (addresses, _):
        yield {**addresses, "engine": request.param}


def _targets(addresses: dict[str, Any]) -> list[Target]:
    ts = [Target(hostport(w["metrics"]), w["role"]) for w in addresses["workers"]]
    ts += [Target(hostport(r["metrics"]), "router") for r in addresses["routers"]]
    return ts


def _counts_and_means(w: Window) -> dict[tuple[str, str], tuple[float, float]]:
    out = {}
    for s in w.workers:
        for key in HISTOGRAM_KEYS:
            summary = getattr(s, key)
            if summary is not None and summary.count:
                assert summary.mean is not None
                out[(s.worker, key)] = (summary.count, summary.mean)
    return out


@pytest.mark.integration
@pytest.mark.slow
async def test_scrape_and_prometheus_agree_on_a_live_simulated_cluster(
    live_sim: dict[str, Any],
) -> None:
    require("prometheus", PROMETHEUS is not None, HOW_TO_INSTALL)
    targets = _targets(live_sim)
    prom = PromServer(targets)
    scrape = ScrapeSource(targets, timeout_s=3.0, clock=CLOCK)
    client = PrometheusClient(prom.url, timeout_s=5.0, retries=1)
    source = PrometheusSource(client, targets, mode="edges")  # the sim serves text 0.0.4
    try:
        prom.wait_scraped_after(CLOCK.now(), timeout_s=30)
        await scrape.window(CLOCK.now() - 1, CLOCK.now())
        prom.wait_scraped_after(CLOCK.now())
        start = CLOCK.now()
        prom.wait_scraped_after(CLOCK.now())
        api = live_sim["routers"][0]["openai"]
        async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
            for turn in range(12):
                r = await http.post(f"{api}/chat/completions", headers={
                    "X-Session-Id": f"s{turn % 3}"}, json={
                    "model": live_sim["model"], "max_tokens": 8,
                    "messages": [{"role": "user", "content": "hello " * (50 + 40 * turn)}]})
                assert r.status_code == 200, r.text
        prom.wait_scraped_after(CLOCK.now() + 1.0)  # requests done, counters settled
        end = CLOCK.now()
        direct = await scrape.window(start, end)
        via_prom = await source.window(start, end)
    finally:
        await scrape.aclose()
        await source.aclose()
        prom.stop()
    assert direct.failures == () and via_prom.failures == ()
    assert {s.engine for s in direct.workers} == {live_sim["engine"]}
    # A decode worker queues each request it finishes once, however many ranks report the
    # queue (SGLang's scheduler series) and the finished count (its tokenizer's, unranked).
    decode = [s for s in direct.workers if s.role == "decode"]
    finished = sum((s.request_rate or 0.0) * direct.interval_s for s in decode)
    queued = sum(s.queue_s.count for s in decode if s.queue_s is not None)
    assert round(finished) == 12 and queued == 12, (finished, queued)
    a, b = _counts_and_means(direct), _counts_and_means(via_prom)
    assert a, "the requests left no trace in the workers' histograms"
    assert a.keys() == b.keys()
    for key, (count, mean) in a.items():
        assert b[key][0] == count, key
        assert abs(b[key][1] - mean) <= 0.02 * abs(mean), key
    assert sum(o.requests for o in direct.outcomes) == 12
    assert sorted((o.router, o.route, o.ctx_bin, o.io_bin, o.requests, o.met)
                  for o in direct.outcomes) == sorted(
        (o.router, o.route, o.ctx_bin, o.io_bin, o.requests, o.met) for o in via_prom.outcomes)
