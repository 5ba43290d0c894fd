"""Token counts for the router's features: the model's tokenizer, or an announced estimate.

With ``[model] tokenizer`` set, counts come from :mod:`controller.tokenize` (the same loader a
user's ``tokenizer.json`` goes through; chat counts include the chat template's overhead).
Without one the router estimates (UTF-8 bytes / 4 per text, 4 tokens per chat message and 3
per prompt), says so at start and exports ``pdrouter_tokenizer_loaded 0``.
"""

from __future__ import annotations

import logging
import math
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


class TokenCounts:
    """Counts for one router process; ``loaded`` says whether they are the model's own."""

    def __init__(self, counter: Counter, *, loaded: bool, source: str) -> None:
        self._counter = counter
        self.loaded = loaded
        self.source = source

    def text(self, text: str) -> int:
        return self._counter.count_text(text)

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
    try:
        from controller.tokenize import load_tokenizer  # type: ignore[import-not-found,unused-ignore]
    except ImportError as e:  # pragma: no cover - the package ships with the router
        raise ConfigError(f"model.tokenizer: the tokenizer package is unavailable: {e}") from None
    try:
        tok = load_tokenizer(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.tokenizer {path}: {e}") from None
    return TokenCounts(tok, loaded=True, source=str(path))
