"""``controller.router.http_errors.classify``: every parser error aiohttp raises, from its C
parser (what a router runs) and its pure-Python one (``AIOHTTP_NO_EXTENSIONS``), maps to
one status and reason. The C parser's errors are exercised against the real process in
``test_router_hostile.py``; here the Python parser's own exceptions, built as it builds
them."""

from __future__ import annotations

import pytest
from aiohttp.http_exceptions import (
    BadHttpMessage,
    BadHttpMethod,
    BadStatusLine,
    InvalidHeader,
    LineTooLong,
    TransferEncodingError,
)

from controller.router.http_errors import classify
from controller.router.metrics import RejectReason


@pytest.mark.parametrize(("exc", "status", "reason"), [
    (InvalidHeader(b"Bearer a\x01b"), 400, RejectReason.INVALID_HEADER),
    (InvalidHeader(b"X Bad"), 400, RejectReason.INVALID_HEADER),
    (InvalidHeader("Content-Length"), 400, RejectReason.INVALID_CONTENT_LENGTH),
    (BadHttpMessage("Duplicate 'Content-Length' header found."), 400,
     RejectReason.INVALID_CONTENT_LENGTH),
    (BadHttpMessage("Transfer-Encoding can't be present with Content-Length"), 400,
     RejectReason.INVALID_FRAMING),
    (TransferEncodingError("zz"), 400, RejectReason.INVALID_FRAMING),
    (LineTooLong(b"X-Session-Id: " + b"a" * 9000, 8190), 431, RejectReason.HEADER_TOO_LARGE),
    (LineTooLong(b"aaaa", 8190), 431, RejectReason.HEADER_TOO_LARGE),  # C: the value alone
    (LineTooLong(b"POST /" + b"x" * 9000, 8190), 414, RejectReason.REQUEST_LINE_TOO_LONG),
    (LineTooLong(bytearray(b"/xxxx"), 8190), 414, RejectReason.REQUEST_LINE_TOO_LONG),
    (BadHttpMessage("Too many headers received"), 431, RejectReason.HEADER_TOO_LARGE),
    (BadHttpMethod("P@ST"), 400, RejectReason.BAD_REQUEST_LINE),
    (BadStatusLine("POST /x HTTP/9.9"), 400, RejectReason.BAD_REQUEST_LINE),
    (BadHttpMessage("something new"), 400, RejectReason.MALFORMED),
], ids=lambda x: x if isinstance(x, int) else None)
def test_every_parser_error_has_one_status_and_reason(exc, status, reason) -> None:
    assert classify(exc) == (status, reason)
