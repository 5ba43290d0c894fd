"""Fixtures shared by the daemon tests."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import pytest

from tests.conftest import require

PG_SERVER = os.environ.get("PDC_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def _admin(sql: str) -> tuple[bool, str]:
    import psycopg

    try:
        conninfo = PG_SERVER.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(conninfo, connect_timeout=3, autocommit=True) as conn:
            conn.execute(sql)
        return True, ""
    except psycopg.Error as e:
        return False, str(e).strip()


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A URL of the real PostgreSQL in a fresh schema, dropped afterwards (fails in CI when
    PostgreSQL is missing)."""
    schema = f"pdc_test_{secrets.token_hex(6)}"
    ok, why = _admin(f"CREATE SCHEMA {schema}")
    require("PostgreSQL", ok, f"{PG_SERVER}: {why}")
    try:
        yield f"{PG_SERVER}?options=-csearch_path%3D{schema}"
    finally:
        _admin(f"DROP SCHEMA {schema} CASCADE")


# The live simulated cluster fixture lives beside the test that introduced it; sharing it here
# lets every daemon test request it without re-exporting it by hand.
from tests.daemon.test_run_live import live_sim  # noqa: E402

__all__ = ["live_sim", "pg_url"]
