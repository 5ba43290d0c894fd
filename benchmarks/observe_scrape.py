"""One ScrapeSource window over 64 workers + 8 routers on loopback (target: within 500 ms).

Run from the repository root: ``.venv/bin/python benchmarks/observe_scrape.py``.

The targets are served by a child process on 127.0.0.1 (one asyncio loop, keep-alive): 32 prefill
and 32 decode workers with the simulator's complete vLLM 0.33 families
(``controller.sim.vllm_metrics``, NIXL families on both roles) and 8 routers with the router
agent's ``pdrouter_*`` metrics. Between windows the child adds traffic and re-renders each
target's exposition (a worker's own cost, so outside the timed window). Prints the latency
of each window (72 GETs + parse + validate + diff + assemble), the bytes read, and the same
for InProcessSource (which also renders the registries, inside its window).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from controller.clock import WallClock  # noqa: E402
from controller.observe.source import Target  # noqa: E402

ROUTES = ("PREFILL_NODE", "DECODE_LOCAL")


def build_registries(workers: int, routers: int, seed: int = 1) -> tuple[list[Any], list[Any]]:
    from controller.rollout.agent_metrics import RouterMetrics
    from controller.sim.vllm_metrics import WorkerMetrics

    ws = [
        WorkerMetrics(model_name="llama-3.1-8b", kv_role="kv_producer" if i % 2 == 0
                      else "kv_consumer", num_gpu_blocks=8192, block_size=16,
                      max_model_len=131072)
        for i in range(workers)
    ]
    from prometheus_client import CollectorRegistry

    rs = [RouterMetrics(CollectorRegistry()) for _ in range(routers)]
    add_traffic(ws, rs, random.Random(seed))
    return ws, rs


def add_traffic(ws: list[Any], rs: list[Any], rng: random.Random) -> None:
    for w in ws:
        for _ in range(20):
            w.h_ttft.observe(rng.uniform(0.05, 2.0))
            w.h_queue.observe(rng.uniform(0.0, 1.0))
            w.h_prefill.observe(rng.uniform(0.05, 1.0))
            w.h_itl.observe(rng.uniform(0.005, 0.05), n=50)
            w.h_tpot.observe(rng.uniform(0.005, 0.05))
            w.h_xfer.observe(rng.uniform(0.005, 0.3))
            w.h_bytes.observe(float(rng.randint(2**16, 2**28)))
            w.success["stop"] += 1
            w.generation_tokens += 50
            w.prompt_by_source["local_compute"] += rng.randint(100, 4000)
        w.running = rng.randint(0, 32)
        w.kv_usage = rng.uniform(0, 0.9)
    for r in rs:
        for _ in range(200):
            ctx = rng.choice(["256", "1024", "4096", "16384", "+Inf"])
            io = rng.choice(["0.25", "1", "4", "+Inf"])
            route = rng.choice(ROUTES)
            r.count_request(route, ctx, io, rng.choice(["met", "ttft_miss", "tpot_miss"]))
            r.observe_ttft(route, ctx, rng.uniform(0.05, 3))
            r.observe_tpot(route, ctx, rng.uniform(0.01, 0.2))
            r.context_tokens.observe(rng.uniform(0, 40000))
            r.io_ratio.observe(rng.uniform(0, 10))
        r.qps.set(rng.uniform(1, 50))


def serve(workers: int, routers: int, conn: Any) -> None:
    """Serve each target's exposition, re-rendered after every traffic step.

    Rendering happens once per step, outside the timed window: a real worker renders its
    own /metrics in its own process, and 72 of them cannot share one child's GIL. One
    asyncio loop answers all 72 ports (keep-alive HTTP/1.1), so the stand-in servers cost
    as little CPU as possible on a machine the scraper shares with them.
    """
    import threading

    from prometheus_client import generate_latest

    ws, rs = build_registries(workers, routers)
    registries = [w.registry for w in ws] + [r.registry for r in rs]
    bodies = [generate_latest(reg) for reg in registries]
    ports: list[int] = []
    ready = threading.Event()

    async def handle(index: int, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if not head:
                    break
                body = bodies[index]
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; "
                             b"charset=utf-8\r\nContent-Length: " + str(len(body)).encode()
                             + b"\r\n\r\n" + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        for i in range(len(registries)):
            server = await asyncio.start_server(functools.partial(handle, i), "127.0.0.1", 0)
            ports.append(server.sockets[0].getsockname()[1])
        ready.set()
        await asyncio.Event().wait()

    threading.Thread(target=lambda: asyncio.run(main()), daemon=True).start()
    ready.wait(30)
    conn.send(ports)
    rng = random.Random(2)
    while True:
        msg = conn.recv()
        if msg == "stop":
            return
        add_traffic(ws, rs, rng)
        bodies[:] = [generate_latest(reg) for reg in registries]
        conn.send("ok")


async def run(workers: int, routers: int, windows: int, concurrency: int) -> None:
    from controller.observe.inprocess import InProcessSource
    from controller.observe.scrape import ScrapeSource

    parent, child = mp.Pipe()
    proc = mp.get_context("fork").Process(target=serve, args=(workers, routers, child),
                                          daemon=True)
    proc.start()
    ports = parent.recv()
    roles = ["prefill" if i % 2 == 0 else "decode" for i in range(workers)] + [
        "router"] * routers
    targets = [Target(f"127.0.0.1:{p}", r) for p, r in zip(ports, roles, strict=True)]  # type: ignore[arg-type]
    clock = WallClock()
    source = ScrapeSource(targets, timeout_s=5.0, concurrency=concurrency, clock=clock)
    times = []
    cpu = []
    try:
        await source.window(clock.now() - 30, clock.now())  # baseline (connections open)
        for _ in range(windows):
            parent.send("traffic")
            parent.recv()
            c0 = time.process_time()
            t0 = clock.perf_counter_ns()
            w = await source.window(clock.now() - 30, clock.now())
            times.append((clock.perf_counter_ns() - t0) / 1e6)
            cpu.append((time.process_time() - c0) * 1000)
            assert len(w.answered) == len(targets), w.failures[:3]
            assert not w.failures, w.failures[:3]
        import httpx

        async with httpx.AsyncClient() as c:
            body = (await c.get(targets[1].metrics_url)).content
            rbody = (await c.get(targets[-1].metrics_url)).content
    finally:
        await source.aclose()
        parent.send("stop")
        proc.join(5)
    print(f"ScrapeSource: {workers} workers + {routers} routers on loopback, "
          f"concurrency {concurrency}, {windows} windows")
    print(f"  window latency ms: min {min(times):.1f}  median {statistics.median(times):.1f}  "
          f"max {max(times):.1f}  (target: <= 500)")
    print(f"  CPU of this process per window ms: median {statistics.median(cpu):.1f} "
          f"(the rest of the wall time is waiting on the loopback servers and other load); "
          f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print(f"  one decode worker's /metrics: {len(body)} bytes, "
          f"{len(body.splitlines())} lines; one router: {len(rbody)} bytes")
    print(f"  workers in the last window: {len(w.workers)}, route-outcome rows: "
          f"{len(w.outcomes)}")

    ws, rs = build_registries(workers, routers)
    regs = {t.name: (ws + rs)[i].registry for i, t in enumerate(targets)}
    inproc = InProcessSource(targets, regs, clock=clock)
    await inproc.window(clock.now() - 30, clock.now())
    itimes = []
    rng = random.Random(3)
    for _ in range(windows):
        add_traffic(ws, rs, rng)
        t0 = clock.perf_counter_ns()
        await inproc.window(clock.now() - 30, clock.now())
        itimes.append((clock.perf_counter_ns() - t0) / 1e6)
    print(f"InProcessSource over the same shape: median {statistics.median(itimes):.1f} ms "
          f"(render + parse + diff, no HTTP)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--routers", type=int, default=8)
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=32)
    a = ap.parse_args()
    asyncio.run(run(a.workers, a.routers, a.windows, a.concurrency))


if __name__ == "__main__":
    main()
