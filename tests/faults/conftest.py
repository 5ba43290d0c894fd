"""Fixtures of the fault suite."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from tests.conftest import require
from tests.store.conftest import PG_SERVER, _admin_execute, _pg_reachable


@pytest.fixture
def pg_url() -> Iterator[tuple[str, str]]:
    """(URL of an empty schema on the test PostgreSQL, the application_name its
    connections carry: what pg_terminate_backend picks them by)."""
    ok, why = _pg_reachable()
    require("PostgreSQL", ok, f"{PG_SERVER}: {why}")
    schema = f"pdc_test_{secrets.token_hex(6)}"
    app = f"pdc_fault_{secrets.token_hex(4)}"
    _admin_execute(f"CREATE SCHEMA {schema}")
    try:
        yield f"{PG_SERVER}?options=-csearch_path%3D{schema}&application_name={app}", app
    finally:
        _admin_execute(f"DROP SCHEMA {schema} CASCADE")
