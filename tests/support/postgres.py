"""The real PostgreSQL the integration tests use, one throw-away schema per test.

The server is the machine's at 127.0.0.1:5432 (user postgres, database test; override with
``PDC_TEST_PG``). Each test gets its own ``pdc_test_<random>`` schema, reached through
``search_path`` and dropped afterwards, so no other data is touched. Unreachable: the test is
skipped locally and fails in CI (:func:`tests.conftest.require`).

Tests that stop or crash the server itself get one of their own instead
(:func:`private_postgres`: ``initdb`` + ``pg_ctl`` on a free port, run as the ``postgres``
user when the tests run as root), never the shared one.
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

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


# -- a private server, for the tests that stop and restart PostgreSQL itself ---------------

PG_BINDIR_GLOB = "/usr/lib/postgresql/*/bin"


def pg_bindir() -> Path | None:
    """Where ``initdb`` and ``pg_ctl`` live: ``pg_config --bindir``, else the newest Debian
    ``/usr/lib/postgresql/N/bin``; None when neither has them."""
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        done = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True,
                              timeout=10, check=False)
        if done.returncode == 0 and done.stdout.strip():
            candidates.append(Path(done.stdout.strip()))
    candidates += sorted((Path(p) for p in glob.glob(PG_BINDIR_GLOB)),
                         key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
                         reverse=True)
    for bindir in candidates:
        if (bindir / "initdb").is_file() and (bindir / "pg_ctl").is_file():
            return bindir
    return None


@dataclass
class PrivatePostgres:
    """A PostgreSQL server of the test's own (its data directory, port and socket
    directory in a temporary directory), so the test may stop, crash and restart it without
    touching the machine's server. ``url`` reaches its ``postgres`` database over TCP."""

    bindir: Path
    root: Path
    port: int
    user: str | None  # the OS user the server runs as (None: this process's user)

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def logfile(self) -> Path:
        return self.root / "server.log"

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str, timeout_s: float = 60.0) -> None:
        # initdb and the server refuse to run as root: run them as the postgres user.
        prefix = ["runuser", "-u", self.user, "--"] if self.user else []
        done = subprocess.run([*prefix, *args], capture_output=True, text=True,
                              timeout=timeout_s, check=False, cwd=self.root)
        if done.returncode != 0:
            log = self.logfile.read_text(errors="replace")[-2000:] \
                if self.logfile.exists() else ""
            raise RuntimeError(f"{' '.join(args[:2])} failed ({done.returncode}): "
                               f"{done.stdout}{done.stderr}\n{log}")

    def initdb(self) -> None:
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres",
                  "--auth=trust", "--no-sync", "--no-instructions", "-E", "UTF8")

    def start(self) -> None:
        # fsync off: the machine does not crash in these tests, the server does, and what
        # it wrote is in the OS's cache. synchronous_commit stays on: off, an immediate
        # stop loses commits already acknowledged (seen: windows gone after the crash).
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
                   "-c fsync=off -c full_page_writes=off")
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.logfile),
                  "-o", options, "-w", "-t", "30", "start")

    def stop(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m MODE``: ``fast`` ends every session and shuts down cleanly;
        ``immediate`` kills the server without a checkpoint (a crash: recovery on start)."""
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w",
                  "-t", "30", "stop")

    def restart(self, mode: str = "fast") -> None:
        """``pg_ctl restart -m MODE`` (the server's options are kept)."""
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.logfile),
                  "-m", mode, "-w", "-t", "30", "restart")

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()


@contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    """A fresh PostgreSQL server on a free loopback port, stopped and deleted on exit.

    Missing ``initdb``/``pg_ctl``: skipped locally, failed in CI (:func:`require`).
    """
    from tests.support.processes import free_port

    bindir = pg_bindir()
    require("PostgreSQL server binaries (initdb, pg_ctl)", bindir is not None,
            f"not found by `pg_config --bindir` nor in {PG_BINDIR_GLOB}")
    assert bindir is not None
    user = None
    if os.geteuid() == 0:
        require("the postgres OS user", _user_exists("postgres"),
                "initdb refuses root and there is no postgres user to run it as")
        user = "postgres"
    # Not pytest's tmp_path: its parents are private to root, the server's user could not
    # reach the data directory. A short path also keeps the socket name under its limit.
    root = Path(tempfile.mkdtemp(prefix="pdc-pg-"))
    if user is not None:
        shutil.chown(root, user)
    server = PrivatePostgres(bindir, root, free_port(), user)
    try:
        server.initdb()
        server.start()
        yield server
    finally:
        try:
            if server.running():
                server.stop("immediate")
        finally:
            shutil.rmtree(root, ignore_errors=True)


def _user_exists(name: str) -> bool:
    import pwd

    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True
