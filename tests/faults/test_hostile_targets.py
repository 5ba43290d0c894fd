"""Hostile metrics targets (issue 39, class 1): a real HTTP server on raw asyncio sockets that
trickles a byte a second, never finishes its headers, sends compression bombs (gzip, zlib
and raw deflate, gzip inside gzip), an endless chunked body, or an encoding we never asked
for. Each such target costs at most its total deadline and the size cap; the healthy
targets' observations are the same as without them."""

from __future__ import annotations

import asyncio
import gzip
import time
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Callable

import pytest
from prometheus_client import generate_latest

from controller.observe.scrape import MAX_BODY_BYTES, ScrapeSource
from controller.observe.source import Target
from tests.observe.cluster import VllmWorker

BOMB_DECODED = 256 * 1024 * 1024  # 8 x the cap
TRICKLE_MAX_S = 30  # the hostile server's own bound on how long it trickles


def _compress(kind: str, total: int) -> bytes:
    wbits = {"gzip": 31, "zlib": 15, "raw": -15}[kind]
    c = zlib.compressobj(9, zlib.DEFLATED, wbits)
    zeros = b"\0" * (1 << 20)
    parts = [c.compress(zeros) for _ in range(total >> 20)]
    return b"".join(parts) + c.flush()


@pytest.fixture(scope="module")
def bombs() -> dict[str, bytes]:
    g = _compress("gzip", BOMB_DECODED)
    return {"gzip": g, "zlib": _compress("zlib", BOMB_DECODED),
            "raw": _compress("raw", BOMB_DECODED), "gzip2": gzip.compress(g, 9)}


class HostileServer:
    """HTTP/1.1 on 127.0.0.1, one behaviour per path; every loop bounded in count and time."""

    def __init__(self, good: Callable[[], bytes], bombs: dict[str, bytes]) -> None:
        self.good, self.bombs = good, bombs
        self.server: asyncio.Server | None = None
        self.port = 0
        self.writers: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> HostileServer:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for writer in list(self.writers):  # the trickling handlers end with their connections
            writer.transport.abort()
        await asyncio.sleep(0)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1].decode()
                await self._answer(path, writer)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.writers.discard(writer)
            writer.close()

    async def _send(self, writer: asyncio.StreamWriter, body: bytes, encoding: str = "") -> None:
        enc = f"Content-Encoding: {encoding}\r\n" if encoding else ""
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n{enc}"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()

    async def _trickle(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        for i in range(min(len(data), TRICKLE_MAX_S)):
            writer.write(data[i:i + 1])
            await writer.drain()
            await asyncio.sleep(1.0)
        writer.close()

    async def _answer(self, path: str, writer: asyncio.StreamWriter) -> None:
        good = self.good()
        if path == "/good":
            await self._send(writer, good)
        elif path == "/good_gzip":
            await self._send(writer, gzip.compress(good), "gzip")
        elif path == "/trickle":  # headers at once, then the body a byte a second
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(good))
            await self._trickle(writer, good)
        elif path == "/headers":  # headers that never finish
            await self._trickle(writer, b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 100)
        elif path == "/endless":  # chunked, never a last chunk (bounded to 96 MiB here)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            line = b"# padding\n" * 104857  # about 1 MiB of valid comment lines
            for _ in range(96):
                writer.write(b"%x\r\n%s\r\n" % (len(line), line))
                await writer.drain()
            writer.close()
        elif path in ("/gzip", "/zlib", "/raw"):
            await self._send(writer, self.bombs[path[1:]],
                             "gzip" if path == "/gzip" else "deflate")
        elif path == "/gzip2":
            await self._send(writer, self.bombs["gzip2"], "gzip, gzip")
        elif path == "/br":
            await self._send(writer, b"\x1b\xff\xff\x0f" * 256, "br")
        elif path == "/zstd":
            await self._send(writer, b"\x28\xb5\x2f\xfd" + b"\0" * 64, "zstd")


@pytest.fixture
async def hostile(bombs: dict[str, bytes]) -> AsyncIterator[tuple[HostileServer, VllmWorker]]:
    worker = VllmWorker()
    worker.hist["ttft_s"].observe(0.2)
    async with HostileServer(lambda: generate_latest(worker.registry), bombs) as server:
        yield server, worker


EXPECTED = {
    "trickle": ("timeout", "within"), "headers": ("timeout", "within"),
    "endless": ("parse", "larger than"), "gzip": ("parse", "larger than"),
    "zlib": ("parse", "larger than"), "raw": ("parse", "larger than"),
    "gzip2": ("parse", "larger than"), "br": ("parse", "not accepted"),
    "zstd": ("parse", "not accepted"),
}


@pytest.mark.integration
async def test_hostile_targets_cost_their_deadline_and_cap_and_nothing_else(
    hostile: tuple[HostileServer, VllmWorker],
) -> None:
    server, worker = hostile
    base = f"http://127.0.0.1:{server.port}"
    good = [Target("good", "decode", f"{base}/good"),
            Target("good_gzip", "decode", f"{base}/good_gzip")]
    bad = [Target(name, "prefill", f"{base}/{name}") for name in EXPECTED]
    timeout_s = 1.5
    alone = ScrapeSource(good, timeout_s=timeout_s)
    mixed = ScrapeSource(good + bad, timeout_s=timeout_s)
    try:
        await alone.window(0, 30)
        await mixed.window(0, 30)
        worker.hist["ttft_s"].observe(0.4)
        t0 = time.monotonic()
        w = await mixed.window(30, 60)
        elapsed = time.monotonic() - t0
        reference = await alone.window(30, 60)
    finally:
        await alone.aclose()
        await mixed.aclose()
    # the trickling targets would take TRICKLE_MAX_S; each costs its total deadline at most
    assert elapsed < 2 * timeout_s + 1.0, elapsed
    got = {f.target: (f.kind, f.message) for f in w.failures}
    assert set(got) == set(EXPECTED)
    for name, (kind, words) in EXPECTED.items():
        assert got[name][0] == kind and words in got[name][1], (name, got[name])
    assert list(w.answered) == ["good", "good_gzip"]
    assert [s.to_dict() for s in w.workers] == [s.to_dict() for s in reference.workers]
    for stats in w.workers:
        assert stats.ttft_s is not None and stats.ttft_s.count == 1
        assert stats.ttft_s.mean == pytest.approx(0.4)


@pytest.mark.integration
@pytest.mark.parametrize("bomb", ["gzip", "zlib", "raw", "gzip2", "endless"])
async def test_a_compression_bomb_costs_at_most_the_cap_in_memory(
    hostile: tuple[HostileServer, VllmWorker], bomb: str,
) -> None:
    server, _ = hostile
    source = ScrapeSource([Target(bomb, "decode", f"http://127.0.0.1:{server.port}/{bomb}")],
                          timeout_s=20.0)
    tracemalloc.start()
    try:
        w = await source.window(0, 30)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        await source.aclose()
    assert [f.kind for f in w.failures] == ["parse"]
    # decoded 256 MiB before the fix (and twice that while joining); now the cap + a margin
    # (the server's own bomb and chunk buffers in this process included)
    assert peak < MAX_BODY_BYTES + 16 * 1024 * 1024, peak
