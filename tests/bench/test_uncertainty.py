"""The margin of adaptive over the strongest static policy and its paired bootstrap interval
over seeds (``controller.bench.uncertainty``), on synthetic numbers whose answer is known."""

from __future__ import annotations

import numpy as np
import pytest

from controller.bench.uncertainty import (
    Verdict,
    margin_over_strongest,
    paired_bootstrap,
    strongest_static,
)

STATICS = ["pd", "local", "threshold"]


def test_a_constant_difference_has_a_zero_width_interval_at_it() -> None:
    mean, low, high = paired_bootstrap([0.02] * 10)
    assert mean == pytest.approx(0.02)
    assert low == pytest.approx(0.02) and high == pytest.approx(0.02)


def test_the_interval_covers_the_true_mean_about_95_percent_of_the_time() -> None:
    """Differences drawn N(0.01, 0.02) over 12 seeds, 400 times: the percentile bootstrap
    covers 0.01 in 0.88-0.99 of the draws (it is a little narrow at n = 12), and its width
    matches the normal interval 2 x 1.96 x 0.02 / sqrt(12) to within 25 %."""
    rng = np.random.default_rng(7)
    covered, widths = 0, []
    for i in range(400):
        d = rng.normal(0.01, 0.02, size=12)
        _, low, high = paired_bootstrap(d, resamples=2000, seed=i)
        covered += low <= 0.01 <= high
        widths.append(high - low)
    assert 0.88 <= covered / 400 <= 0.99
    assert float(np.mean(widths)) == pytest.approx(2 * 1.96 * 0.02 / 12 ** 0.5, rel=0.25)


def test_pairing_removes_what_the_seeds_share() -> None:
    """Seed-to-seed swings of +-0.1 that both policies share leave a clear +0.005 margin:
    a paired interval excludes zero where an unpaired comparison could not."""
    shared = np.linspace(-0.1, 0.1, 10)
    runs = [{"adaptive": 0.8 + s + 0.005 + 0.001 * (i % 2), "local": 0.8 + s, "pd": 0.5}
            for i, s in enumerate(shared)]
    m = margin_over_strongest(runs, STATICS)
    assert m.against == "local" and m.seeds == 10
    assert m.mean == pytest.approx(0.0055)
    assert 0.005 <= m.low < m.mean < m.high <= 0.006
    assert m.verdict is Verdict.BEATS


def test_an_interval_across_zero_is_a_tie_and_one_below_a_loss() -> None:
    ties = [{"adaptive": 0.9 + d, "local": 0.9} for d in (0.01, -0.01, 0.005, -0.004, 0.0)]
    assert margin_over_strongest(ties, STATICS).verdict is Verdict.TIES
    loses = [{"adaptive": 0.9 - d, "local": 0.9} for d in (0.01, 0.012, 0.008, 0.011)]
    m = margin_over_strongest(loses, STATICS)
    assert m.verdict is Verdict.LOSES and m.high < 0


def test_the_strongest_static_policy_is_the_best_on_average_not_per_seed() -> None:
    """Per seed the best static policy alternates; the scenario's strongest is the one with
    the best mean, fixed for every seed (a per-seed maximum favours the baselines' noise)."""
    runs = [{"adaptive": 0.9, "local": 0.91, "threshold": 0.85},
            {"adaptive": 0.9, "local": 0.80, "threshold": 0.86},
            {"adaptive": 0.9, "local": 0.81, "threshold": 0.86}]
    assert strongest_static(runs, STATICS) == "threshold"
    # A policy missing from one seed cannot be the strongest over all seeds.
    runs[1].pop("threshold")
    assert strongest_static(runs, STATICS) == "local"
    with pytest.raises(ValueError, match="no static policy"):
        strongest_static([{"adaptive": 0.9}], STATICS)
    with pytest.raises(ValueError, match="at least one seed"):
        paired_bootstrap([])


def test_the_interval_is_a_function_of_the_runs() -> None:
    d = [0.01, -0.002, 0.004, 0.02, 0.0, 0.007, -0.001, 0.003, 0.012, 0.005]
    assert paired_bootstrap(d) == paired_bootstrap(list(d))
