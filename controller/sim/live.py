"""Live mode: the simulated cluster in wall time, behind real sockets on loopback.

- one HTTP ``/metrics`` endpoint per worker (vLLM's exposition, or SGLang's with
  ``[cluster] metrics_engine = "sglang"``) and per router (the agent's
  ``pdrouter_*`` metrics);
- per router, the agent's gRPC servers (``controller.rollout.server.RouterServer``: policy
  service for the controller, agent service, health), so a real daemon can push policies;
- per router, an OpenAI-compatible API: ``POST /v1/chat/completions`` and
  ``POST /v1/completions`` (streaming SSE or not), ``GET /v1/models``, ``GET /health``.

Token-count rule for text (documented in ``docs/simulator.md``): a text costs
``ceil(utf-8 bytes / 4)`` tokens (at least 1); a chat prompt is the sum over messages of
``tokens(content) + 4``, plus 3. The simulated model generates exactly ``max_tokens`` tokens
(default 64; ``max_completion_tokens`` is accepted too) and finishes with reason ``length``;
the text is the word ``sim`` repeated, one word per token.

Sessions: a request carrying header ``X-Session-Id`` (or the OpenAI ``user`` field) belongs
to that session; otherwise a chat belongs to the session of its first message. A request
whose prompt is longer than the session's previous prompt + output continues it (the common
part is reusable context); any other starts the session over.

The event loop is paced to the wall clock: events run when their virtual time is reached;
the scenario's own traffic runs too unless ``traffic=False``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from controller.clock import VirtualClock, WallClock
from controller.policy import Policy
from controller.sim.cluster import SimCluster, SimRequest
from controller.sim.engine import Engine
from controller.sim.router import SimRouter
from controller.sim.run import ScenarioDriver
from controller.sim.scenario import Scenario

DEFAULT_MAX_TOKENS = 64
MAX_BODY_BYTES = 8 * 1024 * 1024

Handler = Callable[[str, str, dict[str, str], bytes, asyncio.StreamWriter], Awaitable[None]]


def text_tokens(text: str) -> int:
    return max(1, math.ceil(len(text.encode("utf-8")) / 4))


def chat_prompt_tokens(messages: list[dict[str, Any]]) -> int:
    total = 3
    for m in messages:
        content = m.get("content", "")
        if isinstance(content, list):  # content parts: count the text ones
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        total += text_tokens(str(content)) + 4
    return total


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            413: "Payload Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}


async def respond(writer: asyncio.StreamWriter, status: int, content_type: str,
                  body: bytes) -> None:
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'OK')}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    writer.write(head.encode() + body)
    await writer.drain()


async def respond_json(writer: asyncio.StreamWriter, status: int, doc: Any) -> None:
    await respond(writer, status, "application/json", json.dumps(doc).encode())


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

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            parts = line.decode("latin-1").split()
            if len(parts) < 2:
                return
            method, target = parts[0].upper(), parts[1]
            headers: dict[str, str] = {}
            while True:
                h = await reader.readline()
                if h in (b"\r\n", b"\n", b""):
                    break
                k, _, v = h.decode("latin-1").partition(":")
                headers[k.strip().lower()] = v.strip()
            length = int(headers.get("content-length", "0") or 0)
            if length > MAX_BODY_BYTES:
                raise HttpError(413, "body too large")
            body = await reader.readexactly(length) if length else b""
            await self.handler(method, target.split("?", 1)[0], headers, body, writer)
        except HttpError as e:
            with contextlib.suppress(Exception):
                await respond_json(writer, e.status, {"error": {"message": str(e),
                                                                "type": "invalid_request_error"}})
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except Exception as e:  # a bug must not kill the server; report it to the client
            with contextlib.suppress(Exception):
                await respond_json(writer, 500, {"error": {"message": repr(e)}})
        finally:
            with contextlib.suppress(Exception):
                writer.close()


@dataclass
class _Session:
    turn: int
    prompt: int
    output: int


@dataclass
class RouterEndpoints:
    router: SimRouter
    http: HttpServer
    grpc: Any = None  # RouterServer when controller.rollout.server is available
    sessions: dict[str, _Session] = field(default_factory=dict)


class LiveSim:
    def __init__(self, scenario: Scenario, policy: Policy | None, *, host: str = "127.0.0.1",
                 traffic: bool = True, grpc: bool = True) -> None:
        self.scenario = scenario
        self.host = host
        self.wall = WallClock()
        cfg = scenario.cluster
        live_cfg = type(cfg)(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__},
                                "closed_form_runs": False})  # every step at its wall time
        self.clock = VirtualClock(start=0.0)
        self.cluster = SimCluster(live_cfg, scenario.profile, policy, clock=self.clock,
                                  seed=scenario.seed)
        self.driver = ScenarioDriver(scenario, self.cluster, traffic=traffic)
        self._want_grpc = grpc
        self.workers: dict[str, tuple[Engine, HttpServer]] = {}
        self.routers: list[RouterEndpoints] = []
        self._t0 = 0.0
        self._pump_task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    # ------------------------------------------------------------ lifecycle
    def sim_now(self) -> float:
        return self.wall.monotonic() - self._t0

    async def start(self) -> dict[str, Any]:
        self._t0 = self.wall.monotonic()
        self.driver.install()
        await self._sync_workers()
        for router in self.cluster.routers:
            ep = RouterEndpoints(router, HttpServer(self._router_handler(router), self.host))
            await ep.http.start()
            if self._want_grpc:
                from controller.rollout.server import RouterServer

                ep.grpc = RouterServer(router.agent, listen=f"{self.host}:0")
                await ep.grpc.start()
            self.routers.append(ep)
        self._pump_task = asyncio.create_task(self._pump())
        return self.addresses()

    def addresses(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario.name,
            "workers": [
                {"name": name, "role": eng.role, "metrics": f"{srv.url}/metrics"}
                for name, (eng, srv) in self.workers.items()
            ],
            "routers": [
                {"id": ep.router.router_id, "metrics": f"{ep.http.url}/metrics",
                 "openai": f"{ep.http.url}/v1",
                 "grpc": ep.grpc.address if ep.grpc is not None else None}
                for ep in self.routers
            ],
        }

    async def stop(self) -> None:
        self._stopping.set()
        if self._pump_task is not None:
            self._pump_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump_task
        for ep in self.routers:
            await ep.http.stop()
            if ep.grpc is not None:
                await ep.grpc.stop(0.5)
        for _, srv in self.workers.values():
            await srv.stop()

    async def _sync_workers(self) -> None:
        """Serve /metrics for every live worker (workers come and go with events)."""
        alive = {e.name: e for e in self.cluster.engines}
        for name in [n for n in self.workers if n not in alive]:
            _, srv = self.workers.pop(name)
            await srv.stop()
        for name, eng in alive.items():
            if name not in self.workers:
                srv = HttpServer(self._worker_handler(eng), self.host)
                await srv.start()
                self.workers[name] = (eng, srv)

    def advance(self) -> None:
        self.cluster.loop.advance_to(self.sim_now())

    async def _pump(self) -> None:
        n_workers = len(self.cluster.engines)
        while not self._stopping.is_set():
            self.advance()
            if len(self.cluster.engines) != n_workers or any(
                n not in self.workers for n in (e.name for e in self.cluster.engines)
            ):
                await self._sync_workers()
                n_workers = len(self.cluster.engines)
            nxt = self.cluster.loop.next_time()
            delay = 0.005 if nxt is None else min(0.005, max(0.0, nxt - self.sim_now()))
            await self.wall.sleep(delay)

    # ------------------------------------------------------------ handlers
    def _worker_handler(self, eng: Engine) -> Handler:
        async def handle(method: str, path: str, headers: dict[str, str], body: bytes,
                         writer: asyncio.StreamWriter) -> None:
            if path != "/metrics":
                raise HttpError(404, f"no route {path}")
            self.advance()
            await respond(writer, 200, CONTENT_TYPE_LATEST, generate_latest(eng.registry))
        return handle

    def _router_handler(self, router: SimRouter) -> Handler:
        async def handle(method: str, path: str, headers: dict[str, str], body: bytes,
                         writer: asyncio.StreamWriter) -> None:
            if path == "/metrics":
                await respond(writer, 200, CONTENT_TYPE_LATEST,
                              generate_latest(router.agent.registry))
            elif path == "/health":
                await respond(writer, 200, "text/plain", b"ok")
            elif path == "/v1/models":
                await respond_json(writer, 200, {"object": "list", "data": [{
                    "id": self.scenario.profile.model_name, "object": "model", "created": 0,
                    "owned_by": "pd-controller-sim"}]})
            elif path in ("/v1/chat/completions", "/v1/completions"):
                if method != "POST":
                    raise HttpError(405, "use POST")
                await self._completion(router, path.endswith("chat/completions"), headers,
                                       body, writer)
            else:
                raise HttpError(404, f"no route {path}")
        return handle

    def _endpoints(self, router: SimRouter) -> RouterEndpoints:
        return next(ep for ep in self.routers if ep.router is router)

    async def _completion(self, router: SimRouter, chat: bool, headers: dict[str, str],
                          body: bytes, writer: asyncio.StreamWriter) -> None:
        try:
            req_doc = json.loads(body or b"{}")
        except ValueError:
            raise HttpError(400, "body is not JSON") from None
        if not isinstance(req_doc, dict):
            raise HttpError(400, "body must be a JSON object")
        if chat:
            messages = req_doc.get("messages")
            if not isinstance(messages, list) or not messages:
                raise HttpError(400, "messages: required, a non-empty list")
            prompt = chat_prompt_tokens(messages)
            first = json.dumps(messages[0], sort_keys=True)
        else:
            text = req_doc.get("prompt")
            if isinstance(text, list):
                text = "".join(str(t) for t in text)
            if not isinstance(text, str):
                raise HttpError(400, "prompt: required, a string")
            prompt = text_tokens(text)
            first = text[:256]
        max_tokens = req_doc.get("max_completion_tokens", req_doc.get("max_tokens"))
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise HttpError(400, "max_tokens: must be a positive integer")
        session_key = headers.get("x-session-id") or req_doc.get("user") or (
            "h" + hashlib.sha256(first.encode()).hexdigest()[:16])
        session_id = f"live/{session_key}"
        ep = self._endpoints(router)
        prev = ep.sessions.get(session_id)
        if prev is not None and prompt > prev.prompt + prev.output:
            turn, context = prev.turn + 1, prev.prompt + prev.output
        elif prev is not None and prompt > prev.prompt:
            turn, context = prev.turn + 1, prev.prompt
        else:
            turn, context = 1, 0
        ep.sessions[session_id] = _Session(turn, prompt, max_tokens)
        stream = bool(req_doc.get("stream", False))
        include_usage = bool((req_doc.get("stream_options") or {}).get("include_usage"))
        model = str(req_doc.get("model") or self.scenario.profile.model_name)
        queue: asyncio.Queue[tuple[int, bool]] = asyncio.Queue()

        def on_tokens(r: SimRequest, generated: int, now: float) -> None:
            queue.put_nowait((generated, False))

        def on_complete(r: SimRequest) -> None:
            queue.put_nowait((-1 if r.rejected else r.output_tokens, True))

        self.advance()
        sim_req = SimRequest(
            self.driver.next_rid(), session_id, turn, 0.0, prompt, prompt - context,
            max_tokens, max_tokens, on_complete=on_complete, stream=on_tokens if stream else None,
        )
        self.cluster.submit(sim_req, router=router.index)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-sim{sim_req.rid}"
        created = int(self.wall.now())
        usage = {"prompt_tokens": prompt, "completion_tokens": max_tokens,
                 "total_tokens": prompt + max_tokens}
        if not stream:
            while True:
                generated, done = await queue.get()
                if done:
                    break
            if generated < 0:
                raise HttpError(400, f"request rejected: {sim_req.reject_reason}")
            text = " ".join(["sim"] * generated)
            if chat:
                choice: dict[str, Any] = {"index": 0, "finish_reason": "length",
                                          "message": {"role": "assistant", "content": text},
                                          "logprobs": None}
            else:
                choice = {"index": 0, "finish_reason": "length", "text": text, "logprobs": None}
            await respond_json(writer, 200, {
                "id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": model, "choices": [choice], "usage": usage})
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n"
                     b"Connection: close\r\n\r\n")

        async def send(doc: Any) -> None:
            data = b"data: " + (doc if isinstance(doc, bytes) else json.dumps(doc).encode())
            data += b"\n\n"
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await writer.drain()

        def chunk(text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                c: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish,
                                     "logprobs": None}
                obj = "chat.completion.chunk"
            else:
                c = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
                obj = "text_completion"
            return {"id": rid, "object": obj, "created": created, "model": model,
                    "choices": [c]}

        sent = 0
        while True:
            generated, done = await queue.get()
            if generated < 0:
                await send({"error": {"message": f"request rejected: {sim_req.reject_reason}"}})
                break
            if generated > sent:
                words = " ".join(["sim"] * (generated - sent))
                await send(chunk(words if sent == 0 else " " + words, None, role=sent == 0))
                sent = generated
            if done:
                await send(chunk(None if chat else "", "length"))
                if include_usage:
                    await send({"id": rid, "object": "chat.completion.chunk" if chat
                                else "text_completion", "created": created, "model": model,
                                "choices": [], "usage": usage})
                break
        await send(b"[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
