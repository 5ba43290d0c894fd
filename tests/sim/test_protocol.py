"""The simulated workers' own OpenAI endpoints speak vLLM's P/D protocol (the field lists of
docs/simulator.md): prefill leg and its handle, decode leg pulling only the blocks it lacks,
decode-local, no-handle prefill, expiry, errors, streaming, aborts — over real loopback
HTTP (httpx and the openai client), checked against the workers' own metrics."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controller.sim.live import LiveSim
from controller.sim.scenario import ServeConfig, parse_scenario
from controller.tokenize import bundled_tokenizer_dir, load_tokenizer

SCENARIO: dict[str, Any] = {
    "name": "protocol", "seed": 3, "duration_s": 600,
    "cluster": {"prefill_workers": 1, "decode_workers": 2, "routers": 1},
    "workload": {"source": "synthetic", "params": {"qps": 1}},
}
HANDLE_FIELDS = {"do_remote_prefill", "do_remote_decode", "remote_block_ids",
                 "remote_engine_id", "remote_request_id", "remote_host", "remote_port",
                 "tp_size"}
PREFILL_LEG = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}
TOK = load_tokenizer(bundled_tokenizer_dir())


class Cluster:
    def __init__(self, sim: LiveSim, client: httpx.AsyncClient) -> None:
        self.sim = sim
        self.c = client
        a = sim.addresses()
        self.model = a["model"]
        self.p = next(w["url"] for w in a["workers"] if w["name"] == "prefill-0")
        self.d = next(w["url"] for w in a["workers"] if w["name"] == "decode-0")

    async def chat(self, url: str, messages: list[dict[str, str]], *, max_tokens: int = 8,
                   ktp: dict[str, Any] | None = None, rid: str | None = None,
                   **extra: Any) -> httpx.Response:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, **extra}
        if ktp is not None:
            body["kv_transfer_params"] = ktp
        headers = {"X-Request-Id": rid} if rid else {}
        return await self.c.post(url + "/v1/chat/completions", json=body, headers=headers)

    async def state(self, url: str) -> dict[str, Any]:
        return (await self.c.get(url + "/sim/state")).json()  # type: ignore[no-any-return]

    async def metrics(self, url: str) -> dict[str, float]:
        """Sample name + sorted labels (less engine/model) -> value."""
        text = (await self.c.get(url + "/metrics")).text
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                                  if k not in ("engine", "model_name"))
                out[f"{s.name}{{{labels}}}"] = s.value
        return out


async def _cluster(serve: ServeConfig | None = None) -> AsyncIterator[Cluster]:
    scenario = parse_scenario(SCENARIO)
    sim = LiveSim(scenario, None, traffic=False, routers=False, grpc=False,
                  serve=serve or scenario.serve)
    await sim.start()
    try:
        async with httpx.AsyncClient(timeout=20.0) as client:
            yield Cluster(sim, client)
    finally:
        await sim.stop()


@pytest.fixture
async def cl() -> AsyncIterator[Cluster]:
    async for c in _cluster():
        yield c


def conversation(turns: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "You answer about the simulator."},
            {"role": "user", "content": "Explain decode-local routing. " * 60}]
    for i in range(1, turns):
        msgs += [{"role": "assistant", "content": " ".join(["sim"] * 8)},
                 {"role": "user", "content": f"Turn {i}: and the KV link? " * 15}]
    return msgs


async def test_prefill_leg_answers_the_handle_and_pins_the_blocks(cl: Cluster) -> None:
    msgs = conversation(1)
    r = await cl.chat(cl.p, msgs, max_tokens=1, ktp=PREFILL_LEG, rid="req-1")
    assert r.status_code == 200
    doc = r.json()
    prompt = TOK.count_chat(msgs)
    assert doc["usage"] == {"prompt_tokens": prompt, "completion_tokens": 1,
                            "total_tokens": prompt + 1}
    assert doc["choices"][0]["finish_reason"] == "length"
    ktp = doc["kv_transfer_params"]
    assert set(ktp) == HANDLE_FIELDS
    assert ktp["do_remote_prefill"] is True and ktp["do_remote_decode"] is False
    assert ktp["remote_engine_id"] == "sim-prefill-0" and ktp["remote_request_id"] == "req-1"
    assert ktp["remote_host"] == "127.0.0.1" and ktp["tp_size"] == 1
    assert ktp["remote_port"] == int(cl.p.rsplit(":", 1)[1])
    assert len(ktp["remote_block_ids"]) == -(-prompt // 16)
    state = await cl.state(cl.p)
    assert [p["remote_request_id"] for p in state["pinned"]] == ["req-1"]
    assert 479 < state["pinned"][0]["expires_in_s"] <= 480
    m = await cl.metrics(cl.p)
    assert m["vllm:prompt_tokens_total{}"] == prompt
    assert m["vllm:request_success_total{finished_reason=length}"] == 1
    assert m["vllm:generation_tokens_total{}"] == 1


async def _pd_turn(cl: Cluster, msgs: list[dict[str, str]], rid: str,
                   max_tokens: int = 8) -> tuple[dict[str, Any], dict[str, Any]]:
    leg = await cl.chat(cl.p, msgs, max_tokens=1, ktp=PREFILL_LEG, rid=rid)
    assert leg.status_code == 200
    r = await cl.chat(cl.d, msgs, max_tokens=max_tokens,
                      ktp=leg.json()["kv_transfer_params"], rid=rid)
    assert r.status_code == 200, r.text
    return leg.json(), r.json()


async def test_decode_leg_pulls_only_the_blocks_it_lacks(cl: Cluster) -> None:
    one = conversation(1)
    _, first = await _pd_turn(cl, one, "t1")
    prompt1 = TOK.count_chat(one)
    assert first["usage"]["completion_tokens"] == 8
    s1 = await cl.state(cl.d)
    assert s1["counters"]["pulled_tokens"] == prompt1 - 1  # the last token is recomputed
    assert (await cl.state(cl.p))["pinned"] == []  # taken: P's blocks are released
    cached = max(s1["prefix_cache"].values())
    two = conversation(2)
    prompt2 = TOK.count_chat(two)
    await _pd_turn(cl, two, "t2")
    s2 = await cl.state(cl.d)
    pulled = s2["counters"]["pulled_tokens"] - s1["counters"]["pulled_tokens"]
    assert cached >= prompt1 - 16  # turn 1's prompt and output, in whole blocks
    assert 0 < pulled == prompt2 - 1 - cached < prompt2 - prompt1 + 16
    m = await cl.metrics(cl.d)
    assert m["vllm:prompt_tokens_by_source_total{source=local_cache_hit}"] == cached
    assert m["vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"] == (
        prompt1 - 1 + pulled)
    assert m["vllm:request_success_total{finished_reason=length}"] == 2
    assert m["vllm:nixl_bytes_transferred_count{}"] == 2


async def test_decode_local_prefills_only_what_its_cache_lacks(cl: Cluster) -> None:
    one = conversation(1)
    r1 = await cl.chat(cl.d, one)
    assert r1.status_code == 200 and "kv_transfer_params" in r1.json()
    assert r1.json()["kv_transfer_params"] is None
    cached = max((await cl.state(cl.d))["prefix_cache"].values())
    two = conversation(2)
    r2 = await cl.chat(cl.d, two, max_tokens=4)
    assert r2.json()["usage"]["prompt_tokens"] == TOK.count_chat(two)
    m = await cl.metrics(cl.d)
    assert m["vllm:prompt_tokens_by_source_total{source=local_cache_hit}"] == cached
    assert m["vllm:prompt_tokens_by_source_total{source=local_compute}"] == (
        TOK.count_chat(one) + TOK.count_chat(two) - cached)
    assert m["vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"] == 0
    assert (await cl.state(cl.d))["counters"]["requests"]["local"] == 2
    # a different conversation does not hit the first one's cache
    other = [{"role": "user", "content": "Something else entirely. " * 40}]
    await cl.chat(cl.d, other, max_tokens=2)
    m2 = await cl.metrics(cl.d)
    assert m2["vllm:prompt_tokens_by_source_total{source=local_cache_hit}"] == cached


async def test_first_token_eos_returns_no_handle(cl: Cluster) -> None:
    r = await cl.chat(cl.p, conversation(1), max_tokens=1, ktp=PREFILL_LEG,
                      sim_first_token_eos=True)
    doc = r.json()
    assert r.status_code == 200 and doc["kv_transfer_params"] is None
    assert doc["choices"][0]["finish_reason"] == "stop"
    st = await cl.state(cl.p)
    assert st["pinned"] == [] and st["counters"]["no_handle"] == 1


async def test_no_handle_fraction_and_expiry() -> None:
    serve = ServeConfig(no_handle_fraction=1.0, abort_timeout_s=0.3)
    async for cl in _cluster(serve):
        r = await cl.chat(cl.p, conversation(1), max_tokens=1, ktp=PREFILL_LEG)
        assert r.json()["kv_transfer_params"] is None
    async for cl in _cluster(replace(serve, no_handle_fraction=0.0)):
        msgs = conversation(1)
        leg = (await cl.chat(cl.p, msgs, max_tokens=1, ktp=PREFILL_LEG, rid="x")).json()
        assert len((await cl.state(cl.p))["pinned"]) == 1
        await asyncio.sleep(0.6)
        st = await cl.state(cl.p)
        assert st["pinned"] == [] and st["counters"]["handles_expired"] == 1
        assert (await cl.metrics(cl.p))["vllm:nixl_num_kv_expired_reqs_total{}"] == 1
        # the decode worker finds the blocks gone: a KV load failure, recomputed locally
        r = await cl.chat(cl.d, msgs, ktp=leg["kv_transfer_params"])
        assert r.status_code == 200
        assert (await cl.state(cl.d))["counters"]["kv_load_failures"] == 1
        m = await cl.metrics(cl.d)
        assert m["vllm:prompt_tokens_by_source_total{source=local_compute}"] == (
            TOK.count_chat(msgs))


async def test_errors_in_vllm_shape(cl: Cluster) -> None:
    r = await cl.c.post(cl.d + "/v1/chat/completions",
                        json={"model": "gpt-nope", "messages": [{"role": "user",
                                                                 "content": "x"}]})
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "The model `gpt-nope` does not exist.",
                                  "type": "NotFoundError", "param": "model", "code": 404}}
    r = await cl.c.post(cl.d + "/v1/completions", content=b"{not json",
                        headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    r = await cl.chat(cl.p, conversation(1), ktp={"do_remote_prefill": True})
    assert r.status_code == 400 and "prefill worker" in r.json()["error"]["message"]
    assert (await cl.c.get(cl.d + "/v1/chat/completions")).status_code == 405
    assert (await cl.c.get(cl.d + "/nope")).status_code == 404
    r = await cl.chat(cl.d, [{"role": "user", "content": "x"}], max_tokens=200_000)
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    models = (await cl.c.get(cl.d + "/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [cl.model]
    assert (await cl.c.get(cl.d + "/health")).status_code == 200
    m = await cl.metrics(cl.d)
    assert sum(v for k, v in m.items() if k.startswith("vllm:request_success_total")) == 0


async def _sse(cl: Cluster, url: str, body: dict[str, Any]) -> list[Any]:
    events = []
    async with cl.c.stream("POST", url + "/v1/completions", json=body) as s:
        assert s.status_code == 200
        assert s.headers["content-type"].startswith("text/event-stream")
        async for line in s.aiter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def test_streaming_usage_only_when_asked(cl: Cluster) -> None:
    prompt = "The decode worker streams tokens. " * 30
    body = {"model": cl.model, "prompt": prompt, "max_tokens": 6, "stream": True}
    plain = await _sse(cl, cl.d, body)
    assert plain[-1] == "[DONE]" and all("usage" not in e for e in plain[:-1])
    text = "".join(e["choices"][0]["text"] for e in plain[:-1])
    assert text.split() == ["sim"] * 6
    assert plain[-2]["choices"][0]["finish_reason"] == "length"
    with_usage = await _sse(cl, cl.d, {**body, "stream_options": {"include_usage": True}})
    last = with_usage[-2]
    assert last["choices"] == []
    assert last["usage"] == {"prompt_tokens": TOK.count_text(prompt), "completion_tokens": 6,
                             "total_tokens": TOK.count_text(prompt) + 6}
    m = await cl.metrics(cl.d)
    assert m["vllm:prompt_tokens_total{}"] == 2 * TOK.count_text(prompt)
    assert m["vllm:generation_tokens_total{}"] == 12


async def test_a_client_that_leaves_mid_stream_aborts_the_request(cl: Cluster) -> None:
    body = {"model": cl.model, "prompt": "long answer please " * 20, "max_tokens": 4000,
            "stream": True}
    async with cl.c.stream("POST", cl.d + "/v1/completions", json=body) as s:
        async for line in s.aiter_lines():
            if line.startswith("data: "):
                break  # first token seen: hang up
    for _ in range(100):
        st = await cl.state(cl.d)
        if st["running"] == 0 and st["counters"]["requests"]["aborted"] == 1:
            break
        await asyncio.sleep(0.05)
    assert st["running"] == 0 and st["counters"]["requests"]["aborted"] == 1
    m = await cl.metrics(cl.d)
    assert m["vllm:request_success_total{finished_reason=abort}"] == 1
    assert m["vllm:generation_tokens_total{}"] < 4000


async def test_openai_client_against_a_decode_worker(cl: Cluster) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=cl.d + "/v1", api_key="unused", max_retries=0)
    msgs = conversation(1)
    stream = await client.chat.completions.create(
        model=cl.model, messages=msgs, max_tokens=5, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True})
    pieces, usage = [], None
    async for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces).split() == ["sim"] * 5
    assert usage is not None and usage.prompt_tokens == TOK.count_chat(msgs)
    done = await client.completions.create(model=cl.model, prompt="hello there", max_tokens=3)
    assert done.usage is not None and done.usage.completion_tokens == 3
    await client.close()
