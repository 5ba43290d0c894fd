"""Weight tuner: picks the ratio that maximises predicted goodput (and leans the right way)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.core.calibrate import CalibrationConfig, calibrate
from controller.core.weights import DEFAULT_RATIOS, choose_weights, weights_for_ratio
from controller.policy.model import Slo, Weights
from tests.core.synth import Mix, Truth, training_windows

# World A: long contexts recomputed on 2 prefill workers; decode-local wins TTFT by far.
WORLD_A = (Truth(), Mix())
# World B: a fast prefill pool (4 workers, 40 GB/s links) and one decode worker.
WORLD_B = (
    Truth(n_prefill=4, n_decode=1, link_bw=40e9),
    Mix({(1, 2): 0.2, (2, 4): 0.15, (3, 1): 0.15, (4, 3): 0.15, (5, 5): 0.1, (2, 6): 0.1,
         (3, 6): 0.1, (4, 7): 0.05}),
)


@pytest.mark.parametrize(
    ("world", "slo", "qps_range", "leaning"),
    [
        (WORLD_A, Slo(ttft_s=0.4, tpot_s=0.5), (0.5, 4.0), "ttft"),
        (WORLD_A, Slo(ttft_s=10.0, tpot_s=0.0095), (0.5, 4.0), "tpot"),
        (WORLD_B, Slo(ttft_s=0.08, tpot_s=1.0), (2.0, 6.0), "ttft"),
        (WORLD_B, Slo(ttft_s=10.0, tpot_s=0.012), (2.0, 6.0), "tpot"),
    ],
)
def test_tuner_leans_to_the_binding_slo(
    world: tuple[Truth, Mix], slo: Slo, qps_range: tuple[float, float], leaning: str
) -> None:
    truth, mix = world
    windows = training_windows(truth, mix, 200, seed=5, slo=slo, qps_range=qps_range)
    result = calibrate(windows, 1.9e9, config=CalibrationConfig(slo=slo))
    ratio = result.weights.weights.wtft / result.weights.weights.wtpot
    if leaning == "ttft":
        assert ratio > 1.0, result.weights.grid
    else:
        assert ratio < 1.0, result.weights.grid
    # the choice is a maximiser of predicted goodput over the grid
    best = max(g for _, g in result.weights.grid)
    assert result.weights.predicted_goodput >= best - 0.002


def test_pinned_weights_are_kept() -> None:
    truth, mix = WORLD_A
    slo = Slo(ttft_s=0.4, tpot_s=0.5)
    windows = training_windows(truth, mix, 60, seed=6, slo=slo)
    pinned = Weights(wtft=1.0, wtpot=3.0)
    result = calibrate(windows, 1.9e9, config=CalibrationConfig(slo=slo, pinned_weights=pinned))
    assert result.policy.weights == pinned
    assert result.weights.pinned and len(result.weights.grid) == 1


def test_choose_weights_picks_centre_of_best_plateau() -> None:
    # goodput rises to a plateau on [2, 32] then falls: centre in log space is 8
    def goodput(r: float) -> float:
        return 0.9 if 2.0 <= r <= 32.0 else 0.5

    choice = choose_weights(goodput, DEFAULT_RATIOS)
    assert choice.ratio == 8.0
    assert choice.weights == Weights(wtft=8.0, wtpot=1.0)
    assert choice.predicted_goodput == 0.9


@given(st.floats(min_value=-8, max_value=8))
def test_weights_for_ratio_keeps_the_ratio(log2_ratio: float) -> None:
    r = 2.0**log2_ratio
    w = weights_for_ratio(r)
    assert math.isclose(w.wtft / w.wtpot, r, rel_tol=1e-12)
    assert min(w.wtft, w.wtpot) == 1.0


@given(st.lists(st.floats(min_value=0, max_value=1), min_size=len(DEFAULT_RATIOS),
                max_size=len(DEFAULT_RATIOS)))
def test_choice_is_always_near_the_maximum(values: list[float]) -> None:
    table = dict(zip(sorted(DEFAULT_RATIOS), values, strict=True))
    choice = choose_weights(lambda r: table[r])
    assert choice.predicted_goodput >= max(values) - 0.002
    assert choice.ratio in table
