"""The P/D protocol's request shaping and the router's request-level rules, as plain functions.

Sources: ``docs/router.md`` (copied from the vLLM P/D proxy contract: vLLM's
``toy_proxy_server.py``, Ray Serve LLM's P/D server).

* :func:`prefill_body` — the prefill leg: ``kv_transfer_params`` asking P to keep the KV for a
  remote decode, ``stream = false``, ``max_tokens = 1`` (and ``max_completion_tokens = 1``
  when the client sent it), ``stream_options`` / ``min_tokens`` / ``min_completion_tokens``
  removed.
* :func:`decode_body` — the decode leg: the client's body (its ``min_tokens`` kept), with P's
  handle as ``kv_transfer_params`` (prefill-node route) or none (decode-local), and usage
  always requested on a stream so the router can measure TPOT.
* :func:`session_key` and :func:`pick_decode` — session affinity without shared state:
  rendezvous (highest-random-weight) hashing of the session key over the healthy D set.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

# What P is asked to do on the prefill leg (every public proxy sends exactly these fields).
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Removed from the prefill leg (it generates one token) and kept for the decode leg.
PREFILL_REMOVED = ("stream_options", "min_tokens", "min_completion_tokens")

SESSION_HEADER = "X-Session-Id"
REQUEST_ID_HEADER = "X-Request-Id"
# Deepest JSON nesting a request may have. OpenAI bodies nest about 6 deep (content parts,
# tool schemas somewhat more); far deeper bodies exhaust the stack of the JSON encoder that
# writes the legs' bodies.
MAX_NESTING = 64
MAX_NAMED_KEY_CHARS = 256  # an X-Session-Id or `user` kept as it is up to this length


class KeySource(enum.StrEnum):
    """Where a request's session key came from, in precedence order."""

    HEADER = "header"  # X-Session-Id
    USER = "user"  # the OpenAI ``user`` field
    OPENING = "opening"  # a hash of the conversation's opening (chat) / prompt's start


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill leg's body: a copy of the client's with the protocol's changes."""
    out = {k: v for k, v in body.items() if k not in PREFILL_REMOVED}
    out["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


def handle_of(answer: Any) -> dict[str, Any] | None:
    """P's handle from its JSON answer: ``kv_transfer_params`` when it is a non-empty object
    (a first token that is EOS may return none; then there is nothing for D to pull)."""
    if not isinstance(answer, dict):
        return None
    params = answer.get("kv_transfer_params")
    if isinstance(params, dict) and params:
        return params
    return None


def decode_body(body: Mapping[str, Any], handle: Mapping[str, Any] | None) -> dict[str, Any]:
    """The decode leg's body: the client's, with P's handle (None: decode-local, no
    ``kv_transfer_params`` at all); a streamed request always asks for usage."""
    out = dict(body)
    out.pop("kv_transfer_params", None)
    if handle is not None:
        out["kv_transfer_params"] = dict(handle)
    if out.get("stream"):
        options = out.get("stream_options")
        options = dict(options) if isinstance(options, dict) else {}
        options["include_usage"] = True
        out["stream_options"] = options
    return out


def client_wants_usage(body: Mapping[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def _digest(*parts: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(p.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()


def _named(kind: str, name: str) -> str:
    """A client-named session's key, at most ``MAX_NAMED_KEY_CHARS`` + 2 characters: a longer
    name (a ``user`` field may fill a 16 MB body) is replaced by its digest, so the
    completions sessions' LRU holds bounded keys whatever clients send."""
    if len(name) <= MAX_NAMED_KEY_CHARS:
        return f"{kind}:{name}"
    return f"{kind}#{_digest(name)}"


def opening_messages(messages: Sequence[Any]) -> list[Any]:
    """A conversation's opening: every message up to and including the first user message
    (system prompts and the first question), the part every later turn repeats unchanged."""
    out = []
    for m in messages:
        out.append(m)
        if isinstance(m, dict) and m.get("role") == "user":
            break
    return out


def session_key(
    headers: Mapping[str, str], body: Mapping[str, Any], *, chat: bool, opening_chars: int
) -> tuple[str, KeySource]:
    """The request's session key. Precedence: the ``X-Session-Id`` header, else the
    ``user`` field, else a hash of the conversation's opening messages (chat) or of the
    prompt's first ``opening_chars`` characters (completions)."""
    header = headers.get(SESSION_HEADER)
    if header:
        return _named("h", header), KeySource.HEADER
    user = body.get("user")
    if isinstance(user, str) and user:
        return _named("u", user), KeySource.USER
    if chat:
        messages = body.get("messages")
        opening = opening_messages(messages) if isinstance(messages, list) else []
        text = json.dumps(opening, sort_keys=True, separators=(",", ":"), default=str)
    else:
        text = prompt_text(body)[:opening_chars]
    return "o:" + _digest(text), KeySource.OPENING


def prompt_text(body: Mapping[str, Any]) -> str:
    """A completions request's prompt as text (a list of strings is joined; token ids are
    rendered as their numbers, which keeps them stable for hashing and estimating)."""
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return "".join(p if isinstance(p, str) else f"{p} " for p in prompt)
    return str(prompt)


def hrw_score(key: str, instance: str) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(key.encode("utf-8", "surrogatepass"))
    h.update(b"\x00")
    h.update(instance.encode())
    return int.from_bytes(h.digest(), "big")


def pick_decode(key: str, instances: Sequence[str]) -> str | None:
    """Rendezvous hashing: the instance with the highest score for ``key``. Removing an
    instance moves only the sessions it held; every router computes the same answer."""
    best: str | None = None
    best_score = -1
    for inst in instances:
        s = hrw_score(key, inst)
        if s > best_score:
            best, best_score = inst, s
    return best


def chat_turn(messages: Sequence[Any]) -> tuple[int, int]:
    """(turn number, index where this turn's new messages start): turn = 1 + the number of
    assistant messages; new messages are those after the last assistant message."""
    last = -1
    assistants = 0
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "assistant":
            assistants += 1
            last = i
    return assistants + 1, last + 1


def expected_output(body: Mapping[str, Any], default: float) -> float:
    for key in ("max_completion_tokens", "max_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return float(v)
    return default


def nesting_exceeds(doc: Any, limit: int = MAX_NESTING) -> bool:
    """Whether ``doc`` has containers nested deeper than ``limit`` (walked without
    recursion, containers only)."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        for child in children:
            if isinstance(child, dict | list):
                if depth >= limit:
                    return True
                stack.append((child, depth + 1))
    return False


def _messages_ok(messages: Any) -> bool:
    return isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)


def body_problem(body: Any, *, chat: bool) -> str | None:
    """Why a parsed request body cannot be routed (the client's 400), or None.

    Checked here: what the router itself reads, with the types vLLM's OpenAI models require
    (``stream`` a boolean, ``model`` a string, every chat message an object with a string
    ``role``: the chat template renders roles). The rest is the engine's to judge."""
    if not isinstance(body, dict):
        return "request body must be a JSON object"
    if nesting_exceeds(body):
        return f"request body nests deeper than {MAX_NESTING} levels"
    if chat and not _messages_ok(body.get("messages")):
        return "'messages' must be a list of objects, each with a string 'role'"
    if not chat and "prompt" not in body:
        return "'prompt' is required"
    if not isinstance(body.get("stream", False), bool | None):
        return "'stream' must be a boolean"
    if not isinstance(body.get("model", ""), str | None):
        return "'model' must be a string"
    return None


def error_doc(status: int, message: str, kind: str, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": None,
                      "code": code if code is not None else status}}
