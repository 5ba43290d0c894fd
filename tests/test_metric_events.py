"""Metric events are data until emitted, and emitted in the order decided."""

from __future__ import annotations

from typing import Any, cast

from controller.core.rollout import GuardrailVerdict
from controller.loop.metric_events import (
    CanaryState,
    GuardrailDecided,
    MetricEvents,
    OperatorGauges,
    PolicyChanged,
    RolledBack,
)
from controller.loop.metrics import ControllerMetrics


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args: self.calls.append((name, args))


def test_events_touch_nothing_until_emitted_then_apply_in_order() -> None:
    events = MetricEvents()
    events.append(PolicyChanged(3))
    events.append(CanaryState("baking"))
    events.append(GuardrailDecided(GuardrailVerdict.APPROVED, GuardrailVerdict.FORCED, 5.0))
    events.append(RolledBack("watch", 2))
    events.append(OperatorGauges(paused=True, pinned=False, desired_version=None))
    metrics = Recorder()
    assert metrics.calls == []
    events.emit(cast(ControllerMetrics, metrics))
    assert metrics.calls == [
        ("policy_changed", (3,)), ("set_canary_state", ("baking",)),
        ("guardrail_decision", ("approved", "forced", 5.0)), ("rolled_back", ("watch", 2)),
        ("set_paused", (True,)), ("set_pinned", (False,)), ("set_desired_version", (None,)),
    ]


def test_the_guardrail_label_is_the_outcomes_forced_field_not_its_words() -> None:
    """A forced approval is counted as such from the outcome's typed field: words in the
    reason neither make nor unmake it."""
    from controller.loop.learning import CalibrationOutcome
    from controller.policy import Policy, Route

    def outcome(reason: str, forced: bool) -> CalibrationOutcome:
        return CalibrationOutcome(Policy.uniform(2, Route.PREFILL_NODE), True, reason, 0.9,
                                  0.8, {}, forced=forced)

    assert outcome("forced despite guardrail: …", True).label is GuardrailVerdict.FORCED
    assert outcome("approved: …", True).label is GuardrailVerdict.FORCED
    assert outcome("approved: forced words", False).label is GuardrailVerdict.APPROVED
