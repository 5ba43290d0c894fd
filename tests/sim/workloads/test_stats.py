"""summarize(): the numbers the docs and benchmark print."""

from __future__ import annotations

import pytest

from controller.sim.workloads.base import SessionSpec, TurnSpec
from controller.sim.workloads.stats import summarize


def test_summary_of_hand_made_sessions() -> None:
    one = SessionSpec("a", 0.0, (TurnSpec("a", 1, 0.0, 100, 100, 10, 32, 0.0),))
    three = SessionSpec(
        "b",
        10.0,
        (
            TurnSpec("b", 1, 10.0, 200, 200, 20, 32, 0.0),
            TurnSpec("b", 2, 15.0, 260, 40, 20, 32, 5.0, 1),
            TurnSpec("b", 3, 22.0, 380, 100, 40, 64, 7.0, 2),
        ),
    )
    stats = summarize([one, three])
    assert (stats.sessions, stats.requests, stats.later_turns, stats.max_turns) == (2, 4, 2, 3)
    assert stats.mean_turns == 2.0
    assert stats.turns_share == {"1": 0.5, "2": 0.0, "3": 0.5, "4": 0.0, "5+": 0.0}
    assert stats.turn1_prompt_mean == 150.0
    assert stats.later_new_mean == 70.0
    assert stats.later_context_mean == pytest.approx((220 + 280) / 2)
    assert stats.session_rate == pytest.approx(2 / 10)
    assert stats.max_tokens_over_output_mean == pytest.approx((3.2 + 1.6 + 1.6 + 1.6) / 4)
