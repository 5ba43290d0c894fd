"""Hostile and careless clients of ``pdctl router serve`` (a real subprocess in front of fake
vLLM engines, real processes): every malformed request gets an OpenAI-shaped 4xx and is
counted, none costs an engine its place in the rotation, none leaves a traceback; a client
that closes its stream at ``[DONE]`` (the ``openai`` client does) is a completed request."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.processes import REPO, free_port
from tests.support.router import Engine, RouterProc, engines, metric, router_serve, router_toml

pytestmark = pytest.mark.integration

MODEL = "m"
SIM_TOKENIZER = REPO / "controller" / "tokenize" / "data" / "sim-tokenizer"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[Engine, Engine, RouterProc]]:
    tmp = tmp_path_factory.mktemp("hostile")
    with engines("p0", "d0") as (p, d):
        toml = router_toml([p.url], [d.url], http_port=free_port(), grpc_port=free_port(),
                           extra=f'[model]\nnames = ["{MODEL}"]\ntokenizer = "{SIM_TOKENIZER}"\n')
        with router_serve(toml, tmp) as r:
            yield p, d, r


def post(r: RouterProc, content: bytes) -> httpx.Response:
    return httpx.post(r.url + "/v1/chat/completions", content=content, timeout=20,
                      headers={"Content-Type": "application/json"}, trust_env=False)


def assert_openai_error(resp: httpx.Response, status: int) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == status and err["message"] and err["type"]


def test_a_stream_closed_at_done_is_counted_as_completed(cluster) -> None:
    _p, d, r = cluster
    d.behave(linger_s=1.0)  # D ends its stream a second after [DONE]
    try:
        before = r.metrics()
        c = openai.OpenAI(base_url=r.url + "/v1", api_key="k", max_retries=0, timeout=20.0)
        for i in range(3):
            chunks = list(c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"s{i}"}], max_tokens=4,
                stream=True))  # the client closes the connection at [DONE]
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks
                           if ch.choices) == "xxxx"
        after = r.metrics()
    finally:
        d.behave()

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("pdrouter_client_disconnects_total") == 0
    assert delta("pdrouter_routes_executed_total") == 3
    assert delta("pdrouter_http_responses_total", code="200") == 3
    assert delta("pdrouter_completion_tokens_total") == 12


@pytest.mark.parametrize("value", [b'"yes"', b'"false"', b"1", b"{}"])
def test_stream_that_is_not_a_boolean_is_a_400_and_no_engine_failure(cluster, value) -> None:
    _p, d, r = cluster
    body = (b'{"model":"m","max_tokens":2,"messages":[{"role":"user","content":"hi"}],'
            b'"stream":' + value + b"}")
    for _ in range(3):  # [instances] unhealthy_after is 2
        assert_openai_error(post(r, body), 400)
    text = r.metrics()
    assert metric(text, "pdrouter_instance_healthy", instance=d.url) == 1
    assert metric(text, "pdrouter_decode_failures_total") == 0
    ok = post(r, body.replace(b'"stream":' + value, b'"stream":null'))
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "xx"


@pytest.mark.parametrize("body", [
    b'{"model":["m"],"messages":[{"role":"user","content":"hi"}]}',
    b'{"model":{"a":1},"messages":[{"role":"user","content":"hi"}]}',
    b'{"model":"m","messages":' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b'{"model":"m","messages":[' + b"[" * 900 + b"]" * 900 + b"]}",
    b'{"model":"m","messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b"},'
    b'{"role":5,"content":"c"}]}',
    b'{"model":"m","messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b"},'
    b'{"content":"c"}]}',
    b'{"model":"m","messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b"},'
    b'"c"]}',
], ids=["model-list", "model-object", "deep-json", "deep-message", "role-number",
        "role-missing", "message-string"])
def test_malformed_bodies_are_400s_without_a_traceback(cluster, body: bytes) -> None:
    _p, _d, r = cluster
    before = metric(r.metrics(), "pdrouter_http_responses_total", code="400")
    assert_openai_error(post(r, body), 400)
    assert metric(r.metrics(), "pdrouter_http_responses_total", code="400") == before + 1
    assert metric(r.metrics(), "pdrouter_http_responses_total", code="500") == 0
    assert "Traceback" not in r.log_text()



def test_a_request_without_model_is_served_as_vllm_does(cluster) -> None:
    """vLLM serves a request with no (or a null) ``model`` with its served model; another
    name is a 404."""
    _p, _d, r = cluster
    for body in (b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}',
                 b'{"model":null,"messages":[{"role":"user","content":"hi"}],"max_tokens":2}'):
        got = post(r, body)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["message"]["content"] == "xx"
    assert_openai_error(post(r, b'{"model":"other","messages":[]}'), 404)


def test_a_client_that_never_finishes_its_body_gets_a_408_within_the_bound(
        cluster, tmp_path: Path) -> None:
    p, d, _r = cluster
    toml = router_toml([p.url], [d.url], http_port=free_port(), grpc_port=free_port(),
                       extra="[timeouts]\nclient_body_s = 1.0\n")
    with router_serve(toml, tmp_path) as r:
        host, port = r.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: 100\r\n\r\n{")  # 99 bytes short
            started = time.monotonic()
            seen = b""
            while b"\r\n\r\n" not in seen or not seen.rstrip().endswith(b"}"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                seen += chunk
            waited = time.monotonic() - started
        assert seen.startswith(b"HTTP/1.1 408"), seen[:200]
        assert 0.9 <= waited < 5
        assert json.loads(seen.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 408
        assert metric(r.metrics(), "pdrouter_http_responses_total", code="408") == 1


SECRET = b"sk-secret-4f1d"
CHAT_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
OK_BODY = b'{"model":"m","max_tokens":2,"messages":[{"role":"user","content":"hi"}]}'


def _req(headers: bytes, body: bytes = OK_BODY, length: bytes | None = None) -> bytes:
    cl = b"Content-Length: " + (length if length is not None else str(len(body)).encode())
    return CHAT_HEAD + headers + cl + b"\r\n\r\n" + body


def raw_exchange(r: RouterProc, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``data`` on a fresh connection; the answer's status, headers and body (read
    until the server closes, bounded by a 10 s socket timeout)."""
    host, port = r.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        seen = b""
        while chunk := s.recv(65536):
            seen += chunk
    head, _, body = seen.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split(" ")[1]), {k.lower(): v for k, v in headers.items()}, body


@pytest.mark.parametrize(("data", "status", "reason"), [
    (_req(b"Authorization: Bearer " + SECRET + b"\x01x\r\n"), 400, "invalid_header"),
    (_req(b"Authorization: Bearer " + SECRET + b"\x1b[2J\r\n"), 400, "invalid_header"),
    (_req(b"X-Session-Id: s\x00" + SECRET + b"\r\n"), 400, "invalid_header"),
    (_req(b"X-Session-Id: s\x7f" + SECRET + b"\r\n"), 400, "invalid_header"),
    (_req(b"X-Session-Id: s\r" + SECRET + b"\r\n"), 400, "invalid_header"),
    (_req(b"X Bad: v\r\n"), 400, "invalid_header"),
    (_req(b"X-Session-Id: " + SECRET + b"a" * 9000 + b"\r\n"), 431, "header_too_large"),
    (_req(b"".join(b"X-H%d: v\r\n" % i for i in range(200))), 431, "header_too_large"),
    (b"POST /v1/" + b"c" * 9000 + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",
     414, "request_line_too_long"),
    (_req(b"", length=b"-1"), 400, "invalid_content_length"),
    (_req(b"", length=b"12abc"), 400, "invalid_content_length"),
    (_req(b"Content-Length: 3\r\n"), 400, "invalid_content_length"),
    (_req(b"Transfer-Encoding: chunked\r\n"), 400, "invalid_framing"),
    (CHAT_HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", 400,
     "invalid_framing"),
    (b"P@ST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n", 400, "bad_request_line"),
    (b"POST /v1/chat/completions HTTP/9.9\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", 400,
     "bad_request_line"),
], ids=["auth-ctl", "auth-esc", "session-nul", "session-del", "session-cr", "header-name",
        "header-9k", "headers-200", "url-9k", "length-negative", "length-text",
        "length-twice", "length-and-chunked", "chunk-size", "method", "version"])
def test_a_request_http_cannot_parse_gets_an_openai_error_one_log_line_and_a_reason(
        cluster, data: bytes, status: int, reason: str) -> None:
    _p, _d, r = cluster
    before = r.metrics()
    log_before = r.log_text()
    got, headers, body = raw_exchange(r, data)
    assert got == status, body[:300]
    assert headers["content-type"].startswith("application/json")
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["type"] == "invalid_request_error" and err["message"]
    assert SECRET not in body  # the refused bytes are never echoed
    after = r.metrics()
    assert metric(after, "pdrouter_http_rejected_total", reason=reason) == \
        metric(before, "pdrouter_http_rejected_total", reason=reason) + 1
    assert metric(after, "pdrouter_http_responses_total", endpoint="-", code=str(status)) == \
        metric(before, "pdrouter_http_responses_total", endpoint="-", code=str(status)) + 1
    new = r.log_text()[len(log_before):]
    assert "Traceback" not in new and SECRET.decode() not in new, new
    refused = [line for line in new.splitlines() if "HTTP cannot parse" in line]
    assert len(refused) == 1 and f": {reason} (" in refused[0], new


def test_a_header_with_bytes_beyond_ascii_is_served_and_not_a_failure(cluster) -> None:
    """obs-text (0x80-0xff) is legal in a header value (RFC 9110): the request is served,
    its session key is the header's bytes."""
    _p, _d, r = cluster
    got, _, body = raw_exchange(r, _req(b"Connection: close\r\nX-Session-Id: s\xff\xe9\r\n"))
    assert got == 200, body[:300]
    assert metric(r.metrics(), "pdrouter_http_responses_total", code="500") == 0


@pytest.mark.parametrize(("body", "reason"), [
    (b'{"model":"m","messages":[{"role":"user","content":"\xff\xfe"}]}', "body_not_utf8"),
    (b"\xff\xfe{\x00}\x00", "body_not_utf8"),  # UTF-16 with a BOM: not decoded as such
    (b'{"model":"m","messages":', "body_not_json"),
    (b'{"model":"m","messages":"hi"}', "body_invalid"),
], ids=["latin1-in-string", "utf16", "truncated", "not-routable"])
def test_a_body_the_router_cannot_read_is_a_400_with_its_reason(cluster, body: bytes,
                                                                 reason: str) -> None:
    _p, _d, r = cluster
    before = metric(r.metrics(), "pdrouter_http_rejected_total", reason=reason)
    got = post(r, body)
    assert_openai_error(got, 400)
    assert metric(r.metrics(), "pdrouter_http_rejected_total", reason=reason) == before + 1
    assert "Traceback" not in r.log_text()


def test_a_body_over_the_cap_is_a_413_with_its_reason(cluster) -> None:
    """``[http] max_body_bytes`` (16 MiB by default) is the documented cap."""
    _p, _d, r = cluster
    before = metric(r.metrics(), "pdrouter_http_rejected_total", reason="body_too_large")
    big = b'{"model":"m","messages":[{"role":"user","content":"' + b"a" * (16 << 20) + b'"}]}'
    got = post(r, big)
    assert_openai_error(got, 413)
    assert str(16 << 20) in got.json()["error"]["message"]
    assert metric(r.metrics(), "pdrouter_http_rejected_total", reason="body_too_large") == \
        before + 1
