"""An active calibration's grid as simulator traffic (``controller.sim.workloads.active``):
the sessions the plan asks for, on its schedule, each turn 2 in its planned cell."""

from __future__ import annotations

import random

import pytest

from controller.core.active import plan_active_calibration, schedule
from controller.policy import Axes, Slo
from controller.policy.decide import bin_index
from controller.sim.workloads.active import ActivePlanWorkload

AXES = Axes()


def test_the_grid_is_every_planned_conversation_on_its_schedule() -> None:
    plan = plan_active_calibration(AXES, Slo(0.5, 0.05), 1)
    points = plan.phases[1].points
    routers = 2
    workload = ActivePlanWorkload(points, routers, start_s=100.0)
    sessions = list(workload.sessions(random.Random(0)))
    assert len(sessions) == sum(p.sessions for p in points)
    assert 2 * len(sessions) == plan.phases[1].requests
    starts = [s.start_s for s in sessions]
    assert starts == sorted(starts) and starts[0] == 100.0
    assert len({s.session_id for s in sessions}) == len(sessions)
    timed = schedule(points, routers)
    assert workload.end_s == pytest.approx(100.0 + timed[-1].end_s)
    k = 0
    for sp in timed:
        p = sp.point
        for j in range(p.sessions):
            one, two = sessions[k].turns
            k += 1
            assert one.arrival_s == pytest.approx(100.0 + sp.start_s + 2 * j * sp.gap_s)
            assert (one.prompt_tokens, one.max_tokens) == (p.turn1_prompt_tokens, p.output_tokens)
            # Turn 2 waits one gap after turn 1's answer and lands in the point's cell.
            assert two.context_tokens == p.turn2_context_tokens
            assert two.think_s == pytest.approx(sp.gap_s) and two.parent_turn == 1
            assert two.new_tokens == p.append_tokens
            assert two.max_tokens == two.output_tokens == p.output_tokens
            cell = (bin_index(AXES.context_tokens, float(two.context_tokens)),
                    bin_index(AXES.io_ratio, two.new_tokens / two.max_tokens))
            assert cell == p.cell[:2]


def test_the_grid_draws_nothing() -> None:
    plan = plan_active_calibration(AXES, Slo(0.5, 0.05), 1)
    workload = ActivePlanWorkload(plan.phases[0].points, 3)
    assert list(workload.sessions(random.Random(1))) == list(workload.sessions(random.Random(2)))
