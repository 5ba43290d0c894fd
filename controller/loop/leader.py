"""Leadership: only the leader calibrates and approves; every replica may reconcile.

- :class:`Leadership`: what the cycle asks of one; :class:`AlwaysLeader` is a single
  replica's (tests, bench).
- :class:`LeaseLeadership` (SQLite, or any store): a lease row with an expiry in the store.
  ``ensure`` renews it, or takes it when it is free or expired; every change of holder
  raises its ``term``, the fencing number. ``fence(tx)`` re-reads the row inside the
  cycle's write transaction, so a replica that lost the lease mid-cycle writes nothing.
- :class:`PgAdvisoryLeadership` (PostgreSQL): ``pg_try_advisory_lock`` on a dedicated,
  un-pooled psycopg connection with TCP keepalives (a pool's reset does not unlock, and a
  dead leader's lock must go with its connection). The lock decides who may lead; the lease
  row on top of it supplies the term and the in-transaction fence. Advisory locks are per
  database, not per schema, so the key is derived from the schema holding the store: two
  stores in one database (two deployments, or parallel test runs) do not block each other.
  The lock is bound to the server session: a restarted server has dropped it. ``ensure``
  then reconnects and contends again; while the server cannot be reached it raises
  :class:`StoreUnavailable` (the cycle fails, the replica does not lead).

Time comes from the injected clock, so tests move leases forward without sleeping.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import socket
from datetime import timedelta
from typing import Any, Protocol

from controller.clock import Clock
from controller.store import Lease, Store, StoreUnavailable, Tx
from controller.store.engine import PG_CONNECT_ARGS

log = logging.getLogger("pdctl.leader")

LOCK_NAME = b"pd-controller leader"


class Leadership(Protocol):
    """Who may calibrate and approve. ``ensure`` takes or renews leadership and says whether
    this replica leads; ``fence`` re-checks it inside the cycle's write transaction."""

    holder: str

    @property
    def term(self) -> int | None:
        """The fencing number of the leadership held (None: none); a new one each time
        leadership is taken, so a replica that lost it and took it again can tell."""

    async def ensure(self) -> bool: ...

    def fence(self, tx: Tx) -> bool: ...


class AlwaysLeader:
    """A single replica (tests, bench)."""

    def __init__(self, holder: str = "pdctl") -> None:
        self.holder = holder

    @property
    def term(self) -> int | None:
        return 1

    async def ensure(self) -> bool:
        return True

    def fence(self, tx: Tx) -> bool:
        return True


def default_holder() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def process_holder(replica_id: str | None) -> str:
    """This process's lease holder: its replica name (``HOSTNAME-PID`` by default) and a
    nonce of its own. Two processes given one fixed ``replica_id`` (one ConfigMap value
    for every replica) would otherwise both renew one lease and both lead; a restarted
    process (same hostname, PID 1 in a container) would inherit its predecessor's term
    and leave its claimed requests unreclaimed until they went stale."""
    return f"{replica_id or default_holder()}/{secrets.token_hex(4)}"


def replica_name(holder: str) -> str:
    """The replica name in a :func:`process_holder` value (without its nonce)."""
    return holder.rpartition("/")[0] or holder


def advisory_key(name: bytes = LOCK_NAME) -> int:
    """A stable signed 64-bit key for ``pg_try_advisory_lock``."""
    return int.from_bytes(hashlib.sha256(name).digest()[:8], "big", signed=True)


def store_lock_key(schema: str) -> int:
    """The leader lock of the store in ``schema`` (replicas share a store, hence a key)."""
    return advisory_key(LOCK_NAME + b" " + schema.encode())


class LeaseLeadership:
    def __init__(self, store: Store, clock: Clock, holder: str, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError("lease ttl must be > 0")
        self.store = store
        self.clock = clock
        self.holder = holder
        self.ttl_s = ttl_s
        self.lease: Lease | None = None

    @property
    def term(self) -> int | None:
        return self.lease.term if self.lease is not None else None

    @property
    def is_leader(self) -> bool:
        lease = self.lease
        return lease is not None and lease.expires_at is not None \
            and lease.expires_at > self.clock.utcnow()

    async def ensure(self) -> bool:
        """Renew our lease or take a free or expired one; True while we lead."""
        now = self.clock.utcnow()
        with self.store.cycle() as tx:
            lease = None
            if self.lease is not None:
                lease = tx.renew_lease(self.holder, self.ttl_s, now)
            if lease is None:
                lease = tx.try_acquire_lease(self.holder, self.ttl_s, now)
        if lease is None and self.lease is not None:
            log.warning("lost leadership (term %d)", self.lease.term)
        elif lease is not None and (self.lease is None or lease.term != self.lease.term):
            log.info("leader now (term %d)", lease.term)
        self.lease = lease
        return lease is not None

    def fence(self, tx: Tx) -> bool:
        """Inside a write transaction: is the lease still ours, same term, unexpired?"""
        if self.lease is None:
            return False
        row = tx.lease(lock=True)  # a takeover waits for this transaction's commit
        return (
            row is not None and row.holder == self.holder and row.term == self.lease.term
            and row.expires_at is not None and row.expires_at > self.clock.utcnow()
        )

    async def release(self) -> None:
        if self.lease is None:
            return
        self.store.release_lease(self.holder, self.clock.utcnow())
        log.info("released leadership (term %d)", self.lease.term)
        self.lease = None

    async def aclose(self) -> None:
        await self.release()


class PgAdvisoryLeadership(LeaseLeadership):
    """The advisory lock on its own connection, plus the lease row for the term."""

    def __init__(
        self,
        store: Store,
        clock: Clock,
        holder: str,
        ttl_s: float,
        *,
        key: int | None = None,
        connect_timeout_s: int = 5,
        keepalive_idle_s: int = 5,
    ) -> None:
        super().__init__(store, clock, holder, ttl_s)
        self.key = key  # None: derived from the store's schema on the first connection
        self._connect_timeout_s = connect_timeout_s
        self._keepalive_idle_s = keepalive_idle_s
        self._conn: Any = None  # psycopg.AsyncConnection holding the lock
        self.locked = False

    def _conninfo(self) -> str:
        url = self.store.url.set(drivername="postgresql")
        return url.render_as_string(hide_password=False)

    def _connect_args(self) -> dict[str, Any]:
        """The pooled connections' libpq settings (tcp_user_timeout too: keepalives do not
        probe while the per-cycle ``SELECT 1`` waits unacknowledged on a half-open
        connection), with a quicker dead-peer check, unless the store's URL sets them."""
        args = {**PG_CONNECT_ARGS, "connect_timeout": self._connect_timeout_s,
                "keepalives_idle": self._keepalive_idle_s, "keepalives_interval": 2}
        return {k: v for k, v in args.items() if k not in self.store.url.query}

    async def _lock(self) -> bool:
        import psycopg

        if self._conn is not None and not self._conn.closed:
            try:
                await self._conn.execute("SELECT 1")
                return self.locked
            except psycopg.Error as e:
                log.warning("leader lock connection lost: %s", type(e).__name__)
                await self._drop()
        try:
            self._conn = await psycopg.AsyncConnection.connect(
                self._conninfo(), autocommit=True,
                application_name=f"pdctl-leader {self.holder}"[:63], **self._connect_args())
            if self.key is None:
                cur = await self._conn.execute("SELECT current_schema()")
                schema = await cur.fetchone()
                self.key = store_lock_key(str(schema[0]) if schema and schema[0] else "")
            cur = await self._conn.execute("SELECT pg_try_advisory_lock(%s)", (self.key,))
            row = await cur.fetchone()
        except psycopg.Error as e:
            # The server is unreachable (down, restarting, recovering): that is not "another
            # replica leads". Raised, the cycle is counted failed with the store named, and
            # health stops reporting a follower that is fine.
            await self._drop()
            raise StoreUnavailable(
                f"cannot take the leader lock on {self.store.safe_url}: "
                f"{type(e).__name__}: {str(e).strip()}") from None
        self.locked = bool(row and row[0])
        if not self.locked:
            await self._drop()  # do not keep an idle connection per follower
        return self.locked

    async def _drop(self) -> None:
        conn, self._conn, self.locked = self._conn, None, False
        if conn is not None:
            try:
                await conn.close()
            except Exception:  # closing a broken connection may fail too
                log.debug("closing the lock connection failed", exc_info=True)

    async def ensure(self) -> bool:
        try:
            locked = await self._lock()
        except StoreUnavailable:
            self.lease = None  # the lock went with the server's session: we do not lead
            raise
        if not locked:
            self.lease = None
            return False
        return await super().ensure()

    def fence(self, tx: Tx) -> bool:
        return self.locked and super().fence(tx)

    async def release(self) -> None:
        await super().release()
        await self._drop()


def lease_expires_in(lease: Lease | None, clock: Clock) -> timedelta | None:
    if lease is None or lease.expires_at is None:
        return None
    return lease.expires_at - clock.utcnow()


def leadership_for(store: Store, clock: Clock, holder: str, ttl_s: float) -> LeaseLeadership:
    """The store's kind of leadership: the advisory lock on PostgreSQL, else the lease."""
    if store.dialect == "postgresql":
        return PgAdvisoryLeadership(store, clock, holder, ttl_s)
    return LeaseLeadership(store, clock, holder, ttl_s)

