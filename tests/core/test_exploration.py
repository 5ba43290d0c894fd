"""Exploration: bounded, zero without traffic, monotone in uncertainty."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.core.exploration import ExplorationConfig, exploration_fractions

CFG = ExplorationConfig(floor=0.01, cap=0.15)
pos = st.floats(min_value=0, max_value=1e6)
spread = st.floats(min_value=0, max_value=5)
score = st.floats(min_value=-50, max_value=50)


def frac(n: float, v: float, s: float, seen: bool = True) -> float:
    out = exploration_fractions(np.array([n]), np.array([v]), np.array([s]), np.array([seen]),
                                CFG)
    return float(out[0])


@given(pos, spread, score)
def test_bounded_and_zero_when_unseen(n: float, v: float, s: float) -> None:
    f = frac(n, v, s)
    assert CFG.floor <= f <= CFG.cap
    assert frac(n, v, s, seen=False) == 0.0


@given(pos, pos, spread, score)
def test_fewer_samples_never_explore_less(n1: float, n2: float, v: float, s: float) -> None:
    lo, hi = sorted((n1, n2))
    assert frac(lo, v, s) >= frac(hi, v, s)


@given(pos, spread, spread, score)
def test_more_spread_never_explores_less(n: float, v1: float, v2: float, s: float) -> None:
    lo, hi = sorted((v1, v2))
    assert frac(n, hi, s) >= frac(n, lo, s)


@given(pos, spread, score, score)
def test_closer_scores_never_explore_less(n: float, v: float, s1: float, s2: float) -> None:
    near, far = sorted((abs(s1), abs(s2)))
    assert frac(n, v, near) >= frac(n, v, -far)


def test_confident_cells_shrink_to_the_floor_uncertain_ones_reach_the_cap() -> None:
    assert frac(1e9, 0.0, 40.0) == pytest.approx(CFG.floor, abs=1e-6)
    assert frac(0.0, 5.0, 0.0) == pytest.approx(CFG.cap)


def test_config_rejects_out_of_range() -> None:
    with pytest.raises(ValueError):
        ExplorationConfig(floor=0.1, cap=0.05)
    with pytest.raises(ValueError):
        ExplorationConfig(floor=0.0, cap=0.5)
