"""Active cold-start calibration plan: both forced routes, covering, bounded."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.core.active import DEFAULT_TURNS, plan_active_calibration, schedule
from controller.policy.decide import bin_index
from controller.policy.model import Axes, Route, Slo
from controller.policy.validation import validate_policy

AXES = Axes()
SLO = Slo(ttft_s=1.0, tpot_s=0.05)


def test_default_plan_covers_the_grid_under_both_forced_routes() -> None:
    plan = plan_active_calibration(AXES, SLO, first_version=1)
    assert [p.route for p in plan.phases] == [Route.PREFILL_NODE, Route.DECODE_LOCAL]
    for phase in plan.phases:
        validate_policy(phase.policy)
        assert set(phase.policy.table.routes) == {phase.route}
        assert all(e == 0.0 for e in phase.policy.table.exploration)
        assert phase.policy.overrides.first_turn_route == Route.PREFILL_NODE
    assert [p.policy.version for p in plan.phases] == [1, 2]
    a, b = plan.phases
    assert [pt.cell for pt in a.points] == [pt.cell for pt in b.points]
    # context classes x io classes are all present (ratios of the default turns differ)
    ctx_io = {(c, i) for c, i, _ in plan.cells()}
    assert len(ctx_io) >= 4 * len({t[0] / t[1] for t in DEFAULT_TURNS}) - 4
    assert plan.requests <= 4000 and plan.duration_s <= 1800.0


@given(
    max_requests=st.integers(min_value=200, max_value=20_000),
    max_duration=st.floats(min_value=100.0, max_value=20_000.0),
)
def test_plan_respects_its_bounds(max_requests: int, max_duration: float) -> None:
    try:
        plan = plan_active_calibration(AXES, SLO, 1, max_requests=max_requests,
                                       max_duration_s=max_duration)
    except ValueError as e:
        assert "exceeds the bounds" in str(e)
        return
    assert plan.requests <= max_requests
    assert plan.duration_s <= max_duration + 1e-9
    assert all(pt.sessions >= 4 for ph in plan.phases for pt in ph.points)
    # a smaller budget never plans more points than a larger one
    bigger = plan_active_calibration(AXES, SLO, 1, max_requests=max_requests * 2,
                                     max_duration_s=max_duration * 2)
    assert bigger.dropped_points <= plan.dropped_points


def test_shrinking_keeps_the_extreme_qps_points() -> None:
    plan = plan_active_calibration(AXES, SLO, 1, qps_points=(0.5, 1, 2, 4, 8),
                                   max_requests=100_000, max_duration_s=1000.0)
    qps = sorted({pt.qps for pt in plan.phases[0].points})
    assert qps[0] == 0.5 and qps[-1] == 8.0
    assert plan.dropped_points > 0


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError):
        plan_active_calibration(AXES, SLO, 1, qps_points=())
    with pytest.raises(ValueError):
        plan_active_calibration(AXES, SLO, 1, qps_points=(0.0, 1.0))
    with pytest.raises(ValueError):
        plan_active_calibration(AXES, SLO, 1, max_requests=10)


@pytest.mark.parametrize("endpoints", [1, 3])
def test_the_schedule_holds_each_qps_level_back_to_back(endpoints: int) -> None:
    plan = plan_active_calibration(AXES, SLO, 1, sessions_per_point=4,
                                   max_requests=100_000, max_duration_s=100_000.0)
    points = plan.phases[0].points
    timed = schedule(points, endpoints)
    assert sorted(map(id, (sp.point for sp in timed))) == sorted(map(id, points))
    qps = [sp.point.qps for sp in timed]
    assert qps == sorted(qps)  # lowest level first, each level once, in one stretch
    assert timed[0].start_s == 0.0
    for before, after in itertools.pairwise(timed):
        assert after.start_s == pytest.approx(before.end_s)  # no idle time between points
    for sp in timed:
        # Turns go out one gap apart, every router at the point's QPS.
        assert sp.gap_s == pytest.approx(1.0 / (sp.point.qps * endpoints))
        assert sp.end_s - sp.start_s == pytest.approx(sp.point.duration_s / endpoints)


def test_a_schedule_needs_an_endpoint() -> None:
    plan = plan_active_calibration(AXES, SLO, 1)
    with pytest.raises(ValueError, match="at least one endpoint"):
        schedule(plan.phases[0].points, 0)


def test_turn_1_leaves_turn_2_the_planned_context() -> None:
    plan = plan_active_calibration(AXES, SLO, 1)
    for pt in plan.phases[0].points:
        assert pt.turn2_context_tokens == pt.turn1_prompt_tokens + pt.output_tokens
        if pt.context_tokens > pt.output_tokens + 8:
            assert pt.turn2_context_tokens == pt.context_tokens
        else:  # a context shorter than the answer: the shortest prompt there is
            assert pt.turn1_prompt_tokens == 8
        # The planned cell is the one the context as sent falls in.
        assert pt.cell[0] == bin_index(AXES.context_tokens, float(pt.turn2_context_tokens))
