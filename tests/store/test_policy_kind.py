"""policy_kind: the one reader of a stored policy's kind, on the reasons its writers store."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from controller.calibration_runner import FALLBACK_REASON, PHASE_REASON
from controller.core.trigger import Cause, Trigger
from controller.policy import Route
from controller.store import PolicyKind, PolicyRecord, policy_kind
from controller.store.kinds import ADOPTED_PREFIX, REFIT_PREFIX

T = datetime(2026, 1, 1, tzinfo=UTC)


def _record(reason: str, seeded: float | None = None) -> PolicyRecord:
    return PolicyRecord(version=3, checksum="c", body_json="{}", status="approved",
                        reason=reason, created_at=T, updated_at=T, seeded_exploration=seeded)


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
def test_policy_kind_from_what_the_writers_store(reason: str, seeded: float | None,
                                                 kind: PolicyKind) -> None:
    assert policy_kind(_record(reason, seeded)) is kind


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
