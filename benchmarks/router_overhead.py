"""What ``pdctl router serve`` adds: the same workload straight to the engines and through it.

Run from the repository root (Linux; ``taskset`` pins the processes):

    .venv/bin/python benchmarks/router_overhead.py [--router-cpu 0 --other-cpus 1]
        [--rate 200] [--paced 2000] [--ceiling-s 20] [--concurrency 64]
        [--rss-requests 0] [--processes 1] [--tokenizer DIR]

Engines: ``tests/router/fake_vllm.py`` (one P, one D; no token delay), so the router's own
cost is what is measured. The router is pinned to ``--router-cpu``; the engines and this
load generator to ``--other-cpus``. Workload: chat prompts of 2,048 tokens (the bundled
tokenizer's count; ``--tokenizer`` is also the router's), 128 streamed output tokens.

Phases, each printed as one JSON line:

1. ``paced`` (skipped with ``--paced 0``): ``--paced`` requests at ``--rate`` req/s (open
   loop), direct and through the router, decode-local (a policy that sends every turn to D:
   the router's cost alone) and prefill-node (direct = the client runs both legs itself).
   Added TTFT p50/p99 = the difference of the percentiles; added time per streamed token
   likewise.
2. ``ceiling``: ``--concurrency`` closed-loop clients for ``--ceiling-s`` through the router:
   req/s, streamed tokens/s, router CPU seconds per request (from /proc).
3. ``rss`` (``--rss-requests N`` > 10,000): the router's RSS at request 10,000 and at N.

First turns (the default) are routed without counting their tokens (their route does not
depend on them); ``--later-turn`` sends second turns whose history the router has never
counted, so every request pays a full 2,048-token count before it is routed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402

from controller.policy import Overrides, Policy, Route, dumps  # noqa: E402
from controller.tokenize import bundled_tokenizer_dir, load_tokenizer  # noqa: E402
from tests.support.processes import PDCTL, free_port  # noqa: E402

FAKE = REPO / "tests" / "router" / "fake_vllm.py"
OUTPUT_TOKENS = 128
TOKEN_MARK = b'"content":"x'


def prompt_of(tokens: int, tokenizer: Path) -> list[dict[str, str]]:
    """A one-message chat whose prompt is ``tokens`` tokens long by the tokenizer's count."""
    tok = load_tokenizer(tokenizer)
    words = ["the", "router", "measures", "what", "it", "adds", "to", "every", "request"]
    text: list[str] = []
    i = 0
    while tok.count_chat([{"role": "user", "content": " ".join(text)}]) < tokens:
        text.extend(words[(i + j) % len(words)] + str(i) for j in range(32))
        i += 1
    while tok.count_chat([{"role": "user", "content": " ".join(text)}]) > tokens:
        text.pop()
    return [{"role": "user", "content": " ".join(text)}]


class Bodies:
    """Request bodies with distinct prompts (a unique first word each), so that no request's
    token count comes from the router's cache of texts it counted before."""

    def __init__(self, messages: list[dict[str, str]], later_turn: bool = False) -> None:
        self._text = messages[0]["content"]
        self._n = 0
        self._later = later_turn

    def __call__(self) -> bytes:
        self._n += 1
        msgs = [{"role": "user", "content": f"r{self._n} " + self._text}]
        if self._later:  # a second turn whose history this router never counted
            msgs += [{"role": "assistant", "content": "ok"},
                     {"role": "user", "content": "and then?"}]
        doc = {"model": "m", "messages": msgs, "max_tokens": OUTPUT_TOKENS, "stream": True}
        return json.dumps(doc).encode()


def pinned(cpus: str, args: list[str], **kw: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["taskset", "-c", cpus, *args], cwd=REPO, **kw)  # noqa: S603, S607


async def wait_http(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


class Stats:
    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.per_token: list[float] = []
        self.errors = 0
        self.tokens = 0
        self.kinds: dict[str, int] = {}  # what the errors were

    def error(self, kind: str) -> None:
        self.errors += 1
        self.kinds[kind] = self.kinds.get(kind, 0) + 1


async def one(s: aiohttp.ClientSession, base: str, bodies: Bodies, stats: Stats,
              prefill: str | None = None) -> None:
    """One streamed chat; with ``prefill``, the client runs the prefill leg itself first."""
    body = bodies()
    t0 = time.perf_counter()
    headers = {"Content-Type": "application/json"}
    try:
        if prefill is not None:
            doc = json.loads(body)
            pdoc = {**doc, "stream": False, "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True}}
            pdoc.pop("stream_options", None)
            async with s.post(prefill + "/v1/chat/completions", json=pdoc) as r:
                handle = (await r.json())["kv_transfer_params"]
            body = json.dumps({**doc, "kv_transfer_params": handle}).encode()
        async with s.post(base + "/v1/chat/completions", data=body, headers=headers) as r:
            if r.status != 200:
                stats.error(f"http {r.status}")
                return
            first = last = None
            n = 0
            async for chunk in r.content.iter_any():
                k = chunk.count(TOKEN_MARK)
                if k:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    n += k
    except aiohttp.ClientError as e:
        stats.error(type(e).__name__)
        return
    if first is None or last is None or n < OUTPUT_TOKENS:
        stats.error(f"{n} of {OUTPUT_TOKENS} tokens")
        return
    stats.ttft.append(first - t0)
    stats.per_token.append((last - first) / (n - 1))
    stats.tokens += n


async def paced(base: str, body: Bodies, rate: float, count: int,
                prefill: str | None = None) -> Stats:
    stats = Stats()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        tasks = []
        start = time.perf_counter()
        for i in range(count):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(s, base, body, stats, prefill)))
        await asyncio.gather(*tasks)
    return stats


async def closed_loop(base: str, body: Bodies, concurrency: int, seconds: float,
                      limit: int | None = None) -> tuple[Stats, int, float]:
    stats = Stats()
    done = 0
    end = time.perf_counter() + seconds
    conn = aiohttp.TCPConnector(limit=0)

    async def worker(s: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.perf_counter() < end and (limit is None or done < limit):
            done += 1
            await one(s, base, body, stats)

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=conn) as s:
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
    return stats, done, time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=1000)[int(q * 1000) - 1] if len(xs) > 1 else float("nan")


def cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def rss_kb(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total


def children(pid: int) -> list[int]:
    """The router's processes: ``pid`` (taskset execs in place) and its children."""
    out = [pid]
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        kids = []
    for k in kids:
        out.extend(children(int(k)))
    return out


async def overhead(url: str) -> tuple[float, float]:
    """(sum, count) of the router's pdrouter_overhead_seconds: its own time per request
    before the first upstream leg (parse, tokenize, decide, pick)."""
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    got = {"pdrouter_overhead_seconds_sum": 0.0, "pdrouter_overhead_seconds_count": 0.0}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name in got:
                got[sample.name] += sample.value
    return got["pdrouter_overhead_seconds_sum"], got["pdrouter_overhead_seconds_count"]


def summary(name: str, direct: Stats, routed: Stats, extra: dict[str, Any]) -> dict[str, Any]:
    ms = 1000.0
    return {
        "phase": name, **extra,
        "requests": len(routed.ttft), "errors": routed.errors + direct.errors,
        "error_kinds": {**direct.kinds, **routed.kinds},
        "direct_ttft_ms_p50": round(pct(direct.ttft, 0.5) * ms, 3),
        "direct_ttft_ms_p99": round(pct(direct.ttft, 0.99) * ms, 3),
        "router_ttft_ms_p50": round(pct(routed.ttft, 0.5) * ms, 3),
        "router_ttft_ms_p99": round(pct(routed.ttft, 0.99) * ms, 3),
        "added_ttft_ms_p50": round((pct(routed.ttft, 0.5) - pct(direct.ttft, 0.5)) * ms, 3),
        "added_ttft_ms_p99": round((pct(routed.ttft, 0.99) - pct(direct.ttft, 0.99)) * ms, 3),
        "added_per_token_us_p50": round(
            (pct(routed.per_token, 0.5) - pct(direct.per_token, 0.5)) * 1e6, 2),
    }


def start_router(args: argparse.Namespace, tmp: Path, p: str, d: str,
                 policy: Policy | None) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    extra = ""
    if policy is not None:
        pf = tmp / f"policy-{time.monotonic_ns()}.json"
        pf.write_text(dumps(policy))
        extra = f'initial_policy = "{pf}"\n'
    cfg = tmp / f"router-{time.monotonic_ns()}.toml"
    cfg.write_text(
        f'[http]\nlisten = "127.0.0.1:{port}"\nprocesses = {args.processes}\n'
        f'[grpc]\nlisten = "127.0.0.1:{free_port()}"\n{extra}'
        f'[model]\ntokenizer = "{args.tokenizer}"\n'
        f'[instances]\nprefill = ["{p}"]\ndecode = ["{d}"]\n')
    proc = pinned(args.router_cpu, [*PDCTL, "router", "serve", "--config", str(cfg)],
                  stdout=subprocess.DEVNULL, stderr=(tmp / "router.log").open("ab"))
    return proc, f"http://127.0.0.1:{port}"


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


async def run(args: argparse.Namespace, tmp: Path) -> None:
    messages = prompt_of(2048, args.tokenizer)
    body = Bodies(messages, later_turn=args.later_turn)
    ports = free_port(), free_port()
    engines = [pinned(args.other_cpus, [sys.executable, str(FAKE), "--port", str(port),
                                        "--engine-id", f"e{port}"],
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for port in ports]
    p, d = (f"http://127.0.0.1:{port}" for port in ports)
    local = Policy.uniform(1, Route.DECODE_LOCAL,
                           overrides=Overrides(first_turn_route=Route.DECODE_LOCAL))
    try:
        await wait_http(p + "/health")
        await wait_http(d + "/health")
        async with aiohttp.ClientSession() as s:  # the engines keep no request log here
            for e in (p, d):
                async with s.post(e + "/_fake/behaviour", json={"log": False}) as r:
                    r.raise_for_status()
        routes = [("DECODE_LOCAL", local), ("PREFILL_NODE", None)]
        for route, policy in routes[:2 if args.paced else 1]:  # --paced 0: the ceiling only
            router, url = start_router(args, tmp, p, d, policy)
            try:
                await wait_http(url + "/health")
                await paced(url, body, args.rate, 200)  # warm-up
                if args.paced:
                    await paced_phase(args, url, body, route, p if route == "PREFILL_NODE"
                                      else None, d)
                if route == "DECODE_LOCAL":
                    await ceiling_and_rss(args, router, url, body)
            finally:
                stop(router)
    finally:
        for engine in engines:
            engine.kill()


async def paced_phase(args: argparse.Namespace, url: str, body: Bodies, route: str,
                      prefill: str | None, d: str) -> None:
    """``--paced`` requests straight to the engines, then as many through the router."""
    direct = await paced(d, body, args.rate, args.paced, prefill)
    before = await overhead(url)
    routed = await paced(url, body, args.rate, args.paced)
    after = await overhead(url)
    own_ms = (after[0] - before[0]) / max(1.0, after[1] - before[1]) * 1000
    print(json.dumps(summary("paced", direct, routed, {
        "route": route, "rate": args.rate, "processes": args.processes,
        "router_own_ms_mean": round(own_ms, 3)})), flush=True)


async def ceiling_and_rss(args: argparse.Namespace, router: subprocess.Popen[bytes],
                          url: str, body: Bodies) -> None:
    pids = children(router.pid)
    c0 = cpu_s(pids)
    stats, done, elapsed = await closed_loop(url, body, args.concurrency, args.ceiling_s)
    used = cpu_s(pids) - c0
    print(json.dumps({
        "phase": "ceiling", "processes": args.processes, "concurrency": args.concurrency,
        "seconds": round(elapsed, 1), "requests": done, "errors": stats.errors,
        "req_per_s": round(len(stats.ttft) / elapsed, 1),
        "tokens_per_s": round(stats.tokens / elapsed),
        "router_cpu_ms_per_request": round(used / max(1, done) * 1000, 3),
        "ttft_ms_p50": round(pct(stats.ttft, 0.5) * 1000, 2)}), flush=True)
    if args.rss_requests > 10_000:
        await closed_loop(url, body, args.concurrency, 3600, limit=10_000)
        at_10k = rss_kb(pids)
        await closed_loop(url, body, args.concurrency, 3600, limit=args.rss_requests - 10_000)
        at_n = rss_kb(pids)
        print(json.dumps({"phase": "rss", "rss_kb_at_10000": at_10k,
                          f"rss_kb_at_{args.rss_requests}": at_n,
                          "growth_pct": round((at_n - at_10k) / at_10k * 100, 2)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--router-cpu", default="0")
    ap.add_argument("--other-cpus", default="1")
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--paced", type=int, default=2000)
    ap.add_argument("--ceiling-s", type=float, default=20.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rss-requests", type=int, default=0)
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--tokenizer", type=Path, default=bundled_tokenizer_dir())
    ap.add_argument("--later-turn", action="store_true",
                    help="second turns whose 2,048-token history the router never counted "
                    "(the worst case of a later turn: every token encoded)")
    args = ap.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # many requests in flight
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(run(args, Path(tmp)))


if __name__ == "__main__":
    main()
