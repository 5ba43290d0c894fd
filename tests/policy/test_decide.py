"""decide() against a brute-force reference over random tables and inputs."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from controller.policy import Decision, Features, Policy, Reason, Route, decide
from tests.policy.strategies import any_float, policies


def reference_bin(edges: tuple[float, ...], value: float) -> int:
    """Linear scan: the first bin whose inclusive upper edge holds the value, else the last."""
    for i, e in enumerate(edges):
        if value <= e:
            return i
    return len(edges) - 1


def reference_decide(p: Policy, f: Features, draw_value: float) -> Decision:
    vals = [f.turn, f.context_tokens, f.append_tokens, f.expected_output_tokens, f.qps]
    if any((not math.isfinite(v)) or v < 0 for v in vals) or f.turn < 1:
        return Decision(p.default_route, None, Reason.INVALID_INPUT)
    if f.expected_output_tokens == 0:
        return Decision(p.default_route, None, Reason.INVALID_INPUT)
    if f.turn == 1:
        busy = p.overrides.first_turn_busy_waiting
        w = f.prefill_waiting
        if p.overrides.first_turn_route is Route.PREFILL_NODE and busy > 0 \
                and w is not None and math.isfinite(w) and w >= busy:
            return Decision(Route.DECODE_LOCAL, None, Reason.BUSY_PREFILL)
        return Decision(p.overrides.first_turn_route, None, Reason.FIRST_TURN)
    if f.append_tokens < p.overrides.bypass_append_tokens:
        return Decision(Route.DECODE_LOCAL, None, Reason.BYPASS)
    ax = p.table.axes
    cell = (
        reference_bin(ax.context_tokens, f.context_tokens),
        reference_bin(ax.io_ratio, f.append_tokens / f.expected_output_tokens),
        reference_bin(ax.qps, f.qps),
    )
    # Independent flattening: enumerate all cells in C order and find ours.
    flat = [
        (i, j, k)
        for i in range(len(ax.context_tokens))
        for j in range(len(ax.io_ratio))
        for k in range(len(ax.qps))
    ].index(cell)
    route = p.table.routes[flat]
    if draw_value < p.table.exploration[flat]:
        other = Route.PREFILL_NODE if route is Route.DECODE_LOCAL else Route.DECODE_LOCAL
        return Decision(other, cell, Reason.EXPLORE, explored=True)
    busy, w = p.overrides.later_turn_busy_waiting, f.prefill_waiting
    if route is Route.PREFILL_NODE and p.overrides.first_turn_route is Route.PREFILL_NODE \
            and busy > 0 and w is not None and math.isfinite(w) \
            and w >= busy:
        return Decision(Route.DECODE_LOCAL, cell, Reason.BUSY_LATER_TURN)
    return Decision(route, cell, Reason.TABLE)


@settings(max_examples=400, deadline=None)
@given(
    policy=policies(),
    turn=st.integers(-1, 6),
    ctx=any_float,
    append=any_float,
    out=any_float,
    qps=any_float,
    waiting=st.none() | any_float,
    draw_value=st.floats(0, 0.9999),
)
def test_decide_matches_reference(
    policy: Policy, turn: int, ctx: float, append: float, out: float, qps: float,
    waiting: float | None, draw_value: float,
) -> None:
    f = Features(turn, ctx, append, out, qps, waiting)
    assert decide(policy, f, lambda: draw_value) == reference_decide(policy, f, draw_value)


@settings(max_examples=200, deadline=None)
@given(policy=policies(), data=st.data())
def test_values_on_edges_fall_in_their_bin(policy: Policy, data: st.DataObject) -> None:
    ax = policy.table.axes
    i = data.draw(st.integers(0, len(ax.context_tokens) - 1))
    k = data.draw(st.integers(0, len(ax.qps) - 1))
    f = Features(2, ax.context_tokens[i], 10**6, 1, ax.qps[k])
    d = decide(policy, f, lambda: 0.99)
    if d.cell is not None:
        assert d.cell[0] == i
        assert d.cell[2] == k


def test_exploration_uses_injected_draw_only_when_needed() -> None:
    p = Policy.uniform(1, Route.PREFILL_NODE)  # exploration 0 everywhere
    calls = []

    def draw() -> float:
        calls.append(1)
        return 0.0

    d = decide(p, Features(2, 100, 10, 10, 1), draw)
    assert d.route is Route.PREFILL_NODE and not calls


def test_garbage_types_never_raise() -> None:
    p = Policy.uniform(1, Route.DECODE_LOCAL, default_route=Route.PREFILL_NODE)
    bad = Features(2, None, "x", 1, 1)  # type: ignore[arg-type]
    d = decide(p, bad, lambda: 0.0)
    assert d.reason is Reason.INVALID_INPUT and d.route is Route.PREFILL_NODE
