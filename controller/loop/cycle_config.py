"""The cycle's settings: :class:`CycleConfig`, read from ``[controller]``, ``[capacity]``
and ``[ppd]`` once at start-up; frozen, so every room reads the same values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from controller.core.rollout import JudgeParams


@dataclass(frozen=True, slots=True)
class CycleConfig:
    interval_s: float = 30.0
    calibrate_every_s: float | None = 3600.0
    training_windows: int = 120
    min_training_windows: int = 4
    min_policy_interval_s: float = 300.0  # as [controller] min_policy_interval_s
    advisory: bool = False
    canary_fraction: float = 0.25
    bake_windows: int = 3
    bake_min_requests: float = 100.0
    max_bake_windows: int = 12
    canary_refit: bool = True
    promote_margin: float = 0.02
    promote_alpha: float = 0.05
    watch_windows: int = 3
    watch_drop: float = 0.1
    watch_load_rise: float = 0.1
    request_stale_after_s: float = 300.0
    capacity_interval_s: float = 300.0
    capacity_min_windows: int = 2
    # Exploration share turned on in an adopted policy that explores nowhere (0: none); 0
    # as well where the operator pins a route ([ppd]): a pin explores nothing.
    adopted_exploration: float = 0.0

    @property
    def watch_s(self) -> float | None:
        """How long a promotion is watched at most (None: no watch): its windows and one
        interval more, so failed observes do not stretch it."""
        return self.judge.watch_s

    @property
    def judge(self) -> JudgeParams:
        """The settings the canary judge and the post-promotion watch read."""
        return JudgeParams(
            interval_s=self.interval_s, bake_windows=self.bake_windows,
            bake_min_requests=self.bake_min_requests, max_bake_windows=self.max_bake_windows,
            promote_margin=self.promote_margin, promote_alpha=self.promote_alpha,
            watch_windows=self.watch_windows, watch_drop=self.watch_drop,
            watch_load_rise=self.watch_load_rise)

    @classmethod
    def from_settings(cls, settings: Any, advisory: bool | None = None) -> CycleConfig:
        c = settings.controller
        return cls(
            interval_s=c.interval_s, calibrate_every_s=c.calibrate_every_s,
            training_windows=c.training_windows, min_training_windows=c.min_training_windows,
            min_policy_interval_s=c.min_policy_interval_s,
            advisory=c.advisory if advisory is None else advisory,
            canary_fraction=c.canary_fraction, bake_windows=c.bake_windows,
            bake_min_requests=c.bake_min_requests, max_bake_windows=c.max_bake_windows,
            canary_refit=c.canary_refit,
            promote_margin=c.promote_margin, promote_alpha=c.promote_alpha,
            watch_windows=c.watch_windows, watch_drop=c.watch_drop,
            watch_load_rise=c.watch_load_rise,
            capacity_interval_s=settings.capacity.interval_s,
            capacity_min_windows=settings.capacity.min_windows,
            adopted_exploration=(c.adopted_exploration if settings.ppd.enabled
                                 and settings.ppd.append_prefill_route == "dynamic" else 0.0),
        )
