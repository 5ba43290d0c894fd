"""``decide()``: the routing decision a router makes for every request.

Pure and allocation-light: it runs inside routers on every request (budget: a few
microseconds). It never raises on bad input; a router must always get a route.
"""

from __future__ import annotations

import enum
import math
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass

from controller.policy.model import Policy, Route


class Reason(enum.StrEnum):
    TABLE = "table"  # the cell's route
    EXPLORE = "explore"  # the cell's other route, drawn with the cell's exploration fraction
    FIRST_TURN = "first_turn"  # override: turn 1
    BUSY_PREFILL = "busy_prefill"  # override: turn 1 decode-local, every prefill worker busy
    # override: a later turn its cell sends to a prefill node runs decode-local, every prefill
    # worker busy (the cell is reported)
    BUSY_LATER_TURN = "busy_later_turn"
    BYPASS = "bypass"  # override: append below the bypass threshold
    INVALID_INPUT = "invalid_input"  # NaN, infinite, negative or zero-output features
    TIMEOUT = "timeout"  # set by the agent: the decision took longer than decision_timeout_ms
    NO_POLICY = "no_policy"  # set by the agent: no policy loaded yet


@dataclass(frozen=True, slots=True)
class Features:
    """What a router knows about a request when it must route it.

    ``prefill_waiting``: requests waiting on the least-busy prefill worker as the router sees
    it (None: unknown, and the busy override never fires; so does a NaN or negative value).
    """

    turn: int
    context_tokens: float
    append_tokens: float
    expected_output_tokens: float
    qps: float
    prefill_waiting: float | None = None

    @property
    def io_ratio(self) -> float:
        return self.append_tokens / self.expected_output_tokens


@dataclass(frozen=True, slots=True)
class Decision:
    route: Route
    # (context bin, io bin, qps bin) when the table was consulted, else None.
    cell: tuple[int, int, int] | None
    reason: Reason
    explored: bool = False


def bin_index(edges: tuple[float, ...], value: float) -> int:
    """Inclusive upper edges: a value equal to an edge is in that bin; beyond the last, last."""
    i = bisect_left(edges, value)
    return i if i < len(edges) else len(edges) - 1


def features_valid(f: Features) -> bool:
    try:
        values = (f.turn, f.context_tokens, f.append_tokens, f.expected_output_tokens, f.qps)
        for v in values:
            if not math.isfinite(v) or v < 0:
                return False
        return f.turn >= 1 and f.expected_output_tokens > 0
    except TypeError:
        return False


def prefill_busy(need: int, prefill_waiting: float | None) -> bool:
    """Whether a busy override fires: on (``need`` > 0), and the least-busy prefill worker has
    at least ``need`` requests waiting (False for an unknown or invalid count)."""
    # A chained comparison is False for NaN; a value of another type counts as unknown.
    return need > 0 and isinstance(prefill_waiting, (int, float)) \
        and need <= prefill_waiting < math.inf


def first_turn_busy_waiting(policy: Policy) -> int:
    """Turn 1's busy override bar, 0 (off) while turn 1 runs decode-local: nothing to divert."""
    o = policy.overrides
    return o.first_turn_busy_waiting if o.first_turn_route is Route.PREFILL_NODE else 0


def later_turn_busy_waiting(policy: Policy) -> int:
    """The later-turn busy override's bar, 0 (off) while turn 1 runs decode-local: the
    override moves prefill work onto the decode pool, which then already carries every new
    conversation's prompt (measured in ``CHANGELOG.md``, "The later-turn busy override")."""
    o = policy.overrides
    return o.later_turn_busy_waiting if o.first_turn_route is Route.PREFILL_NODE else 0


def locate(policy: Policy, f: Features) -> tuple[int, int, int]:
    """The table cell of valid features."""
    axes = policy.table.axes
    return (
        bin_index(axes.context_tokens, f.context_tokens),
        bin_index(axes.io_ratio, f.append_tokens / f.expected_output_tokens),
        bin_index(axes.qps, f.qps),
    )


def decide(policy: Policy, f: Features, draw: Callable[[], float]) -> Decision:
    """Route one request.

    ``draw`` returns a uniform float in [0, 1); it is only called when the cell has a
    non-zero exploration fraction, so tests can inject a deterministic source.
    """
    if not features_valid(f):
        return Decision(policy.default_route, None, Reason.INVALID_INPUT)
    if f.turn == 1:
        if prefill_busy(first_turn_busy_waiting(policy), f.prefill_waiting):
            return Decision(Route.DECODE_LOCAL, None, Reason.BUSY_PREFILL)
        return Decision(policy.overrides.first_turn_route, None, Reason.FIRST_TURN)
    if f.append_tokens < policy.overrides.bypass_append_tokens:
        return Decision(Route.DECODE_LOCAL, None, Reason.BYPASS)
    cell = locate(policy, f)
    table = policy.table
    idx = table.axes.cell_index(*cell)
    route = table.routes[idx]
    expl = table.exploration[idx]
    if expl > 0.0 and draw() < expl:
        return Decision(route.other, cell, Reason.EXPLORE, explored=True)
    if route is Route.PREFILL_NODE and prefill_busy(later_turn_busy_waiting(policy),
                                                    f.prefill_waiting):
        return Decision(Route.DECODE_LOCAL, cell, Reason.BUSY_LATER_TURN)
    return Decision(route, cell, Reason.TABLE)
