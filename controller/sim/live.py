"""Live mode: the simulated cluster in wall time, behind real sockets on loopback.

- per worker, its own HTTP endpoint (:mod:`controller.sim.protocol`): an OpenAI API with
  vLLM's P/D semantics (prefill leg and handle, decode leg pulling missing blocks,
  decode-local), ``/health``, ``/v1/models`` and ``/metrics`` (vLLM's exposition, or SGLang's
  with ``[cluster] metrics_engine = "sglang"``);
- per router, unless ``routers=False`` (``pdctl sim serve --workers-only``, for a router of
  its own process): the agent's ``pdrouter_*`` metrics, its gRPC servers
  (``controller.rollout.server.RouterServer``: policy service for the controller, agent
  service, health), so a real daemon can push policies, and an OpenAI-compatible API whose
  requests the in-simulation router routes (``POST /v1/chat/completions`` and
  ``POST /v1/completions``, streaming SSE or not, ``GET /v1/models``, ``GET /health``).

Tokens of every live HTTP request are counted with :mod:`controller.tokenize` (the bundled
tokenizer unless ``[serve] tokenizer`` names another): a chat prompt as its rendered chat
template, a completions prompt as its encoding with special tokens. A request naming another
model than the profile's answers 404 (vLLM's error shape). The simulated model generates
exactly ``max_tokens`` tokens (default ``[serve] default_max_tokens``, 64;
``max_completion_tokens`` is accepted too) and finishes with reason ``length``; the text is
the word ``sim`` repeated, one word per token.

Sessions at the in-simulation routers: a request carrying header ``X-Session-Id`` (or the
OpenAI ``user`` field) belongs to that session; otherwise a chat belongs to the session of its
first message. A request whose prompt is longer than the session's previous prompt + output
continues it (the common part is reusable context); any other starts the session over.

Ports: the OS picks them unless ``[serve] port_base`` (``--port-base``) fixes the layout of
docs/simulator.md. The event loop is paced to the wall clock: events run when their virtual
time is reached; the scenario's own traffic runs too unless ``traffic=False``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import Awaitable
from dataclasses import dataclass, field, replace
from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from controller.clock import VirtualClock, WallClock
from controller.errors import ConfigError
from controller.policy import Policy
from controller.sim.cluster import SimCluster, SimRequest
from controller.sim.engine import Engine
from controller.sim.http import (
    Handler,
    HttpError,
    HttpServer,
    SseWriter,
    openai_body,
    relay_generated,
    respond,
    respond_json,
)
from controller.sim.protocol import Hub, ProtocolConfig, WorkerApi
from controller.sim.router import SimRouter
from controller.sim.run import ScenarioDriver
from controller.sim.scenario import Scenario, ServeConfig
from controller.tokenize import Tokenizer, bundled_tokenizer_dir, load_tokenizer

# Fixed-port layout (``--port-base N`` / ``[serve] port_base``), documented in docs/simulator.md.
ROUTER_HTTP_OFFSET = 0
ROUTER_GRPC_OFFSET = 100
PREFILL_OFFSET = 200
DECODE_OFFSET = 300
PER_KIND = 100


def fixed_port(base: int | None, offset: int, index: int, what: str) -> int:
    """The port of the ``index``-th thing of a kind (0 = the OS picks when no base)."""
    if base is None:
        return 0
    if index >= PER_KIND:
        raise ConfigError(f"{what}: with a port base, at most {PER_KIND} of a kind "
                          f"(ports {base}..{base + 4 * PER_KIND - 1})")
    return base + offset + index


async def bind(server: HttpServer, what: str) -> None:
    try:
        await server.start()
    except OSError as e:
        raise ConfigError(f"cannot listen on {server.host}:{server.port} for {what}: "
                          f"{e.strerror or e} (another process holds the port? pick another "
                          f"--port-base)") from None


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
    """The cluster in wall time. ``routers=False`` (``--workers-only``) serves the workers
    alone, for a router of its own process in front of them; ``serve`` overrides the
    scenario's ``[serve]`` table (ports, tokenizer, protocol knobs)."""

    def __init__(self, scenario: Scenario, policy: Policy | None, *, host: str = "127.0.0.1",
                 traffic: bool = True, grpc: bool = True, routers: bool = True,
                 serve: ServeConfig | None = None, tokenizer: Tokenizer | None = None) -> None:
        self.scenario = scenario
        self.host = host
        self.wall = WallClock()
        self.serve = serve or scenario.serve
        self.tokenizer = tokenizer or load_tokenizer(self.serve.tokenizer
                                                     or bundled_tokenizer_dir())
        cfg = scenario.cluster
        live_cfg = replace(cfg, closed_form_runs=False)  # every step at its wall time
        self.clock = VirtualClock(start=0.0)
        self.cluster = SimCluster(live_cfg, scenario.profile, policy, clock=self.clock,
                                  seed=scenario.seed)
        self.driver = ScenarioDriver(scenario, self.cluster, traffic=traffic)
        self.protocol = ProtocolConfig(
            model=scenario.profile.model_name, tokenizer=self.tokenizer,
            max_model_len=scenario.profile.max_model_len,
            abort_timeout_s=self.serve.abort_timeout_s,
            no_handle_fraction=self.serve.no_handle_fraction,
            default_max_tokens=self.serve.default_max_tokens, host=host)
        self._want_grpc = grpc
        self._want_routers = routers
        self.hub: Hub = {}
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
        try:
            await self._sync_workers()
            if self._want_routers:
                await self._start_routers()
        except BaseException:
            await self.stop()
            raise
        self._pump_task = asyncio.create_task(self._pump())
        return self.addresses()

    async def _start_routers(self) -> None:
        base = self.serve.port_base
        for router in self.cluster.routers:
            i = router.index
            ep = RouterEndpoints(router, HttpServer(
                self._router_handler(router), self.host,
                fixed_port(base, ROUTER_HTTP_OFFSET, i, "routers")))
            self.routers.append(ep)
            await bind(ep.http, f"router {router.router_id}")
            if self._want_grpc:
                from controller.rollout.server import RouterServer

                port = fixed_port(base, ROUTER_GRPC_OFFSET, i, "routers")
                ep.grpc = RouterServer(router.agent, listen=f"{self.host}:{port}")
                try:
                    await ep.grpc.start()
                except (OSError, RuntimeError) as e:
                    ep.grpc = None
                    raise ConfigError(f"cannot listen on {self.host}:{port} for router "
                                      f"{router.router_id}'s gRPC: {e} (pick another "
                                      "--port-base)") from None

    def addresses(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario.name,
            "model": self.protocol.model,
            "workers": [
                {"name": name, "role": eng.role, "url": srv.url,
                 "metrics": f"{srv.url}/metrics", "openai": f"{srv.url}/v1"}
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

    def _worker_port(self, eng: Engine) -> int:
        offset = PREFILL_OFFSET if eng.role == "prefill" else DECODE_OFFSET
        return fixed_port(self.serve.port_base, offset, int(eng.name.rsplit("-", 1)[1]),
                          f"{eng.role} workers")

    async def _sync_workers(self) -> None:
        """Serve every live worker's endpoint (workers come and go with events)."""
        alive = {e.name: e for e in self.cluster.engines}
        for name in [n for n in self.workers if n not in alive]:
            eng, srv = self.workers.pop(name)
            self.hub.pop(f"sim-{name}", None)
            await srv.stop()
        for name, eng in alive.items():
            if name not in self.workers:
                api = WorkerApi(eng, self.cluster, self.protocol, self.hub, self.advance,
                                self.driver.next_rid)
                srv = HttpServer(api.handle, self.host, self._worker_port(eng))
                await bind(srv, f"worker {name}")
                api.port = srv.port
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
    def _router_handler(self, router: SimRouter) -> Handler:
        async def handle(method: str, path: str, headers: dict[str, str], body: bytes,
                         writer: asyncio.StreamWriter, gone: Awaitable[None]) -> None:
            if path == "/metrics":
                await respond(writer, 200, CONTENT_TYPE_LATEST,
                              generate_latest(router.agent.registry))
            elif path == "/health":
                await respond(writer, 200, "text/plain", b"ok")
            elif path == "/v1/models":
                await respond_json(writer, 200, {"object": "list", "data": [{
                    "id": self.protocol.model, "object": "model", "created": 0,
                    "owned_by": "pd-controller-sim"}]})
            elif path in ("/v1/chat/completions", "/v1/completions"):
                if method != "POST":
                    raise HttpError(405, "Method Not Allowed")
                await self._completion(router, path.endswith("chat/completions"), headers,
                                       body, writer, gone)
            else:
                raise HttpError(404, "Not Found")
        return handle

    def _endpoints(self, router: SimRouter) -> RouterEndpoints:
        return next(ep for ep in self.routers if ep.router is router)

    def _parse(self, chat: bool, body: bytes) -> tuple[dict[str, Any], int, str, int]:
        """(request, prompt tokens, opening text for the session key, max_tokens)."""
        doc = openai_body(body, self.protocol.model)
        if chat:
            messages = doc.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) for m in messages):
                raise HttpError(400, "messages: required, a non-empty list of objects")
            prompt = self.tokenizer.count_chat(messages)
            first = json.dumps(messages[0], sort_keys=True)
        else:
            text = doc.get("prompt")
            if isinstance(text, list):
                text = "".join(str(t) for t in text)
            if not isinstance(text, str):
                raise HttpError(400, "prompt: required, a string")
            prompt = self.tokenizer.count_text(text)
            first = text[:256]
        max_tokens = doc.get("max_completion_tokens", doc.get("max_tokens"))
        if max_tokens is None:
            max_tokens = self.protocol.default_max_tokens
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise HttpError(400, "max_tokens must be a positive integer")
        return doc, prompt, first, max_tokens

    def _session(self, router: SimRouter, key: str, prompt: int,
                 max_tokens: int) -> tuple[str, int, int]:
        """(session id, turn, reusable context): a longer prompt continues the session."""
        session_id = f"live/{key}"
        ep = self._endpoints(router)
        prev = ep.sessions.get(session_id)
        if prev is not None and prompt > prev.prompt + prev.output:
            turn, context = prev.turn + 1, prev.prompt + prev.output
        elif prev is not None and prompt > prev.prompt:
            turn, context = prev.turn + 1, prev.prompt
        else:
            turn, context = 1, 0
        ep.sessions[session_id] = _Session(turn, prompt, max_tokens)
        return session_id, turn, context

    async def _completion(self, router: SimRouter, chat: bool, headers: dict[str, str],
                          body: bytes, writer: asyncio.StreamWriter,
                          gone: Awaitable[None]) -> None:
        doc, prompt, first, max_tokens = self._parse(chat, body)
        key = headers.get("x-session-id") or doc.get("user") or (
            "h" + hashlib.sha256(first.encode()).hexdigest()[:16])
        session_id, turn, context = self._session(router, str(key), prompt, max_tokens)
        stream = doc.get("stream") is True
        opts = doc.get("stream_options") or {}
        include_usage = isinstance(opts, dict) and opts.get("include_usage") is True
        model = str(doc.get("model") or self.protocol.model)
        queue: asyncio.Queue[tuple[int, bool]] = asyncio.Queue()
        self.advance()
        sim_req = SimRequest(
            self.driver.next_rid(), session_id, turn, 0.0, prompt, prompt - context,
            max_tokens, max_tokens,
            on_complete=lambda r: queue.put_nowait((-1 if r.rejected else r.output_tokens,
                                                    True)),
            stream=(lambda r, n, now: queue.put_nowait((n, False))) if stream else None,
        )
        self.cluster.submit(sim_req, router=router.index)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-sim{sim_req.rid}"
        created = int(self.wall.now())
        sse = SseWriter(writer, chat, rid, created, model) if stream else None
        if sse is not None:
            await sse.start()
        sent = await relay_generated(queue, sse, gone, 400,
                                     lambda: f"request rejected: {sim_req.reject_reason}")
        if sent is None:
            return
        usage = {"prompt_tokens": prompt, "completion_tokens": sent,
                 "total_tokens": prompt + sent}
        if sse is not None:
            await sse.finish("length", usage if include_usage else None)
            return
        text = " ".join(["sim"] * sent)
        choice: dict[str, Any] = (
            {"index": 0, "finish_reason": "length", "logprobs": None,
             "message": {"role": "assistant", "content": text}} if chat else
            {"index": 0, "finish_reason": "length", "text": text, "logprobs": None})
        await respond_json(writer, 200, {
            "id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "choices": [choice], "usage": usage})
