"""Two replicas competing for leadership: the SQLite lease row, and the PostgreSQL advisory
lock on the real server at 127.0.0.1:5432 (skipped locally without it, failing in CI), and
on a private server the test stops and starts."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from controller.clock import VirtualClock
from controller.loop.leader import LeaseLeadership, PgAdvisoryLeadership, advisory_key
from controller.store import Store, StoreUnavailable
from tests.support.postgres import private_postgres


async def test_sqlite_lease_one_leader_then_takeover_after_expiry(tmp_path: Path) -> None:
    clock = VirtualClock(1_800_000_000.0)
    store = Store(f"sqlite:///{tmp_path / 'h.db'}", clock)
    store.upgrade()
    a = LeaseLeadership(store, clock, "a", ttl_s=15.0)
    b = LeaseLeadership(store, clock, "b", ttl_s=15.0)
    assert await a.ensure() and not await b.ensure()
    first = a.term
    clock.advance(10)
    assert await a.ensure() and not await b.ensure()  # renewed: still a's
    with store.read() as tx:
        assert a.fence(tx) and not b.fence(tx)
    clock.advance(16)  # a died: no renewal within the ttl
    assert await b.ensure()
    assert b.term is not None and first is not None and b.term == first + 1
    with store.read() as tx:
        assert b.fence(tx) and not a.fence(tx)  # a's writes are fenced off
    assert not await a.ensure()
    await b.release()
    assert await a.ensure()  # a released lease is free at once
    assert a.term == first + 2


async def test_postgres_advisory_lock_passes_when_the_connection_closes(pg_url: str) -> None:
    clock = VirtualClock(1_800_000_000.0)
    store = Store(pg_url, clock)
    store.upgrade()
    key = advisory_key(f"test {secrets.token_hex(4)}".encode())  # not the real leader's
    a = PgAdvisoryLeadership(store, clock, "a", ttl_s=15.0, key=key)
    b = PgAdvisoryLeadership(store, clock, "b", ttl_s=15.0, key=key)
    try:
        assert await a.ensure() and a.locked
        assert not await b.ensure() and not b.locked
        clock.advance(60)  # even with the lease row expired, the lock keeps b out
        assert not await b.ensure()
        assert await a.ensure()
        # a dies: its lock connection goes away with it (no release of the lease row).
        await a._conn.close()
        assert await b.ensure() is False  # b has the lock; a's lease row still runs
        assert b.locked
        clock.advance(16)
        assert await b.ensure() and b.term == (a.term or 0) + 1
        with store.read() as tx:
            assert b.fence(tx) and not a.fence(tx)
        assert not await a.ensure()  # a notices its lock is gone
    finally:
        await a.release()
        await b.release()
        store.close()


async def test_postgres_a_takeover_waits_for_the_fenced_write_in_flight(pg_url: str) -> None:
    """The fence read the lease row without a lock: under READ COMMITTED another replica
    took the expiring lease while the leader's fenced write transaction was still open, and
    both committed (two leaders' writes in one term). Now the takeover waits for it."""
    import threading

    clock = VirtualClock(1_800_000_000.0)
    store = Store(pg_url, clock)
    store.upgrade()
    a = LeaseLeadership(store, clock, "a", ttl_s=15.0)
    took: dict[str, object] = {}
    try:
        assert await a.ensure()
        clock.advance(14.9)
        with store.cycle() as tx:  # a's write transaction, fenced while the lease holds
            assert a.fence(tx)
            clock.advance(0.5)  # the transaction runs on past the lease's end
            b = threading.Thread(target=lambda: took.setdefault(
                "lease", store.try_acquire_lease("b", 15.0, clock.utcnow())))
            b.start()
            b.join(1.0)
            assert b.is_alive(), f"b took the lease under a's open write: {took}"
            tx.add_request("pause", {}, "a", "written under a's fence")
        b.join(10.0)
        lease = took["lease"]
        assert lease is not None and lease.holder == "b" and lease.term == 2  # type: ignore[attr-defined]
        assert [r.who for r in store.requests()] == ["a"]  # committed before b's term
    finally:
        store.close()


async def test_postgres_leader_locks_of_stores_in_two_schemas_do_not_collide(
    pg_url: str,
) -> None:
    """Advisory locks are per database: keyed by the store's schema, two stores (two
    deployments, parallel test runs) each have a leader; replicas of one store contend."""
    from tests.support.postgres import fresh_schema

    clock = VirtualClock(1_800_000_000.0)
    with fresh_schema() as other_url:
        stores = [Store(pg_url, clock), Store(other_url, clock)]
        for store in stores:
            store.upgrade()
        a = PgAdvisoryLeadership(stores[0], clock, "a", ttl_s=15.0)
        a2 = PgAdvisoryLeadership(stores[0], clock, "a2", ttl_s=15.0)
        b = PgAdvisoryLeadership(stores[1], clock, "b", ttl_s=15.0)
        try:
            assert await a.ensure() and a.locked
            assert not await a2.ensure()  # the same store: one leader
            assert await b.ensure() and b.locked  # another store: its own leader
            assert a.key != b.key and a.key == a2.key
        finally:
            for leadership in (a, a2, b):
                await leadership.release()
            for store in stores:
                store.close()


async def test_postgres_leader_with_its_server_down_fails_then_leads_again() -> None:
    """The server itself stopped (a crash) under the leader: its lock went with the session.
    ``ensure`` raises ``StoreUnavailable`` (a failed cycle, not a healthy follower), the
    replica stops leading and fences its writes, and leads again once the server is back."""
    clock = VirtualClock(1_800_000_000.0)
    with private_postgres() as pg:
        store = Store(pg.url, clock)
        store.upgrade()
        a = PgAdvisoryLeadership(store, clock, "a", ttl_s=15.0, connect_timeout_s=2)
        try:
            assert await a.ensure() and a.is_leader
            term = a.term
            pg.stop("immediate")
            with pytest.raises(StoreUnavailable, match="leader lock"):
                await a.ensure()
            assert not a.is_leader and not a.locked and a.lease is None
            with pytest.raises(StoreUnavailable, match="leader lock"):
                await a.ensure()  # still down: still failing, never "a follower"
            pg.start()
            assert await a.ensure() and a.is_leader and a.locked
            assert a.term == term  # the same holder re-took its own lease row
            with store.read() as tx:
                assert a.fence(tx)
        finally:
            await a.release()
            store.close()


async def test_postgres_lock_connection_bounds_a_half_open_peer(pg_url: str) -> None:
    """The lock connection had keepalives but no tcp_user_timeout: its per-cycle ``SELECT
    1``, sent on a half-open connection, waits unacknowledged, when keepalives do not probe,
    for the kernel's retransmission timeout (about 15 minutes). The URL still decides."""
    from controller.store.engine import PG_CONNECT_ARGS

    clock = VirtualClock(1_800_000_000.0)

    async def params(url: str) -> dict[str, str]:
        store = Store(url, clock)
        store.upgrade()
        lead = PgAdvisoryLeadership(store, clock, "a", ttl_s=15.0,
                                    key=advisory_key(secrets.token_bytes(8)))
        try:
            assert await lead.ensure()
            return dict(lead._conn.info.get_parameters())
        finally:
            await lead.release()
            store.close()

    got = await params(pg_url)
    assert got["tcp_user_timeout"] == str(PG_CONNECT_ARGS["tcp_user_timeout"])
    assert (got["keepalives"], got["keepalives_idle"], got["connect_timeout"]) == ("1", "5", "5")
    sep = "&" if "?" in pg_url else "?"
    assert (await params(pg_url + f"{sep}tcp_user_timeout=7000"))["tcp_user_timeout"] == "7000"
