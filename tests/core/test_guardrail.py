"""Guardrail: approve iff candidate >= current + margin (raised to the held-out goodput error
when the current policy is overloaded)."""

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


@given(prob, prob, st.floats(min_value=0, max_value=0.2), st.floats(min_value=0, max_value=1),
       prob)
def test_overload_rule(candidate: float, current: float, margin: float, error: float,
                       overload_below: float) -> None:
    v = check(candidate, current, margin, heldout_error=error, overload_below=overload_below)
    needed = max(margin, error) if current < overload_below else margin
    assert v.approved == (candidate - current >= needed)
    assert v.margin == needed


def test_overloaded_gain_within_the_heldout_error_is_rejected() -> None:
    # context x3 on ppd-2p2d: predicted 0.059 vs 0.028, held-out goodput error 0.054.
    overloaded = check(0.059, 0.028, 0.005, heldout_error=0.054, overload_below=0.5)
    assert not overloaded.approved and overloaded.margin == 0.054
    # The same gain and error outside overload: the absolute margin alone.
    assert check(0.93, 0.90, 0.005, heldout_error=0.054, overload_below=0.5).approved
    with pytest.raises(ValueError):
        check(0.5, 0.4, 0.0, heldout_error=-0.1)


def test_reject_keeps_the_numbers_and_force_overrides() -> None:
    v = check(0.90, 0.89, 0.02)
    assert not v.approved and v.reason.startswith("rejected")
    assert v.to_dict()["margin"] == 0.02
    forced = check(0.90, 0.89, 0.02, force=True)
    assert forced.approved and forced.forced and "forced" in forced.reason
    assert forced.overridden and "overridden" not in forced.to_dict()
    # Forcing a candidate the guardrail approves anyway overrides nothing.
    assert not check(0.95, 0.89, 0.02, force=True).overridden
    assert not v.overridden


def test_cold_start_has_nothing_to_beat() -> None:
    v = check(0.5, None, 0.01)
    assert v.approved and v.current_goodput is None


def test_negative_margin_is_refused() -> None:
    with pytest.raises(ValueError):
        check(0.5, 0.4, -0.1)
