"""The traffic driver against a small loopback server (aiohttp) that records what arrives:
pacing, the conversation it builds, its bounds, failure reasons and a clean stop."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from controller.clock import WallClock
from controller.sim.drive import DriveLimits, FailReason, TrafficDriver
from controller.sim.scenario import parse_scenario
from controller.tokenize import bundled_tokenizer_dir, load_tokenizer

TOK = load_tokenizer(bundled_tokenizer_dir())
CLOCK = WallClock()


def scenario(qps: float = 8.0, turns: int = 3, duration_s: float = 1.5) -> Any:
    return parse_scenario({
        "name": "drive-unit", "seed": 3, "duration_s": duration_s,
        "cluster": {"prefill_workers": 1, "decode_workers": 1, "routers": 1},
        "workload": {"source": "synthetic", "params": {
            "qps": qps, "turns": turns, "think_s": 0.15, "turn1_input": 120,
            "turn1_output": 5, "append_input": 30, "append_output": 4}}})


@dataclass
class Server:
    url: str = ""
    status: int = 200
    delay_s: float = 0.0
    arrivals: list[tuple[float, str, dict[str, Any]]] = field(default_factory=list)
    finished: dict[str, float] = field(default_factory=dict)  # session -> last answer's end
    in_flight: int = 0
    peak: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)  # ends every delay


@asynccontextmanager
async def server() -> AsyncIterator[Server]:
    s = Server()

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        sid = request.headers["X-Session-Id"]
        s.arrivals.append((CLOCK.monotonic(), sid, body))
        if s.status != 200:
            return web.json_response({"error": {"message": "no"}}, status=s.status)
        s.in_flight += 1
        s.peak = max(s.peak, s.in_flight)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(s.release.wait(), timeout=s.delay_s)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "x-pdrouter-decode": "d-0"})
            await resp.prepare(request)
            n = body["max_tokens"]
            chunk = {"choices": [{"index": 0, "delta": {"content": " ".join(["sim"] * n)}}]}
            usage = {"choices": [], "usage": {"prompt_tokens": TOK.count_chat(body["messages"]),
                                              "completion_tokens": n}}
            for doc in (chunk, usage):
                await resp.write(f"data: {json.dumps(doc)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            s.finished[sid] = CLOCK.monotonic()
            return resp
        finally:
            s.in_flight -= 1

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    s.url = f"http://127.0.0.1:{port}"
    try:
        yield s
    finally:
        s.release.set()
        await runner.cleanup()


async def test_sessions_are_paced_conversations_sized_to_the_workload() -> None:
    sc = scenario()
    async with server() as s:
        driver = TrafficDriver(sc, s.url, DriveLimits(duration_s=1.5, drain_s=20.0),
                               tokenizer=TOK)
        specs = {f"drive-{spec.session_id}": (start, spec) for start, spec in driver.sessions()}
        t0 = CLOCK.monotonic()
        stats = await driver.run()
    assert len(specs) >= 4 and stats.sessions == len(specs)
    assert stats.sent == stats.ok == len(s.arrivals) == 3 * len(specs) and not stats.failed
    seen: dict[str, int] = {}
    last: dict[str, float] = {}
    for at, sid, body in s.arrivals:
        start, spec = specs[sid]
        k = seen.get(sid, 0)
        turn = spec.turns[k]
        msgs = body["messages"]
        assert len(msgs) == 2 * k + 1 and [m["role"] for m in msgs[-2:]][-1] == "user"
        assert TOK.count_chat(msgs) == turn.prompt_tokens
        assert msgs[0]["content"].startswith(f"[{sid}] the the")  # each its own opening
        assert body["max_tokens"] == turn.output_tokens and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        if k == 0:
            assert at >= t0 + start - 0.005  # never early
            assert at <= t0 + start + 0.5  # nor far late on an idle loopback
        else:
            assert at >= last[sid] + turn.think_s - 0.005
            assert msgs[-2] == {"role": "assistant",
                                "content": " ".join(["sim"] * spec.turns[k - 1].output_tokens)}
        seen[sid] = k + 1
        last[sid] = at
    assert stats.completion_tokens == sum(b["max_tokens"] for _, _, b in s.arrivals)
    assert stats.split_sessions == 0


async def test_request_budget_and_concurrency_bound() -> None:
    async with server() as s:
        s.delay_s = 0.3
        budget = await TrafficDriver(
            scenario(qps=40.0, turns=1), s.url,
            DriveLimits(duration_s=1.5, max_requests=5, drain_s=10.0), tokenizer=TOK).run()
        assert budget.sent == 5 == len(s.arrivals) and budget.stopped_by == "request budget"
        s.arrivals.clear()
        s.peak = 0
        bounded = await TrafficDriver(
            scenario(qps=40.0, turns=1), s.url,
            DriveLimits(duration_s=1.0, max_concurrency=3, drain_s=10.0), tokenizer=TOK).run()
    assert bounded.sent > 10 and bounded.ok == bounded.sent
    assert s.peak == 3  # reached, never passed


async def test_http_errors_are_counted_and_end_their_session() -> None:
    async with server() as s:
        s.status = 503
        stats = await TrafficDriver(scenario(), s.url, DriveLimits(duration_s=1.0, drain_s=5.0),
                                    tokenizer=TOK).run()
    assert stats.sessions >= 3 and stats.sent == stats.sessions  # no turn after a failure
    assert stats.failed == {FailReason.HTTP_STATUS: stats.sent}
    assert stats.statuses == {503: stats.sent} and stats.ok == 0


async def test_stop_cancels_what_is_in_flight_and_returns_promptly() -> None:
    async with server() as s:
        s.delay_s = 30.0  # never answers while the test runs
        stop = asyncio.Event()
        driver = TrafficDriver(scenario(qps=20.0), s.url,
                               DriveLimits(duration_s=5.0, drain_s=60.0), tokenizer=TOK)
        asyncio.get_running_loop().call_later(0.6, stop.set)
        t0 = CLOCK.monotonic()
        stats = await driver.run(stop)
        took = CLOCK.monotonic() - t0
    assert took < 3.0
    assert stats.sent >= 2 and stats.failed == {FailReason.STOPPED: stats.sent}
    assert stats.stopped_by == "signal" and stats.ok == 0


async def test_drain_limit_cancels_late_turns() -> None:
    async with server() as s:
        s.delay_s = 30.0
        stats = await TrafficDriver(scenario(qps=20.0), s.url,
                                    DriveLimits(duration_s=0.5, drain_s=0.5),
                                    tokenizer=TOK).run()
    assert stats.stopped_by == "drain limit" and stats.failed[FailReason.STOPPED] == stats.sent
