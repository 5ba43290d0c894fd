"""Active cold-start calibration plan: both forced routes, covering, bounded."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.core.active import DEFAULT_TURNS, plan_active_calibration
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
