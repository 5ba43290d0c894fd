"""Static baselines of the evaluation: ``pd``, ``local`` and the Dynamo-style ``threshold``.

``threshold`` follows NVIDIA Dynamo's conditional disaggregation (``docs/bench.md``,
"Policies"): a request runs decode-local when its *uncached* prompt (prompt minus what the session's
decode worker already holds) is under ``max_uncached_tokens`` (2048) **and** under
``max_uncached_ratio`` (0.7) of the whole prompt, **or** when the prefill pool is busy: the
least-busy prefill worker has ``prefill_waiting`` (2) or more requests waiting. The rule
knows nothing about turns (turn 1 has no cached prefix, so only the busyness clause can send
it decode-local). It replaces the table through the simulated router's ``decider`` hook.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from controller.policy import Decision, Features, Policy, Reason, Route, Slo


@dataclass(frozen=True, slots=True)
class ThresholdConfig:
    max_uncached_tokens: float = 2048.0
    max_uncached_ratio: float = 0.7
    prefill_waiting: int = 2  # 0 disables the busyness clause

    def __post_init__(self) -> None:
        if self.max_uncached_tokens < 0 or not 0 <= self.max_uncached_ratio <= 1:
            raise ValueError("threshold: max_uncached_tokens >= 0 and 0 <= ratio <= 1 needed")
        if self.prefill_waiting < 0:
            raise ValueError("threshold: prefill_waiting must be >= 0")


def static_policy(route: Route, slo: Slo) -> Policy:
    """``pd`` (PREFILL_NODE) or ``local`` (DECODE_LOCAL): every later turn one way, turn 1
    to a prefill node (the policy contract's default override)."""
    return Policy.uniform(1, route, slo=slo)


def threshold_route(cfg: ThresholdConfig, prompt_tokens: float, uncached_tokens: float,
                    min_prefill_waiting: int | None) -> Route:
    """The rule itself. ``min_prefill_waiting``: requests waiting on the least-busy prefill
    worker (None: no prefill worker, which the cluster handles as decode-local anyway)."""
    if prompt_tokens > 0 and uncached_tokens < cfg.max_uncached_tokens \
            and uncached_tokens / prompt_tokens < cfg.max_uncached_ratio:
        return Route.DECODE_LOCAL
    if cfg.prefill_waiting > 0 and min_prefill_waiting is not None \
            and min_prefill_waiting >= cfg.prefill_waiting:
        return Route.DECODE_LOCAL
    return Route.PREFILL_NODE


class ThresholdDecider:
    """A simulated router's ``decider``: the rule over the router's ``prefill_waiting``."""

    def __init__(self, cfg: ThresholdConfig) -> None:
        self.cfg = cfg

    def __call__(self, features: Features, prompt_tokens: int) -> Decision:
        waiting = features.prefill_waiting
        route = threshold_route(self.cfg, float(prompt_tokens), features.append_tokens,
                                None if waiting is None else int(waiting))
        return Decision(route=route, cell=None, reason=Reason.TABLE)


def install_threshold(cfg: ThresholdConfig) -> Callable[[Any], None]:
    """A ``run_scenario(setup=...)`` hook that puts the rule on every router of a cluster."""

    def setup(cluster: Any) -> None:
        for router in cluster.routers:
            router.decider = ThresholdDecider(cfg)

    return setup


def threshold_from_options(options: dict[str, float], base: ThresholdConfig | None = None
                           ) -> ThresholdConfig:
    """``--threshold KEY=VALUE`` overrides (keys: the :class:`ThresholdConfig` fields)."""
    cfg = base or ThresholdConfig()
    known = set(ThresholdConfig.__dataclass_fields__)
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"threshold: unknown key(s) {', '.join(unknown)}; "
                         f"expected {', '.join(sorted(known))}")
    typed: dict[str, Any] = {}
    for k, v in options.items():
        count = k == "prefill_waiting"  # requests waiting: a whole count, never truncated
        if not math.isfinite(v) or v < 0 or (count and v != int(v)):
            raise ValueError(f"threshold: {k} must be a {'whole number' if count else 'number'}"
                             f" >= 0, got {v:g}")
        typed[k] = int(v) if count else float(v)
    return replace(cfg, **typed)
