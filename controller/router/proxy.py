"""The router's HTTP side: the OpenAI-compatible API and the execution of each route.

Per request: parse → features → ``RouterAgent.decide()`` → prefill leg (route PREFILL_NODE)
→ decode leg to the session's D, relayed back → ``RouterAgent.observe()`` with TTFT/TPOT
measured on the relayed stream. Failure rules (each counted, see ``docs/router.md``):

* prefill leg fails (connection, 5xx, timeout, bad or handle-less answer): one retry on
  another P, then decode-local (``pdrouter_fallbacks_total{reason}``); a 4xx from P goes to
  the client as it is;
* decode leg fails before its first event: an OpenAI-shaped 502 (connection), 504 (timeout)
  or D's own error answer; no healthy D: 503; mid-stream: an SSE error event, then the end;
* the client hangs up: the handler is cancelled and both legs' connections are closed, which
  is how vLLM notices an abort.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import uuid
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from controller.clock import Clock
from controller.policy import Decision, Features, Route
from controller.rollout.agent import RouterAgent
from controller.rollout.qps import QpsMeter
from controller.router.config import RouterConfig
from controller.router.features import (
    FIRST_TURN_UNCOUNTED,
    CompletionSessions,
    Shape,
    chat_shape,
    output_tokens_of,
    prompt_tokens_of,
)
from controller.router.instances import Pool
from controller.router.merge import merge_expositions
from controller.router.metrics import DecodeFailure, FallbackReason, RouterHttpMetrics, Stage
from controller.router.protocol import (
    REQUEST_ID_HEADER,
    body_problem,
    client_wants_usage,
    decode_body,
    error_doc,
    expected_output,
    handle_of,
    pick_decode,
    prefill_body,
    prompt_text,
    session_key,
)
from controller.router.relay import SseScan
from controller.router.tokens import TokenCounts

log = logging.getLogger(__name__)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ROUTE_HEADER = "X-PDRouter-Route"
DECODE_HEADER = "X-PDRouter-Decode"
POLICY_HEADER = "X-PDRouter-Policy"  # the policy version that decided the request
PRIVATE_KEY: web.AppKey[bool] = web.AppKey("pdrouter_private_metrics", bool)
# D's silence is cut after between_tokens_s, and at most this fraction later (see _pump).
BETWEEN_TOKENS_SLACK = 0.05
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


def error_response(status: int, message: str, kind: str) -> web.Response:
    return web.json_response(error_doc(status, message, kind), status=status)


class RequestError(Exception):
    """Ends a request with an OpenAI-shaped error answer."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


@dataclass(slots=True)
class Ctx:
    """One client request as it goes through the router."""

    endpoint: str
    chat: bool
    body: dict[str, Any]
    stream: bool
    headers: dict[str, str]
    started: float
    key: str = ""
    shape: Shape | None = None
    features: Features | None = None
    decision: Decision | None = None
    decode_url: str = ""
    policy_version: int = 0
    stage: Stage = Stage.PREFILL
    prefilled: bool = False


class Router:
    """Serves the client API for one process. ``session`` is the upstream HTTP client."""

    def __init__(self, cfg: RouterConfig, agent: RouterAgent, counts: TokenCounts,
                 prefill: Pool, decode: Pool, metrics: RouterHttpMetrics,
                 session: aiohttp.ClientSession, clock: Clock) -> None:
        self.cfg, self.agent, self.counts = cfg, agent, counts
        self.p, self.d, self.m = prefill, decode, metrics
        self.session = session
        self._perf = clock.monotonic
        self._qps = QpsMeter(clock, cfg.sessions.qps_window_s)
        self._sessions = CompletionSessions(cfg.sessions.max_sessions)
        self._key = cfg.http.client_key()
        engine_key = cfg.instances.api_key
        self._engine_auth = ({"Authorization": f"Bearer {engine_key.get_secret_value()}"}
                             if engine_key is not None else None)
        self._names = set(cfg.model.names)
        t = cfg.timeouts
        self._t = t
        self._p_timeout = aiohttp.ClientTimeout(total=None, sock_connect=t.connect_s)
        # With several processes: every process's private /metrics, merged on each scrape.
        self.metrics_peers: list[str] = []

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.http.max_body_bytes)
        app.router.add_post(CHAT, self.chat)
        app.router.add_post(COMPLETIONS, self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    def metrics_app(self, private: bool = False) -> web.Application:
        """``/metrics`` alone; ``private``: this process's own samples, never merged."""
        app = web.Application()
        if private:
            app[PRIVATE_KEY] = True
        app.router.add_get("/metrics", self.metrics)
        return app

    # -- small endpoints -------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if not self.d.healthy():
            return error_response(503, "no healthy decode instance", "service_unavailable")
        return web.Response(text="ok")

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.agent.registry)
        if self.metrics_peers and request.app.get(PRIVATE_KEY) is None:
            texts = await asyncio.gather(*(self._peer_metrics(u) for u in self.metrics_peers))
            if any(t is None for t in texts):
                return error_response(503, "a router process did not answer its metrics",
                                      "service_unavailable")
            body = merge_expositions(t for t in texts if t is not None).encode()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _peer_metrics(self, url: str) -> str | None:
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(
                    total=self._t.health_s * 5)) as r:
                return await r.text() if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError):
            return None

    async def models(self, request: web.Request) -> web.Response:
        if (denied := self._auth(request)) is not None:
            return denied
        if self._names:
            data = [{"id": n, "object": "model", "owned_by": "pd-controller"}
                    for n in sorted(self._names)]
            return web.json_response({"object": "list", "data": data})
        for url in self.d.healthy():
            try:
                async with self.session.get(url + "/v1/models", headers=self._auth_header(
                        request), timeout=aiohttp.ClientTimeout(total=self._t.health_s * 5)) as r:
                    return web.Response(body=await r.read(), status=r.status,
                                        content_type="application/json")
            except (aiohttp.ClientError, TimeoutError):
                continue
        return error_response(503, "no healthy decode instance", "service_unavailable")

    def _auth(self, request: web.Request) -> web.Response | None:
        if self._key is None:
            return None
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, f"Bearer {self._key}".encode()):  # constant time
            return error_response(401, "invalid or missing API key", "authentication_error")
        return None

    @staticmethod
    def _auth_header(request: web.Request) -> dict[str, str]:
        auth = request.headers.get("Authorization")
        return {"Authorization": auth} if auth else {}

    # -- completions ----------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, CHAT)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, COMPLETIONS)

    async def _answer(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        ctx: Ctx | None = None
        try:
            ctx = await self._parse(request, endpoint)
            response = await self._execute(request, ctx)
        except RequestError as e:
            response = error_response(e.status, str(e), e.kind)
        except asyncio.CancelledError:
            if ctx is not None and ctx.stage is Stage.DONE:  # the client had the whole answer
                self.m.responses.labels(endpoint, "200").inc()
            else:
                self.m.client_disconnects.labels(ctx.stage if ctx else Stage.READ).inc()
            raise
        except Exception:  # a bug must still answer in OpenAI's shape, and be counted
            log.exception("router: request failed unexpectedly")
            response = error_response(500, "internal router error", "internal_error")
        self.m.responses.labels(endpoint, str(response.status)).inc()
        return response

    async def _parse(self, request: web.Request, endpoint: str) -> Ctx:
        started = self._perf()
        if self._auth(request) is not None:
            raise RequestError(401, "invalid or missing API key", "authentication_error")
        try:
            async with asyncio.timeout(self._t.client_body_s):
                raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise RequestError(413, "request body too large") from None
        except TimeoutError:
            raise RequestError(408, "request body not received in time") from None
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise RequestError(400, f"request body is not valid JSON: {e}") from None
        except RecursionError:
            raise RequestError(400, "request body nests too deeply") from None
        chat = endpoint == CHAT
        if (problem := body_problem(body, chat=chat)) is not None:
            raise RequestError(400, problem)
        model = body.get("model")
        if self._names and model is not None and model not in self._names:
            raise RequestError(404, f"The model `{model}` does not exist.", "NotFoundError")
        headers = {"Content-Type": "application/json",
                   REQUEST_ID_HEADER: request.headers.get(REQUEST_ID_HEADER)
                   or f"pdr-{uuid.uuid4().hex}"}
        headers.update(self._engine_auth if self._engine_auth is not None
                       else self._auth_header(request))
        return Ctx(endpoint, chat, body, bool(body.get("stream")), headers, started)

    def _decide(self, request: web.Request, ctx: Ctx) -> None:
        """Features and the decision. A first turn is not counted here: its route is the
        first-turn override's whatever its length (``controller.policy.decide``), so its
        tokens come from the engine's usage when it completes (``_finish``)."""
        body = ctx.body
        ctx.key, _ = session_key(request.headers, body, chat=ctx.chat,
                                 opening_chars=self.cfg.sessions.opening_chars)
        if ctx.chat:
            shape = chat_shape(self.counts, body["messages"], count_first=False)
        elif not self._sessions.known(ctx.key):
            shape = FIRST_TURN_UNCOUNTED
        else:
            shape = self._sessions.shape(ctx.key, self._completion_tokens(ctx.key, body))
        self._qps.note_arrival()
        ctx.shape = shape
        ctx.features = Features(
            turn=shape.turn, context_tokens=float(shape.context_tokens),
            append_tokens=float(shape.append_tokens),
            expected_output_tokens=expected_output(body, self.cfg.model.default_output_tokens),
            qps=self._qps.rate(), prefill_waiting=self.p.min_waiting())
        snap = self.agent.snapshot
        ctx.policy_version = snap.version if snap is not None else 0
        ctx.decision = self.agent.decide(ctx.features)

    async def _execute(self, request: web.Request, ctx: Ctx) -> web.StreamResponse:
        self._decide(request, ctx)
        assert ctx.decision is not None
        decode = pick_decode(ctx.key, self.d.healthy())
        if decode is None:
            self.m.decode_failures.labels(DecodeFailure.NO_INSTANCE.value, "false").inc()
            raise RequestError(503, "no healthy decode instance", "service_unavailable")
        ctx.decode_url = decode
        self.m.overhead.observe(self._perf() - ctx.started)
        handle: dict[str, Any] | None = None
        if ctx.decision.route is Route.PREFILL_NODE:
            got = await self._prefill(ctx)
            if isinstance(got, web.Response):
                return got
            handle = got
        ctx.prefilled = handle is not None
        ctx.stage = Stage.DECODE
        return await self._decode(request, ctx, handle)

    # -- the prefill leg --------------------------------------------------------------------

    async def _prefill(self, ctx: Ctx) -> dict[str, Any] | web.Response | None:
        """P's handle, P's 4xx answer (passed on as is), or None: run decode-local."""
        body = json.dumps(prefill_body(ctx.body)).encode()
        tried: list[str] = []
        reason = FallbackReason.NO_INSTANCE
        for attempt in range(2):
            candidates = self.p.by_least_waiting(exclude=tried)
            if not candidates:
                break
            url = candidates[0]
            tried.append(url)
            got = await self._prefill_once(url, ctx, body)
            if not isinstance(got, FallbackReason):
                return got
            reason = got
            if attempt == 0 and self.p.by_least_waiting(exclude=tried):
                self.m.prefill_retries.labels(reason.value).inc()
        self.m.fallbacks.labels(reason.value).inc()
        return None

    async def _prefill_once(self, url: str, ctx: Ctx, body: bytes
                            ) -> dict[str, Any] | web.Response | FallbackReason:
        inst = self.p.instances.get(url)
        if inst is not None:
            inst.inflight += 1
        try:
            async with asyncio.timeout(self._t.prefill_s):
                async with self.session.post(url + ctx.endpoint, data=body, headers=ctx.headers,
                                             timeout=self._p_timeout) as r:
                    raw = await r.read()
                    status, ctype = r.status, r.content_type
        except aiohttp.ClientError:
            self.p.failed(url)
            return FallbackReason.CONNECT
        except TimeoutError:
            return FallbackReason.TIMEOUT
        finally:
            if inst is not None:
                inst.inflight -= 1
        if 400 <= status < 500:
            return web.Response(body=raw, status=status, content_type=ctype)
        if status != 200:
            return FallbackReason.STATUS_5XX
        try:
            handle = handle_of(json.loads(raw))
        except ValueError:
            return FallbackReason.BAD_ANSWER
        return handle if handle is not None else FallbackReason.NO_HANDLE

    # -- the decode leg ---------------------------------------------------------------------

    def _decode_failed(self, ctx: Ctx, reason: DecodeFailure) -> None:
        self.m.decode_failures.labels(reason.value, "true" if ctx.prefilled else "false").inc()
        if ctx.prefilled:
            log.warning("router: decode leg on %s failed (%s) after a prefill: P keeps the "
                        "blocks until its abort timeout", ctx.decode_url, reason.value)

    async def _decode(self, request: web.Request, ctx: Ctx, handle: dict[str, Any] | None
                      ) -> web.StreamResponse:
        route = Route.PREFILL_NODE if handle is not None else Route.DECODE_LOCAL
        body = json.dumps(decode_body(ctx.body, handle)).encode()
        loop = asyncio.get_running_loop()
        up: aiohttp.ClientResponse | None = None
        done = False
        try:
            try:
                async with asyncio.timeout(self._t.first_byte_s) as tm:
                    up = await self.session.post(ctx.decode_url + ctx.endpoint, data=body,
                                                 headers=ctx.headers, timeout=self._p_timeout)
                    if up.status != 200:
                        raw = await up.read()
                        done = True
                        self._decode_failed(ctx, DecodeFailure.STATUS)
                        return web.Response(body=raw, status=up.status,
                                            content_type=up.content_type)
                    if not ctx.stream:
                        tm.reschedule(loop.time() + self._t.non_streamed_s)
                        raw = await up.read()
                        done = True
                        return self._whole(ctx, route, raw)
                    scan = SseScan(chat=ctx.chat, keep_usage=client_wants_usage(ctx.body))
                    first = await self._first_block(up, scan)
            except aiohttp.ClientError as e:
                self.d.failed(ctx.decode_url)
                self._decode_failed(ctx, DecodeFailure.CONNECT)
                raise RequestError(502, f"decode instance failed: {type(e).__name__}",
                                   "bad_gateway") from None
            except TimeoutError:
                self._decode_failed(ctx, DecodeFailure.TIMEOUT_FIRST_BYTE)
                raise RequestError(504, "decode instance did not answer in time",
                                   "gateway_timeout") from None
            response, done = await self._relay(request, ctx, route, up, scan, first)
            return response
        finally:
            if up is not None:
                if done:
                    up.release()
                else:
                    up.close()  # closing the connection is how vLLM sees an abort

    async def _first_block(self, up: aiohttp.ClientResponse, scan: SseScan) -> bytes:
        """Read until at least one complete event (before answering the client 200)."""
        while True:
            data = await up.content.readany()
            if not data:
                raise aiohttp.ClientPayloadError("stream ended before its first event")
            out = scan.feed(data, self._perf())
            if out or scan.events:
                return out

    async def _relay(self, request: web.Request, ctx: Ctx, route: Route,
                     up: aiohttp.ClientResponse, scan: SseScan, first: bytes
                     ) -> tuple[web.StreamResponse, bool]:
        """Stream D's events to the client; (the response, whether D's stream ended).

        The request is counted complete when D's ``[DONE]`` arrives, before it is passed on:
        clients (the ``openai`` library among them) close the connection at ``[DONE]``
        without waiting for the end of the HTTP stream."""
        out = web.StreamResponse(status=200, headers={
            **SSE_HEADERS, REQUEST_ID_HEADER: ctx.headers[REQUEST_ID_HEADER],
            ROUTE_HEADER: route.name, DECODE_HEADER: ctx.decode_url,
            POLICY_HEADER: str(ctx.policy_version)})
        await out.prepare(request)
        try:
            if scan.done:
                self._complete(ctx, route, scan)
            if first:
                await out.write(first)
            if not scan.done:
                await self._pump(ctx, route, up, scan, out)
        except TimeoutError:
            self._decode_failed(ctx, DecodeFailure.TIMEOUT_BETWEEN_TOKENS)
            await self._stream_error(out, "decode instance stopped sending tokens")
            return out, False
        except aiohttp.ClientError:
            self._decode_failed(ctx, DecodeFailure.BROKEN_STREAM)
            await self._stream_error(out, "decode instance failed mid-stream")
            return out, False
        except ConnectionResetError:
            if ctx.stage is not Stage.DONE:
                self.m.client_disconnects.labels(Stage.DECODE).inc()
            return out, False
        if not scan.done:
            self._decode_failed(ctx, DecodeFailure.BROKEN_STREAM)
            await self._stream_error(out, "decode stream ended early")
            return out, False
        with contextlib.suppress(ConnectionResetError):  # the client had [DONE]
            await out.write_eof()
        return out, await self._drain(up)

    async def _pump(self, ctx: Ctx, route: Route, up: aiohttp.ClientResponse, scan: SseScan,
                    out: web.StreamResponse) -> None:
        """Relay events until ``[DONE]`` or the end of D's stream, each within the
        between-tokens bound (``TimeoutError`` when D falls silent).

        After every read the deadline is at least ``between`` away, and at most
        ``between + slack``: it is moved only when less than ``between`` is left, so a stream
        of many small reads moves it once per ``slack`` seconds rather than on every read
        (re-arming the timer on every read costs about 5 % of the router's CPU when relaying
        is its main work)."""
        loop = asyncio.get_running_loop()
        between = self._t.between_tokens_s
        slack = between * BETWEEN_TOKENS_SLACK
        perf = self._perf
        async with asyncio.timeout(between + slack) as tm:
            async for data in up.content.iter_any():
                block = scan.feed(data, perf())
                if scan.done:
                    self._complete(ctx, route, scan)
                if block:
                    await out.write(block)
                if scan.done:
                    return
                now = loop.time()
                if (tm.when() or now) - now < between:
                    tm.reschedule(now + between + slack)

    async def _drain(self, up: aiohttp.ClientResponse) -> bool:
        """Read what D sends after ``[DONE]`` (the end of its stream), within the
        between-tokens bound; True when its stream ended (its connection can be reused)."""
        try:
            async with asyncio.timeout(self._t.between_tokens_s):
                while await up.content.readany():
                    pass
        except (TimeoutError, aiohttp.ClientError):
            return False
        return True

    def _complete(self, ctx: Ctx, route: Route, scan: SseScan) -> None:
        if ctx.stage is not Stage.DONE:
            ctx.stage = Stage.DONE
            self._finish(ctx, route, scan.first_t, scan.last_t, scan.usage)

    @staticmethod
    async def _stream_error(out: web.StreamResponse, message: str) -> None:
        doc = error_doc(502, message, "bad_gateway")
        try:
            await out.write(b"data: " + json.dumps(doc).encode() + b"\n\n")
            await out.write_eof()
        except ConnectionResetError:
            pass

    def _whole(self, ctx: Ctx, route: Route, raw: bytes) -> web.Response:
        """A non-streamed answer: passed on as it is; its TTFT is the time to the whole
        answer (the only time a non-streamed answer shows), its TPOT unknown."""
        now = self._perf()
        try:
            doc = json.loads(raw)
            usage = doc.get("usage") if isinstance(doc, dict) else None
        except ValueError:
            usage = None
        self._finish(ctx, route, now, None, usage)
        return web.Response(body=raw, status=200, content_type="application/json", headers={
            REQUEST_ID_HEADER: ctx.headers[REQUEST_ID_HEADER], ROUTE_HEADER: route.name,
            DECODE_HEADER: ctx.decode_url, POLICY_HEADER: str(ctx.policy_version)})

    def _finish(self, ctx: Ctx, route: Route, first_t: float | None, last_t: float | None,
                usage: dict[str, Any] | None) -> None:
        """Count a completed request and feed the agent's outcome metrics."""
        decision, features, shape = ctx.decision, ctx.features, ctx.shape
        assert decision is not None and features is not None and shape is not None
        if decision.route is not route:  # a fallback: the outcome belongs to what ran
            decision = Decision(route, decision.cell, decision.reason, decision.explored)
        out_tokens = output_tokens_of(usage)
        prompt_tokens = prompt_tokens_of(usage)
        if not shape.counted:  # a first turn: the engine's count, else ours, now
            shape = Shape(1, 0, prompt_tokens if prompt_tokens is not None
                          else self._count_prompt(ctx))
            features = replace(features, append_tokens=float(shape.append_tokens))
        tpot = None
        if first_t is not None and last_t is not None and out_tokens and out_tokens > 1:
            tpot = (last_t - first_t) / (out_tokens - 1)
        ttft = (first_t - ctx.started) if first_t is not None else float("nan")
        self.agent.observe(decision, ttft, tpot, features)
        name = route.name
        self.m.routes.labels(name).inc()
        if prompt_tokens is not None:
            self.m.prompt_tokens.labels(name).inc(prompt_tokens)
        if out_tokens is not None:
            self.m.completion_tokens.labels(name).inc(out_tokens)
        if not ctx.chat:
            self._sessions.record(ctx.key, shape.turn,
                                  prompt_tokens if prompt_tokens is not None
                                  else shape.prompt_tokens, out_tokens or 0,
                                  prompt_text(ctx.body))

    def _completion_tokens(self, key: str, body: dict[str, Any]) -> int:
        """A completions prompt's tokens; a prompt extending the session's previous one
        encodes only what it adds (the boundary may differ from a whole encode by a token)."""
        prompt = prompt_text(body)
        ext = self._sessions.extension(key, prompt)
        if ext is None:
            return self.counts.text(prompt)
        return ext[0] + self.counts.piece(ext[1])

    def _count_prompt(self, ctx: Ctx) -> int:
        if ctx.chat:
            return self.counts.chat(ctx.body["messages"])
        return self.counts.text(prompt_text(ctx.body))
