"""Driver errors as the store's own: passing (retried next cycle) or refused (a bug or bad
data: the same write fails again). PostgreSQL raised most of them as InternalError,
ProgrammingError or DataError, which escaped unclassified: ``pdctl pause`` against a
read-only server printed a traceback and exit 1, and the daemon logged one every cycle."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from controller.store import Store, StoreError, StoreUnavailable, migrate
from tests.support.postgres import fresh_schema


@pytest.fixture
def pg_url() -> Iterator[str]:
    with fresh_schema() as url:
        migrate.upgrade(url)
        yield url


@pytest.mark.integration
def test_a_read_only_server_is_unavailable_not_a_bug(pg_url: str) -> None:
    """A demoted primary or a hot standby mid-failover (SQLSTATE 25006) passes: the
    writes work again once the URL's host is the new primary."""
    read_only = pg_url.replace("?options=", "?options=-cdefault_transaction_read_only%3Don%20")
    with Store(read_only) as store:
        assert store.requests() == []  # reads still work
        with pytest.raises(StoreUnavailable, match="read-only transaction"):
            store.add_request("pause", {}, who="ops")
        with pytest.raises(StoreUnavailable):
            store.try_acquire_lease("a", 10.0, store.clock.utcnow())


@pytest.mark.integration
def test_a_value_too_long_for_its_column_is_refused(pg_url: str) -> None:
    """SQLSTATE 22001 (SQLite stores it): the same write fails again, so not retried as an
    outage."""
    with Store(pg_url) as store:
        with pytest.raises(StoreError, match="too long") as e:
            store.record_ack("r1", 1, "ab" * 40)
        assert not isinstance(e.value, StoreUnavailable)
        assert store.routers() == []


@pytest.mark.integration
def test_pooled_connections_carry_dead_peer_settings_unless_the_url_says_otherwise(
        pg_url: str) -> None:
    """Without keepalives and tcp_user_timeout a half-open connection held a store call
    for the kernel's retransmission timeout (about 15 minutes), on the event loop."""
    from controller.store.engine import PG_CONNECT_ARGS

    def params(url: str) -> dict[str, str]:
        with Store(url) as store, store.engine.connect() as conn:
            info = conn.connection.dbapi_connection.info  # type: ignore[union-attr]
            return dict(info.get_parameters())

    got = params(pg_url)
    assert {k: got.get(k) for k in PG_CONNECT_ARGS} == {
        k: str(v) for k, v in PG_CONNECT_ARGS.items()}
    assert params(pg_url + "&keepalives_idle=60")["keepalives_idle"] == "60"
