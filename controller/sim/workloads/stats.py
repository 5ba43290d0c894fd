"""Summary statistics of a session stream (for docs, benchmarks and sanity checks)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from controller.sim.workloads.base import SessionSpec


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, int(q * len(values)))]


@dataclass(frozen=True, slots=True)
class WorkloadStats:
    sessions: int
    requests: int
    later_turns: int
    mean_turns: float
    max_turns: int
    turns_share: dict[str, float]  # "1", "2", "3", "4", "5+" -> share of sessions
    start_span_s: float  # first to last session start
    session_rate: float  # sessions started per second over the span
    turn1_prompt_mean: float
    output_mean: float
    later_new_mean: float
    later_new_p50: float
    later_new_p90: float
    later_context_mean: float
    later_context_p50: float
    think_p50_s: float
    think_p90_s: float
    max_tokens_over_output_mean: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(sessions: Iterable[SessionSpec]) -> WorkloadStats:
    lengths: list[int] = []
    starts: list[float] = []
    first_prompts: list[int] = []
    outputs: list[int] = []
    new: list[float] = []
    context: list[float] = []
    think: list[float] = []
    headroom: list[float] = []
    for session in sessions:
        lengths.append(len(session.turns))
        starts.append(session.start_s)
        first_prompts.append(session.turns[0].prompt_tokens)
        for turn in session.turns:
            outputs.append(turn.output_tokens)
            headroom.append(turn.max_tokens / turn.output_tokens)
            if turn.turn > 1:
                new.append(turn.new_tokens)
                context.append(turn.context_tokens)
                think.append(turn.think_s)
    new.sort()
    context.sort()
    think.sort()
    n = len(lengths)
    span = (max(starts) - min(starts)) if starts else 0.0
    shares = {str(k): sum(x == k for x in lengths) / n if n else 0.0 for k in (1, 2, 3, 4)}
    shares["5+"] = sum(x >= 5 for x in lengths) / n if n else 0.0
    return WorkloadStats(
        sessions=n,
        requests=sum(lengths),
        later_turns=len(new),
        mean_turns=sum(lengths) / n if n else 0.0,
        max_turns=max(lengths, default=0),
        turns_share=shares,
        start_span_s=span,
        session_rate=n / span if span > 0 else 0.0,
        turn1_prompt_mean=statistics.fmean(first_prompts) if first_prompts else 0.0,
        output_mean=statistics.fmean(outputs) if outputs else 0.0,
        later_new_mean=statistics.fmean(new) if new else 0.0,
        later_new_p50=_pct(new, 0.5),
        later_new_p90=_pct(new, 0.9),
        later_context_mean=statistics.fmean(context) if context else 0.0,
        later_context_p50=_pct(context, 0.5),
        think_p50_s=_pct(think, 0.5),
        think_p90_s=_pct(think, 0.9),
        max_tokens_over_output_mean=statistics.fmean(headroom) if headroom else 0.0,
    )
