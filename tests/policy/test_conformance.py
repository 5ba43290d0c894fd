"""The published conformance vectors: every router implementation must return these."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from controller.policy import Features, Route, decide, policy_from_dict

VECTORS = Path(__file__).parents[2] / "controller" / "policy" / "conformance.json"


def _cases() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    data = json.loads(VECTORS.read_text())
    return [
        (f"{p['name']}: {c['name']}", p["policy"], c)
        for p in data["policies"]
        for c in p["cases"]
    ]


def _num(v: Any) -> float:
    return float(v)  # "NaN" / "Infinity" strings become floats on purpose


@pytest.mark.parametrize(("name", "policy_dict", "case"), _cases(), ids=lambda x: str(x)[:60])
def test_vector(name: str, policy_dict: dict[str, Any], case: dict[str, Any]) -> None:
    policy = policy_from_dict(policy_dict)
    f = case["features"]
    features = Features(
        turn=int(f["turn"]),
        context_tokens=_num(f["context_tokens"]),
        append_tokens=_num(f["append_tokens"]),
        expected_output_tokens=_num(f["expected_output_tokens"]),
        qps=_num(f["qps"]),
        prefill_waiting=_num(f["prefill_waiting"]) if "prefill_waiting" in f else None,
    )
    d = decide(policy, features, lambda: case["draw"])
    exp = case["expect"]
    assert d.route is Route[exp["route"]], name
    assert (list(d.cell) if d.cell is not None else None) == exp["cell"], name
    assert d.reason.value == exp["reason"], name
    assert d.explored is exp["explored"], name


def test_vectors_cover_every_reason_a_table_can_give() -> None:
    reasons = {c["expect"]["reason"] for _, _, c in _cases()}
    assert {"first_turn", "busy_prefill", "busy_later_turn", "bypass", "table", "explore",
            "invalid_input"} <= reasons
