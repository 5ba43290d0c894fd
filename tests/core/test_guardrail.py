"""Guardrail: approve iff candidate >= current + margin."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.core.guardrail import check

prob = st.floats(min_value=0, max_value=1)


@given(prob, prob, st.floats(min_value=0, max_value=0.2))
def test_approval_rule(candidate: float, current: float, margin: float) -> None:
    v = check(candidate, current, margin)
    assert v.approved == (candidate - current >= margin)
    assert v.candidate_goodput == candidate and v.current_goodput == current
    assert f"{candidate:.4f}" in v.reason and f"{current:.4f}" in v.reason


def test_reject_keeps_the_numbers_and_force_overrides() -> None:
    v = check(0.90, 0.89, 0.02)
    assert not v.approved and v.reason.startswith("rejected")
    assert v.to_dict()["margin"] == 0.02
    forced = check(0.90, 0.89, 0.02, force=True)
    assert forced.approved and forced.forced and "forced" in forced.reason


def test_cold_start_has_nothing_to_beat() -> None:
    v = check(0.5, None, 0.01)
    assert v.approved and v.current_goodput is None


def test_negative_margin_is_refused() -> None:
    with pytest.raises(ValueError):
        check(0.5, 0.4, -0.1)
