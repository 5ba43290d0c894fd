"""Scanning a relayed SSE stream: when tokens arrive, what usage says, which event to strip.

A streamed chunk may carry several tokens, so the router always asks the engine for usage on
the stream; TPOT is (last token event - first token event) / (completion tokens - 1). The
final usage chunk (``choices: []`` with ``usage``) is passed on only when the client asked for
it. Events are parsed as JSON only until the first token and when they mention usage, so the
per-chunk cost after the first token is a few byte searches.
"""

from __future__ import annotations

import json
from typing import Any

_USAGE = b'"usage"'
_DONE = b"[DONE]"


def is_token_choice(choice: Any, chat: bool) -> bool:
    """Whether a streamed choice carries output (a first token that is EOS carries only a
    finish reason: it counts)."""
    if not isinstance(choice, dict):
        return False
    if choice.get("finish_reason"):
        return True
    if chat:
        delta = choice.get("delta")
        return isinstance(delta, dict) and bool(
            delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content")
            or delta.get("reasoning"))
    return bool(choice.get("text"))


class SseScan:
    """Feeds on the upstream's bytes; returns what to pass on, complete events only."""

    __slots__ = ("_buf", "chat", "done", "events", "first_t", "keep_usage", "last_t", "usage")

    def __init__(self, *, chat: bool, keep_usage: bool) -> None:
        self._buf = b""
        self.chat = chat
        self.keep_usage = keep_usage
        self.first_t: float | None = None
        self.last_t: float | None = None
        self.usage: dict[str, Any] | None = None
        self.done = False
        self.events = 0

    @property
    def pending(self) -> bytes:
        """Bytes of an incomplete last event (left when the stream ends)."""
        return self._buf

    def feed(self, data: bytes, now: float) -> bytes:
        buf = self._buf + data if self._buf else data
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return b""
        self._buf = buf[end + 2:]
        block = buf[:end + 2]
        if self.first_t is not None and _USAGE not in block:
            # Fast path: tokens (and maybe the end marker), nothing to strip.
            n = block.count(b"\n\n")
            self.events += n
            if _DONE in block:
                self.done = True
                n -= 1
            if n > 0:
                self.last_t = now
            return block
        kept = [ev + b"\n\n" for ev in block.split(b"\n\n")[:-1] if self._event(ev, now)]
        return b"".join(kept)

    def _event(self, ev: bytes, now: float) -> bool:
        """Account one event; False when it must not reach the client."""
        self.events += 1
        if not ev.startswith(b"data:"):
            return True  # comments, other fields: passed on as they are
        data = ev[5:].strip()
        if data == _DONE:
            self.done = True
            return True
        if self.first_t is not None and _USAGE not in data:
            self.last_t = now
            return True
        try:
            doc = json.loads(data)
        except ValueError:
            return True
        if not isinstance(doc, dict):
            return True
        usage = doc.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        choices = doc.get("choices")
        if not choices:
            return self.keep_usage if isinstance(usage, dict) else True
        if self.first_t is None:
            if is_token_choice(choices[0], self.chat):
                self.first_t = self.last_t = now
        else:
            self.last_t = now
        return True

