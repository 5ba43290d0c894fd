"""Prometheus text exposition (format 0.0.4) → a typed, validated snapshot of one target.

Stricter than ``prometheus_client.parser`` (which reads ``foo 1 2 3 4`` as ``foo=1``): every
sample line must be ``name[{labels}] value [timestamp]``; a non-numeric value, a repeated
series, text cut off mid-line or an HTML page raises :class:`ExpositionError` with the
failure kind the window reports for that target. Samples of families the window does not
use are skipped after reading only their name, which keeps a 72-target scrape cheap.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Container
from dataclasses import dataclass, field

from controller.core.window import FailureKind

LabelKey = tuple[tuple[str, str], ...]  # sorted (name, value) pairs

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\\n]|\\.)*)"\s*(?:,|\Z)')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
_ESCAPE_RE = re.compile(r"\\[\\\"n]")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


class ExpositionError(ValueError):
    """The target's answer is not valid exposition text; ``kind`` is the window's failure
    kind for that target."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Cumulative values of one target at one moment (``taken_at``, epoch seconds)."""

    target: str
    taken_at: float
    # sample name (``x_total``, ``x_bucket``, ...) -> label set -> value (NaN kept as NaN)
    samples: dict[str, dict[LabelKey, float]] = field(default_factory=dict)
    families: frozenset[str] = frozenset()  # family names announced or seen

    def series(self, name: str) -> dict[LabelKey, float]:
        return self.samples.get(name, {})


def base_name(sample: str) -> str:
    for suffix in HISTOGRAM_SUFFIXES:
        if sample.endswith(suffix):
            return sample[: -len(suffix)]
    return sample


def parse_exposition(text: str, *, target: str, taken_at: float,
                     keep: Container[str] | None = None) -> Snapshot:
    """Parse ``text``; keep samples whose name or family is in ``keep`` (all if ``None``).
    The scrape's hot path: helpers run once per text, TYPE line, new name or label set."""
    _check_whole(text)
    samples: dict[str, dict[LabelKey, float]] = {}
    families: set[str] = set()
    decided: dict[str, str | None] = {}  # sample name -> its family if kept, else None
    # Samples follow their family's TYPE line: a family the window does not use is skipped
    # by a prefix test per line, without reading its names or values.
    skip_prefix: str | None = None
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line:
            continue
        if line[0] == "#":
            if line.startswith("# TYPE "):
                skip_prefix = _type_line(line, keep, families, skip_prefix)
            continue
        if skip_prefix is not None and line.startswith(skip_prefix):
            continue
        brace = line.find("{")
        if brace >= 0:
            name = line[:brace]
            close = line.rfind("}")
            if close < brace:
                raise ExpositionError(FailureKind.PARSE, f"line {lineno}: unclosed label set")
            rest = line[close + 1 :]
        else:
            name, _, rest = line.partition(" ")
            rest = " " + rest
            close = -1
        if name in decided:
            family = decided[name]
        else:
            name, family = _decide(name, keep, decided, lineno)
        if family is None:
            continue
        fields = rest.split()
        if not 1 <= len(fields) <= 2 or (rest and not rest[0].isspace()):
            raise _shape_error(lineno)
        value = _number(fields[0], lineno)
        if len(fields) == 2 and not fields[1].lstrip("-").isdigit():
            raise ExpositionError(FailureKind.NON_NUMERIC,
                                  f"line {lineno}: bad timestamp {fields[1]!r}")
        if brace >= 0:
            body = line[brace + 1 : close]
            labels = _LABEL_CACHE.get(body)
            if labels is None:
                labels = _cache_labels(body, lineno)
        else:
            labels = ()
        by_labels = samples.get(name)
        if by_labels is None:
            by_labels = samples[name] = {}
            families.add(family)
        if labels in by_labels:
            raise _duplicate_error(name, labels, lineno)
        by_labels[labels] = value
    return Snapshot(target=target, taken_at=taken_at, samples=samples,
                    families=frozenset(families))


def _check_whole(text: str) -> None:
    """Refuse an HTML page and a text cut off mid-line before reading any sample."""
    # No exposition line starts with "<"; an HTML page (login proxy, error page) does.
    if text.lstrip()[:1] == "<":
        raise ExpositionError(FailureKind.PARSE, "the answer is an HTML page, not exposition text")
    if text and not text.endswith("\n"):
        last = text.rsplit("\n", 1)[-1]
        raise ExpositionError(FailureKind.PARSE,
                              f"truncated exposition: last line {last[:80]!r} is cut off")


def _type_line(line: str, keep: Container[str] | None, families: set[str],
               skip_prefix: str | None) -> str | None:
    """Record a ``# TYPE`` line's family; the prefix of the samples to skip after it (the
    family is not kept), None when they are read, ``skip_prefix`` unchanged when the line
    names no family."""
    parts = line.split(None, 3)
    if len(parts) < 3:
        return skip_prefix
    families.add(parts[2])
    if keep is not None and parts[2] not in keep and not _keeps_any(keep, parts[2]):
        return parts[2]
    return None


def _decide(name: str, keep: Container[str] | None, decided: dict[str, str | None],
            lineno: int) -> tuple[str, str | None]:
    """A sample name seen for the first time: its stripped form and its family when kept
    (None when ``keep`` leaves it out), remembered in ``decided``."""
    name = name.strip()
    family: str | None = base_name(name)
    if keep is not None and name not in keep and family not in keep:
        family = None
    elif not _NAME.match(name):
        raise ExpositionError(FailureKind.PARSE, f"line {lineno}: bad metric name {name[:80]!r}")
    decided[name] = family
    return name, family


def _cache_labels(body: str, lineno: int) -> LabelKey:
    labels = _labels(body, lineno)
    if len(_LABEL_CACHE) > _LABEL_CACHE_MAX:
        _LABEL_CACHE.clear()
    _LABEL_CACHE[body] = labels
    return labels


def _shape_error(lineno: int) -> ExpositionError:
    return ExpositionError(FailureKind.PARSE,
                           f"line {lineno}: expected 'name{{labels}} value [timestamp]'")


def _duplicate_error(name: str, labels: LabelKey, lineno: int) -> ExpositionError:
    shown = ",".join(f'{k}="{v}"' for k, v in labels)
    return ExpositionError(
        FailureKind.DUPLICATE_SERIES, f"line {lineno}: series {name}{{{shown}}} appears twice")


def _keeps_any(keep: Container[str], family: str) -> bool:
    # A counter's TYPE line may name it with or without "_total"; keep both spellings.
    return (family + "_total") in keep or (
        family.endswith("_total") and family[: -len("_total")] in keep)


# Label sets repeat across targets (same model, engine, le edges): parse each text once.
_LABEL_CACHE: dict[str, LabelKey] = {}
_LABEL_CACHE_MAX = 200_000


def _number(text: str, lineno: int) -> float:
    try:
        value = float(text)
        if "_" in text:  # Python accepts 1_000; the exposition format does not
            raise ValueError(text)
    except ValueError:
        raise ExpositionError(
            FailureKind.NON_NUMERIC, f"line {lineno}: sample value {text[:40]!r} is not a number"
        ) from None
    if math.isinf(value) and text.lstrip("+-").lower() not in ("inf",):
        raise ExpositionError(FailureKind.NON_NUMERIC,
                              f"line {lineno}: value {text!r} is not a number")
    return value


def _labels(body: str, lineno: int) -> LabelKey:
    pairs: list[tuple[str, str]] = []
    pos = 0
    end = len(body.rstrip())
    while pos < end:
        m = _LABEL.match(body, pos)
        if m is None:
            raise ExpositionError(FailureKind.PARSE,
                                  f"line {lineno}: malformed labels {body[:80]!r}")
        value = m.group(2)
        if "\\" in value:
            value = _ESCAPE_RE.sub(lambda e: _ESCAPES[e.group(0)], value)
        pairs.append((m.group(1), value))
        pos = m.end()
        if pos >= end:
            break
        if body[pos - 1] != ",":
            raise ExpositionError(FailureKind.PARSE,
                                  f"line {lineno}: labels not separated by commas")
    pairs.sort()
    if any(a[0] == b[0] for a, b in itertools.pairwise(pairs)):
        raise ExpositionError(FailureKind.PARSE, f"line {lineno}: a label name repeats")
    return tuple(pairs)
