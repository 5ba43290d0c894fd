"""Choose ``wtft``/``wtpot``: the ratio that maximises predicted goodput, unless pinned.

Only the ratio matters for the decision (``score > 0``). The tuner evaluates a log-spaced grid
of ratios ``wtft / wtpot``; each ratio yields a table (through the calibration fixed point)
and a predicted goodput for the current mix and SLOs. Many ratios often give the same table:
the choice is the middle (in log space) of the best plateau, so the chosen weights sit as far
as possible from the ratios where the decision would change.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from controller.policy.model import Weights

DEFAULT_RATIOS: tuple[float, ...] = tuple(2.0**e for e in range(-8, 9))  # 1/256 .. 256
GOODPUT_TOLERANCE = 0.002  # predicted goodput differences below this are ties


@dataclass(frozen=True, slots=True)
class WeightChoice:
    weights: Weights
    ratio: float
    predicted_goodput: float
    pinned: bool
    # (ratio, predicted goodput) for every ratio evaluated, in grid order
    grid: tuple[tuple[float, float], ...]

    def to_dict(self) -> dict[str, object]:
        return {
            "wtft": self.weights.wtft, "wtpot": self.weights.wtpot, "ratio": self.ratio,
            "predicted_goodput": self.predicted_goodput, "pinned": self.pinned,
            "grid": [list(g) for g in self.grid],
        }


def weights_for_ratio(ratio: float) -> Weights:
    """Normalised so the smaller weight is 1 (the paper's presets: (2, 1), (1, 2))."""
    if ratio >= 1.0:
        return Weights(wtft=ratio, wtpot=1.0)
    return Weights(wtft=1.0, wtpot=1.0 / ratio)


def choose_weights(
    goodput_of_ratio: Callable[[float], float],
    ratios: Sequence[float] = DEFAULT_RATIOS,
    pinned: Weights | None = None,
    tolerance: float = GOODPUT_TOLERANCE,
) -> WeightChoice:
    """Evaluate the grid (or only the pinned ratio) and pick the centre of the best plateau."""
    if pinned is not None:
        ratio = pinned.wtft / pinned.wtpot if pinned.wtpot > 0 else math.inf
        g = goodput_of_ratio(ratio)
        return WeightChoice(pinned, ratio, g, True, ((ratio, g),))
    grid = sorted(float(r) for r in ratios)
    values = [goodput_of_ratio(r) for r in grid]
    best = max(values)
    i_best = values.index(best)
    # Contiguous run of near-best ratios around the argmax.
    lo = hi = i_best
    while lo > 0 and values[lo - 1] >= best - tolerance:
        lo -= 1
    while hi < len(grid) - 1 and values[hi + 1] >= best - tolerance:
        hi += 1
    centre = math.exp((math.log(grid[lo]) + math.log(grid[hi])) / 2.0)
    # Snap to the grid point nearest the centre (it has been evaluated).
    j = min(range(lo, hi + 1), key=lambda i: abs(math.log(grid[i]) - math.log(centre)))
    return WeightChoice(weights_for_ratio(grid[j]), grid[j], values[j], False,
                        tuple(zip(grid, values, strict=True)))
