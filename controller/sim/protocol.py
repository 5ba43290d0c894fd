"""Each simulated vLLM worker's own OpenAI endpoint, with vLLM's P/D (NixlConnector) semantics.

Routes per worker: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (SSE streaming
or not, ``stream_options.include_usage``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(the worker's vLLM or SGLang exposition) and ``GET /sim/state`` (the simulator's own JSON view:
pinned handles, prefix cache, protocol counters; not a vLLM route).

What a request does, by its ``kv_transfer_params`` (the field lists of
``docs/simulator.md``, from vLLM's proxy protocol):

- ``do_remote_decode: true`` (the prefill leg): the worker prefills from its own prefix cache,
  emits one token, finishes ``length`` and answers the handle (``do_remote_prefill: true,
  do_remote_decode: false, remote_block_ids, remote_engine_id, remote_request_id,
  remote_host, remote_port, tp_size``). It pins the blocks until a decode worker takes the
  handle or ``abort_timeout_s`` passes (then ``vllm:nixl_num_kv_expired_reqs`` counts it).
  A first token that is EOS (body field ``sim_first_token_eos: true``, or a
  ``no_handle_fraction`` of requests) finishes ``stop`` with no handle, as vLLM does.
- ``do_remote_prefill: true`` (the decode leg, on a decode worker): the worker counts its own
  prefix-cache hit and pulls only the rest of the prompt over the prefill worker's simulated
  link, then decodes. A handle whose blocks are gone (expired, taken, unknown engine) is a KV
  load failure: the worker recomputes the prompt locally and counts it.
- no ``kv_transfer_params`` (decode-local, or any plain request): the worker prefills what its
  prefix cache lacks, beside its running decodes, then decodes.

Tokens are counted with :mod:`controller.tokenize` (the router's tokenizer). The model
generates exactly ``max_tokens`` tokens (``max_completion_tokens`` too; default
``default_max_tokens``), the word ``sim`` once per token.

Prefix cache identity: the engine model caches per conversation, so a worker maps a prompt to
the conversation whose remembered tokens (prompt + output) it continues — the longest common
token prefix among conversations that share its first block, and at least all of that
conversation's previous prompt but one block. A prompt that continues none starts a new one
(a prefix shared by different conversations, such as one system prompt, is not a hit here).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from controller.clock import WallClock
from controller.sim.cluster import SimCluster, SimRequest
from controller.sim.engine import Engine, Kind
from controller.sim.http import (
    ClientGone,
    HttpError,
    SseWriter,
    openai_body,
    relay_generated,
    respond,
    respond_json,
)
from controller.tokenize import Tokenizer, TokenizerError

VLLM_ABORT_TIMEOUT_S = 480.0  # VLLM_NIXL_ABORT_REQUEST_TIMEOUT, recent vLLM versions
DEFAULT_MAX_TOKENS = 64
MAX_CONVERSATIONS = 8192  # per worker: the oldest remembered conversation is forgotten


@dataclass(frozen=True, slots=True)
class ProtocolConfig:
    model: str
    tokenizer: Tokenizer
    max_model_len: int
    abort_timeout_s: float = VLLM_ABORT_TIMEOUT_S
    no_handle_fraction: float = 0.0
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    host: str = "127.0.0.1"


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix (binary search over C-speed slice compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(slots=True)
class _Conversation:
    prompt_len: int
    tokens: list[int]


class PrefixIndex:
    """Maps a prompt to the conversation (engine cache key) it continues; see module doc."""

    def __init__(self, worker: str, block_size: int, capacity: int = MAX_CONVERSATIONS) -> None:
        self.worker = worker
        self.bs = block_size
        self.capacity = capacity
        self.convs: OrderedDict[str, _Conversation] = OrderedDict()
        self.by_head: dict[tuple[int, ...], list[str]] = {}
        self._n = 0

    def match(self, ids: list[int]) -> tuple[str, int]:
        """(conversation key, tokens shared with what it remembers)."""
        head = tuple(ids[: self.bs])
        best, best_lcp = None, -1
        for key in self.by_head.get(head, ()):
            conv = self.convs[key]
            lcp = common_prefix(conv.tokens, ids)
            if lcp >= conv.prompt_len - self.bs and lcp > best_lcp:
                best, best_lcp = key, lcp
        if best is not None:
            self.convs.move_to_end(best)
            return best, best_lcp
        self._n += 1
        key = f"{self.worker}/c{self._n}"
        self.convs[key] = _Conversation(len(ids), list(ids))
        self.by_head.setdefault(head, []).append(key)
        while len(self.convs) > self.capacity:
            old, conv = self.convs.popitem(last=False)
            keys = self.by_head.get(tuple(conv.tokens[: self.bs]), [])
            with contextlib.suppress(ValueError):
                keys.remove(old)
        return key, 0

    def remember(self, key: str, prompt: list[int], output: list[int]) -> None:
        conv = self.convs.get(key)
        if conv is not None:
            conv.prompt_len = len(prompt)
            conv.tokens = prompt + output


@dataclass(slots=True)
class PinnedKv:
    request_id: str
    blocks: int
    tokens: int
    expires_at: float


@dataclass(slots=True)
class Counters:
    handles_issued: int = 0
    handles_taken: int = 0
    handles_expired: int = 0
    no_handle: int = 0
    kv_load_failures: int = 0
    pulled_tokens: int = 0
    requests: dict[str, int] = field(default_factory=lambda: {
        "prefill_leg": 0, "decode_leg": 0, "local": 0, "aborted": 0})


Hub = dict[str, "WorkerApi"]  # engine id -> worker: a decode leg finds its prefill worker


@dataclass(slots=True)
class _Call:
    """One parsed completion request."""

    chat: bool
    ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    model: str
    request_id: str
    ktp: dict[str, Any] | None
    eos_first: bool


class WorkerApi:
    """The HTTP face of one simulated worker."""

    def __init__(self, eng: Engine, cluster: SimCluster, config: ProtocolConfig, hub: Hub,
                 advance: Callable[[], None], next_rid: Callable[[], int]) -> None:
        self.eng = eng
        self.cluster = cluster
        self.config = config
        self.hub = hub
        self.advance = advance
        self.next_rid = next_rid
        self.engine_id = f"sim-{eng.name}"
        self.port = 0
        self.prefix = PrefixIndex(eng.name, eng.bs)
        self.pinned: dict[str, PinnedKv] = {}
        self.counters = Counters()
        self.wall = WallClock()  # the answers' "created" stamps (the simulation is virtual)
        hub[self.engine_id] = self

    # ------------------------------------------------------------ routing
    async def handle(self, method: str, path: str, headers: dict[str, str], body: bytes,
                     writer: asyncio.StreamWriter, gone: Awaitable[None]) -> None:
        if path == "/metrics":
            self.advance()
            self.eng.sync(self.cluster.loop.now)
            await respond(writer, 200, CONTENT_TYPE_LATEST, generate_latest(self.eng.registry))
        elif path == "/health":
            await respond(writer, 200, "text/plain", b"")
        elif path == "/v1/models":
            await respond_json(writer, 200, {"object": "list", "data": [{
                "id": self.config.model, "object": "model", "created": 0,
                "owned_by": "vllm", "root": self.config.model,
                "max_model_len": self.config.max_model_len}]})
        elif path == "/sim/state":
            self.advance()
            await respond_json(writer, 200, self.state())
        elif path in ("/v1/chat/completions", "/v1/completions"):
            if method != "POST":
                raise HttpError(405, "Method Not Allowed")
            call = self.parse(path.endswith("chat/completions"), headers, body)
            await self.serve(call, writer, gone)
        else:
            raise HttpError(404, "Not Found", "NotFoundError")

    def state(self) -> dict[str, Any]:
        now = self.cluster.loop.now
        c = self.counters
        return {
            "name": self.eng.name, "role": self.eng.role, "engine_id": self.engine_id,
            "pinned": [{"remote_request_id": p.request_id, "blocks": p.blocks,
                        "tokens": p.tokens, "expires_in_s": round(p.expires_at - now, 3)}
                       for p in self.pinned.values()],
            "counters": {"handles_issued": c.handles_issued, "handles_taken": c.handles_taken,
                         "handles_expired": c.handles_expired, "no_handle": c.no_handle,
                         "kv_load_failures": c.kv_load_failures,
                         "pulled_tokens": c.pulled_tokens, "requests": dict(c.requests)},
            "prefix_cache": dict(self.eng.cache),
            "running": len(self.eng.running), "waiting": len(self.eng.waiting),
            "fetching": len(self.eng.fetching),
        }

    # ------------------------------------------------------------ parsing
    def parse(self, chat: bool, headers: dict[str, str], body: bytes) -> _Call:
        doc = openai_body(body, self.config.model)
        ids = self._prompt_ids(chat, doc)
        max_tokens = doc.get("max_completion_tokens", doc.get("max_tokens"))
        if max_tokens is None:
            max_tokens = self.config.default_max_tokens
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise HttpError(400, "max_tokens must be a positive integer", param="max_tokens")
        if len(ids) + max_tokens > self.config.max_model_len:
            raise HttpError(400, f"This model's maximum context length is "
                            f"{self.config.max_model_len} tokens. However, you requested "
                            f"{len(ids) + max_tokens} tokens ({len(ids)} in the messages, "
                            f"{max_tokens} in the completion).")
        ktp = doc.get("kv_transfer_params")
        if ktp is not None and not isinstance(ktp, dict):
            raise HttpError(400, "kv_transfer_params must be an object",
                            param="kv_transfer_params")
        opts = doc.get("stream_options") or {}
        request_id = headers.get("x-request-id") or f"sim{self.next_rid()}"
        return _Call(chat, ids, max_tokens, doc.get("stream") is True,
                     isinstance(opts, dict) and opts.get("include_usage") is True,
                     str(doc.get("model") or self.config.model), request_id, ktp,
                     doc.get("sim_first_token_eos") is True or self._eos_draw(request_id))

    def _eos_draw(self, request_id: str) -> bool:
        f = self.config.no_handle_fraction
        if f <= 0:
            return False
        h = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:4], "big")
        return h < f * 2**32

    def _prompt_ids(self, chat: bool, doc: dict[str, Any]) -> list[int]:
        tok = self.config.tokenizer
        if chat:
            messages = doc.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) for m in messages):
                raise HttpError(400, "messages: required, a non-empty list of objects",
                                param="messages")
            try:
                return tok.encode_chat(messages)
            except TokenizerError as e:
                raise HttpError(400, str(e), param="messages") from None
        prompt = doc.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return tok.encode(prompt)
        if isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise HttpError(400, "prompt: required, a string or a list of token ids (one prompt)",
                        param="prompt")

    # ------------------------------------------------------------ serving
    def _kind(self, call: _Call) -> tuple[Kind, WorkerApi | None]:
        ktp = call.ktp or {}
        if ktp.get("do_remote_decode") is True:
            self.counters.requests["prefill_leg"] += 1
            return "prefill", None
        if ktp.get("do_remote_prefill") is True:
            if self.eng.role != "decode":
                raise HttpError(400, f"{self.eng.name} is a prefill worker: a decode leg "
                                "(do_remote_prefill) goes to a decode worker",
                                param="kv_transfer_params")
            self.counters.requests["decode_leg"] += 1
            source = self.hub.get(str(ktp.get("remote_engine_id")))
            rid = str(ktp.get("remote_request_id") or "")
            if source is None or not source.take(rid):
                self.counters.kv_load_failures += 1  # blocks gone: recompute here
                return "local", None
            return "pd_decode", source
        self.counters.requests["local"] += 1
        return "local", None

    async def serve(self, call: _Call, writer: asyncio.StreamWriter,
                    gone: Awaitable[None]) -> None:
        self.advance()
        if -(-(len(call.ids) + call.max_tokens) // self.eng.bs) > self.eng.total_blocks:
            raise HttpError(400, f"prompt + max_tokens ({len(call.ids) + call.max_tokens} "
                            f"tokens) exceed this worker's KV cache ({self.eng.total_blocks} "
                            f"blocks of {self.eng.bs})")
        kind, source = self._kind(call)
        key, shared = self.prefix.match(call.ids)
        queue: asyncio.Queue[tuple[int, bool]] = asyncio.Queue()
        req = SimRequest(
            self.next_rid(), key, 1, 0.0, len(call.ids), len(call.ids) - shared,
            call.max_tokens, call.max_tokens,
            on_complete=lambda r: queue.put_nowait(
                (-1 if r.rejected else r.output_tokens, True)),
            stream=(lambda r, n, now: queue.put_nowait((n, False))) if call.stream else None,
        )
        if kind == "prefill":
            req.output_tokens = 1
        er = self.cluster.run_on(self.eng, req, kind,
                                 source.eng.name if source is not None else None)
        try:
            await self._reply(call, kind, req, queue, writer, gone)
        except ClientGone:
            self.counters.requests["aborted"] += 1
            self.advance()
            self.cluster.abort(self.eng, er)
            return
        if kind == "pd_decode":
            self.counters.pulled_tokens += er.external
        out = self.config.tokenizer.encode(" ".join(["sim"] * max(0, req.output_tokens)),
                                           add_special_tokens=False)
        self.prefix.remember(key, call.ids, out)

    async def _reply(self, call: _Call, kind: Kind, req: SimRequest,
                     queue: asyncio.Queue[tuple[int, bool]], writer: asyncio.StreamWriter,
                     gone: Awaitable[None]) -> None:
        created = int(self.wall.now())
        rid = f"{'chatcmpl' if call.chat else 'cmpl'}-{call.request_id}"
        sse = SseWriter(writer, call.chat, rid, created, call.model) if call.stream else None
        if sse is not None:
            await sse.start()
        generated = await relay_generated(queue, sse, gone, 503,
                                          lambda: f"request failed: {req.reject_reason}")
        if generated is None:
            return
        finish = "stop" if kind == "prefill" and call.eos_first else "length"
        ktp = self._handle(call, req) if kind == "prefill" else None
        usage = {"prompt_tokens": len(call.ids), "completion_tokens": generated,
                 "total_tokens": len(call.ids) + generated}
        if sse is not None:
            await sse.finish(finish, usage if call.include_usage else None)
            return
        text = " ".join(["sim"] * generated)
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text},
             "logprobs": None, "finish_reason": finish, "stop_reason": None}
            if call.chat else
            {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
             "stop_reason": None})
        await respond_json(writer, 200, {
            "id": rid, "object": "chat.completion" if call.chat else "text_completion",
            "created": created, "model": call.model, "choices": [choice], "usage": usage,
            "kv_transfer_params": ktp})

    # ------------------------------------------------------------ handles (prefill side)
    def _handle(self, call: _Call, req: SimRequest) -> dict[str, Any] | None:
        """The prefill leg's answer: pin the prompt's blocks and describe them, or no
        handle when the first token was EOS (vLLM returns one only when length-capped)."""
        if call.eos_first:
            self.counters.no_handle += 1
            return None
        now = self.cluster.loop.now
        blocks = -(-len(call.ids) // self.eng.bs)
        pin = PinnedKv(call.request_id, blocks, len(call.ids),
                       now + self.config.abort_timeout_s)
        self.pinned[call.request_id] = pin
        self.counters.handles_issued += 1
        self.cluster.loop.at(pin.expires_at, self._expire, call.request_id, pin)
        base = req.rid * 1024
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": list(range(base, base + blocks)),
                "remote_engine_id": self.engine_id, "remote_request_id": call.request_id,
                "remote_host": self.config.host, "remote_port": self.port, "tp_size": 1}

    def take(self, request_id: str) -> bool:
        """A decode worker takes the handle: True when the blocks were still pinned."""
        if self.pinned.pop(request_id, None) is None:
            return False
        self.counters.handles_taken += 1
        return True

    def _expire(self, request_id: str, pin: PinnedKv) -> None:
        if self.pinned.get(request_id) is pin:
            del self.pinned[request_id]
            self.counters.handles_expired += 1
            self.eng.metrics.nixl_expired += 1  # vllm:nixl_num_kv_expired_reqs
