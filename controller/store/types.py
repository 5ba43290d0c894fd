"""Column types that behave the same on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import DateTime, Dialect, String, Text
from sqlalchemy.types import TypeDecorator

# Free text from outside (operators' reasons, routers' and workers' errors, outcomes).
MAX_TEXT_CHARS = 8192
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _escape_surrogate(m: re.Match[str]) -> str:
    return f"\\u{ord(m.group()):04x}"


def store_text(value: str, limit: int | None = MAX_TEXT_CHARS) -> str:
    """``value`` as every backend holds it, the same on SQLite and PostgreSQL: NUL (which a
    PostgreSQL text column refuses) written ``\\x00``, a lone surrogate (not encodable as
    UTF-8) written ``\\udXXX``, and at most ``limit`` characters (the cut marked ``…[+N]``,
    N the characters left out). Every other character is kept as it is; ``pdctl`` escapes
    control characters when it prints (``controller.cli.shown``)."""
    text = value.replace("\x00", "\\x00")
    text = _LONE_SURROGATE.sub(_escape_surrogate, text)
    if limit is not None and len(text) > limit:
        marker = f"…[+{len(text) - limit}]"
        keep = max(0, limit - len(marker))
        text = text[:keep] + f"…[+{len(text) - keep}]"
    return text


class SafeText(TypeDecorator[str]):
    """Text from outside, passed through :func:`store_text` on the way in."""

    impl = Text
    cache_ok = True

    def __init__(self, limit: int | None = MAX_TEXT_CHARS) -> None:
        super().__init__()
        self.limit = limit

    def process_bind_param(self, value: str | None, dialect: Dialect) -> str | None:
        return None if value is None else store_text(str(value), self.limit)


class SafeString(TypeDecorator[str]):
    """A ``VARCHAR(length)`` from outside (names of people and hosts): :func:`store_text`
    capped at ``length`` characters, which PostgreSQL enforces and SQLite does not."""

    impl = String
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Dialect) -> str | None:
        length = getattr(self.impl_instance, "length", None)
        return None if value is None else store_text(str(value), length)


class UtcDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every engine.

    SQLite keeps no time zone and hands back naive values; PostgreSQL keeps ``timestamptz``.
    Values go in as aware datetimes (a naive one is a bug: refused) and come back in UTC.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"naive datetime {value!r}: pass a timezone-aware UTC time")
        utc = value.astimezone(UTC)
        return utc.replace(tzinfo=None) if dialect.name == "sqlite" else utc

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class JsonText(TypeDecorator[Any]):
    """JSON kept as text: exact float round-trip on both engines, NaN refused."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> str | None:
        if value is None:
            return None
        return dumps_json(value)

    def process_result_value(self, value: str | None, dialect: Dialect) -> Any:
        return None if value is None else json.loads(value)


def dumps_json(value: Any) -> str:
    """Compact JSON; raises ``ValueError`` on NaN or infinity (they are not JSON). NUL is
    escaped by JSON itself; a lone surrogate is written as its JSON escape, so the text is
    valid UTF-8 on every backend and decodes to the same value."""
    text = json.dumps(value, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    return _LONE_SURROGATE.sub(_escape_surrogate, text)
