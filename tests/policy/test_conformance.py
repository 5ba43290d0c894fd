"""The published conformance vectors: every router implementation must return these."""

from __future__ import annotations

from typing import Any

import pytest

from controller.policy import Route, decide, policy_from_dict
from tests.policy.vectors import case_features, cases


@pytest.mark.parametrize(("name", "policy_dict", "case"), cases(), ids=lambda x: str(x)[:60])
def test_vector(name: str, policy_dict: dict[str, Any], case: dict[str, Any]) -> None:
    policy = policy_from_dict(policy_dict)
    features = case_features(case)
    d = decide(policy, features, lambda: case["draw"])
    exp = case["expect"]
    assert d.route is Route[exp["route"]], name
    assert (list(d.cell) if d.cell is not None else None) == exp["cell"], name
    assert d.reason.value == exp["reason"], name
    assert d.explored is exp["explored"], name


def test_vectors_cover_every_reason_a_table_can_give() -> None:
    reasons = {c["expect"]["reason"] for _, _, c in cases()}
    assert {"first_turn", "busy_prefill", "busy_later_turn", "bypass", "table", "explore",
            "invalid_input"} <= reasons
