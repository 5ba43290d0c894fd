"""``pdctl demo --router real``'s cluster: simulated workers, a real ``pdctl router serve``
subprocess starting on the demo's baseline, traffic through it; all of it gone after stop."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from controller.demo import SCENARIO
from controller.demo_real import RealRouterCluster
from controller.policy import Policy, Route
from controller.sim.scenario import load_scenario
from tests.support.router import metric

pytestmark = pytest.mark.integration


async def test_real_router_cluster_routes_the_scenario_traffic_and_stops(tmp_path: Path) -> None:
    scenario = load_scenario(SCENARIO)
    # every later turn decode-local: a router without it would send them all to P
    baseline = Policy.uniform(1, Route.DECODE_LOCAL, exploration=0.0)
    cluster = RealRouterCluster(scenario, baseline, tmp_path)
    addresses = await cluster.start()
    try:
        (router,) = addresses["routers"]
        async with httpx.AsyncClient(timeout=10, trust_env=False) as http:
            local = 0.0
            for _ in range(100):  # bounded: 20 s
                await asyncio.sleep(0.2)
                text = (await http.get(router["metrics"])).text
                local = metric(text, "pdrouter_routes_executed_total", route="DECODE_LOCAL")
                if local >= 5:
                    break
        # the baseline came from [grpc] initial_policy: later turns went decode-local
        assert local >= 5
        assert metric(text, "pdrouter_routes_executed_total", route="PREFILL_NODE") >= 5
        proc = cluster.router
        assert proc is not None and proc.returncode is None
    finally:
        await cluster.stop()
    assert proc.returncode is not None  # the subprocess is gone
    assert cluster.traffic is not None and cluster.traffic.done()
    async with httpx.AsyncClient(timeout=2, trust_env=False) as http:
        with pytest.raises(httpx.HTTPError):
            await http.get(router["metrics"])
