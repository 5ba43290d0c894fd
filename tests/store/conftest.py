"""The store's contract suite runs every test against SQLite and the real PostgreSQL.

PostgreSQL: the real server, one throw-away schema per test (``tests/support/postgres.py``);
unreachable: skip locally, fail in CI.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from controller.clock import VirtualClock
from controller.store import Store
from tests.support.postgres import fresh_schema

BACKENDS = ("sqlite", "postgresql")


@pytest.fixture(params=BACKENDS)
def db_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """An EMPTY database (no schema) on each backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('store') / 'history.db'}"
        return
    with fresh_schema() as url:
        yield url


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
