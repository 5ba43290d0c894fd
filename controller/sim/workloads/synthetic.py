"""Synthetic PPD-style multi-turn sessions (the PPD paper's benchmark shape).

Every session has ``turns`` turns. Turn 1 sends ``turn1_input`` tokens and generates
``turn1_output``; each later turn appends ``append_input`` new tokens to the previous prompt
+ output (all of which is reusable context) and generates ``append_output``. Think time
between a turn's completion and the next turn: ``think_s`` (``think = "fixed"``) or
exponential with that mean (``think = "exp"``).

Sessions start as a Poisson process (seeded) during ``[0, duration_s)`` at ``qps / turns``
per second, so the overall request rate is ``qps`` once sessions overlap in steady state.
``max_tokens`` equals the output length: the PPD benchmark fixes the output length of each
class (a client asking for N tokens with ``ignore_eos``), so here the router's
``expected_output_tokens`` is exact by construction.

Named classes (from the PPD paper, arXiv 2603.13358, and
its ``freelulul/vllm-ppd`` benchmark): ``class`` picks the Turn-2+ shape (input -> output) and
``context`` the Turn-1 shape (``small`` 128 -> 128, ``large`` 1024 -> 1024). Giving a class
and one of the sizes it sets is an error, so a scenario never says two things at once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from controller.sim.workloads.base import Params, SessionSpec, TurnSpec, WorkloadError

if TYPE_CHECKING:
    import random

# Turn-2+ classes of the PPD paper: (append_input, append_output)
PPD_CLASSES: dict[str, tuple[int, int]] = {
    "tiny": (16, 32),
    "short_gen": (32, 256),
    "long_gen": (32, 512),
    "very_long_gen": (64, 1024),
    "small_bal": (64, 64),
    "mid_bal": (128, 128),
    "mid_paste": (256, 64),
    "big_paste": (512, 64),
    "huge_paste": (1024, 32),
}
# Turn-1 contexts of the PPD paper: (turn1_input, turn1_output)
PPD_CONTEXTS: dict[str, tuple[int, int]] = {"small": (128, 128), "large": (1024, 1024)}

PARAMS = {
    "qps",
    "turns",
    "turn1_input",
    "turn1_output",
    "append_input",
    "append_output",
    "think_s",
    "think",
    "duration_s",
    "class",
    "context",
    "max_sessions",
}


@dataclass(frozen=True, slots=True)
class SyntheticShape:
    qps: float
    turns: int
    turn1_input: int
    turn1_output: int
    append_input: int
    append_output: int
    think_s: float
    think: str  # "fixed" | "exp"
    duration_s: float
    max_sessions: int | None = None


class SyntheticWorkload:
    def __init__(self, shape: SyntheticShape, name: str = "synthetic") -> None:
        self.shape = shape
        self.name = name

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> SyntheticWorkload:
        p = Params("synthetic", params, PARAMS)
        sizes = {"turn1_input": 128, "turn1_output": 128, "append_input": 128, "append_output": 128}
        name = "synthetic"
        presets = (("context", PPD_CONTEXTS, "turn1"), ("class", PPD_CLASSES, "append"))
        for key, table, prefix in presets:
            if not p.has(key):
                continue
            label = p.string(key, "", tuple(table))
            for size_key in (f"{prefix}_input", f"{prefix}_output"):
                if p.has(size_key):
                    raise WorkloadError(
                        f"workload.params.{size_key}: conflicts with {key} = {label!r}, "
                        f"which sets it; give one or the other"
                    )
            sizes[f"{prefix}_input"], sizes[f"{prefix}_output"] = table[label]
            name += f"-{label}"
        for key, default in list(sizes.items()):
            sizes[key] = p.integer(key, default, minimum=1)
        shape = SyntheticShape(
            qps=p.number("qps", 1.0, strict=True, maximum=10_000.0),  # beyond: a silent hang
            turns=p.integer("turns", 2, minimum=1),
            think_s=p.number("think_s", 1.0),
            think=p.string("think", "fixed", ("fixed", "exp")),
            duration_s=p.number("duration_s", 600.0, strict=True),
            max_sessions=p.optional_integer("max_sessions"),
            turn1_input=sizes["turn1_input"],
            turn1_output=sizes["turn1_output"],
            append_input=sizes["append_input"],
            append_output=sizes["append_output"],
        )
        return cls(shape, name)

    def sessions(self, rng: random.Random) -> Iterator[SessionSpec]:
        shape = self.shape
        session_rate = shape.qps / shape.turns
        start = 0.0
        count = 0
        while shape.max_sessions is None or count < shape.max_sessions:
            start += rng.expovariate(session_rate)
            if start >= shape.duration_s:
                return
            yield self._session(f"{self.name}-{count}", start, rng)
            count += 1

    def _session(self, sid: str, start: float, rng: random.Random) -> SessionSpec:
        shape = self.shape
        turns = [
            TurnSpec(
                session_id=sid,
                turn=1,
                arrival_s=start,
                prompt_tokens=shape.turn1_input,
                new_tokens=shape.turn1_input,
                output_tokens=shape.turn1_output,
                max_tokens=shape.turn1_output,
                think_s=0.0,
            )
        ]
        for n in range(2, shape.turns + 1):
            previous = turns[-1]
            think = shape.think_s
            if shape.think == "exp" and think > 0:
                think = rng.expovariate(1.0 / think)
            turns.append(
                TurnSpec(
                    session_id=sid,
                    turn=n,
                    arrival_s=previous.arrival_s + think,  # informational: no service time
                    prompt_tokens=previous.prompt_tokens
                    + previous.output_tokens
                    + shape.append_input,
                    new_tokens=shape.append_input,
                    output_tokens=shape.append_output,
                    max_tokens=shape.append_output,
                    think_s=think,
                    parent_turn=n - 1,
                )
            )
        return SessionSpec(session_id=sid, start_s=start, turns=tuple(turns))
