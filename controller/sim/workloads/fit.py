"""Session shape fitted to the Mooncake chains, and multi-turn synthesis for turn-less traces.

Azure 2023 and ServeGen have no sessions. To make them exercise the routing decision, their
requests are grouped into sessions whose shape is fitted to the Mooncake conversation chains
(:func:`fit_session_shape`):

- **turns per session**: the empirical distribution of Mooncake session lengths (counts kept
  exactly, so the synthesis draws from the very same histogram);
- **think time** between turns: the percentiles (0th..100th) of the Mooncake gaps between
  consecutive turns (trace time, jitter off, so the fit is deterministic), sampled by inverse
  CDF, log-linear between neighbouring percentiles (an empirical table, not a log-normal:
  a log-normal misplaces the tail, e.g. the append ratio's p90 at 1.34 where the data has
  0.92);
- **append size**: the same kind of table for ``new_tokens / turn-1 prompt_tokens`` of
  Mooncake's later turns. A ratio, not a token count, because Mooncake prompts are ten times
  longer than Azure's or ServeGen's: a follow-up is sized relative to the conversation's
  opening.

Synthesis (:func:`synthesize_sessions`) walks the source's requests in arrival order; each
session draws its turn count ``n`` and takes the next ``n`` requests: the first is turn 1
(its arrival, prompt and output as in the trace); each later turn keeps its request's output
length, appends ``max(1, round(ratio * turn-1 prompt))`` new tokens (ratio drawn from the
fit) to the previous turn's prompt + output (all of it reusable context), and follows a think
time drawn from the fit. Every source request is used exactly once, so request counts and
output lengths are those of the source; session starts come at the source rate divided by the
mean turn count. A session ends early rather than exceed ``max_prompt_tokens``.

Regenerate the stored constants with ``python -m controller.sim.workloads.fit``
(``--check`` compares instead of writing).
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import itertools
import json
import math
import random
import statistics
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.data import TRACES_DIR
from controller.sim.workloads.base import (
    MaxTokensRule,
    SessionSpec,
    TurnSpec,
    WorkloadError,
    max_tokens_for,
    require_file,
)

SHAPE_FILE = Path(__file__).with_name("data") / "session_shape.json"
FIT_COMMAND = "python -m controller.sim.workloads.fit"
DEFAULT_MAX_PROMPT_TOKENS = 131_072


@dataclass(frozen=True, slots=True)
class SourceRequest:
    """One request of a turn-less trace (arrival in seconds from the trace start)."""

    arrival_s: float
    input_tokens: int
    output_tokens: int


QUANTILE_STEPS = 100  # tables hold the 0th, 1st, ..., 100th percentile


def _percentile_table(values: Sequence[float]) -> tuple[float, ...]:
    ordered = sorted(values)
    inner = statistics.quantiles(ordered, n=QUANTILE_STEPS, method="inclusive")
    return (ordered[0], *inner, ordered[-1])


def _draw_from_table(table: Sequence[float], rng: random.Random) -> float:
    """Inverse-CDF draw, log-linear between neighbouring percentiles (values are > 0)."""
    position = rng.random() * (len(table) - 1)
    j = min(int(position), len(table) - 2)
    lo, hi = math.log(table[j]), math.log(table[j + 1])
    return math.exp(lo + (hi - lo) * (position - j))


@dataclass(frozen=True)
class SessionShape:
    turns_counts: tuple[int, ...]  # number of Mooncake sessions with 1, 2, ... turns
    think_percentiles_s: tuple[float, ...]  # 0th..100th percentile of the think time
    append_ratio_percentiles: tuple[float, ...]  # same for new_tokens / turn-1 prompt_tokens
    provenance: Mapping[str, Any] = field(default_factory=dict)
    _cumulative: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.turns_counts or sum(self.turns_counts) <= 0 or min(self.turns_counts) < 0:
            raise WorkloadError("session shape: turns_counts must be non-negative with sum > 0")
        for name in ("think_percentiles_s", "append_ratio_percentiles"):
            table = getattr(self, name)
            if (
                len(table) != QUANTILE_STEPS + 1
                or min(table) <= 0
                or any(b < a for a, b in itertools.pairwise(table))
            ):
                raise WorkloadError(
                    f"session shape: {name} must hold {QUANTILE_STEPS + 1} positive, "
                    f"non-decreasing values"
                )
        object.__setattr__(self, "_cumulative", tuple(itertools.accumulate(self.turns_counts)))

    @property
    def max_turns(self) -> int:
        return len(self.turns_counts)

    @property
    def mean_turns(self) -> float:
        total = sum(self.turns_counts)
        return sum(n * c for n, c in enumerate(self.turns_counts, start=1)) / total

    def percentile(self, name: str, q: float) -> float:
        """``q`` in [0, 1] of ``think_percentiles_s`` or ``append_ratio_percentiles``."""
        table: tuple[float, ...] = getattr(self, name)
        return table[round(q * QUANTILE_STEPS)]

    def draw_turns(self, rng: random.Random) -> int:
        total = self._cumulative[-1]
        return bisect.bisect_right(self._cumulative, rng.random() * total) + 1

    def draw_think_s(self, rng: random.Random) -> float:
        return _draw_from_table(self.think_percentiles_s, rng)

    def draw_append_ratio(self, rng: random.Random) -> float:
        return _draw_from_table(self.append_ratio_percentiles, rng)

    def summary(self) -> dict[str, float]:
        return {
            "sessions": float(sum(self.turns_counts)),
            "mean_turns": self.mean_turns,
            "single_turn_share": self.turns_counts[0] / sum(self.turns_counts),
            "think_p50_s": self.percentile("think_percentiles_s", 0.5),
            "think_p90_s": self.percentile("think_percentiles_s", 0.9),
            "append_ratio_p50": self.percentile("append_ratio_percentiles", 0.5),
            "append_ratio_p90": self.percentile("append_ratio_percentiles", 0.9),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "turns_counts": list(self.turns_counts),
            "think_percentiles_s": list(self.think_percentiles_s),
            "append_ratio_percentiles": list(self.append_ratio_percentiles),
            "summary": self.summary(),
            "provenance": dict(self.provenance),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str = "session shape") -> SessionShape:
        try:
            return cls(
                turns_counts=tuple(int(c) for c in data["turns_counts"]),
                think_percentiles_s=tuple(float(v) for v in data["think_percentiles_s"]),
                append_ratio_percentiles=tuple(float(v) for v in data["append_ratio_percentiles"]),
                provenance=dict(data.get("provenance", {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise WorkloadError(f"{source}: malformed session shape: {exc!r}") from exc


def fit_session_shape(
    sessions: Iterable[SessionSpec], provenance: Mapping[str, Any] | None = None
) -> SessionShape:
    """Fit turns per session, think time and append ratio (see the module docstring)."""
    lengths: Counter[int] = Counter()
    thinks: list[float] = []
    ratios: list[float] = []
    for session in sessions:
        lengths[len(session.turns)] += 1
        first_prompt = session.turns[0].prompt_tokens
        for turn in session.turns[1:]:
            if turn.think_s > 0:  # a zero gap carries no think time to sample
                thinks.append(turn.think_s)
            ratios.append(turn.new_tokens / first_prompt)
    if not lengths or len(thinks) < 2 or len(ratios) < 2:
        raise WorkloadError("fit_session_shape: need sessions with at least two later turns")
    return SessionShape(
        turns_counts=tuple(lengths.get(n, 0) for n in range(1, max(lengths) + 1)),
        think_percentiles_s=_percentile_table(thinks),
        append_ratio_percentiles=_percentile_table(ratios),
        provenance=dict(provenance or {}),
    )


def load_shape(path: Path | None = None) -> SessionShape:
    path = SHAPE_FILE if path is None else path
    require_file(path, "session shape")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise WorkloadError(f"{path}: cannot read session shape: {exc}") from exc
    return SessionShape.from_json(data, str(path))


def synthesize_sessions(
    requests: Sequence[SourceRequest],
    shape: SessionShape | None,
    rng: random.Random,
    *,
    prefix: str,
    max_tokens: MaxTokensRule = "pow2",
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
) -> list[SessionSpec]:
    """Group ``requests`` (arrival order) into sessions of the fitted ``shape``.

    ``shape=None`` keeps every request a one-turn session (the trace as published).
    """
    cap = max((r.output_tokens for r in requests), default=1)
    sessions: list[SessionSpec] = []
    i = 0
    while i < len(requests):
        first = requests[i]
        sid = f"{prefix}-{i}"
        prompt = min(first.input_tokens, max_prompt_tokens)
        turns = [
            TurnSpec(
                session_id=sid,
                turn=1,
                arrival_s=first.arrival_s,
                prompt_tokens=prompt,
                new_tokens=prompt,
                output_tokens=first.output_tokens,
                max_tokens=max_tokens_for(first.output_tokens, max_tokens, cap),
                think_s=0.0,
            )
        ]
        wanted = 1 if shape is None else shape.draw_turns(rng)
        while shape is not None and len(turns) < wanted and i + len(turns) < len(requests):
            previous = turns[-1]
            request = requests[i + len(turns)]
            new = max(1, round(shape.draw_append_ratio(rng) * turns[0].prompt_tokens))
            think = shape.draw_think_s(rng)
            context = previous.prompt_tokens + previous.output_tokens
            if context + new > max_prompt_tokens:
                break
            turns.append(
                TurnSpec(
                    session_id=sid,
                    turn=previous.turn + 1,
                    arrival_s=previous.arrival_s + think,
                    prompt_tokens=context + new,
                    new_tokens=new,
                    output_tokens=request.output_tokens,
                    max_tokens=max_tokens_for(request.output_tokens, max_tokens, cap),
                    think_s=think,
                    parent_turn=previous.turn,
                )
            )
        sessions.append(SessionSpec(session_id=sid, start_s=first.arrival_s, turns=tuple(turns)))
        i += len(turns)
    return sessions


def fit_from_trace(path: Path | None = None) -> SessionShape:
    """Fit on the Mooncake trace, the bundled one unless ``path`` names another (jitter off:
    trace time, deterministic)."""
    from controller.sim.workloads.mooncake import TRACE_FILE, MooncakeWorkload

    path = TRACES_DIR / TRACE_FILE if path is None else path
    workload = MooncakeWorkload(path, jitter=False)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    provenance = {
        "source": f"traces/{TRACE_FILE}",
        "source_sha256": digest,
        "linkage": "controller.sim.workloads.mooncake.link_requests (2 full 512-token blocks)",
        "think": "gap between consecutive turns' trace arrivals, jitter off",
        "append_ratio": "new_tokens of a later turn / prompt_tokens of the session's turn 1",
        "command": FIT_COMMAND,
    }
    return fit_session_shape(workload.sessions(random.Random(0)), provenance)


def shapes_match(a: SessionShape, b: SessionShape, rel_tol: float = 1e-9) -> bool:
    """Same histogram and the same percentile tables (to ``rel_tol``); provenance ignored."""

    def close(x: Sequence[float], y: Sequence[float]) -> bool:
        return len(x) == len(y) and all(
            math.isclose(u, v, rel_tol=rel_tol) for u, v in zip(x, y, strict=True)
        )

    return (
        a.turns_counts == b.turns_counts
        and close(a.think_percentiles_s, b.think_percentiles_s)
        and close(a.append_ratio_percentiles, b.append_ratio_percentiles)
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=FIT_COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=SHAPE_FILE, help="JSON file to write")
    parser.add_argument("--trace", type=Path, default=None,
                        help="Mooncake trace file (default: the bundled one)")
    parser.add_argument("--check", action="store_true", help="compare with --out, write nothing")
    args = parser.parse_args(argv)
    shape = fit_from_trace(args.trace)
    text = json.dumps(shape.to_json(), indent=2, sort_keys=True) + "\n"
    if args.check:
        same = shapes_match(shape, load_shape(args.out))
        print(f"{args.out}: {'up to date' if same else 'OUT OF DATE'}")
        return 0 if same else 1
    args.out.write_text(text, encoding="utf-8")
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
