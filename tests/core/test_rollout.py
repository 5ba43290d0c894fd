"""The pure rollout rules on plain values: no store, no clock, no metrics."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import pytest

from controller.core.rollout import (
    POLICY_TRANSITIONS,
    CanaryAction,
    JudgeParams,
    OperatorState,
    PolicyStatus,
    Rollout,
    TriggerInputs,
    TriggerNote,
    VersionInfo,
    WatchAction,
    choose_trigger,
    judge_canary,
    judge_watch,
    may_transition,
    operator_state,
    rollout_of,
    scaling_damped,
)
from controller.core.trigger import Trigger
from controller.core.window import RouteOutcome, TargetFailure, Window
from controller.policy import Route


@dataclass(frozen=True)
class Req:
    id: int
    kind: str
    status: str = "done"
    args: dict[str, Any] | None = None


def _window(end: float, per_router: dict[str, tuple[float, float]],
            failed: tuple[str, ...] = ()) -> Window:
    outcomes = [RouteOutcome(r, Route.PREFILL_NODE, 0, 0, n, met, 0.0, 0.0, 0.0, 0.0)
                for r, (met, n) in per_router.items()]
    return Window(end - 30.0, end, 30.0, outcomes=outcomes,
                  failures=tuple(TargetFailure(t, "unreachable", "") for t in failed))


def test_policy_transitions_cover_every_status_and_end_in_final_ones() -> None:
    assert set(POLICY_TRANSITIONS) == set(PolicyStatus)
    assert may_transition("approved", "rolled_back")
    assert may_transition("rejected", "rejected")
    assert not may_transition("rolled_back", "approved")
    assert not may_transition("superseded", "approved")
    assert str(PolicyStatus.ROLLED_BACK) == "rolled_back"


def test_operator_state_folds_only_done_requests_in_id_order() -> None:
    reqs = [Req(3, "resume"), Req(1, "pause"), Req(2, "pause", args={"what": "pin",
                                                                      "version": 4}),
            Req(4, "pause", status="failed")]
    assert operator_state(reqs) == OperatorState(paused=False, pinned=4)
    fallback = operator_state([Req(1, "pause", args={"what": "pin", "version": 2}),
                               Req(2, "rollback", args={"to": "fallback-prefill"})])
    assert fallback.fallback and fallback.pinned is None and fallback.holding
    assert operator_state([Req(1, "pause", args={"what": "exploration"})]).exploration_off


def test_rollout_of_finds_the_canary_by_when_its_table_was_made() -> None:
    assert rollout_of({}, {}) == Rollout(None, None)
    assert rollout_of({"a": 2, "b": 2}, {}) == Rollout(2, None)
    desired = {"a": 3, "b": 2, "c": 2}
    info = {2: VersionInfo("approved"), 3: VersionInfo("approved")}
    assert rollout_of(desired, info) == Rollout(2, 3, ("a",), ("b", "c"))
    # v4 re-issues the fleet's v2 above the canary v3: v3 is still the canary
    reissued = {"a": 3, "b": 4, "c": 4}
    info4 = {**info, 4: VersionInfo("approved", reissue_of=2)}
    assert rollout_of(reissued, info4) == Rollout(4, 3, ("a",), ("b", "c"))
    # a newest version that is no longer approved is no canary
    assert rollout_of(desired, {**info, 3: VersionInfo("rolled_back")}) == Rollout(2, None)


P = JudgeParams(bake_windows=2, bake_min_requests=100, max_bake_windows=4)


def test_judge_canary_waits_promotes_and_rolls_back() -> None:
    good = [_window(60.0 * i, {"c": (95, 100), "k": (95, 100)}) for i in range(1, 3)]
    assert judge_canary(good[:1], {"c"}, {"k"}, P).action is CanaryAction.WAIT
    assert judge_canary(good, {"c"}, {"k"}, P).action is CanaryAction.PROMOTE
    bad = [_window(60.0 * i, {"c": (50, 100), "k": (95, 100)}) for i in range(1, 3)]
    verdict = judge_canary(bad, {"c"}, {"k"}, P)
    assert verdict.action is CanaryAction.ROLL_BACK and verdict.z is not None
    assert "canary worse than control" in verdict.reason


def test_judge_canary_skips_windows_a_judged_router_missed_and_gives_up_on_no_traffic() -> None:
    missed = [_window(30.0, {"c": (95, 100), "k": (95, 100)}, failed=("c",)),
              _window(60.0, {"c": (95, 100), "k": (95, 100)})]
    assert judge_canary(missed, {"c"}, {"k"}, P).action is CanaryAction.WAIT
    thin = [_window(30.0 * i, {"c": (1, 1), "k": (1, 1)}) for i in range(1, 5)]
    verdict = judge_canary(thin, {"c"}, {"k"}, P)
    assert verdict.action is CanaryAction.ROLL_BACK
    assert verdict.reason.startswith("not enough traffic to judge")


def test_judge_watch_rolls_back_a_fall_unless_the_load_rose() -> None:
    p = JudgeParams(watch_windows=2, bake_min_requests=100)
    bake = [_window(30.0, {"a": (95, 100)}), _window(60.0, {"a": (95, 100)})]
    fell = [_window(90.0, {"a": (40, 100)}), _window(120.0, {"a": (40, 100)})]
    assert judge_watch(120.0, 60.0, bake + fell, {"a"}, p).action is WatchAction.ROLL_BACK
    rose = [_window(90.0, {"a": (80, 200)}), _window(120.0, {"a": (80, 200)})]
    kept = judge_watch(120.0, 60.0, bake + rose, {"a"}, p)
    assert kept.action is WatchAction.KEEP and "not the policy's doing" in kept.reason
    assert judge_watch(1000.0, 60.0, bake, {"a"}, p).action is WatchAction.OVER


BASE = TriggerInputs(
    now=1000.0, operator_recalibrate=False, canary_baking=False, canary_refit=True,
    refit_due=False, holding=False, pending_drift=False, pending_measured=False,
    pending_scaling=False, pending_recommendation=False, scaling_damped=False,
    drift_fired=False, since_last_change=math.inf, min_policy_interval_s=300.0,
    fit_failed_at=None, fit_retry_s=300.0, link_retry_at=None, next_due=None)


@pytest.mark.parametrize(("change", "trigger"), [
    ({}, None),
    ({"operator_recalibrate": True, "holding": True}, Trigger.OPERATOR),
    ({"pending_drift": True}, Trigger.DRIFT),
    ({"pending_drift": True, "holding": True}, None),
    ({"pending_drift": True, "since_last_change": 10.0}, None),
    ({"pending_drift": True, "pending_measured": True, "since_last_change": 10.0},
     Trigger.DRIFT),
    ({"pending_drift": True, "fit_failed_at": 900.0}, None),
    ({"pending_drift": True, "pending_recommendation": True}, Trigger.SCALING),
    ({"pending_scaling": True}, Trigger.SCALING),
    ({"pending_scaling": True, "scaling_damped": True}, None),
    ({"next_due": 1000.0}, Trigger.SCHEDULE),
    ({"link_retry_at": 999.0}, Trigger.DRIFT),
    ({"canary_baking": True, "pending_drift": True}, None),
    ({"canary_baking": True, "refit_due": True}, Trigger.CANARY),
    ({"canary_baking": True, "refit_due": True, "canary_refit": False}, None),
])
def test_choose_trigger(change: dict[str, Any], trigger: Trigger | None) -> None:
    assert choose_trigger(replace(BASE, **change)).trigger is trigger


def test_choose_trigger_says_what_to_log_and_voids_drift_during_a_bake() -> None:
    baking = choose_trigger(replace(BASE, canary_baking=True, pending_drift=True))
    assert baking.clear_pending_drift
    limited = choose_trigger(replace(BASE, pending_drift=True, drift_fired=True,
                                     since_last_change=1.0))
    assert limited.notes == (TriggerNote.RATE_LIMITED_DRIFT,)
    held = choose_trigger(replace(BASE, pending_scaling=True, scaling_damped=True,
                                  next_due=0.0))
    assert held.trigger is Trigger.SCHEDULE and held.notes == (TriggerNote.SCALING_HELD,)


def test_scaling_damping_per_role_and_lifted_by_a_clock_stepped_back() -> None:
    assert scaling_damped({"prefill"}, {"prefill": 900.0}, 1000.0, 300.0)
    assert not scaling_damped({"prefill", "decode"}, {"prefill": 900.0}, 1000.0, 300.0)
    assert not scaling_damped({"prefill"}, {"prefill": 1100.0}, 1000.0, 300.0)
    assert scaling_damped(set(), {"": 900.0}, 1000.0, 300.0)
