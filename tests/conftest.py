"""Shared test helpers.

``require(component, available)``: an integration test whose real component is missing
skips on a developer machine but FAILS in CI (``CI=true``), so a green CI always means the
real thing ran.
"""

from __future__ import annotations

import os
import random

import pytest

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def require(component: str, available: bool, how: str = "") -> None:
    if available:
        return
    msg = f"{component} is not available{': ' + how if how else ''}"
    if IN_CI:
        pytest.fail(f"{msg} (CI=true: integration tests must not skip)")
    pytest.skip(msg)


@pytest.fixture
def rng() -> random.Random:
    return random.Random(1234)
