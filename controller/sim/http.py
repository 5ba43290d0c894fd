"""A minimal HTTP/1.1 server for the live simulator (one request per connection), with
OpenAI-shaped errors and an SSE writer.

Errors answer vLLM's error JSON (``{"error": {"message", "type", "param", "code"}}``) with
the HTTP status. A handler receives ``gone``: an awaitable that completes when the client
closes its side of the connection, so a streaming or waiting handler can abort its work.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

MAX_BODY_BYTES = 8 * 1024 * 1024
T = TypeVar("T")

Handler = Callable[[str, str, dict[str, str], bytes, asyncio.StreamWriter, Awaitable[None]],
                   Awaitable[None]]

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            413: "Payload Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}
_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError",
          413: "BadRequestError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class HttpError(Exception):
    """Answered as ``status`` with an OpenAI/vLLM error body."""

    def __init__(self, status: int, message: str, err_type: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.err_type = err_type or _TYPES.get(status, "BadRequestError")
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.err_type, "param": self.param,
                          "code": self.status}}


class ClientGone(Exception):
    """The client closed the connection before the answer was complete."""


async def wait_or_gone(aw: Awaitable[T], gone: Awaitable[None]) -> T:
    """``await aw``, or raise :class:`ClientGone` if the client leaves first."""
    task = asyncio.ensure_future(aw)
    gone_f = asyncio.ensure_future(gone)
    done, _ = await asyncio.wait({task, gone_f}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        return task.result()
    task.cancel()
    raise ClientGone


def openai_body(body: bytes, served_model: str) -> dict[str, Any]:
    """An OpenAI request body as vLLM takes it: a JSON object (400 otherwise) whose ``model``,
    when given, is the served one (404 in vLLM's words otherwise)."""
    try:
        doc = json.loads(body or b"")
    except ValueError:
        raise HttpError(400, "the request body is not valid JSON") from None
    if not isinstance(doc, dict):
        raise HttpError(400, "the request body must be a JSON object")
    model = doc.get("model")
    if model is not None and model != served_model:
        raise HttpError(404, f"The model `{model}` does not exist.", "NotFoundError",
                        param="model")
    return doc


async def relay_generated(queue: asyncio.Queue[tuple[int, bool]], sse: SseWriter | None,
                          gone: Awaitable[None], fail_status: int,
                          failure: Callable[[], str]) -> int | None:
    """Relay a simulated request's progress (``(tokens generated, done)`` from ``queue``; a
    negative count: it failed) to the SSE stream, if any, until done. The tokens generated,
    or None when it failed: the stream then ends with an error event, and a non-streamed
    answer raises ``HttpError(fail_status, failure())``."""
    sent = 0
    while True:
        generated, done = await wait_or_gone(queue.get(), gone)
        if generated < 0:
            if sse is None:
                raise HttpError(fail_status, failure())
            await sse.error(failure())
            return None
        if sse is not None and generated > sent:
            await sse.tokens(sent, generated)
        sent = max(sent, generated)
        if done:
            return sent


async def respond(writer: asyncio.StreamWriter, status: int, content_type: str,
                  body: bytes) -> None:
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'OK')}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    writer.write(head.encode() + body)
    await writer.drain()


async def respond_json(writer: asyncio.StreamWriter, status: int, doc: Any) -> None:
    await respond(writer, status, "application/json", json.dumps(doc).encode())


class SseWriter:
    """An OpenAI completion stream (chunked ``text/event-stream``): role chunk first for
    chat, one chunk per batch of new tokens, a finish chunk, the usage chunk when asked
    (``choices: []``), then ``data: [DONE]``."""

    def __init__(self, writer: asyncio.StreamWriter, chat: bool, rid: str, created: int,
                 model: str) -> None:
        self.w = writer
        self.chat = chat
        self.head = {"id": rid, "object": "chat.completion.chunk" if chat
                     else "text_completion", "created": created, "model": model}

    async def start(self) -> None:
        self.w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n"
                     b"Connection: close\r\n\r\n")
        await self.w.drain()

    async def send(self, doc: Any) -> None:
        data = b"data: " + (doc if isinstance(doc, bytes) else json.dumps(doc).encode())
        data += b"\n\n"
        self.w.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await self.w.drain()

    def chunk(self, text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            c: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                 "finish_reason": finish}
        else:
            c = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self.head, "choices": [c]}

    async def tokens(self, sent: int, generated: int) -> None:
        words = " ".join(["sim"] * (generated - sent))
        await self.send(self.chunk(words if sent == 0 else " " + words, None, role=sent == 0))

    async def finish(self, reason: str, usage: dict[str, int] | None) -> None:
        await self.send(self.chunk(None if self.chat else "", reason))
        if usage is not None:
            await self.send({**self.head, "choices": [], "usage": usage})
        await self.send(b"[DONE]")
        self.w.write(b"0\r\n\r\n")
        await self.w.drain()

    async def error(self, message: str) -> None:
        await self.send({"error": {"message": message, "type": "ServiceUnavailableError",
                                   "param": None, "code": 503}})
        await self.send(b"[DONE]")
        self.w.write(b"0\r\n\r\n")
        await self.w.drain()


async def _until_eof(reader: asyncio.StreamReader) -> None:
    with contextlib.suppress(ConnectionError):
        while await reader.read(4096):
            pass


class HttpServer:
    """A minimal HTTP/1.1 server (one request per connection) on asyncio streams."""

    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0) -> None:
        self.handler = handler
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None

    async def _read(self, reader: asyncio.StreamReader
                    ) -> tuple[str, str, dict[str, str], bytes] | None:
        parts = (await reader.readline()).decode("latin-1").split()
        if len(parts) < 2:
            return None
        headers: dict[str, str] = {}
        while True:
            h = await reader.readline()
            if h in (b"\r\n", b"\n", b""):
                break
            k, _, v = h.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        try:
            length = int(headers.get("content-length", "0") or 0)
        except ValueError:
            raise HttpError(400, "bad Content-Length") from None
        if length > MAX_BODY_BYTES:
            raise HttpError(413, "body too large")
        body = await reader.readexactly(length) if length > 0 else b""
        return parts[0].upper(), parts[1].split("?", 1)[0], headers, body

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        gone: asyncio.Task[None] | None = None
        try:
            req = await self._read(reader)
            if req is None:
                return
            gone = asyncio.create_task(_until_eof(reader))
            await self.handler(*req, writer, asyncio.shield(gone))
        except HttpError as e:
            with contextlib.suppress(Exception):
                await respond_json(writer, e.status, e.body())
        except (ConnectionError, asyncio.IncompleteReadError, ClientGone):
            pass
        except Exception as e:  # a bug must not kill the server; report it to the client
            with contextlib.suppress(Exception):
                await respond_json(writer, 500, HttpError(500, repr(e)).body())
        finally:
            if gone is not None:
                gone.cancel()
            with contextlib.suppress(Exception):
                writer.close()
