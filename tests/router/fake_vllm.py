"""A minimal vLLM stand-in on loopback that follows the P/D proxy contract's field lists.

Not a simulator (the simulated workers live in ``controller/sim``): it answers exactly what the
router's tests and ``benchmarks/router_overhead.py`` need, cheaply. Run as a script:

    python tests/router/fake_vllm.py --port N [--engine-id ID] [--interval-ms MS]

* a request with ``kv_transfer_params.do_remote_decode`` answers JSON with one token and the
  handle fields (``remote_block_ids``, ``remote_engine_id``, ``remote_request_id``,
  ``remote_host``, ``remote_port``, ``tp_size``), unless told to return none;
* otherwise it generates ``max_tokens`` (default 16) tokens, streamed (SSE, ``usage`` last when
  ``stream_options.include_usage``) or not; prompt tokens are UTF-8 bytes / 4 per text (+4 per
  chat message, +3 per chat prompt), the router's own estimate;
* ``POST /_fake/behaviour`` changes what it does next (status, no_handle, hang, stall_after,
  pause_after and pause_s: one silence of pause_s seconds after that many tokens, delay_s,
  health_status, waiting, linger_s: seconds between ``[DONE]`` and the stream's end);
  ``GET /_fake/log`` lists the requests it got (path, X-Request-Id, Authorization, body);
  ``GET /_fake/stats`` counts them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from typing import Any

from aiohttp import web


def _tokens(text: str) -> int:
    return max(1, math.ceil(len(text.encode()) / 4))


def prompt_tokens(body: dict[str, Any], chat: bool) -> int:
    if chat:
        total = 3
        for m in body.get("messages", []):
            c = m.get("content", "")
            if isinstance(c, list):
                c = " ".join(str(p.get("text", "")) for p in c if isinstance(p, dict))
            total += _tokens(str(c or "")) + 4
        return total
    p = body.get("prompt", "")
    return _tokens(p if isinstance(p, str) else json.dumps(p))


class Fake:
    def __init__(self, engine_id: str, interval_s: float, port: int) -> None:
        self.engine_id, self.interval_s, self.port = engine_id, interval_s, port
        self.behaviour: dict[str, Any] = {}
        self.log: list[dict[str, Any]] = []
        self.stats = {"requests": 0, "completed": 0, "aborted": 0, "prefills": 0,
                      "prompt_tokens": 0, "generation_tokens": 0, "with_handle": 0}
        self.keep_log = True

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/_fake/behaviour", self.set_behaviour)
        app.router.add_get("/_fake/log", self.get_log)
        app.router.add_get("/_fake/stats", self.get_stats)
        return app

    async def set_behaviour(self, request: web.Request) -> web.Response:
        self.behaviour = await request.json()
        self.keep_log = bool(self.behaviour.get("log", True))
        return web.json_response(self.behaviour)

    async def get_log(self, request: web.Request) -> web.Response:
        return web.json_response(self.log)

    async def get_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=int(self.behaviour.get("health_status", 200)))

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def metrics(self, request: web.Request) -> web.Response:
        w = self.behaviour.get("waiting", 0)
        s = self.stats
        text = (
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="fake",engine="0"}} {w}\n'
            "# TYPE vllm:request_success counter\n"
            f'vllm:request_success_total{{model_name="fake",engine="0"}} {s["completed"]}\n'
            "# TYPE vllm:prompt_tokens counter\n"
            f'vllm:prompt_tokens_total{{model_name="fake",engine="0"}} {s["prompt_tokens"]}\n'
            "# TYPE vllm:generation_tokens counter\n"
            f'vllm:generation_tokens_total{{model_name="fake",engine="0"}} '
            f'{s["generation_tokens"]}\n')
        return web.Response(text=text, content_type="text/plain")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    async def _complete(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            return await self._complete_inner(request, chat)
        except asyncio.CancelledError:  # the caller hung up: vLLM aborts the request
            self.stats["aborted"] += 1
            raise

    async def _complete_inner(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.json()
        b = self.behaviour
        self.stats["requests"] += 1
        if self.keep_log:
            self.log.append({"path": request.path, "body": body,
                             "x_request_id": request.headers.get("X-Request-Id"),
                             "authorization": request.headers.get("Authorization")})
        if b.get("hang"):
            await asyncio.sleep(3600)
        if b.get("delay_s"):
            await asyncio.sleep(float(b["delay_s"]))
        if b.get("status"):
            return web.json_response({"error": {"message": "injected", "type": "BadRequestError"
                                      if b["status"] < 500 else "InternalServerError",
                                      "param": None, "code": b["status"]}}, status=b["status"])
        kv = body.get("kv_transfer_params") or {}
        prompt = prompt_tokens(body, chat)
        if kv.get("do_remote_decode"):
            return self._prefill(body, chat, prompt)
        if kv.get("do_remote_prefill"):
            self.stats["with_handle"] += 1
        n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        if body.get("stream"):
            return await self._stream(request, body, chat, prompt, n)
        await asyncio.sleep(self.interval_s * n)
        self._done(prompt, n)
        return web.json_response(self._doc(body, chat, "x" * n, "length", prompt, n))

    def _done(self, prompt: int, n: int) -> None:
        self.stats["completed"] += 1
        self.stats["prompt_tokens"] += prompt
        self.stats["generation_tokens"] += n

    def _prefill(self, body: dict[str, Any], chat: bool, prompt: int) -> web.Response:
        self.stats["prefills"] += 1
        self._done(prompt, 1)
        doc = self._doc(body, chat, "x", "length", prompt, 1)
        if not self.behaviour.get("no_handle"):
            doc["kv_transfer_params"] = {
                "do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": list(range(max(1, prompt // 16))),
                "remote_engine_id": self.engine_id, "remote_request_id": "r-" + str(time.time()),
                "remote_host": "127.0.0.1", "remote_port": self.port, "tp_size": 1}
        return web.json_response(doc)

    @staticmethod
    def _doc(body: dict[str, Any], chat: bool, text: str, finish: str, prompt: int,
             n: int) -> dict[str, Any]:
        choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": text},
                                   "finish_reason": finish} if chat else
                                  {"index": 0, "text": text, "finish_reason": finish})
        return {"id": "cmpl-fake", "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": body.get("model", "fake"),
                "choices": [choice], "usage": {"prompt_tokens": prompt, "completion_tokens": n,
                                               "total_tokens": prompt + n}}

    async def _stream(self, request: web.Request, body: dict[str, Any], chat: bool,
                      prompt: int, n: int) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": "cmpl-fake", "object": obj, "created": int(time.time()),
                "model": body.get("model", "fake")}
        stall = self.behaviour.get("stall_after")
        pause_after = self.behaviour.get("pause_after")
        per = int(self.behaviour.get("tokens_per_chunk", 1))
        try:
            if chat:
                await self._send(out, {**base, "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": ""},
                     "finish_reason": None}]})
            sent = 0
            while sent < n:
                if stall is not None and sent >= stall:
                    await asyncio.sleep(3600)
                if pause_after is not None and sent == pause_after:
                    await asyncio.sleep(float(self.behaviour.get("pause_s", 0.0)))
                await asyncio.sleep(self.interval_s)
                k = min(per, n - sent)
                sent += k
                fin = "length" if sent == n else None
                c: dict[str, Any] = ({"index": 0, "delta": {"content": "x" * k},
                                      "finish_reason": fin} if chat else
                                     {"index": 0, "text": "x" * k, "finish_reason": fin})
                await self._send(out, {**base, "choices": [c]})
            opts = body.get("stream_options") or {}
            if opts.get("include_usage"):
                await self._send(out, {**base, "choices": [], "usage": {
                    "prompt_tokens": prompt, "completion_tokens": n,
                    "total_tokens": prompt + n}})
            await out.write(b"data: [DONE]\n\n")
            self._done(prompt, n)
            if self.behaviour.get("linger_s"):
                await asyncio.sleep(float(self.behaviour["linger_s"]))
        except ConnectionResetError:
            self.stats["aborted"] += 1
            raise
        await out.write_eof()
        return out

    @staticmethod
    async def _send(out: web.StreamResponse, doc: dict[str, Any]) -> None:
        await out.write(b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--engine-id", default="fake")
    ap.add_argument("--interval-ms", type=float, default=0.0)
    a = ap.parse_args()
    fake = Fake(a.engine_id, a.interval_ms / 1000.0, a.port)
    web.run_app(fake.app(), host="127.0.0.1", port=a.port, print=None, access_log=None,
                handler_cancellation=True)


if __name__ == "__main__":
    main()
