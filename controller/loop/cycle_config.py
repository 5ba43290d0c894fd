"""The cycle's settings: :class:`CycleConfig`, read from ``[controller]``, ``[capacity]``
and ``[ppd]`` once at start-up; frozen, so every room reads the same values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from controller.core.rollout import JudgeParams


@dataclass(frozen=True, slots=True)
class CycleConfig:
    # The canary judge's and the post-promotion watch's settings, the cycle's interval with
    # them (the watch lasts a number of intervals).
    judge: JudgeParams = field(default_factory=JudgeParams)
    calibrate_every_s: float | None = 3600.0
    training_windows: int = 120
    min_training_windows: int = 4
    min_policy_interval_s: float = 300.0  # as [controller] min_policy_interval_s
    advisory: bool = False
    canary_fraction: float = 0.25
    canary_refit: bool = True
    request_stale_after_s: float = 300.0
    capacity_interval_s: float = 300.0
    capacity_min_windows: int = 2
    # Exploration share turned on in an adopted policy that explores nowhere (0: none); 0
    # as well where the operator pins a route ([ppd]): a pin explores nothing.
    adopted_exploration: float = 0.0

    @property
    def interval_s(self) -> float:
        return self.judge.interval_s

    @property
    def watch_s(self) -> float | None:
        """How long a promotion is watched at most (None: no watch)."""
        return self.judge.watch_s

    @classmethod
    def from_settings(cls, settings: Any, advisory: bool | None = None) -> CycleConfig:
        c = settings.controller
        return cls(
            judge=JudgeParams(
                interval_s=c.interval_s, bake_windows=c.bake_windows,
                bake_min_requests=c.bake_min_requests, max_bake_windows=c.max_bake_windows,
                promote_margin=c.promote_margin, promote_alpha=c.promote_alpha,
                watch_windows=c.watch_windows, watch_drop=c.watch_drop,
                watch_load_rise=c.watch_load_rise),
            calibrate_every_s=c.calibrate_every_s,
            training_windows=c.training_windows, min_training_windows=c.min_training_windows,
            min_policy_interval_s=c.min_policy_interval_s,
            advisory=c.advisory if advisory is None else advisory,
            canary_fraction=c.canary_fraction, canary_refit=c.canary_refit,
            capacity_interval_s=settings.capacity.interval_s,
            capacity_min_windows=settings.capacity.min_windows,
            adopted_exploration=(c.adopted_exploration if settings.ppd.enabled
                                 and settings.ppd.append_prefill_route == "dynamic" else 0.0),
        )
