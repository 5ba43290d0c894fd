"""The store's contract suite runs every test against SQLite and the real PostgreSQL.

PostgreSQL: the server at 127.0.0.1:5432 (user postgres, database test). Each test gets its
own schema (``pdc_test_<random>``, reached through ``search_path``) that is dropped
afterwards, so no other data is touched. Unreachable: skip locally, fail in CI.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import pytest

from controller.clock import VirtualClock
from controller.store import Store
from tests.conftest import require

PG_SERVER = os.environ.get("PDC_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
BACKENDS = ("sqlite", "postgresql")


def _pg_reachable() -> tuple[bool, str]:
    import psycopg

    try:
        conninfo = PG_SERVER.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(conninfo, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
        return True, ""
    except psycopg.Error as e:
        return False, str(e).strip()


def _admin_execute(sql: str) -> None:
    import psycopg

    conninfo = PG_SERVER.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(conninfo, connect_timeout=3, autocommit=True) as conn:
        conn.execute(sql)


@pytest.fixture(params=BACKENDS)
def db_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """An EMPTY database (no schema) on each backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('store') / 'history.db'}"
        return
    ok, why = _pg_reachable()
    require("PostgreSQL", ok, f"{PG_SERVER}: {why}")
    schema = f"pdc_test_{secrets.token_hex(6)}"
    _admin_execute(f"CREATE SCHEMA {schema}")
    try:
        yield f"{PG_SERVER}?options=-csearch_path%3D{schema}"
    finally:
        _admin_execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.fixture
def clock() -> VirtualClock:
    return VirtualClock(start=1_800_000_000.0)


@pytest.fixture
def migrated_url(db_url: str) -> str:
    from controller.store import migrate

    migrate.upgrade(db_url)
    return db_url


@pytest.fixture
def store(migrated_url: str, clock: VirtualClock) -> Iterator[Store]:
    with Store(migrated_url, clock) as s:
        yield s


@pytest.fixture
def other_store(migrated_url: str, clock: VirtualClock) -> Iterator[Store]:
    """A second, independent Store (own engine and pool) on the same database."""
    with Store(migrated_url, clock) as s:
        yield s
