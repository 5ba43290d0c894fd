"""Requests the HTTP parser refuses, answered in OpenAI's error shape.

aiohttp answers a request it cannot parse (a control character in a header, a header line
over its 8,190-byte limit, more than 128 headers, an invalid ``Content-Length``, a broken
chunked body, a bad request line) from ``RequestHandler.handle_error`` before any route
runs: a plain-text 400 echoing the offending bytes, and a logged traceback. The router's
server (:class:`JsonErrorRunner`) answers every such request with
``{"error": {"message", "type", "param", "code"}}`` and the status the problem calls for
(431 for headers too large, 414 for a request line too long, 400 otherwise), logs one line
without a traceback, and counts it in ``pdrouter_http_rejected_total{reason}`` through
``on_reject``. The answer and the log line never repeat the request's bytes: a header the
parser refused may be a client's ``Authorization``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import (
    BadStatusLine,
    HttpProcessingError,
    InvalidHeader,
    LineTooLong,
    PayloadEncodingError,
)
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from controller.router.metrics import RejectReason
from controller.router.protocol import error_doc

log = logging.getLogger(__name__)


_MESSAGES = {
    RejectReason.HEADER_TOO_LARGE: "request headers too large",
    RejectReason.REQUEST_LINE_TOO_LONG: "request line too long",
    RejectReason.INVALID_HEADER: "malformed request header (control character, invalid "
                                 "name or line ending)",
    RejectReason.INVALID_CONTENT_LENGTH: "invalid Content-Length header",
    RejectReason.INVALID_FRAMING: "malformed message framing (Transfer-Encoding or chunks)",
    RejectReason.BAD_REQUEST_LINE: "malformed request line",
    RejectReason.MALFORMED: "malformed HTTP request",
}


def classify(exc: HttpProcessingError) -> tuple[int, RejectReason]:
    """The status and reason for a parser error. A line too long is the request line's when
    it is the URL (the C parser hands the URL over as a ``bytearray``, the Python parser the
    whole line, which starts with the method) and a header's otherwise."""
    text = str(getattr(exc, "message", "") or exc)
    if isinstance(exc, LineTooLong):
        line = exc.args[0] if exc.args else b""
        if isinstance(line, bytearray) or (isinstance(line, bytes | str)
                                           and _starts_request_line(line)):
            return 414, RejectReason.REQUEST_LINE_TOO_LONG
        return 431, RejectReason.HEADER_TOO_LARGE
    if "Too many headers" in text:
        return 431, RejectReason.HEADER_TOO_LARGE
    if "Content-Length" in text and "Transfer-Encoding" not in text:
        return 400, RejectReason.INVALID_CONTENT_LENGTH
    if isinstance(exc, PayloadEncodingError) or "chunk" in text.lower() \
            or "Transfer-Encoding" in text:
        return 400, RejectReason.INVALID_FRAMING
    if isinstance(exc, BadStatusLine):
        return 400, RejectReason.BAD_REQUEST_LINE
    if isinstance(exc, InvalidHeader) or "header" in text.lower():
        return 400, RejectReason.INVALID_HEADER
    return 400, RejectReason.MALFORMED


def _starts_request_line(line: bytes | str) -> bool:
    head = line[:16].encode("latin-1", "replace") if isinstance(line, str) else line[:16]
    method, _, _ = head.partition(b" ")
    return bool(method) and method.isalpha() and method.isupper() and b" " in head


OnReject = Callable[[int, RejectReason], None]


class JsonErrorHandler(RequestHandler):
    """aiohttp's per-connection protocol, its error answers in OpenAI's shape."""

    on_reject: OnReject | None = None

    def handle_error(self, request: BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # an answer is on its way: the connection closes
            return super().handle_error(request, status, exc, message)
        if isinstance(exc, HttpProcessingError):
            status, reason = classify(exc)
            log.warning("router: refused a request from %s that HTTP cannot parse: %s "
                        "(%s, answered %d)", request.remote, reason.value,
                        type(exc).__name__, status)
            if self.on_reject is not None:
                self.on_reject(status, reason)
            text, kind = _MESSAGES[reason], "invalid_request_error"
        elif status == 500:  # a handler's bug: its traceback is what fixes it
            log.error("router: request failed unexpectedly", exc_info=exc)
            text, kind = "internal router error", "internal_error"
        else:
            text, kind = message or f"HTTP {status}", "server_error"
        resp = web.json_response(error_doc(status, text, kind), status=status)
        resp.force_close()
        return resp


class JsonErrorServer(web.Server):
    """A ``web.Server`` whose connections are :class:`JsonErrorHandler`."""

    def __init__(self, *args: Any, on_reject: OnReject | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_reject = on_reject

    def __call__(self) -> RequestHandler:
        handler = JsonErrorHandler(self, loop=self._loop, **self._kwargs)
        handler.on_reject = self.on_reject
        return handler


class JsonErrorRunner(web.AppRunner):
    """``web.AppRunner`` serving its application through :class:`JsonErrorServer`."""

    def __init__(self, app: web.Application, *, on_reject: OnReject | None = None,
                 **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._on_reject = on_reject

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()
        return JsonErrorServer(plain.request_handler, request_factory=plain.request_factory,
                               handler_cancellation=plain.handler_cancellation,
                               loop=plain._loop, on_reject=self._on_reject, **plain._kwargs)


__all__ = ["JsonErrorRunner", "RejectReason", "classify"]
