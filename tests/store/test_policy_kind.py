"""Policy kinds: the fallback rule on the reasons the writers store, the stored column, and
the typed triggers' printed forms."""

from __future__ import annotations

import pytest

from controller.core.trigger import Cause, Trigger
from controller.loop.calibration_runner import FALLBACK_REASON, PHASE_REASON
from controller.policy import Route
from controller.store import PolicyKind, Store, policy_kind
from controller.store.kinds import ADOPTED_PREFIX, REFIT_PREFIX, kind_of_reason


@pytest.mark.parametrize(("reason", "seeded", "kind"), [
    (PHASE_REASON[Route.DECODE_LOCAL], None, PolicyKind.FORCED),
    (PHASE_REASON[Route.PREFILL_NODE], None, PolicyKind.FORCED),
    (FALLBACK_REASON, None, PolicyKind.OTHER),  # active calibration, but not a forced phase
    (f"{ADOPTED_PREFIX}every router answered when the daemon started", None,
     PolicyKind.ADOPTED),
    (f"{REFIT_PREFIX}2: approved: +0.012", None, PolicyKind.REFIT),
    ("exploration 0.05 in every cell of v1, the routers' own policy", 0.05, PolicyKind.SEEDED),
    (str(Cause(Trigger.DRIFT)), None, PolicyKind.OTHER),
    (str(Cause(Trigger.OPERATOR, f"{REFIT_PREFIX} in the operator's words")), None,
     PolicyKind.OTHER),  # a prefix inside another reason names no kind
])
def test_the_kind_a_reason_names(reason: str, seeded: float | None, kind: PolicyKind) -> None:
    assert kind_of_reason(reason, seeded) is kind


def test_the_stored_kind_is_the_writers_and_outlives_a_rewritten_reason(store: Store) -> None:
    store.add_policy(1, "aa" * 32, "{}", "approved", "drift")
    store.add_policy(2, "bb" * 32, "{}", "candidate", "held as a candidate, not rolled out",
                     kind=PolicyKind.REFIT)
    store.add_policy(3, "cc" * 32, "{}", "approved", PHASE_REASON[Route.PREFILL_NODE])
    assert [policy_kind(p) for p in store.policies()] == [
        PolicyKind.OTHER, PolicyKind.REFIT, PolicyKind.FORCED]
    store.set_policy_status(3, "superseded", "the run is over: not a rollback target")
    assert policy_kind(store.policy(3)) is PolicyKind.FORCED  # type: ignore[arg-type]


def test_kinds_and_triggers_print_as_their_stored_strings() -> None:
    assert [str(t) for t in Trigger] == ["drift", "schedule", "scaling", "operator", "canary",
                                         "active"]
    assert f"{PolicyKind.FORCED}" == "forced"
    assert str(Cause(Trigger.SCALING, "prefill workers 2 -> 1")) == \
        "scaling: prefill workers 2 -> 1"
    assert str(Cause(Trigger.CANARY, refits=Trigger.DRIFT, text="drift (canary refit of v2)")) \
        == "drift (canary refit of v2)"


def test_a_refit_trains_on_the_regime_of_the_canary_it_refits() -> None:
    assert Cause(Trigger.CANARY, refits=Trigger.SCALING).regime is Trigger.SCALING
    assert Cause(Trigger.CANARY).regime is None  # a canary no calibration produced
    assert Cause(Trigger.DRIFT, "workload").regime is Trigger.DRIFT
