"""A request's :class:`~controller.policy.Features` from its body.

* chat: the turn is 1 + the number of assistant messages; the context D holds is the prompt up
  to and including the last assistant message (counted with the chat template), what this turn
  appends is the rest;
* completions (one prompt string): a bounded LRU record per session of the previous prompt and
  output length; a prompt that extends past it continues the conversation (context = previous
  prompt + output), any other — or no record — is a first turn.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from controller.router.protocol import chat_turn
from controller.router.tokens import TokenCounts


@dataclass(frozen=True, slots=True)
class Shape:
    """A request's turn and token split. ``counted`` False: a first turn whose prompt was not
    counted before routing (its route does not depend on its length); its tokens come from
    the engine's usage once it completes."""

    turn: int
    context_tokens: int
    append_tokens: int
    counted: bool = True

    @property
    def prompt_tokens(self) -> int:
        return self.context_tokens + self.append_tokens


FIRST_TURN_UNCOUNTED = Shape(1, 0, 0, counted=False)


def chat_shape(counts: TokenCounts, messages: list[Any], *, count_first: bool = True) -> Shape:
    turn, start = chat_turn(messages)
    if start == 0 and not count_first:
        return FIRST_TURN_UNCOUNTED
    total = counts.chat(messages)
    if start == 0:
        return Shape(1, 0, total)
    context = min(counts.chat(messages[:start]), total)
    return Shape(turn, context, total - context)


@dataclass(slots=True)
class _Record:
    turn: int
    prompt_tokens: int
    held_tokens: int  # prompt + output of the previous turn: what D holds
    prompt_chars: int = 0  # the previous prompt's length in characters
    prompt_hash: int = 0  # and its hash: a prompt that starts with it extends it


class CompletionSessions:
    """Previous turns of completions sessions, at most ``capacity`` (least recent dropped)."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._records: OrderedDict[str, _Record] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def known(self, key: str) -> bool:
        return key in self._records

    def shape(self, key: str, prompt_tokens: int) -> Shape:
        rec = self._records.get(key)
        if rec is None or prompt_tokens <= rec.prompt_tokens:
            return Shape(1, 0, prompt_tokens)
        context = min(rec.held_tokens, prompt_tokens)
        return Shape(rec.turn + 1, context, prompt_tokens - context)

    def extension(self, key: str, prompt: str) -> tuple[int, str] | None:
        """(the previous prompt's tokens, the text this prompt adds to it) when ``prompt``
        starts with the session's previous prompt, else None: a later turn then encodes only
        what it appends (a 20,000-token conversation cost ~20 ms to encode whole)."""
        rec = self._records.get(key)
        if rec is None or not rec.prompt_chars or len(prompt) <= rec.prompt_chars:
            return None
        if hash(prompt[:rec.prompt_chars]) != rec.prompt_hash:
            return None
        return rec.prompt_tokens, prompt[rec.prompt_chars:]

    def record(self, key: str, turn: int, prompt_tokens: int, output_tokens: int,
               prompt: str = "") -> None:
        records = self._records
        records[key] = _Record(turn, prompt_tokens, prompt_tokens + max(output_tokens, 0),
                               len(prompt), hash(prompt) if prompt else 0)
        records.move_to_end(key)
        while len(records) > self._capacity:
            records.popitem(last=False)


def output_tokens_of(usage: Mapping[str, Any] | None) -> int | None:
    if not isinstance(usage, Mapping):
        return None
    v = usage.get("completion_tokens")
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def prompt_tokens_of(usage: Mapping[str, Any] | None) -> int | None:
    if not isinstance(usage, Mapping):
        return None
    v = usage.get("prompt_tokens")
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None
