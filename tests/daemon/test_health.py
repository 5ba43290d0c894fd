"""The probe endpoints over real loopback HTTP."""

from __future__ import annotations

import httpx
from prometheus_client import CollectorRegistry

from controller.clock import VirtualClock
from controller.health import Health, HealthServer
from controller.loop.metrics import ControllerMetrics


async def test_healthz_follows_the_loop_readyz_the_daemon_metrics_the_registry() -> None:
    clock = VirtualClock(1_800_000_000.0)
    last: list[float | None] = [None]
    ended: list[float | None] = [None]
    health = Health(clock, stalled_after_s=90.0, last_cycle=lambda: last[0],
                    last_ended=lambda: ended[0])
    registry = CollectorRegistry()
    metrics = ControllerMetrics(registry)
    server = HealthServer(health, registry, "127.0.0.1:0")
    await server.start()
    base = f"http://{server.address}"
    try:
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            r = await client.get(f"{base}/healthz")
            assert r.status_code == 503 and "no cycle" in r.json()["status"]
            assert (await client.get(f"{base}/readyz")).status_code == 503
            health.ready = True
            assert (await client.get(f"{base}/readyz")).status_code == 200

            r = await client.get(f"{base}/livez")  # within stalled_after_s of the start
            assert r.status_code == 200 and r.json()["status"].startswith("starting")
            health.started_at -= 91  # started 91 s ago and still no cycle has ended
            r = await client.get(f"{base}/livez")
            assert r.status_code == 503 and r.json()["status"] == "no cycle ended yet"

            last[0] = ended[0] = clock.now()
            metrics.observe_cycle("ok", 0.1, clock.now())
            assert (await client.get(f"{base}/healthz")).status_code == 200
            clock.advance(60)
            assert (await client.get(f"{base}/livez")).status_code == 200
            clock.advance(31)  # 91 s without a completed cycle; one skipped (Prometheus down)
            ended[0] = clock.now()
            r = await client.get(f"{base}/healthz")
            assert r.status_code == 503 and "stalled: no cycle completed" in r.json()["status"]
            r = await client.get(f"{base}/livez")  # the loop turns: no restart for an outage
            assert r.status_code == 200 and r.json()["last_cycle_age_s"] == 91.0
            clock.advance(91)  # wedged: no cycle ended at all
            r = await client.get(f"{base}/livez")
            assert r.status_code == 503 and "stalled: no cycle ended" in r.json()["status"]

            r = await client.get(f"{base}/metrics")
            assert r.status_code == 200
            assert 'pdctl_cycles_total{result="ok"} 1.0' in r.text
            assert (await client.get(f"{base}/nope")).status_code == 404
            assert (await client.post(f"{base}/healthz")).status_code == 405
    finally:
        await server.stop()
