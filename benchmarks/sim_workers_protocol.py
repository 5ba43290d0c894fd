"""CPU cost of the simulated workers' P/D protocol endpoints (``pdctl sim serve --workers-only``).

Run from the repository root: ``.venv/bin/python benchmarks/sim_workers_protocol.py
[--requests 400] [--concurrency 32] [--prompt-tokens 2048] [--output-tokens 128]``.

Starts ``pdctl sim serve scenarios/ppd-2p2d.toml --workers-only`` as a subprocess and drives
it with ``--concurrency`` clients, each a conversation of turns doing what a P/D router does
(a prefill leg on a prefill worker, then a streamed decode leg with the handle on a decode
worker; every third turn decode-local). The first turn's prompt is ``--prompt-tokens`` long;
later turns append ~100 tokens. Prints requests/s, turn latency p50/p99 (set by the simulated
GPU, not the CPU) and the simulator process's CPU seconds per turn (user + system, from
/proc), which is what bounds how many requests one simulator process can serve. Bounded:
``--requests`` turns and ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from controller.tokenize import bundled_tokenizer_dir, load_tokenizer  # noqa: E402

PREFILL_LEG = {"do_remote_decode": True, "do_remote_prefill": False}


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def opening(tokens: int, i: int) -> list[dict[str, str]]:
    tok = load_tokenizer(bundled_tokenizer_dir())
    words = (REPO / "docs" / "simulator.md").read_text().split()
    text = f"conversation {i}:"
    k = 0
    while tok.count_chat([{"role": "user", "content": text}]) < tokens:
        text += " " + " ".join(words[k % len(words):][:50])
        k += 50
    return [{"role": "user", "content": text}]


async def turn(c: httpx.AsyncClient, p: str, d: str, model: str, msgs: list[dict[str, str]],
               out: int, pd: bool) -> str:
    body = {"model": model, "messages": msgs, "max_tokens": out, "stream": True}
    if pd:
        leg = await c.post(p + "/v1/chat/completions", json={
            **body, "stream": False, "max_tokens": 1, "kv_transfer_params": PREFILL_LEG})
        body["kv_transfer_params"] = leg.json()["kv_transfer_params"]
    text = []
    async with c.stream("POST", d + "/v1/chat/completions", json=body) as s:
        async for line in s.aiter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    text.append(ch["delta"].get("content") or "")
    return "".join(text)


async def drive(addresses: dict, args: argparse.Namespace) -> list[float]:
    ws = addresses["workers"]
    ps = [w["url"] for w in ws if w["role"] == "prefill"]
    ds = [w["url"] for w in ws if w["role"] == "decode"]
    model = addresses["model"]
    lat: list[float] = []
    budget = iter(range(args.requests))
    openings = [opening(args.prompt_tokens, i) for i in range(args.concurrency)]

    async def client(i: int, c: httpx.AsyncClient) -> None:
        msgs = openings[i]
        for n, _ in enumerate(budget):
            t0 = time.perf_counter()
            ans = await turn(c, ps[i % len(ps)], ds[i % len(ds)], model, msgs,
                             args.output_tokens, pd=n % 3 != 2)
            lat.append(time.perf_counter() - t0)
            msgs = [*msgs, {"role": "assistant", "content": ans},
                    {"role": "user", "content": f"turn {n}: " + "and then what happens? " * 16}]

    limits = httpx.Limits(max_connections=4 * args.concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as c:
        await asyncio.wait_for(asyncio.gather(*(client(i, c) for i in range(args.concurrency))),
                               args.timeout)
    return lat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    proc = subprocess.Popen([sys.executable, "-c", "from controller.cli import main; main()",
                             "sim", "serve", "scenarios/ppd-2p2d.toml", "--workers-only",
                             "--json"], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        addresses = json.loads(proc.stdout.readline())
        cpu0, t0 = cpu_s(proc.pid), time.perf_counter()
        lat = asyncio.run(drive(addresses, args))
        wall, cpu = time.perf_counter() - t0, cpu_s(proc.pid) - cpu0
    finally:
        proc.terminate()
        proc.wait(15)
    lat.sort()
    print(f"{len(lat)} turns ({args.prompt_tokens}-token openings, {args.output_tokens} streamed "
          f"tokens, 2/3 P/D + 1/3 decode-local), concurrency {args.concurrency}")
    print(f"  {len(lat) / wall:.1f} turns/s; turn latency p50 {lat[len(lat) // 2]:.3f} s, "
          f"p99 {lat[int(len(lat) * 0.99)]:.3f} s, mean {statistics.fmean(lat):.3f} s")
    print(f"  simulator CPU {cpu:.1f} s in {wall:.1f} s wall: {1000 * cpu / len(lat):.2f} ms a "
          f"turn (both legs), {100 * cpu / wall:.0f}% of one core")


if __name__ == "__main__":
    main()
