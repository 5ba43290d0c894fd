"""The wrapped Prometheus client against small real HTTP servers on loopback: every way the
client library fails becomes one PrometheusError, transient or terminal."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from controller.errors import TerminalError, TransientError
from controller.observe.prometheus import (
    PrometheusClient,
    PrometheusError,
    PrometheusQueryError,
    PrometheusUnavailable,
    build_queries,
)


class _Api(BaseHTTPRequestHandler):
    hits: ClassVar[dict[str, int]] = {}

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        _Api.hits[path] = _Api.hits.get(path, 0) + 1
        if path.startswith("/bad/"):
            body = json.dumps({"status": "error", "errorType": "bad_data",
                               "error": "1:5: parse error: unexpected"}).encode()
            self._send(400, "application/json", body)
        elif path.startswith("/down/"):
            self._send(503, "text/plain", b"unavailable")
        elif path.startswith("/html/"):
            self._send(200, "text/html", b"<html>proxy login</html>")
        elif path.startswith("/nan/"):
            body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
                {"metric": {"instance": "a"}, "value": [1.0, "NaN"]},
                {"metric": {"instance": "b"}, "value": [1.0, "+Inf"]}]}}).encode()
            self._send(200, "application/json", body)
        else:
            self._send(404, "text/plain", b"")

    def _send(self, status: int, ctype: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return


@pytest.fixture
def api() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Api.hits = {}
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.integration
async def test_bad_query_is_terminal_with_the_error_type(api: str) -> None:
    client = PrometheusClient(api + "/bad/", timeout_s=2, retries=2, backoff_s=0)
    with pytest.raises(PrometheusQueryError) as e:
        await client.query("sum(", 1.0)
    assert isinstance(e.value, TerminalError) and isinstance(e.value, PrometheusError)
    assert e.value.error_type == "bad_data"
    assert "parse error" in str(e.value)
    assert _Api.hits["/bad/api/v1/query"] == 1  # a refused query is not retried


@pytest.mark.integration
async def test_unavailable_is_transient_after_bounded_retries(api: str) -> None:
    client = PrometheusClient(api + "/down/", timeout_s=2, retries=2, backoff_s=0)
    with pytest.raises(PrometheusUnavailable) as e:
        await client.query("up", 1.0)
    assert isinstance(e.value, TransientError)
    assert "503" in str(e.value)
    assert _Api.hits["/down/api/v1/query"] == 3  # first try + 2 retries, then it gives up


@pytest.mark.integration
async def test_refused_connection_and_timeout_are_transient() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(PrometheusUnavailable):
        await PrometheusClient(f"http://127.0.0.1:{port}", timeout_s=1, retries=1,
                               backoff_s=0).query("up", 1.0)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    try:
        with pytest.raises(PrometheusUnavailable):
            await PrometheusClient(f"http://127.0.0.1:{silent.getsockname()[1]}",
                                   timeout_s=0.3, retries=0).query("up", 1.0)
    finally:
        silent.close()


@pytest.mark.integration
async def test_not_api_json_is_terminal(api: str) -> None:
    with pytest.raises(PrometheusQueryError):
        await PrometheusClient(api + "/html/", timeout_s=2, retries=0).query("up", 1.0)


@pytest.mark.integration
async def test_values_are_strings_including_nan_and_inf(api: str) -> None:
    from controller.observe.prometheus import parse_value

    rows = await PrometheusClient(api + "/nan/", timeout_s=2).query("x", 1.0)
    values = [parse_value(r["value"][1]) for r in rows]
    assert values[0] != values[0] and values[1] == float("inf")


def test_query_count_does_not_grow_with_workers() -> None:
    # The queries name families, never instances: the same text for any cluster size.
    for window_ms in (None, 30_000):
        queries = build_queries(window_ms)
        assert len(queries) == 5
        assert all("instance=" not in q.promql for q in queries)
        assert all("by (instance" in q.promql for q in queries)
