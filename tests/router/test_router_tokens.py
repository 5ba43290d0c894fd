"""The router's token counts never fail a request: a chat template that breaks on a request's
messages (a TypeError inside the template, a refusal) falls back to the estimate."""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

import pytest

from controller.errors import ConfigError
from controller.router.tokens import ModelCounter
from controller.tokenize import bundled_tokenizer_dir, load_tokenizer


class BrokenTemplate:
    """The bundled tokenizer whose chat template raises ``error`` on every render."""

    def __init__(self, error: Exception) -> None:
        self._real = load_tokenizer(bundled_tokenizer_dir())
        self._error = error
        self.has_chat_template = True
        self.hf = self._real.hf

    def count_text(self, text: str) -> int:
        return int(self._real.count_text(text))

    def count_chat(self, messages: list[dict[str, Any]]) -> int:
        raise self._error


@pytest.mark.parametrize("error", [TypeError("can only concatenate str (not int)"),
                                   ValueError("bad"), KeyError("role"),
                                   ConfigError("chat template: roles must alternate")])
def test_a_template_that_breaks_falls_back_to_the_estimate(error: Exception) -> None:
    counter = ModelCounter(BrokenTemplate(error))
    messages = [{"role": "user", "content": "hello there"}, {"role": 7, "content": "x"}]
    content = counter.count_piece("hello there") + counter.count_piece("x")
    assert counter.count_chat(messages) == content + 4 * len(messages) + 3


class AnyRoleTemplate:
    """A chat template that renders any role (as Llama 3's does), counting its renders."""

    has_chat_template = True
    hf = None  # every content below is empty: nothing is encoded

    def __init__(self) -> None:
        self.renders = 0

    def count_text(self, text: str) -> int:
        return len(text)

    def count_chat(self, messages: list[dict[str, Any]]) -> int:
        self.renders += 1
        return 3 * len(messages)


def test_the_template_overhead_cache_holds_no_client_text() -> None:
    """Roles are the client's: 200 chats, each with a distinct 100 kB role, leave the
    counter holding about nothing of them (20 MB if their roles were the cache's keys); a
    role sequence seen before is not rendered again."""
    counter = ModelCounter(AnyRoleTemplate())
    gc.collect()
    tracemalloc.start()
    try:
        for i in range(200):
            role = f"{i:06d}" + "r" * 100_000
            assert counter.count_chat([{"role": role, "content": ""}]) == 3
            del role
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 1_000_000, held
    template = AnyRoleTemplate()
    counter = ModelCounter(template)
    chat = [{"role": "system", "content": ""}, {"role": "user", "content": ""}]
    assert counter.count_chat(chat) == counter.count_chat([dict(m) for m in chat]) == 6
    assert template.renders == 1
