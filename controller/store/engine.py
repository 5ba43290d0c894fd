"""Engines for the history store: SQLite (embedded default) and PostgreSQL (psycopg 3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, make_url
from sqlalchemy.engine import URL, Connection

from controller.config import LIBPQ_SCHEMES, PG_DRIVER, libpq_scheme

DEFAULT_BUSY_TIMEOUT_MS = 5000
PG_CONNECT_TIMEOUT_S = 10
# libpq settings for pooled connections, unless the URL gives its own. A half-open connection
# (the server's host gone, a failover behind a load balancer) otherwise left a store call
# waiting for the kernel's retransmission timeout, about 15 minutes, on the event loop:
# keepalives find a dead peer of an idle-looking connection in 10 + 3 x 5 s, and
# tcp_user_timeout bounds data sent and never acknowledged at 30 s.
PG_CONNECT_ARGS: dict[str, int] = {
    "connect_timeout": PG_CONNECT_TIMEOUT_S,  # an unreachable server fails, never hangs
    "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}
# Execution option asking the SQLite begin hook for BEGIN IMMEDIATE (a write transaction).
WRITE_OPTION = "pdc_write"


def normalize_url(url: str | URL) -> URL:
    """Make a PostgreSQL URL explicit about psycopg 3 (``postgres://`` and
    ``postgresql://`` as libpq takes them, see :func:`libpq_scheme`) and SQLite file paths
    absolute."""
    u = make_url(libpq_scheme(url) if isinstance(url, str) else url)
    if u.drivername in LIBPQ_SCHEMES:
        u = u.set(drivername=PG_DRIVER)
    elif u.drivername.startswith("postgres+"):
        u = u.set(drivername="postgresql+" + u.drivername.partition("+")[2])
    db = u.database
    if u.get_backend_name() == "sqlite" and db and db != ":memory:" and not db.startswith("file:"):
        u = u.set(database=str(Path(db).expanduser().resolve()))
    return u


def make_engine(
    url: str | URL,
    *,
    echo: bool = False,
    foreign_keys: bool = True,
    busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
    sqlite_synchronous: str = "NORMAL",
) -> Engine:
    """A sync engine with our SQLite settings: WAL, foreign keys, busy timeout, and
    explicit ``BEGIN`` so a transaction holds from its first statement (pysqlite's own
    handling starts it only at the first write, which would leave reads outside it).

    ``foreign_keys=False`` is for migrations: batch mode recreates tables, and dropping a
    parent table with foreign keys on would cascade into its children.

    ``sqlite_synchronous="NORMAL"`` (with WAL): a commit is atomic and survives a process
    crash, but the last commits before a power loss may be lost (the file stays
    consistent); each commit then costs no fsync. ``"FULL"`` fsyncs every commit.
    """
    if sqlite_synchronous not in ("NORMAL", "FULL"):
        raise ValueError(f"sqlite_synchronous must be NORMAL or FULL, got {sqlite_synchronous!r}")
    u = normalize_url(url)
    kwargs: dict[str, Any] = {"echo": echo}
    if u.get_backend_name() == "postgresql":
        kwargs["pool_pre_ping"] = True
        kwargs["connect_args"] = {k: v for k, v in PG_CONNECT_ARGS.items() if k not in u.query}
    engine = create_engine(u, **kwargs)
    if engine.dialect.name == "sqlite":
        _install_sqlite_hooks(
            engine, foreign_keys=foreign_keys, busy_timeout_ms=busy_timeout_ms,
            synchronous=sqlite_synchronous,
        )
    return engine


def _install_sqlite_hooks(
    engine: Engine, *, foreign_keys: bool, busy_timeout_ms: int, synchronous: str
) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # The driver must not open transactions on its own: the begin hook does it.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute(f"PRAGMA synchronous={synchronous}")
            cursor.execute(f"PRAGMA foreign_keys={'ON' if foreign_keys else 'OFF'}")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # Writers take the lock up front: a deferred transaction that read first could not
        # upgrade to a writer once another writer committed (SQLITE_BUSY, no waiting).
        write = conn.get_execution_options().get(WRITE_OPTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")
