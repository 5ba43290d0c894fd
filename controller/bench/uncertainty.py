"""Adaptive's margin over the strongest static policy, with its uncertainty over seeds.

Per scenario, each seed gives one paired difference: adaptive's goodput minus the goodput of
the strongest static policy *of the scenario* (the static policy with the highest mean
goodput over the seeds, fixed before resampling; all of them replayed the same draw as
adaptive). The 95 % interval of the mean difference is a paired percentile bootstrap over
seeds: seeds are resampled with replacement, each resample keeping a seed's differences
together, with a fixed generator seed so that the same runs give the same interval.

The summary claims "beats" only where the interval lies above zero, "loses" where it lies
below, "ties" otherwise. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 10_000
GENERATOR_SEED = 41  # fixed: the interval is a function of the runs alone
MIN_SEEDS = 10  # what the evaluation commits to per scenario (scenarios/bench/seeds.toml)


class Verdict(StrEnum):
    BEATS = "beats"
    TIES = "ties"
    LOSES = "loses"


@dataclass(frozen=True, slots=True)
class Margin:
    """Adaptive minus ``against`` over ``seeds`` seeds: the mean and its interval."""

    against: str
    seeds: int
    mean: float
    low: float
    high: float

    @property
    def verdict(self) -> Verdict:
        if self.low > 0:
            return Verdict.BEATS
        if self.high < 0:
            return Verdict.LOSES
        return Verdict.TIES


def paired_bootstrap(differences: Sequence[float], confidence: float = CONFIDENCE,
                     resamples: int = RESAMPLES, seed: int = GENERATOR_SEED
                     ) -> tuple[float, float, float]:
    """(mean, low, high): the mean of ``differences`` (one per seed, adaptive minus a
    baseline on the same draw) and its percentile bootstrap interval. One difference gives
    a zero-width interval at it; none raises ValueError."""
    d = np.asarray(differences, dtype=float)
    if d.size == 0:
        raise ValueError("a bootstrap needs at least one seed")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, d.size, size=(resamples, d.size))
    means = d[idx].mean(axis=1)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(d.mean()), float(low), float(high)


def strongest_static(runs: Sequence[Mapping[str, float]], statics: Sequence[str]) -> str:
    """The static policy with the highest mean goodput over ``runs`` (policy -> goodput,
    one per seed), among those present in every run; ties: the first in ``statics``."""
    present = [k for k in statics if runs and all(k in r for r in runs)]
    if not present:
        raise ValueError("no static policy was run on every seed")
    return max(present, key=lambda k: (sum(r[k] for r in runs) / len(runs),
                                       -statics.index(k)))


def margin_over_strongest(runs: Sequence[Mapping[str, float]], statics: Sequence[str],
                          adaptive: str = "adaptive", **bootstrap: Any) -> Margin:
    """Per scenario: adaptive's mean margin over its strongest static policy across the
    seeds of ``runs`` (policy -> goodput, one mapping per seed), with the paired interval."""
    against = strongest_static(runs, statics)
    diffs = [r[adaptive] - r[against] for r in runs]
    mean, low, high = paired_bootstrap(diffs, **bootstrap)
    return Margin(against, len(diffs), mean, low, high)
