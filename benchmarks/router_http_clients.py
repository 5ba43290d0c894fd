"""Why the router's upstream client is aiohttp: CPU per relayed stream, aiohttp vs httpx.

Run from the repository root: ``.venv/bin/python benchmarks/router_http_clients.py
[--streams 1000] [--concurrency 16]``. One fake engine (``tests/router/fake_vllm.py``, no token
delay) in its own process; this process reads ``--streams`` streamed chat completions of 128
tokens from it with each client (the same bytes-level loop the router runs: read whatever
arrived, look for the end) and prints the CPU seconds it spent per stream. The engine's CPU
is not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402
import httpx  # noqa: E402

from tests.support.processes import free_port  # noqa: E402

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 8000}],
                   "max_tokens": 128, "stream": True}).encode()


async def with_aiohttp(url: str, n: int, conc: int) -> int:
    done = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def worker() -> None:
            nonlocal done
            while done < n:
                done += 1
                async with s.post(url, data=BODY,
                                  headers={"Content-Type": "application/json"}) as r:
                    async for chunk in r.content.iter_any():
                        if b"[DONE]" in chunk:
                            pass
        await asyncio.gather(*(worker() for _ in range(conc)))
    return done


async def with_httpx(url: str, n: int, conc: int) -> int:
    done = 0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=conc)
    async with httpx.AsyncClient(limits=limits, timeout=60, trust_env=False) as c:
        async def worker() -> None:
            nonlocal done
            while done < n:
                done += 1
                async with c.stream("POST", url, content=BODY,
                                    headers={"Content-Type": "application/json"}) as r:
                    async for chunk in r.aiter_raw():
                        if b"[DONE]" in chunk:
                            pass
        await asyncio.gather(*(worker() for _ in range(conc)))
    return done


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16)
    a = ap.parse_args()
    port = free_port()
    fake = subprocess.Popen([sys.executable, str(REPO / "tests/router/fake_vllm.py"), "--port",  # noqa: S603
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                httpx.post(url + "/_fake/behaviour", json={"log": False}, timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        for name, run in (("aiohttp", with_aiohttp), ("httpx", with_httpx),
                          ("aiohttp", with_aiohttp), ("httpx", with_httpx)):
            asyncio.run(run(url + "/v1/chat/completions", 50, a.concurrency))  # warm-up
            c0, t0 = time.process_time(), time.perf_counter()
            n = asyncio.run(run(url + "/v1/chat/completions", a.streams, a.concurrency))
            cpu, wall = time.process_time() - c0, time.perf_counter() - t0
            print(json.dumps({"client": name, "streams": n, "cpu_ms_per_stream":
                              round(cpu / n * 1000, 3), "wall_s": round(wall, 2)}), flush=True)
    finally:
        fake.kill()


if __name__ == "__main__":
    main()
