"""A loopback HTTP server of fixed texts, for sources that must read what a test wrote."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class TextServer:
    """Serves ``default`` on every path, except the paths in ``bodies`` (status, content type,
    text). Both may be changed between requests; ``address`` is ``HOST:PORT``. With
    ``render`` set, ``render()`` is served instead of ``default`` (a text made per request)."""

    def __init__(self, default: str = "",
                 content_type: str = "text/plain; version=0.0.4",
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.default = default
        self.content_type = content_type
        self.bodies: dict[str, tuple[int, str, str]] = {}
        self.render: Callable[[], str] | None = None
        served = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                render = served.render
                status, ctype, body = served.bodies.get(self.path, (
                    200, served.content_type,
                    render() if render is not None else served.default))
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                return

        self._server = ThreadingHTTPServer((host, port), Handler)
        self.port = self._server.server_port
        self.address = f"{host}:{self.port}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
