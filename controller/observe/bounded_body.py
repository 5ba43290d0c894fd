"""Read an HTTP answer's body with a cap on its DECODED size, enforced while streaming.

A target chooses how it encodes its answer, whatever we asked for. httpx's own decoders
inflate each received chunk whole (a 64 KiB gzip chunk can inflate to about 64 MiB), and a
length check after ``response.content`` comes after the whole inflation. Here the raw bytes
are decoded by our own decoders whose output per step is bounded (``zlib``'s
``max_length``), so memory stays within the cap plus one step whatever the ratio:

* ``identity`` (or no ``Content-Encoding``), ``gzip``/``x-gzip`` and ``deflate`` (zlib or
  raw deflate, as httpx accepts), also chained (``gzip, gzip``);
* any other encoding (``br``, ``zstd``, ``compress``, unknown words) is refused with
  :class:`BodyRefused`: we never ask for them (``Accept-Encoding: gzip, deflate``), and
  their libraries offer no bounded-output step to rely on.

The raw bytes received count against the same cap, so an endless or padded body stops too.
The time a body may take is the caller's (a total deadline around the whole request).
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator, Iterator
from typing import Protocol

ACCEPT_ENCODING = "gzip, deflate"
_STEP = 64 * 1024  # the most decoded bytes one decoder step may produce


class BodyRefused(Exception):
    """The body is larger than the cap (decoded or raw) or in an encoding we do not decode."""


class _Decoder(Protocol):
    def feed(self, data: bytes) -> Iterator[bytes]: ...

    def finish(self) -> Iterator[bytes]: ...


class _Identity:
    def feed(self, data: bytes) -> Iterator[bytes]:
        if data:
            yield data

    def finish(self) -> Iterator[bytes]:
        return iter(())


class _Zlib:
    """gzip (``wbits`` 16 + 15) or deflate (zlib header, else raw deflate like httpx)."""

    def __init__(self, gzip: bool) -> None:
        self._gzip = gzip
        self._d = zlib.decompressobj(zlib.MAX_WBITS | 16 if gzip else zlib.MAX_WBITS)
        self._started = False

    def feed(self, data: bytes) -> Iterator[bytes]:
        if not self._gzip and not self._started and data:
            self._started = True
            try:  # probe the first bytes: a deflate body without the zlib header is raw
                zlib.decompressobj().decompress(data[:2], 1)
            except zlib.error:
                self._d = zlib.decompressobj(-zlib.MAX_WBITS)
        pending = data
        while pending:
            try:
                out = self._d.decompress(pending, _STEP)
            except zlib.error as e:
                raise BodyRefused(f"undecodable compressed body: {e}") from e
            pending = self._d.unconsumed_tail
            if not out:
                break  # no output means all input was taken (or the stream ended)
            yield out

    def finish(self) -> Iterator[bytes]:
        while not self._d.eof:
            out = self._d.decompress(b"", _STEP)  # drains buffered output, bounded
            if not out:
                break
            yield out


def _decoder_for(coding: str) -> _Decoder:
    if coding in ("", "identity"):
        return _Identity()
    if coding in ("gzip", "x-gzip"):
        return _Zlib(gzip=True)
    if coding == "deflate":
        return _Zlib(gzip=False)
    raise BodyRefused(f"content encoding {coding!r} not accepted (we ask for {ACCEPT_ENCODING})")


def decoders(content_encoding: str) -> list[_Decoder]:
    """The decoders for a ``Content-Encoding`` header, in the order to apply them (the
    header lists them in the order they were applied)."""
    codings = [c.strip().lower() for c in content_encoding.split(",") if c.strip()]
    if len(codings) > 4:
        raise BodyRefused(f"{len(codings)} content encodings stacked")
    return [_decoder_for(c) for c in reversed(codings)]


def _through(chain: list[_Decoder], data: bytes, final: bool) -> Iterator[bytes]:
    if not chain:
        if data:
            yield data
        return
    head, rest = chain[0], chain[1:]
    for piece in head.feed(data):
        yield from _through(rest, piece, False)
    if final:
        for piece in head.finish():
            yield from _through(rest, piece, False)
        yield from _through(rest, b"", True)


async def read_bounded(raw: AsyncIterator[bytes], content_encoding: str,
                       max_bytes: int) -> bytes:
    """The decoded body of ``raw`` (the undecoded chunks), or :class:`BodyRefused` as soon
    as the raw or the decoded bytes pass ``max_bytes``. Memory: at most ``max_bytes`` of
    output plus one decoder step."""
    chain = decoders(content_encoding)
    parts: list[bytes] = []
    size = 0
    received = 0

    def keep(pieces: Iterator[bytes]) -> None:
        nonlocal size
        for piece in pieces:
            size += len(piece)
            if size > max_bytes:
                raise BodyRefused(f"answer larger than {max_bytes} bytes (decoded)")
            parts.append(piece)

    async for chunk in raw:
        received += len(chunk)
        if received > max_bytes:
            raise BodyRefused(f"answer larger than {max_bytes} bytes (as sent)")
        keep(_through(chain, chunk, False))
    keep(_through(chain, b"", True))
    return b"".join(parts)
