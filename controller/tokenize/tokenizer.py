"""Loading a ``tokenizer.json`` + chat template, and counting prompts as vLLM counts them.

Counting rules (what vLLM's OpenAI server does, so router and engine agree):

- ``/v1/completions``: the prompt string is encoded with the tokenizer's special tokens
  (its post-processor, e.g. a BOS token) — :meth:`Tokenizer.count_text`.
- ``/v1/chat/completions``: the chat template is rendered with ``messages`` and
  ``add_generation_prompt=True`` (the template writes its own BOS), and the text is encoded
  WITHOUT adding special tokens again — :meth:`Tokenizer.count_chat`. Message content given
  as a list of parts counts its text parts joined by newlines (vLLM's "string" content
  format). A tokenizer without a chat template cannot count chat prompts and says so.
"""

from __future__ import annotations

import json
import re
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HfTokenizer

from controller.clock import WallClock
from controller.errors import ConfigError

SEGMENT_CACHE_ENTRIES = 65_536
SEGMENT_CACHE_CHARS = 32 * 1024 * 1024
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
BUNDLED_NAME = "sim-tokenizer"


class TokenizerError(ConfigError):
    """A tokenizer file is missing or invalid, or a prompt cannot be rendered."""


def bundled_tokenizer_dir() -> Path:
    """The directory of the tokenizer shipped with the package (built by the repository)."""
    return Path(str(resources.files("controller.tokenize") / "data" / BUNDLED_NAME))


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _raise_exception(message: str) -> NoReturn:
    raise TokenizerError(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
    return WallClock().utcnow().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers uses (sandboxed,
    ``trim_blocks``/``lstrip_blocks``, loop controls, ``raise_exception``, ``tojson``)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"chat_template: not a valid Jinja2 template: {e}") from None


def _plain_content(content: Any) -> Any:
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content
                         if isinstance(p, Mapping) and p.get("type", "text") == "text")
    return content


class SegmentCounter:
    """Chat encodes that re-encode only what is new since an earlier request.

    ``tokenizers`` cuts a text at its added tokens first and encodes every piece between
    them on its own, so a rendered chat's ids are the added tokens' ids and the pieces' ids
    in order; a conversation's earlier messages are pieces seen before, taken from this
    cache. Used only when that cut is exact: every added token matched as is (no
    ``lstrip``/``rstrip``/``single_word``, not normalized when there is a normalizer) and no
    ``Metaspace`` pre-tokenizer (it treats the first piece apart). Bounded: the cache is
    emptied when it passes ``SEGMENT_CACHE_ENTRIES`` pieces or ``SEGMENT_CACHE_CHARS``.
    """

    def __init__(self, hf: HfTokenizer, pattern: re.Pattern[str],
                 ids: Mapping[str, int]) -> None:
        self.hf = hf
        self.pattern = pattern
        self.added_ids = dict(ids)
        self.cache: dict[str, array[int]] = {}
        self.chars = 0

    @classmethod
    def of(cls, hf: HfTokenizer) -> SegmentCounter | None:
        decoder = hf.get_added_tokens_decoder()
        if not decoder or "Metaspace" in json.dumps(json.loads(hf.to_str()).get("pre_tokenizer")):
            return None
        for t in decoder.values():
            if t.lstrip or t.rstrip or t.single_word or (t.normalized and hf.normalizer):
                return None
        ids = {t.content: i for i, t in decoder.items()}
        contents = sorted(ids, key=len, reverse=True)
        return cls(hf, re.compile("(" + "|".join(re.escape(c) for c in contents) + ")"), ids)

    def _piece(self, seg: str) -> array[int]:
        got = self.cache.get(seg)
        if got is None:
            got = array("i", self.hf.encode(seg, add_special_tokens=False).ids)
            if len(self.cache) >= SEGMENT_CACHE_ENTRIES or self.chars >= SEGMENT_CACHE_CHARS:
                self.cache.clear()
                self.chars = 0
            self.cache[seg] = got
            self.chars += len(seg)
        return got

    def count(self, text: str) -> int:
        """Tokens of ``text`` encoded without adding special tokens."""
        parts = self.pattern.split(text)
        n = len(parts) // 2  # the added tokens: every other part
        for seg in parts[::2]:
            if seg:
                n += len(self._piece(seg))
        return n

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` encoded without adding special tokens."""
        out: array[int] = array("i")
        for i, part in enumerate(self.pattern.split(text)):
            if i % 2:
                out.append(self.added_ids[part])
            elif part:
                out.extend(self._piece(part))
        return out.tolist()


@dataclass(frozen=True, slots=True)
class Tokenizer:
    """A loaded tokenizer; thread-safe for concurrent encodes (``tokenizers`` is)."""

    source: str
    hf: HfTokenizer
    template: jinja2.Template | None
    special: Mapping[str, str]
    segments: SegmentCounter | None = None

    @property
    def has_chat_template(self) -> bool:
        return self.template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens).ids)

    def count_text(self, text: str) -> int:
        """Prompt tokens of a ``/v1/completions`` prompt string."""
        return len(self.hf.encode(text, add_special_tokens=True).ids)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], **extra: Any) -> str:
        """The chat template rendered with ``add_generation_prompt=True``."""
        if self.template is None:
            raise TokenizerError(f"{self.source}: no chat_template in {CONFIG_FILE}; "
                                 "chat prompts cannot be counted")
        msgs = [{**m, "content": _plain_content(m.get("content"))} for m in messages]
        try:
            return self.template.render(messages=msgs, add_generation_prompt=True,
                                        **self.special, **extra)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template: {e}") from None

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Prompt ids of a chat request (earlier turns' messages come from a cache)."""
        text = self.render_chat(messages)
        if self.segments is not None:
            return self.segments.encode(text)
        return list(self.hf.encode(text, add_special_tokens=False).ids)

    def count_chat(self, messages: Sequence[Mapping[str, Any]]) -> int:
        """Prompt tokens of a chat request, the template's overhead included (equal to
        ``len(encode_chat(messages))``; earlier turns' messages come from a cache)."""
        text = self.render_chat(messages)
        if self.segments is not None:
            return self.segments.count(text)
        return len(self.hf.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.hf.decode(list(ids)))


def _read_config(path: Path) -> tuple[jinja2.Template | None, dict[str, str]]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: cannot read: {e}") from None
    if not isinstance(doc, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    special = {k: t for k in ("bos_token", "eos_token", "pad_token", "unk_token")
               if (t := _token_text(doc.get(k))) is not None}
    source = doc.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is None:
        return None, special
    if not isinstance(source, str):
        raise TokenizerError(f"{path}: chat_template: expected a string")
    return compile_template(source), special


def load_tokenizer(path_or_dir: str | Path) -> Tokenizer:
    """Load ``tokenizer.json`` (the path, or the file of that name in the directory) and the
    chat template of ``tokenizer_config.json`` beside it when there is one."""
    path = Path(path_or_dir)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise TokenizerError(f"{path}: no {TOKENIZER_FILE} there (a Hugging Face tokenizer "
                             "file, or a directory holding one)")
    try:
        hf = HfTokenizer.from_file(str(file))
    except Exception as e:  # the library raises a bare Exception for a malformed file
        raise TokenizerError(f"{file}: not a valid {TOKENIZER_FILE}: {e}") from None
    config = file.with_name(CONFIG_FILE)
    template, special = _read_config(config) if config.is_file() else (None, {})
    return Tokenizer(str(file), hf, template, special, SegmentCounter.of(hf))


FILL_WORD = "the"


def fill_message(tok: Tokenizer, before: Sequence[Mapping[str, Any]], total: int, *,
                 role: str = "user", word: str = FILL_WORD, lead: str = "") -> str:
    """Content of one more ``role`` message, ``lead`` then ``word`` repeated, that makes the
    chat's prompt ``total`` tokens by ``tok`` — exactly when one word costs one token (the
    bundled tokenizer's ``the``), else the nearest count not above ``total`` (one word at
    least). Used to send prompts of a planned length (the active calibration's load points,
    ``controller.sim.drive``, whose ``lead`` makes each conversation's first tokens its own)."""
    def count(k: int) -> int:
        return tok.count_chat([*before, {"role": role, "content": lead + " ".join([word] * k)}])

    one, two = count(1), count(2)
    per_word = max(1, two - one)
    k = max(1, 1 + (total - one) // per_word)
    best = 1
    for _ in range(8):  # the word's cost is near constant: a few corrections at most
        c = count(k)
        if c == total:
            return lead + " ".join([word] * k)
        if c < total:
            best = max(best, k)
        step = (total - c) // per_word if c < total else -(-(total - c) // per_word)
        k = max(1, k + (step or (1 if c < total else -1)))
    return lead + " ".join([word] * best)
