"""Failure semantics of ``pdctl router serve``, each injected into real engine processes:
every request gets an answer and every deviation a counted reason."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.processes import free_port
from tests.support.router import Engine, RouterProc, engines, metric, router_serve, router_toml

pytestmark = pytest.mark.integration

TIMEOUTS = ("[timeouts]\nconnect_s = 1.0\nprefill_s = 1.0\nfirst_byte_s = 1.0\n"
            "between_tokens_s = 1.0\n")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[list[Engine], list[Engine], RouterProc]]:
    with engines("p0", "p1", "d0", interval_ms=5.0) as es:
        p, d = es[:2], es[2:]
        toml = router_toml([e.url for e in p], [e.url for e in d], http_port=free_port(),
                           grpc_port=free_port(), extra=TIMEOUTS)
        with router_serve(toml, tmp_path) as r:
            yield p, d, r


def chat(r: RouterProc, stream: bool = False, **extra: object) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
            "stream": stream, **extra}
    return httpx.post(r.url + "/v1/chat/completions", json=body, timeout=10,
                      headers={"X-Session-Id": "s"})


def route(resp: httpx.Response) -> str:
    return resp.headers.get("x-pdrouter-route", "")


def test_a_failing_prefill_is_retried_on_another_p_then_runs_decode_local(cluster) -> None:
    p, d, r = cluster
    p[0].behave(status=500)
    p[1].behave(status=500)
    got = chat(r)
    assert got.status_code == 200 and route(got) == "DECODE_LOCAL"
    text = r.metrics()
    assert metric(text, "pdrouter_prefill_retries_total", reason="prefill_5xx") == 1
    assert metric(text, "pdrouter_fallbacks_total", reason="prefill_5xx") == 1
    assert sum(e.stats()["requests"] for e in p) == 2
    assert "kv_transfer_params" not in d[0].log()[-1]["body"]
    p[1].behave()
    got = chat(r)  # one bad P: the retry on the other succeeds
    assert route(got) == "PREFILL_NODE" and got.json()["choices"][0]["message"]["content"]
    assert metric(r.metrics(), "pdrouter_fallbacks_total", reason="prefill_5xx") == 1


def test_no_handle_timeout_and_a_killed_p_fall_back_with_their_reasons(cluster) -> None:
    p, _d, r = cluster
    for e in p:
        e.behave(no_handle=True)
    assert route(chat(r)) == "DECODE_LOCAL"
    assert metric(r.metrics(), "pdrouter_fallbacks_total", reason="prefill_no_handle") == 1
    for e in p:
        e.behave(hang=True)
    started = time.monotonic()
    got = chat(r, stream=True)
    assert got.status_code == 200 and route(got) == "DECODE_LOCAL"
    assert time.monotonic() - started < 5  # two 1 s prefill timeouts, then decode
    assert metric(r.metrics(), "pdrouter_fallbacks_total", reason="prefill_timeout") == 1
    p[0].kill()
    p[1].kill()
    assert route(chat(r)) == "DECODE_LOCAL"
    text = r.metrics()
    assert (metric(text, "pdrouter_fallbacks_total", reason="prefill_connect")
            + metric(text, "pdrouter_fallbacks_total", reason="no_prefill_instance")) == 1


def test_a_4xx_from_p_goes_to_the_client_as_it_is(cluster) -> None:
    p, d, r = cluster
    for e in p:
        e.behave(status=400)
    got = chat(r)
    assert got.status_code == 400 and got.json()["error"]["message"] == "injected"
    assert d[0].stats()["requests"] == 0


def test_decode_failures_before_the_first_byte_answer_502_or_504(cluster) -> None:
    _p, d, r = cluster
    d[0].behave(hang=True)
    started = time.monotonic()
    got = chat(r, stream=True)
    assert got.status_code == 504 and got.json()["error"]["type"] == "gateway_timeout"
    assert time.monotonic() - started < 5
    text = r.metrics()
    assert metric(text, "pdrouter_decode_failures_total", reason="timeout_first_byte",
                  after_prefill="true") == 1
    d[0].behave(status=503)
    passed = chat(r)
    assert passed.status_code == 503 and passed.json()["error"]["message"] == "injected"
    d[0].kill()
    gone = chat(r)
    assert gone.status_code in (502, 503) and gone.json()["error"]["message"]


def test_a_stalled_stream_ends_with_an_error_event_within_the_bound(cluster) -> None:
    _p, d, r = cluster
    d[0].behave(stall_after=2)
    started = time.monotonic()
    got = chat(r, stream=True, max_tokens=10)
    assert time.monotonic() - started < 5
    assert got.status_code == 200 and b'"error"' in got.content
    assert metric(r.metrics(), "pdrouter_decode_failures_total",
                  reason="timeout_between_tokens") == 1
    d[0].behave(stall_after=0)  # silent right after its first event (the role chunk)
    started = time.monotonic()
    got = chat(r, stream=True, max_tokens=10)
    assert time.monotonic() - started < 5
    assert got.status_code == 200 and b'"error"' in got.content
    assert metric(r.metrics(), "pdrouter_decode_failures_total",
                  reason="timeout_between_tokens") == 2


def test_a_silence_shorter_than_the_bound_is_never_cut(cluster) -> None:
    """The between-tokens deadline is moved lazily, yet after every read it is at least the
    whole bound away: after 0.5 s of tokens every 5 ms, a 0.7 s silence (under the 1.0 s
    bound) ends normally. A deadline left where the first tokens put it would cut it."""
    _p, d, r = cluster
    d[0].behave(pause_after=100, pause_s=0.7)
    got = chat(r, stream=True, max_tokens=110)
    assert got.status_code == 200 and b'"error"' not in got.content
    assert got.content.count(b'"content":"x"') == 110
    assert metric(r.metrics(), "pdrouter_decode_failures_total",
                  reason="timeout_between_tokens") == 0


def _hang_up_after(r: RouterProc, body: bytes, wait_for: bytes | None, sleep_s: float) -> None:
    host, port = r.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: " + str(len(body)).encode()
                  + b"\r\n\r\n" + body)
        if wait_for is not None:
            seen = b""
            while wait_for not in seen:
                seen += s.recv(65536)
        time.sleep(sleep_s)


def wait_until(check, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached")


def test_a_client_hanging_up_cancels_both_legs(cluster) -> None:
    p, d, r = cluster
    body = (b'{"model":"m","stream":true,"max_tokens":400,'
            b'"messages":[{"role":"user","content":"hello"}]}')
    _hang_up_after(r, body, wait_for=b'"content":"x"', sleep_s=0.05)
    wait_until(lambda: d[0].stats()["aborted"] == 1)
    assert d[0].stats()["completed"] == 0
    for e in p:
        e.behave(delay_s=3.0)
    _hang_up_after(r, body, wait_for=None, sleep_s=0.3)  # during the prefill leg
    wait_until(lambda: sum(e.stats()["aborted"] for e in p) == 1)
    time.sleep(0.5)
    assert d[0].stats()["requests"] == 1  # no decode leg was started for it
    wait_until(lambda: metric(r.metrics(), "pdrouter_client_disconnects_total") == 2)
    text = r.metrics()
    assert metric(text, "pdrouter_client_disconnects_total", stage="decode") == 1


def test_an_unhealthy_instance_leaves_the_rotation_and_comes_back(tmp_path: Path) -> None:
    with engines("d0", "d1") as ds:
        toml = router_toml([], [e.url for e in ds], http_port=free_port(),
                           grpc_port=free_port(), extra=TIMEOUTS)
        with router_serve(toml, tmp_path) as r:
            keys = [f"k{i}" for i in range(40)]

            def decodes() -> dict[str, str]:
                out = {}
                for k in keys:
                    resp = httpx.post(r.url + "/v1/completions", timeout=10,
                                      headers={"X-Session-Id": k},
                                      json={"model": "m", "prompt": "p", "max_tokens": 1})
                    out[k] = resp.headers["x-pdrouter-decode"]
                return out

            before = decodes()
            assert set(before.values()) == {ds[0].url, ds[1].url}
            ds[1].behave(health_status=503)
            wait_until(lambda: metric(r.metrics(), "pdrouter_instance_healthy",
                                      instance=ds[1].url) == 0)
            during = decodes()
            assert set(during.values()) == {ds[0].url}
            assert all(during[k] == before[k] for k in keys if before[k] == ds[0].url)
            ds[1].behave()
            wait_until(lambda: metric(r.metrics(), "pdrouter_instance_healthy",
                                      instance=ds[1].url) == 1)
            assert decodes() == before  # the sessions return to their D


def test_a_p_killed_mid_leg_is_retried_and_a_d_killed_mid_stream_ends_it(cluster) -> None:
    p, d, r = cluster
    p[0].behave(delay_s=3.0)
    p[1].behave(delay_s=3.0)
    results: list[httpx.Response] = []
    t = threading.Thread(target=lambda: results.append(chat(r, stream=True)))
    t.start()
    wait_until(lambda: sum(e.stats()["requests"] for e in p) == 1)
    busy = next(e for e in p if e.stats()["requests"] == 1)
    other = next(e for e in p if e is not busy)
    other.behave()
    busy.kill()  # mid-leg: P dies while the router waits for its answer
    t.join(20)
    assert results and results[0].status_code == 200 and route(results[0]) == "PREFILL_NODE"
    text = r.metrics()
    assert metric(text, "pdrouter_prefill_retries_total", reason="prefill_connect") == 1
    assert metric(text, "pdrouter_fallbacks_total") == 0
    d[0].behave(stall_after=3)
    t2 = threading.Thread(target=lambda: results.append(chat(r, stream=True, max_tokens=50)))
    t2.start()
    wait_until(lambda: d[0].stats()["requests"] == 2)
    time.sleep(0.3)
    d[0].kill()  # mid-stream
    t2.join(20)
    assert results[1].status_code == 200 and b'"error"' in results[1].content
    assert metric(r.metrics(), "pdrouter_decode_failures_total", reason="broken_stream",
                  after_prefill="true") == 1
