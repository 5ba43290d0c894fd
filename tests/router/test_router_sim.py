"""``pdctl router serve`` (a real subprocess) in front of the simulated vLLM workers (the
P/D protocol over loopback HTTP, counting with the same bundled tokenizer), called with the
real ``openai`` client."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from controller.policy import Policy, Route, dumps
from controller.sim.live import LiveSim
from controller.sim.scenario import parse_scenario
from controller.tokenize import bundled_tokenizer_dir, load_tokenizer
from tests.support.processes import PDCTL, REPO, free_port
from tests.support.router import RouterProc, metric, router_serve, router_toml

pytestmark = pytest.mark.integration

SCENARIO: dict[str, Any] = {
    "name": "router-e2e", "seed": 5, "duration_s": 600,
    "cluster": {"prefill_workers": 1, "decode_workers": 2, "routers": 1},
    "workload": {"source": "synthetic", "params": {"qps": 1}},
}
TOK = load_tokenizer(bundled_tokenizer_dir())


class Sim:
    def __init__(self, sim: LiveSim, router: RouterProc) -> None:
        a = sim.addresses()
        self.model = a["model"]
        self.workers = {w["name"]: w["url"] for w in a["workers"]}
        self.router = router
        self.client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="k",
                                         max_retries=0, timeout=30.0)

    async def worker_metric(self, prefix: str, name: str, **labels: str) -> float:
        total = 0.0
        async with httpx.AsyncClient(timeout=10) as c:
            for wname, url in self.workers.items():
                if wname.startswith(prefix):
                    total += metric((await c.get(url + "/metrics")).text, name, **labels)
        return total

    async def router_metrics(self) -> str:
        async with httpx.AsyncClient(timeout=10) as c:
            return (await c.get(self.router.url + "/metrics")).text


@contextlib.asynccontextmanager
async def sim_and_router(tmp: Path) -> AsyncIterator[Sim]:
    scenario = parse_scenario(SCENARIO)
    sim = LiveSim(scenario, None, traffic=False, routers=False, grpc=False, serve=scenario.serve)
    await sim.start()
    stack = contextlib.ExitStack()
    try:
        a = sim.addresses()
        ps = [w["url"] for w in a["workers"] if w["role"] == "prefill"]
        ds = [w["url"] for w in a["workers"] if w["role"] == "decode"]
        toml = router_toml(ps, ds, http_port=free_port(), grpc_port=free_port(),
                           extra=f'[model]\ntokenizer = "{bundled_tokenizer_dir()}"\n'
                                 f'names = ["{a["model"]}"]\n'
                                 # a loaded CI machine must not flap an instance's health
                                 "[timeouts]\nhealth_s = 5.0\n")
        # started off the loop: the simulated workers keep answering meanwhile
        router = await asyncio.to_thread(stack.enter_context, router_serve(toml, tmp))
        yield Sim(sim, router)
    finally:
        await asyncio.to_thread(stack.close)
        await sim.stop()


async def push(r: RouterProc, tmp: Path, policy: Policy) -> None:
    path = tmp / f"v{policy.version}.json"
    path.write_text(dumps(policy))
    out = await asyncio.to_thread(
        subprocess.run, [*PDCTL, "push", str(path), "-r", r.grpc, "--json"], cwd=REPO,
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


async def test_both_routes_streaming_and_not_with_the_tokenizers_usage(tmp_path: Path) -> None:
    async with sim_and_router(tmp_path) as s:
        msgs = [{"role": "user", "content": "Tell me about prefill and decode."}]
        whole = await s.client.chat.completions.create(model=s.model, messages=msgs,
                                                       max_tokens=6)
        assert whole.usage and whole.usage.prompt_tokens == TOK.count_chat(msgs)
        assert whole.usage.completion_tokens == 6
        stream = await s.client.chat.completions.create(
            model=s.model, messages=msgs, max_tokens=5, stream=True,
            stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        assert chunks[-1].usage and chunks[-1].usage.completion_tokens == 5
        assert chunks[-1].usage.prompt_tokens == TOK.count_chat(msgs)
        plain = await s.client.completions.create(model=s.model, prompt="Once upon a time",
                                                  max_tokens=4, stream=True)
        got = [c async for c in plain]
        assert all(c.usage is None for c in got) and any(c.choices for c in got)
        text = await s.router_metrics()
        assert metric(text, "pdrouter_tokenizer_loaded") == 1
        assert metric(text, "pdrouter_routes_executed_total", route="PREFILL_NODE") == 3
        assert await s.worker_metric("prefill", "vllm:request_success_total") == 3


async def test_policy_makes_later_turns_decode_local_and_counts_match_workers(
        tmp_path: Path) -> None:
    async with sim_and_router(tmp_path) as s:
        await push(s.router, tmp_path, Policy.uniform(2, Route.DECODE_LOCAL))
        decodes: dict[int, set[str]] = {}
        routes: list[str] = []
        for conv in range(6):
            msgs = [{"role": "system", "content": f"You are assistant number {conv}."}]
            for turn in range(3):
                msgs.append({"role": "user", "content": f"Question {turn}: " + "why? " * 30})
                raw = await s.client.chat.completions.with_raw_response.create(
                    model=s.model, messages=msgs, max_tokens=8)
                out = raw.parse()
                msgs.append({"role": "assistant", "content": out.choices[0].message.content})
                decodes.setdefault(conv, set()).add(raw.headers["x-pdrouter-decode"])
                routes.append(raw.headers["x-pdrouter-route"])
        assert all(len(v) == 1 for v in decodes.values())  # a conversation stays on its D
        assert routes.count("DECODE_LOCAL") == 12 and routes.count("PREFILL_NODE") == 6
        text = await s.router_metrics()
        gen_workers = await s.worker_metric("decode", "vllm:generation_tokens_total")
        gen_router = metric(text, "pdrouter_completion_tokens_total")
        done_workers = await s.worker_metric("decode", "vllm:request_success_total")
        done_router = metric(text, "pdrouter_requests_total")
        assert abs(gen_router - gen_workers) <= 0.01 * gen_workers
        assert abs(done_router - done_workers) <= 0.01 * done_workers and done_router == 18
        cached = await s.worker_metric("decode", "vllm:prompt_tokens_by_source_total",
                                       source="local_cache_hit")
        assert cached > 0  # decode-local turns reused the conversation's KV on their D
