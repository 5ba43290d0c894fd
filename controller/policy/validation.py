"""Semantic validation of a policy. Returns every problem, each with its field path."""

from __future__ import annotations

import math
from dataclasses import dataclass

from controller.errors import PolicyError
from controller.policy.model import AXIS_NAMES, MAX_EDGES_PER_AXIS, MAX_EXPLORATION, Policy, Route

MAX_VERSION = 2**63 - 1
MAX_BYPASS_TOKENS = 2**32 - 1
MAX_BUSY_WAITING = 2**32 - 1  # a u32 in the canonical encoding


@dataclass(frozen=True, slots=True)
class Problem:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class PolicyValidationError(PolicyError):
    """Raised with every problem found; ``str()`` lists them one per line."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid policy ({len(problems)} problem(s)):\n{lines}")


def _finite(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _all_finite(values: tuple[float, ...]) -> bool:
    """Fast path of ``all(map(_finite, values))`` at C speed (tables have 1000s of cells)."""
    kinds = set(map(type, values))
    if not kinds <= {float, int}:  # bool, str, None, ...: let the slow loop name them
        return False
    return all(map(math.isfinite, values))


def validate_edges(path: str, edges: tuple[float, ...]) -> list[Problem]:
    out: list[Problem] = []
    if not 1 <= len(edges) <= MAX_EDGES_PER_AXIS:
        out.append(Problem(path, f"needs 1 to {MAX_EDGES_PER_AXIS} edges, got {len(edges)}"))
    prev: float | None = None
    for i, e in enumerate(edges):
        if not _finite(e):
            out.append(Problem(f"{path}[{i}]", f"edge must be a finite number, got {e!r}"))
            prev = None
            continue
        if e < 0:
            out.append(Problem(f"{path}[{i}]", f"edge must be >= 0, got {e}"))
        if prev is not None and e <= prev:
            out.append(
                Problem(f"{path}[{i}]", f"edges must be strictly increasing ({e} <= {prev})")
            )
        prev = e
    return out


def validate_policy(p: Policy) -> list[Problem]:
    """Every problem of an already-typed policy (from JSON, protobuf or code)."""
    out: list[Problem] = []
    if isinstance(p.version, bool) or not isinstance(p.version, int):
        out.append(Problem("version", f"must be an integer, got {p.version!r}"))
    elif not 1 <= p.version <= MAX_VERSION:
        out.append(Problem("version", f"must be between 1 and {MAX_VERSION}, got {p.version}"))
    axes = p.table.axes
    for name in AXIS_NAMES:
        out.extend(validate_edges(f"axes.{name}", getattr(axes, name)))
    n = axes.n_cells
    for field_name in ("routes", "scores", "exploration"):
        got = len(getattr(p.table, field_name))
        if got != n:
            out.append(Problem(field_name, f"needs {n} cells (axes shape {axes.shape}), got {got}"))
    routes, scores, exploration = p.table.routes, p.table.scores, p.table.exploration
    # Each per-cell loop runs only when the C-speed check over the whole column fails.
    if not set(map(type, routes)) <= {Route}:
        for i, r in enumerate(routes):
            if not isinstance(r, Route):
                out.append(Problem(f"routes[{i}]", f"unknown route {r!r}"))
    if not _all_finite(scores):
        for i, s in enumerate(scores):
            if not _finite(s):
                out.append(Problem(f"scores[{i}]", f"must be a finite number, got {s!r}"))
    if not (
        _all_finite(exploration)
        and (not exploration or (min(exploration) >= 0.0 and max(exploration) <= MAX_EXPLORATION))
    ):
        for i, e in enumerate(exploration):
            if not _finite(e) or not 0.0 <= e <= MAX_EXPLORATION:
                out.append(
                    Problem(
                        f"exploration[{i}]", f"must be within [0, {MAX_EXPLORATION}], got {e!r}"
                    )
                )
    w = p.weights
    for name, v in (("wtft", w.wtft), ("wtpot", w.wtpot)):
        if not _finite(v) or v < 0:
            out.append(Problem(f"weights.{name}", f"must be a finite number >= 0, got {v!r}"))
    if _finite(w.wtft) and _finite(w.wtpot) and w.wtft == 0 and w.wtpot == 0:
        out.append(Problem("weights", "wtft and wtpot cannot both be 0"))
    for name in ("ttft_s", "tpot_s"):
        v = getattr(p.slo, name)
        if not _finite(v) or v <= 0:
            out.append(Problem(f"slo.{name}", f"must be a finite number > 0, got {v!r}"))
    if not isinstance(p.overrides.first_turn_route, Route):
        out.append(Problem("overrides.first_turn_route", "unknown route"))
    for name, top in (("bypass_append_tokens", MAX_BYPASS_TOKENS),
                      ("first_turn_busy_waiting", MAX_BUSY_WAITING),
                      ("later_turn_busy_waiting", MAX_BUSY_WAITING)):
        v = getattr(p.overrides, name)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= top:
            out.append(
                Problem(f"overrides.{name}", f"must be an integer in [0, {top}], got {v!r}")
            )
    if not isinstance(p.default_route, Route):
        out.append(Problem("default_route", "unknown route"))
    return out


def check_policy(p: Policy) -> Policy:
    """Return ``p`` unchanged or raise :class:`PolicyValidationError` with every problem."""
    problems = validate_policy(p)
    if problems:
        raise PolicyValidationError(problems)
    return p
