"""``pdctl router serve`` (a real subprocess) in front of fake vLLM engines (real processes),
called with the real ``openai`` client: both routes, streaming and not, usage, affinity,
policy pushes over gRPC, the protocol's field lists on the wire."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from controller.policy import Policy, Route, dumps
from tests.support.processes import PDCTL, REPO, free_port
from tests.support.router import Engine, RouterProc, engines, metric, router_serve, router_toml

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[list[Engine], list[Engine], RouterProc]]:
    tmp = tmp_path_factory.mktemp("router")
    with engines("p0", "p1", "d0", "d1") as es:
        p, d = es[:2], es[2:]
        toml = router_toml([e.url for e in p], [e.url for e in d], http_port=free_port(),
                           grpc_port=free_port(), extra="[timeouts]\nhealth_s = 5.0\n")
        with router_serve(toml, tmp) as r:
            yield p, d, r


def client(r: RouterProc, **kw: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=r.url + "/v1", api_key="sk-client", max_retries=0,
                         timeout=20.0, **kw)  # type: ignore[arg-type]


def push(r: RouterProc, tmp: Path, policy: Policy) -> None:
    path = tmp / f"v{policy.version}.json"
    path.write_text(dumps(policy))
    out = subprocess.run([*PDCTL, "push", str(path), "-r", r.grpc, "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def reset(*es: Engine) -> None:
    for e in es:
        e.behave()


def test_chat_and_completions_stream_and_not_with_usage(cluster, tmp_path: Path) -> None:
    _p, _d, r = cluster
    c = client(r)
    msgs = [{"role": "user", "content": "x" * 400}]
    whole = c.chat.completions.create(model="m", messages=msgs, max_tokens=7)
    assert whole.choices[0].message.content == "x" * 7
    assert whole.usage is not None and whole.usage.prompt_tokens == 3 + 100 + 4
    assert whole.usage.completion_tokens == 7
    chunks = list(c.chat.completions.create(model="m", messages=msgs, max_tokens=5, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "x" * 5
    assert all(ch.usage is None for ch in chunks)  # not asked: the router stripped it
    asked = list(c.chat.completions.create(model="m", messages=msgs, max_tokens=5, stream=True,
                                           stream_options={"include_usage": True}))
    assert asked[-1].choices == [] and asked[-1].usage is not None
    assert asked[-1].usage.completion_tokens == 5 and asked[-1].usage.prompt_tokens == 107
    comp = c.completions.create(model="m", prompt="y" * 40, max_tokens=4)
    assert comp.choices[0].text == "xxxx" and comp.usage and comp.usage.prompt_tokens == 10
    streamed = list(c.completions.create(model="m", prompt="y" * 40, max_tokens=3, stream=True))
    assert "".join(s.choices[0].text for s in streamed if s.choices) == "xxx"
    text = r.metrics()
    assert metric(text, "pdrouter_requests_total") >= 5
    assert metric(text, "pdrouter_completion_tokens_total") >= 7 + 5 + 5 + 4 + 3
    assert metric(text, "pdrouter_tokenizer_loaded") == 0


def test_prefill_leg_and_decode_leg_on_the_wire(cluster) -> None:
    p, d, r = cluster
    for e in (*p, *d):
        e.behave()
        httpx.post(e.url + "/_fake/behaviour", json={}, timeout=5)
    before = {e.engine_id: len(e.log()) for e in (*p, *d)}
    httpx.post(r.url + "/v1/chat/completions", timeout=20, headers={
        "Authorization": "Bearer tok", "X-Request-Id": "rid-1", "X-Session-Id": "wire"},
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
              "min_tokens": 2, "stream": True}).raise_for_status()
    new = {e.engine_id: e.log()[before[e.engine_id]:] for e in (*p, *d)}
    legs_p = [x for e in p for x in new[e.engine_id]]
    legs_d = [x for e in d for x in new[e.engine_id]]
    assert len(legs_p) == 1 and len(legs_d) == 1
    pb, db = legs_p[0]["body"], legs_d[0]["body"]
    assert pb["kv_transfer_params"]["do_remote_decode"] is True
    assert pb["max_tokens"] == 1 and pb["stream"] is False and "min_tokens" not in pb
    assert "stream_options" not in pb
    assert db["min_tokens"] == 2 and db["max_tokens"] == 9 and db["stream"] is True
    assert db["kv_transfer_params"]["do_remote_prefill"] is True
    assert db["kv_transfer_params"]["remote_engine_id"] in {"p0", "p1"}
    assert db["stream_options"] == {"include_usage": True}
    assert legs_p[0]["x_request_id"] == legs_d[0]["x_request_id"] == "rid-1"
    assert legs_p[0]["authorization"] == legs_d[0]["authorization"] == "Bearer tok"


def test_pushed_policy_runs_later_turns_decode_local_on_the_sessions_d(cluster, tmp_path) -> None:
    _p, _d, r = cluster
    push(r, tmp_path, Policy.uniform(3, Route.DECODE_LOCAL))
    c = client(r)
    routes: dict[str, list[str]] = {}
    for conv in range(16):  # rendezvous over 2 Ds: all on one has p = 2**-15
        msgs: list[dict[str, str]] = [{"role": "system", "content": f"conversation {conv}"}]
        for turn in range(3):
            msgs.append({"role": "user", "content": f"question {turn} " * 20})
            raw = c.chat.completions.with_raw_response.create(
                model="m", messages=msgs, max_tokens=4, stream=False)
            msgs.append({"role": "assistant", "content": raw.parse().choices[0].message.content})
            routes.setdefault(str(conv), []).append(
                f"{raw.headers['x-pdrouter-route']}@{raw.headers['x-pdrouter-decode']}")
    for seq in routes.values():
        assert seq[0].startswith("PREFILL_NODE@")  # turn 1: the first-turn override
        assert all(s.startswith("DECODE_LOCAL@") for s in seq[1:])
        assert len({s.split("@")[1] for s in seq}) == 1  # one D for the whole conversation
    assert len({seq[0].split("@")[1] for seq in routes.values()}) == 2  # both Ds used
    text = r.metrics()
    assert metric(text, "pdrouter_policy_version") == 3
    assert metric(text, "pdrouter_decisions_total", route="DECODE_LOCAL", reason="table") >= 12


def test_client_errors_are_openai_shaped(cluster) -> None:
    _, _, r = cluster
    bad = httpx.post(r.url + "/v1/chat/completions", content=b"{nope", timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    nomsg = httpx.post(r.url + "/v1/chat/completions", json={"model": "m"}, timeout=10)
    assert nomsg.status_code == 400 and "messages" in nomsg.json()["error"]["message"]
    assert httpx.get(r.url + "/health", timeout=5).status_code == 200
    models = httpx.get(r.url + "/v1/models", timeout=5).json()
    assert models["data"][0]["id"] == "fake"  # no names configured: D's own list


def test_own_api_key_and_model_names(tmp_path: Path) -> None:
    with engines("d") as (d,):
        toml = router_toml([], [d.url], http_port=free_port(), grpc_port=free_port(),
                           extra='[model]\nnames = ["served"]\n',
                           http_extra='api_key = "sekrit"\n')
        with router_serve(toml, tmp_path) as r:
            body = {"model": "served", "prompt": "a", "max_tokens": 1}
            denied = httpx.post(r.url + "/v1/completions", json=body, timeout=10)
            assert denied.status_code == 401 and denied.json()["error"]["message"]
            auth = {"Authorization": "Bearer sekrit"}
            ok = httpx.post(r.url + "/v1/completions", json=body, headers=auth, timeout=10)
            assert ok.status_code == 200 and d.log()[-1]["authorization"] == "Bearer sekrit"
            other = httpx.post(r.url + "/v1/completions", json={**body, "model": "x"},
                               headers=auth, timeout=10)
            assert other.status_code == 404 and "x" in json.dumps(other.json())
            assert [m["id"] for m in httpx.get(r.url + "/v1/models", headers=auth,
                                               timeout=5).json()["data"]] == ["served"]
        # [instances] api_key: the engines get their own key, not the client's
        toml = router_toml([], [d.url], http_port=free_port(), grpc_port=free_port(),
                           extra='api_key = "engine-key"\n', http_extra='api_key = "sekrit"\n')
        with router_serve(toml, tmp_path) as r:
            ok = httpx.post(r.url + "/v1/completions", headers={"Authorization": "Bearer sekrit"},
                            json={"model": "m", "prompt": "a", "max_tokens": 1}, timeout=10)
            assert ok.status_code == 200 and d.log()[-1]["authorization"] == "Bearer engine-key"
