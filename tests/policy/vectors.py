"""The published conformance vectors (``controller/policy/conformance.json``), read once for
every test that checks an implementation of ``decide()`` against them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from controller.policy import Features

VECTORS = Path(__file__).parents[2] / "controller" / "policy" / "conformance.json"


def cases() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(``policy name: case name``, the policy's JSON, the case) for every case."""
    data = json.loads(VECTORS.read_text())
    return [
        (f"{p['name']}: {c['name']}", p["policy"], c)
        for p in data["policies"]
        for c in p["cases"]
    ]


def case_features(case: dict[str, Any]) -> Features:
    """The case's features; "NaN" / "Infinity" strings become floats on purpose."""
    f = case["features"]
    return Features(
        turn=int(f["turn"]),
        context_tokens=float(f["context_tokens"]),
        append_tokens=float(f["append_tokens"]),
        expected_output_tokens=float(f["expected_output_tokens"]),
        qps=float(f["qps"]),
        prefill_waiting=float(f["prefill_waiting"]) if "prefill_waiting" in f else None,
    )
