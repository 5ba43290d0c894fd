"""InProcessSource over a virtual-time simulated cluster: it reads what a scrape would see."""

from __future__ import annotations

import asyncio

from controller.core.window import FailureKind
from controller.observe.inprocess import InProcessSource, sim_cluster_provider
from controller.policy import Route
from controller.sim.cluster import SimCluster
from tests.sim._synthetic import drive


def test_windows_follow_the_simulated_cluster_in_virtual_time() -> None:
    sources: list[InProcessSource] = []
    baselines = []

    def attach(cluster: SimCluster) -> None:
        source = InProcessSource.following(sim_cluster_provider(cluster), clock=cluster.clock)
        sources.append(source)
        baselines.append(asyncio.run(source.window(-30.0, 0.0)))

    cluster, done, _ = drive(route=Route.DECODE_LOCAL, sessions=12, turns=2,
                             before_run=attach)
    (source,) = sources
    now = cluster.clock.now()
    assert now > 0  # virtual time moved; no wall time was read
    w = asyncio.run(source.window(0.0, now))
    finished = [r for r in done if not r.rejected]
    assert finished
    assert w.failures == ()
    decode = [s for s in w.workers if s.role == "decode"]
    assert decode and all(s.engine == "vllm" for s in w.workers)
    served = sum((s.request_rate or 0.0) * w.interval_s for s in decode)
    assert round(served) == len(finished)
    ttft = sum(s.ttft_s.count for s in decode if s.ttft_s is not None and s.ttft_s.count)
    assert ttft == len(finished)

    lost = cluster.remove_worker("decode")
    assert lost is not None
    later = asyncio.run(source.window(now, now + 30.0))
    assert [(f.target, f.kind) for f in later.failures] == [(lost.name, FailureKind.UNREACHABLE)]
    assert lost.name not in {s.worker for s in later.workers}
    assert baselines[0].answered  # the first window had every target, gauges only
