"""The contract between workloads and the simulator: sessions of turns, and how to build them.

A workload yields :class:`SessionSpec` objects ordered by ``start_s``. Turn 1 of a session
arrives at ``start_s``; the simulator issues every later turn ``think_s`` seconds after the
previous turn of the same session completes (closed loop), so a slow cluster stretches a
session the way a real user waiting for an answer would. ``arrival_s`` of later turns is the
time the trace saw them (shifted with the session), for a simulator that prefers to replay
trace time (``max(arrival_s, previous completion)``).

Token bookkeeping of a turn: ``prompt_tokens = context_tokens + new_tokens``, where
``context_tokens`` is the part of the prompt that the parent turn's prompt + output already
contained (0 for turn 1). It is the most a prefix cache can give; a decode worker that lost
the session's KV holds less, and the simulator computes what it actually holds.

``max_tokens`` is what the client asks for and what a router sees as
``expected_output_tokens``; ``output_tokens`` is the true length, which only the engine may
use. Every source documents its ``max_tokens`` rule (see :func:`max_tokens_for`).
"""

from __future__ import annotations

import dataclasses
import gzip
import math
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import IO, TYPE_CHECKING, Any, Literal, Protocol, get_args, runtime_checkable

from controller.errors import ConfigError

if TYPE_CHECKING:
    import random

Source = Literal["mooncake", "azure-conv", "azure-code", "servegen", "synthetic"]
SOURCES: tuple[str, ...] = get_args(Source)


class WorkloadError(ConfigError, ValueError):
    """A workload is misconfigured or its data is missing; the message names the key or file."""


@dataclass(frozen=True, slots=True)
class TurnSpec:
    session_id: str
    turn: int  # 1-based
    arrival_s: float  # turn 1: absolute sim time; later turns: trace time (informational)
    prompt_tokens: int  # the whole prompt of this turn, history included
    new_tokens: int  # prompt tokens not in the parent turn's prompt + output (= prompt on turn 1)
    output_tokens: int  # true output length: only the engine may use it
    max_tokens: int  # what the client asks for = the router's expected_output_tokens
    think_s: float  # gap after the previous turn completes; 0 for turn 1
    parent_turn: int = 0  # turn whose prompt + output this one extends (0 on turn 1)

    def __post_init__(self) -> None:
        problems = []
        if self.turn < 1:
            problems.append(f"turn={self.turn} < 1")
        if self.prompt_tokens < 1:
            problems.append(f"prompt_tokens={self.prompt_tokens} < 1")
        if not 1 <= self.new_tokens <= self.prompt_tokens:
            problems.append(f"new_tokens={self.new_tokens} not in [1, prompt_tokens]")
        if self.output_tokens < 1:
            problems.append(f"output_tokens={self.output_tokens} < 1")
        if self.max_tokens < self.output_tokens:
            problems.append(f"max_tokens={self.max_tokens} < output_tokens")
        if not (self.think_s >= 0 and math.isfinite(self.think_s)):
            problems.append(f"think_s={self.think_s} is not a finite number >= 0")
        if self.turn == 1 and (self.new_tokens != self.prompt_tokens or self.parent_turn != 0):
            problems.append("turn 1 must have new_tokens == prompt_tokens and parent_turn 0")
        if self.turn > 1 and not 1 <= self.parent_turn < self.turn:
            problems.append(f"parent_turn={self.parent_turn} not in [1, turn)")
        if problems:
            raise WorkloadError(
                f"invalid turn {self.session_id}#{self.turn}: {'; '.join(problems)}"
            )

    @property
    def context_tokens(self) -> int:
        """Prompt tokens the parent turn's prompt + output already held (reusable KV)."""
        return self.prompt_tokens - self.new_tokens


@dataclass(frozen=True, slots=True)
class SessionSpec:
    session_id: str
    start_s: float
    turns: tuple[TurnSpec, ...]

    def __post_init__(self) -> None:
        if not self.turns:
            raise WorkloadError(f"session {self.session_id} has no turns")
        if any(t.turn != i + 1 for i, t in enumerate(self.turns)):
            raise WorkloadError(f"session {self.session_id}: turns must be numbered 1..n")
        if abs(self.turns[0].arrival_s - self.start_s) > 1e-6:
            raise WorkloadError(f"session {self.session_id}: turn 1 must arrive at start_s")


@runtime_checkable
class Workload(Protocol):
    name: str

    def sessions(self, rng: random.Random) -> Iterator[SessionSpec]:
        """Sessions ordered by ``start_s``; finite; deterministic for a given ``rng`` state."""
        ...


@dataclass(frozen=True)
class WorkloadConfig:
    source: Source
    rate_scale: float = 1.0
    time_slice_s: tuple[float, float] | None = None
    params: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise WorkloadError(
                f"workload.source: unknown source {self.source!r}; expected one of {list(SOURCES)}"
            )
        if not (isinstance(self.rate_scale, int | float) and math.isfinite(self.rate_scale)):
            raise WorkloadError(f"workload.rate_scale: {self.rate_scale!r} is not a number")
        if self.rate_scale <= 0:
            raise WorkloadError(f"workload.rate_scale: must be > 0, got {self.rate_scale}")
        if self.time_slice_s is not None:
            bounds = tuple(self.time_slice_s)
            if (
                len(bounds) != 2
                or not all(isinstance(b, int | float) and math.isfinite(b) for b in bounds)
                or not 0 <= bounds[0] < bounds[1]
            ):
                raise WorkloadError(
                    f"workload.time_slice_s: expected [start, end] with 0 <= start < end, "
                    f"got {self.time_slice_s!r}"
                )
            object.__setattr__(self, "time_slice_s", (float(bounds[0]), float(bounds[1])))
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))


def build_workload(cfg: WorkloadConfig) -> Workload:
    """The workload ``cfg`` names, with ``time_slice_s`` then ``rate_scale`` applied. Trace
    sources read the file bundled in ``controller/data/traces`` unless ``params.path`` names
    another."""
    from controller.sim.workloads.factory import build  # the sources import this module

    return build(cfg)


# --- helpers shared by the sources -------------------------------------------------------------


def open_text(path: str) -> IO[str]:
    """``path`` opened as UTF-8 text; a name ending in ``.gz`` is read through gzip (the bundled
    traces are gzip-compressed; a user's own file may be either)."""
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


@contextmanager
def reading(path: str, what: str) -> Iterator[None]:
    """Errors reading a trace file, named with the file: not UTF-8, a damaged or cut gzip
    (``EOFError`` read as Ctrl-C's "Aborted!" in the CLI), an I/O error."""
    try:
        yield
    except UnicodeDecodeError as e:
        raise WorkloadError(f"{path}: the {what} is not UTF-8 text ({e.reason} at byte "
                            f"{e.start})") from None
    except (EOFError, OSError) as e:  # gzip.BadGzipFile is an OSError
        raise WorkloadError(f"{path}: cannot read the {what}: {e}") from None


def require_file(path: Path, what: str) -> Path:
    if path.is_dir():
        raise WorkloadError(f"{what}: {path} is a directory, not a trace file")
    if not path.is_file():
        raise WorkloadError(
            f"{what}: file not found: {path} (set workload params.path to the trace file)"
        )
    return path


class Params:
    """Typed access to a source's ``params`` that names the key in every error."""

    def __init__(self, source: str, params: Mapping[str, Any], allowed: set[str]) -> None:
        unknown = sorted(set(params) - allowed)
        if unknown:
            raise WorkloadError(
                f"workload.params.{unknown[0]}: unknown parameter for source {source!r}; "
                f"allowed: {sorted(allowed)}"
            )
        self._source = source
        self._params = params

    def _key(self, key: str) -> str:
        return f"workload.params.{key}"

    def has(self, key: str) -> bool:
        return key in self._params

    def number(
        self, key: str, default: float, *, minimum: float = 0.0, strict: bool = False,
        maximum: float | None = None,
    ) -> float:
        value = self._params.get(key, default)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise WorkloadError(f"{self._key(key)}: expected a number, got {value!r}")
        if value < minimum or (strict and value == minimum):
            op = ">" if strict else ">="
            raise WorkloadError(f"{self._key(key)}: must be {op} {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise WorkloadError(f"{self._key(key)}: at most {maximum:g}, got {value:g}")
        return float(value)

    def integer(self, key: str, default: int, *, minimum: int = 0) -> int:
        value = self._params.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise WorkloadError(f"{self._key(key)}: expected an integer, got {value!r}")
        if value < minimum:
            raise WorkloadError(f"{self._key(key)}: must be >= {minimum}, got {value}")
        return value

    def optional_integer(self, key: str, *, minimum: int = 1) -> int | None:
        if self._params.get(key) is None:
            return None
        return self.integer(key, 0, minimum=minimum)

    def string(self, key: str, default: str, choices: tuple[str, ...] | None = None) -> str:
        value = self._params.get(key, default)
        if not isinstance(value, str):
            raise WorkloadError(f"{self._key(key)}: expected a string, got {value!r}")
        if choices is not None and value not in choices:
            raise WorkloadError(f"{self._key(key)}: {value!r} is not one of {list(choices)}")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self._params.get(key, default)
        if not isinstance(value, bool):
            raise WorkloadError(f"{self._key(key)}: expected true or false, got {value!r}")
        return value

    def path(self, key: str, default: Path) -> Path:
        found = self.optional_path(key)
        return default if found is None else found

    def optional_path(self, key: str) -> Path | None:
        value = self._params.get(key)
        if value is None:
            return None
        if not isinstance(value, str | os.PathLike) or not str(value):
            raise WorkloadError(f"{self._key(key)}: expected a file path, got {value!r}")
        return Path(value)

    def max_tokens_rule(self, key: str = "max_tokens", default: str = "pow2") -> MaxTokensRule:
        value = self._params.get(key, default)
        if isinstance(value, bool):
            raise WorkloadError(f"{self._key(key)}: expected 'pow2', 'cap' or an integer")
        if isinstance(value, int):
            if value < 1:
                raise WorkloadError(f"{self._key(key)}: must be >= 1, got {value}")
            return value
        if value in ("pow2", "cap"):
            return "pow2" if value == "pow2" else "cap"
        raise WorkloadError(
            f"{self._key(key)}: expected 'pow2', 'cap' or an integer, got {value!r}"
        )


MaxTokensRule = Literal["pow2", "cap"] | int
POW2_FLOOR = 32


def max_tokens_for(output_tokens: int, rule: MaxTokensRule, cap: int) -> int:
    """The client's ``max_tokens`` for a request whose true output is ``output_tokens``.

    - ``"pow2"`` (default for traces): the next power of two >= the output, at least 32 — a
      client that asks for a coarse budget per kind of request; the router learns the output
      only to within a factor of two.
    - ``"cap"``: one fixed budget for every request, the source's largest output (``cap``;
      Mooncake's 2,000 looks like such a client cap).
    - an integer: that budget, raised to the true output where the output is longer (a
      client cannot receive more than it asked for).
    """
    if rule == "pow2":
        return max(POW2_FLOOR, 1 << max(0, output_tokens - 1).bit_length())
    if rule == "cap":
        return max(cap, output_tokens)
    return max(int(rule), output_tokens)


def retime(session: SessionSpec, start_s: float, session_id: str | None = None) -> SessionSpec:
    """The same session starting at ``start_s``: every turn's trace offset is kept."""
    sid = session.session_id if session_id is None else session_id
    shift = start_s - session.start_s
    turns = tuple(
        dataclasses.replace(
            t, session_id=sid, arrival_s=start_s if t.turn == 1 else t.arrival_s + shift
        )
        for t in session.turns
    )
    return SessionSpec(session_id=sid, start_s=start_s, turns=turns)
