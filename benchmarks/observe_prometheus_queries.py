"""PromQL queries per window do not grow with the number of workers.

Run from the repository root: ``.venv/bin/python benchmarks/observe_prometheus_queries.py``
(needs Debian's ``prometheus`` binary). For 2, 8 and 32 workers (plus 2 routers) it serves
vLLM-shaped targets on loopback, starts a real Prometheus scraping them every second, builds
one 7 s window per mode (one traffic step inside it) and prints the HTTP requests the source
sent (counted by our client and, independently, by Prometheus' own
``prometheus_http_requests_total``), the window latency and what the window held. Router
cells are fewer in ``increase`` mode: label sets first used inside the window have no earlier
sample for ``increase()`` to start from.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Literal

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from observe_scrape import serve  # noqa: E402

from controller.observe.prometheus import PrometheusClient, PrometheusSource  # noqa: E402
from controller.observe.source import Target  # noqa: E402
from tests.observe.promserver import PROMETHEUS, PromServer  # noqa: E402


async def one(workers: int, routers: int) -> list[str]:
    parent, child = mp.Pipe()
    proc = mp.get_context("fork").Process(target=serve, args=(workers, routers, child),
                                          daemon=True)
    proc.start()
    ports = parent.recv()
    roles = ["prefill" if i % 2 == 0 else "decode" for i in range(workers)] + [
        "router"] * routers
    targets = [Target(f"127.0.0.1:{p}", r) for p, r in zip(ports, roles, strict=True)]  # type: ignore[arg-type]
    prom = PromServer(targets)
    rows = []
    try:
        prom.wait_scraped_after(time.time(), timeout_s=30)
        prom.wait_scraped_after(time.time() + 2)  # samples before the traffic, in the window
        parent.send("traffic")
        parent.recv()
        prom.wait_scraped_after(time.time() + 3, timeout_s=30)
        client = PrometheusClient(prom.url, timeout_s=10, retries=1)
        modes: tuple[Literal["edges", "increase"], ...] = ("edges", "increase")
        for mode in modes:
            source = PrometheusSource(client, targets, mode=mode)
            end = time.time()
            served_before = prom.http_requests().get("/api/v1/query", 0.0)
            sent_before = client.requests_sent
            t0 = time.perf_counter()
            w = await source.window(end - 7.0, end)
            ms = (time.perf_counter() - t0) * 1000
            served = prom.http_requests().get("/api/v1/query", 0.0) - served_before
            sent = client.requests_sent - sent_before
            assert len(w.workers) == workers, w.failures[:3]
            rows.append(f"| {workers} | {routers} | {mode} | {sent} | {served:g} | {ms:.0f} | "
                        f"{len(w.answered)} | {len(w.outcomes)} |")
        await client.aclose()
    finally:
        prom.stop()
        parent.send("stop")
        proc.join(5)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--routers", type=int, default=2)
    a = ap.parse_args()
    if PROMETHEUS is None:
        sys.exit("prometheus binary not found: apt-get install -y --no-install-recommends "
                 "prometheus")
    print("| workers | routers | mode | queries sent | /api/v1/query served (Prometheus' "
          "count) | window ms | targets answered | outcome rows |")
    print("|---|---|---|---|---|---|---|---|")
    for n in a.workers:
        for row in asyncio.run(one(n, a.routers)):
            print(row, flush=True)


if __name__ == "__main__":
    main()
