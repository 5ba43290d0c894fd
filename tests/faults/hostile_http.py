"""A hostile HTTP/1.1 server on raw asyncio sockets (issue 39: a metrics target, class 1, or
a Prometheus, that answers forever or expands). Per path (its first segment) it trickles a
byte a second, never finishes its headers, sends compression bombs (gzip, zlib and raw
deflate, gzip inside gzip), an endless chunked body, or an encoding nobody asked for. Every
loop is bounded in count and time."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import Callable

TRICKLE_MAX_S = 30  # the hostile server's own bound on how long it trickles


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
                # the first segment names the behaviour: /trickle/api/v1/query?... trickles
                await self._answer("/" + path.split("?", 1)[0].split("/")[1], writer)
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
