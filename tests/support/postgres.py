"""The real PostgreSQL the integration tests use, one throw-away schema per test.

The server is the machine's at 127.0.0.1:5432 (user postgres, database test; override with
``PDC_TEST_PG``). Each test gets its own ``pdc_test_<random>`` schema, reached through
``search_path`` and dropped afterwards, so no other data is touched. Unreachable: the test is
skipped locally and fails in CI (:func:`tests.conftest.require`).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

from tests.conftest import require

PG_SERVER = os.environ.get("PDC_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def _conninfo() -> str:
    return PG_SERVER.replace("postgresql+psycopg://", "postgresql://")


def admin_execute(sql: str) -> None:
    """Run one statement as the admin user, outside any test schema (autocommit)."""
    import psycopg

    with psycopg.connect(_conninfo(), connect_timeout=3, autocommit=True) as conn:
        conn.execute(sql)


def pg_reachable() -> tuple[bool, str]:
    import psycopg

    try:
        with psycopg.connect(_conninfo(), connect_timeout=3) as conn:
            conn.execute("SELECT 1")
        return True, ""
    except psycopg.Error as e:
        return False, str(e).strip()


@contextmanager
def fresh_schema(extra_query: str = "") -> Iterator[str]:
    """A SQLAlchemy URL of an empty schema on the test server, dropped on exit.

    ``extra_query`` is appended to the URL's query string (e.g. ``application_name=...``).
    """
    ok, why = pg_reachable()
    require("PostgreSQL", ok, f"{PG_SERVER}: {why}")
    schema = f"pdc_test_{secrets.token_hex(6)}"
    admin_execute(f"CREATE SCHEMA {schema}")
    suffix = f"&{extra_query}" if extra_query else ""
    try:
        yield f"{PG_SERVER}?options=-csearch_path%3D{schema}{suffix}"
    finally:
        admin_execute(f"DROP SCHEMA {schema} CASCADE")
