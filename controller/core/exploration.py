"""Per-cell exploration: a bounded share of requests takes the other route.

Both routes must stay measured everywhere the table is used, so each cell explores
``floor + (cap - floor) * u`` where ``u`` in [0, 1] grows with the uncertainty of the cell's
estimate: few samples on the less-measured route, a high spread of the model's residuals in
the cell, or a score close to 0 (a decision that could go either way). A cell that never sees
traffic explores nothing (there is nobody to send). ``u`` is monotone in each uncertainty
input, so more uncertainty never means less exploration.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from controller.policy.model import MAX_EXPLORATION

FloatArray = NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class ExplorationConfig:
    floor: float = 0.01
    cap: float = 0.1
    half_samples: float = 200.0  # samples of the rarer route at which u_samples = 1/2
    spread_scale: float = 0.5  # log-residual spread at which u_spread saturates
    score_scale: float = 0.1  # |score| at which u_score = 1/e

    def __post_init__(self) -> None:
        if not 0.0 <= self.floor <= self.cap <= MAX_EXPLORATION:
            raise ValueError(
                f"exploration needs 0 <= floor <= cap <= {MAX_EXPLORATION}, "
                f"got floor={self.floor}, cap={self.cap}"
            )


def uncertainty(
    samples: FloatArray, spread: FloatArray, score: FloatArray, cfg: ExplorationConfig
) -> FloatArray:
    """Combined uncertainty in [0, 1], non-decreasing in spread, |score|^-1 and 1/samples."""
    u_n = cfg.half_samples / (cfg.half_samples + np.maximum(samples, 0.0))
    u_v = np.clip(np.nan_to_num(spread, nan=cfg.spread_scale) / cfg.spread_scale, 0.0, 1.0)
    u_s = np.exp(-np.abs(np.nan_to_num(score, nan=0.0)) / cfg.score_scale)
    u: FloatArray = 1.0 - (1.0 - u_n) * (1.0 - u_v) * (1.0 - u_s)
    return u


def exploration_fractions(
    samples: FloatArray,
    spread: FloatArray,
    score: FloatArray,
    seen: NDArray[np.bool_],
    cfg: ExplorationConfig | None = None,
) -> FloatArray:
    """Per-cell exploration fraction: 0 where unseen, else in ``[floor, cap]``."""
    c = cfg or ExplorationConfig()
    u = uncertainty(samples, spread, score, c)
    frac = c.floor + (c.cap - c.floor) * u
    out: FloatArray = np.where(seen, np.clip(frac, c.floor, c.cap), 0.0)
    return out
