"""Active cold-start calibration: the plan (pure).

With no history there is nothing to learn from, so the controller measures, as the PPD paper
does offline, but on the live cluster: it pushes a **forced** policy (every later turn to a
prefill node, then every later turn decode-local) and, under each, sends a bounded synthetic
multi-turn load that covers the table's cells — context classes × io-ratio classes × QPS
points. The windows observed meanwhile are an exploration-rich calibration set for the first
real table.

This module only plans: which forced policies, which load points, how many requests, how
long. The executor that sends the load through an OpenAI-compatible endpoint lives with the
daemon (``controller/loop/calibration_runner.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from controller.policy.decide import bin_index
from controller.policy.model import Axes, Overrides, Policy, Provenance, Route, Slo

# Defaults follow the PPD paper's benchmark grid (context small/large/huge; append/output
# pairs from tiny to huge_paste; QPS points), scaled down to a bounded run. Every point sits
# on its bin's representative value (arithmetic midpoint for context, geometric for io ratio
# and QPS), which is what the latency model takes a bin to stand for: the paper's round
# numbers (1024, 4096, ratio 1, 8, 32, QPS 0.5, 2, 8) are the default axes' upper edges,
# and on them the grid measured one bin off (held-out TTFT MAPE 0.28-0.50). The lowest QPS
# point moves up a bin (0.71, not 0.35): a point lasts sessions / QPS, and under a time
# bound a slower lowest point cost the plan all its other QPS points.
DEFAULT_CONTEXTS: tuple[int, ...] = (128, 768, 3072, 12288)
DEFAULT_TURNS: tuple[tuple[int, int], ...] = (  # (append tokens, output tokens)
    (11, 32), (23, 256), (45, 64), (90, 128), (181, 64), (362, 64), (724, 32),
)
DEFAULT_QPS: tuple[float, ...] = (0.71, 2.8, 5.7)


@dataclass(frozen=True, slots=True)
class LoadPoint:
    """One synthetic load: ``sessions`` two-turn conversations at ``qps`` turns per second."""

    context_tokens: int  # turn 1 prompt (becomes the cached context of turn 2)
    append_tokens: int  # turn 2 new tokens
    output_tokens: int  # max_tokens of turn 2 (turn 1 gets the same)
    qps: float
    sessions: int
    duration_s: float
    cell: tuple[int, int, int]  # the table cell turn 2 falls in

    @property
    def requests(self) -> int:
        return 2 * self.sessions

    @property
    def turn1_prompt_tokens(self) -> int:
        """Turn 1's prompt: ``context - output`` tokens, so that turn 2's reusable context
        (turn 1's prompt and answer) is ``context_tokens``; 8 at least."""
        return max(self.context_tokens - self.output_tokens, 8)

    @property
    def turn2_context_tokens(self) -> int:
        """Turn 2's reusable context as sent: ``context_tokens`` unless the context class is
        shorter than turn 1's answer plus its shortest prompt."""
        return self.turn1_prompt_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class Phase:
    route: Route
    policy: Policy
    points: tuple[LoadPoint, ...]

    @property
    def requests(self) -> int:
        return sum(p.requests for p in self.points)

    @property
    def duration_s(self) -> float:
        return math.fsum(p.duration_s for p in self.points)


@dataclass(frozen=True, slots=True)
class ActivePlan:
    phases: tuple[Phase, ...]
    dropped_points: int  # load points left out to stay within the bounds

    @property
    def requests(self) -> int:
        return sum(p.requests for p in self.phases)

    @property
    def duration_s(self) -> float:
        return math.fsum(p.duration_s for p in self.phases)

    def cells(self) -> set[tuple[int, int, int]]:
        return {pt.cell for ph in self.phases for pt in ph.points}


@dataclass(frozen=True, slots=True)
class ScheduledPoint:
    """When one load point of a phase runs (seconds from the phase's start)."""

    point: LoadPoint
    start_s: float
    gap_s: float  # between one turn and the next that goes out

    @property
    def end_s(self) -> float:
        return self.start_s + 2 * self.point.sessions * self.gap_s


def schedule(points: Sequence[LoadPoint], endpoints: int) -> tuple[ScheduledPoint, ...]:
    """The phase's load points in the order and at the times they run, ``endpoints``
    routers sharing the load.

    Lowest QPS first, each level held for all its points: a window then measures one QPS
    level (the table's axis) instead of an average over alternating levels. A point's QPS
    is per router and its conversations go to the routers in turn, so its turns go out at
    ``qps × endpoints`` per second, one ``gap`` apart: conversation j starts at ``2j·gap``
    and its second turn follows one ``gap`` later. The points follow back to back (a
    point's planned ``duration_s`` is its length on one router)."""
    if endpoints < 1:
        raise ValueError("an active calibration needs at least one endpoint")
    out: list[ScheduledPoint] = []
    start = 0.0
    for point in sorted(points, key=lambda p: p.qps):
        out.append(ScheduledPoint(point, start, 1.0 / (point.qps * endpoints)))
        start = out[-1].end_s
    return tuple(out)


def forced_policy(route: Route, version: int, axes: Axes, slo: Slo, reason: str) -> Policy:
    """Every later turn one way; turn 1 still to a prefill node; no bypass, no exploration."""
    return Policy.uniform(
        version, route, axes, slo=slo,
        overrides=Overrides(first_turn_route=Route.PREFILL_NODE, bypass_append_tokens=0),
        provenance=Provenance(reason=reason, created_by="pd-controller active calibration"),
    )


def plan_active_calibration(
    axes: Axes,
    slo: Slo,
    first_version: int,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    turns: Sequence[tuple[int, int]] = DEFAULT_TURNS,
    qps_points: Sequence[float] = DEFAULT_QPS,
    sessions_per_point: int = 20,
    min_sessions_per_point: int = 4,
    max_requests: int = 4000,
    max_duration_s: float = 1800.0,
) -> ActivePlan:
    """Both forced phases over the grid, shrunk to fit ``max_requests`` and ``max_duration_s``.

    Shrinking first lowers the sessions per point (not below ``min_sessions_per_point``), then
    drops QPS points from the middle outwards (the extremes bound the load axis), then context
    classes likewise; ``dropped_points`` says how many points were left out.
    """
    if not contexts or not turns or not qps_points:
        raise ValueError("an active calibration needs contexts, turns and qps points")
    if min(qps_points) <= 0:
        raise ValueError("qps points must be > 0")
    if sessions_per_point < min_sessions_per_point or min_sessions_per_point < 1:
        raise ValueError("need sessions_per_point >= min_sessions_per_point >= 1")
    qps = sorted(float(q) for q in qps_points)
    ctxs = sorted(int(c) for c in contexts)
    full = 2 * len(ctxs) * len(turns) * len(qps)
    sessions = _shrink(qps, ctxs, len(turns), sessions_per_point, min_sessions_per_point,
                       max_requests, max_duration_s)
    phases = tuple(_phase(route, first_version + i, axes, slo, ctxs, turns, qps, sessions)
                   for i, route in enumerate((Route.PREFILL_NODE, Route.DECODE_LOCAL)))
    kept = sum(len(p.points) for p in phases)
    return ActivePlan(phases, full - kept)


def _shrink(qps: list[float], ctxs: list[int], n_turns: int, sessions_per_point: int,
            min_sessions_per_point: int, max_requests: int, max_duration_s: float) -> int:
    """The sessions per point that fit the bounds; drops points from ``qps`` and ``ctxs`` (in
    place) when fewer sessions are not enough. Raises ``ValueError`` when one point is too
    much."""

    def cost(sessions: int, qs: Sequence[float], cs: Sequence[int]) -> tuple[int, float]:
        per_route_requests = 2 * sessions * n_turns * len(cs) * len(qs)
        per_route_time = sum(2 * sessions / q for q in qs) * n_turns * len(cs)
        return 2 * per_route_requests, 2 * per_route_time

    def fits(sessions: int, qs: Sequence[float], cs: Sequence[int]) -> bool:
        r, t = cost(sessions, qs, cs)
        return r <= max_requests and t <= max_duration_s

    sessions = sessions_per_point
    while sessions > min_sessions_per_point and not fits(sessions, qps, ctxs):
        sessions -= 1
    while not fits(sessions, qps, ctxs) and (len(qps) > 1 or len(ctxs) > 1):
        if len(qps) > 1 and (len(qps) >= len(ctxs) or len(ctxs) == 1):
            qps.pop(len(qps) // 2 if len(qps) > 2 else len(qps) - 1)
        else:
            ctxs.pop(len(ctxs) // 2 if len(ctxs) > 2 else len(ctxs) - 1)
    if not fits(sessions, qps, ctxs):
        raise ValueError(
            f"even one load point exceeds the bounds ({max_requests} requests, "
            f"{max_duration_s:g} s): raise them or lower min_sessions_per_point"
        )
    return sessions


def _phase(route: Route, version: int, axes: Axes, slo: Slo, ctxs: Sequence[int],
           turns: Sequence[tuple[int, int]], qps: Sequence[float], sessions: int) -> Phase:
    """One forced phase: every (context, turn shape, QPS) point under ``route``."""
    points = []
    for c in ctxs:
        for append, out in turns:
            for q in qps:
                point = LoadPoint(c, append, out, q, sessions, 2 * sessions / q, (0, 0, 0))
                # The cell turn 2 lands in, from the context it is sent with.
                cell = (bin_index(axes.context_tokens, float(point.turn2_context_tokens)),
                        bin_index(axes.io_ratio, append / out), bin_index(axes.qps, q))
                points.append(replace(point, cell=cell))
    name = "all-prefill-node" if route == Route.PREFILL_NODE else "all-decode-local"
    return Phase(route, forced_policy(route, version, axes, slo, f"active calibration: {name}"),
                 tuple(points))
