"""Metric updates a cycle's write decides, as data, emitted only once the write committed.

A write transaction appends :class:`MetricEvent` values to a :class:`MetricEvents` list
instead of touching the registry; :meth:`MetricEvents.emit` applies them, in order, after
the commit. A write that fails emits nothing, so a decision the store never recorded is
never counted, and its retry in a later cycle is counted once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from controller.core.rollout import GuardrailVerdict
from controller.loop.metrics import ControllerMetrics


class MetricEvent(Protocol):
    def emit(self, metrics: ControllerMetrics) -> None: ...


@dataclass(frozen=True, slots=True)
class DriftStatistic:
    detector: str
    feature: str
    statistic: float
    threshold: float

    def emit(self, metrics: ControllerMetrics) -> None:
        metrics.set_drift(self.detector, self.feature, self.statistic, self.threshold)


@dataclass(frozen=True, slots=True)
class DriftFired:
    detector: str

    def emit(self, metrics: ControllerMetrics) -> None:
        metrics.drift_event(self.detector)


@dataclass(frozen=True, slots=True)
class GuardrailDecided:
    decision: GuardrailVerdict  # approved | rejected
    reason: GuardrailVerdict  # the decision, or forced
    at: float

    def emit(self, metrics: ControllerMetrics) -> None:
        metrics.guardrail_decision(self.decision, self.reason, self.at)


@dataclass(frozen=True, slots=True)
class PredictedGoodput:
    current: float
    candidate: float | None

    def emit(self, metrics: ControllerMetrics) -> None:
        metrics.set_predicted_goodput(self.current, self.candidate)


@dataclass(frozen=True, slots=True)
class PolicyChanged:
    version: int

    def emit(self, metrics: ControllerMetrics) -> None:
        metrics.policy_changed(self.version)


@dataclass(frozen=True, slots=True)
class CanaryState:
    state: str  # "baking" | "promoted" | "rolled_back"

    def emit(self, metrics: ControllerMetrics) -> None:
        metrics.set_canary_state(self.state)


@dataclass(frozen=True, slots=True)
class NoCanary:
    def emit(self, metrics: ControllerMetrics) -> None:
        metrics.no_canary()


@dataclass(frozen=True, slots=True)
class RolledBack:
    by: str  # "canary" | "watch" | "operator"
    to_version: int | None

    def emit(self, metrics: ControllerMetrics) -> None:
        metrics.rolled_back(self.by, self.to_version)


@dataclass(frozen=True, slots=True)
class OperatorGauges:
    """The leader's state gauges as the write leaves them."""

    paused: bool
    pinned: bool
    desired_version: int | None

    def emit(self, metrics: ControllerMetrics) -> None:
        metrics.set_paused(self.paused)
        metrics.set_pinned(self.pinned)
        metrics.set_desired_version(self.desired_version)


class MetricEvents(list[MetricEvent]):
    """The metric events of one write, in the order decided."""

    def emit(self, metrics: ControllerMetrics) -> None:
        for event in self:
            event.emit(metrics)


__all__ = [
    "CanaryState", "DriftFired", "DriftStatistic", "GuardrailDecided", "MetricEvent",
    "MetricEvents", "NoCanary", "OperatorGauges", "PolicyChanged", "PredictedGoodput",
    "RolledBack",
]
