"""Token counts for the router's features: the model's tokenizer, or an announced estimate.

With ``[model] tokenizer`` set, counts come from :mod:`controller.tokenize` (the same loader a
user's ``tokenizer.json`` goes through; chat counts include the chat template's overhead).
Without one the router estimates (UTF-8 bytes / 4 per text, 4 tokens per chat message and 3
per prompt), says so at start and exports ``pdrouter_tokenizer_loaded 0``.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from controller.errors import ConfigError

log = logging.getLogger(__name__)


class Counter(Protocol):
    def count_text(self, text: str) -> int: ...

    def count_chat(self, messages: list[dict[str, Any]]) -> int: ...


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


class Estimate:
    """The announced fallback: ceil(UTF-8 bytes / 4) per text (at least 1)."""

    def count_text(self, text: str) -> int:
        return max(1, math.ceil(len(text.encode("utf-8", "surrogatepass")) / 4))

    def count_chat(self, messages: list[dict[str, Any]]) -> int:
        total = 3
        for m in messages:
            total += self.count_text(_content_text(m.get("content"))) + 4
        return total


class ModelCounter:
    """The model's tokenizer, counting a chat as its template's overhead plus each message's
    content, with content counts remembered (a bounded LRU keyed by the text's hash).

    Both caches are keyed by ``hash()`` of what the client sent, never by the text: an entry
    holds two integers whatever the request's size, so 16 MB role strings or messages cannot
    pile up in memory. A collision (str hashes are SipHash under this process's random key;
    about ``entries / 2**64`` per new text) miscounts one request's tokens, which only
    shifts that request's route.

    A conversation's turn repeats every earlier message, so turn k encodes only what is new:
    without the cache a 20,000-token history cost ~20 ms of encoding per request. The template
    overhead is the template rendered with empty contents (cached per sequence of roles). The
    sum can differ from encoding the whole rendered prompt by a token at a message boundary
    (``docs/router.md`` has the measured difference); a chat the template refuses, or a
    tokenizer without one, is counted as its texts plus the estimate's 4 per message and 3.
    """

    def __init__(self, tok: Any, cache_entries: int = 65_536) -> None:
        self._tok = tok
        self._template = bool(tok.has_chat_template)
        self._texts: OrderedDict[int, int] = OrderedDict()
        self._skeletons: dict[int, int] = {}  # hash of the roles in order -> overhead
        self._cap = cache_entries

    def count_text(self, text: str) -> int:
        """A completions prompt: the tokenizer's own count, special tokens included."""
        return int(self._tok.count_text(text))

    def count_piece(self, text: str) -> int:
        return self._content(text)

    def _content(self, text: str) -> int:
        """One message's content, no special tokens (the template holds those); offsets
        are not computed (``encode_batch_fast``: about 20% cheaper than ``encode``)."""
        key = hash(text)
        got = self._texts.get(key)
        if got is None:
            got = len(self._tok.hf.encode_batch_fast([text], add_special_tokens=False)[0].ids)
            self._texts[key] = got
            if len(self._texts) > self._cap:
                self._texts.popitem(last=False)
        else:
            self._texts.move_to_end(key)
        return got

    def _overhead(self, messages: list[dict[str, Any]]) -> int:
        plain = all(m.keys() <= {"role", "content"} for m in messages)
        roles_key = hash(tuple(str(m.get("role", "")) for m in messages))
        if plain and (got := self._skeletons.get(roles_key)) is not None:
            return got
        skeleton = [{**m, "content": ""} for m in messages]
        got = int(self._tok.count_chat(skeleton))
        if plain and len(self._skeletons) < 4096:
            self._skeletons[roles_key] = got
        return got

    def count_chat(self, messages: list[dict[str, Any]]) -> int:
        content = sum(self._content(t) for m in messages
                      if (t := _content_text(m.get("content"))))
        if self._template:
            try:
                return self._overhead(messages) + content
            except (ConfigError, TypeError, ValueError, KeyError) as e:
                # A template that refuses these messages (raise_exception, odd roles) is the
                # engine's to answer; the router estimates its overhead and routes on.
                log.debug("chat template failed, overhead estimated: %s", e)
        return content + 4 * len(messages) + 3


class TokenCounts:
    """Counts for one router process; ``loaded`` says whether they are the model's own."""

    def __init__(self, counter: Counter, *, loaded: bool, source: str) -> None:
        self._counter = counter
        self.loaded = loaded
        self.source = source

    def text(self, text: str) -> int:
        return self._counter.count_text(text)

    def piece(self, text: str) -> int:
        """Tokens ``text`` adds inside a longer prompt (no special tokens)."""
        piece = getattr(self._counter, "count_piece", None)
        return int(piece(text)) if piece is not None else self._counter.count_text(text)

    def chat(self, messages: Sequence[Any]) -> int:
        clean = [m for m in messages if isinstance(m, dict)]
        if not clean:
            return 0
        return self._counter.count_chat(clean)


def load_counts(path: Path | None) -> TokenCounts:
    """The model's tokenizer at ``path`` (ConfigError when it cannot be read), else the
    estimate."""
    if path is None:
        log.warning("router: no [model] tokenizer configured: token counts are ESTIMATED "
                    "(UTF-8 bytes / 4); pdrouter_tokenizer_loaded is 0")
        return TokenCounts(Estimate(), loaded=False, source="estimate (bytes/4)")
    from controller.tokenize import load_tokenizer

    try:
        tok = load_tokenizer(path)
    except ConfigError as e:
        raise ConfigError(f"model.tokenizer: {e}") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.tokenizer {path}: {e}") from None
    if not tok.has_chat_template:
        log.warning("router: %s has no chat template: chat prompts are counted as their "
                    "messages' tokens plus an estimated 4 per message and 3 per prompt", path)
    return TokenCounts(ModelCounter(tok), loaded=True, source=str(path))
