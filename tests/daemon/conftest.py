"""Fixtures shared by the daemon tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.postgres import fresh_schema


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A URL of the real PostgreSQL in a fresh schema, dropped afterwards (fails in CI when
    PostgreSQL is missing)."""
    with fresh_schema() as url:
        yield url


# The live simulated cluster fixture lives beside the test that introduced it; sharing it here
# lets every daemon test request it without re-exporting it by hand.
from tests.daemon.test_run_live import live_sim  # noqa: E402

__all__ = ["live_sim", "pg_url"]
