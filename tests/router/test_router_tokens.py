"""The router's token counts never fail a request: a chat template that breaks on a request's
messages (a TypeError inside the template, a refusal) falls back to the estimate."""

from __future__ import annotations

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
