"""``postgres://`` and ``postgresql://`` (libpq's URI schemes) name PostgreSQL through
psycopg 3 wherever a store URL is taken: the config file, the environment, ``--url``, the
Store, migrations and the leader's lock connection. The integration part runs against the
real PostgreSQL (tests/support/postgres.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from typer.testing import CliRunner

from controller.cli import app
from controller.clock import VirtualClock
from controller.config import StoreConfig, libpq_scheme, load_settings
from controller.loop.leader import leadership_for
from controller.store import Store, migrate, normalize_url
from tests.support.postgres import fresh_schema

runner = CliRunner()


@pytest.mark.parametrize(("given", "expected"), [
    ("postgres://u:p%40ss@db:5433/pd?sslmode=require",
     "postgresql+psycopg://u:p%40ss@db:5433/pd?sslmode=require"),
    ("postgresql://u@db/pd", "postgresql+psycopg://u@db/pd"),
    ("POSTGRES://u@db/pd", "postgresql+psycopg://u@db/pd"),
    ("postgres+psycopg://u@db/pd", "postgresql+psycopg://u@db/pd"),
    ("postgresql+psycopg://u@db/pd", "postgresql+psycopg://u@db/pd"),
    ("sqlite:////tmp/pd.db", "sqlite:////tmp/pd.db"),
    ("mysql://u@db/pd", "mysql://u@db/pd"),
    ("not a url", "not a url"),
])
def test_libpq_schemes_become_the_psycopg_driver_and_nothing_else_changes(
        given: str, expected: str) -> None:
    assert libpq_scheme(given) == expected


def test_the_config_env_and_store_take_postgres_urls(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert StoreConfig(url="postgres://pdc@db.example:5432/pdc").url == \
        "postgresql+psycopg://pdc@db.example:5432/pdc"
    config = tmp_path / "pd.toml"
    config.write_text('[store]\nurl = "postgres://pdc@db.example/pdc"\n')
    assert load_settings(config).store.url == "postgresql+psycopg://pdc@db.example/pdc"
    monkeypatch.setenv("PDCTL_STORE__URL", "postgresql://pdc@db.example/other")
    assert load_settings(None).store.url == "postgresql+psycopg://pdc@db.example/other"
    u = normalize_url("postgres://pdc:secret@db.example/pdc")
    assert (u.drivername, u.password, u.database) == ("postgresql+psycopg", "secret", "pdc")
    # Other backends are still refused, by their name.
    with pytest.raises(ValueError, match="mysql: the store runs on sqlite or postgresql only"):
        StoreConfig(url="mysql://u@db/pd")


def _as_libpq(url: str) -> str:
    """The test schema's URL as psql and libpq write it."""
    assert url.startswith("postgresql+psycopg://")
    return "postgres://" + url.removeprefix("postgresql+psycopg://")


def test_a_postgres_url_reaches_the_real_server_everywhere(tmp_path: Path) -> None:
    with fresh_schema() as url:
        libpq = _as_libpq(url)
        # pdctl's --url: migrations, then status and history against the same schema.
        result = runner.invoke(app, ["db", "upgrade", "--url", libpq])
        assert result.exit_code == 0, result.stderr
        assert f"empty -> {migrate.head_revision()}" in result.stdout
        assert migrate.current_revision(libpq) == migrate.head_revision()
        clock = VirtualClock(start=1_800_000_000.0)
        with Store(libpq, clock) as store:
            assert store.dialect == "postgresql"
            store.require_schema()
            request_id = store.add_request("pause", {"what": "approvals"}, "test", "via libpq")
            # The leader's lock is a separate psycopg connection built from the store's URL.
            leadership = leadership_for(store, clock, "a", ttl_s=15.0)

            async def lead() -> bool:
                try:
                    return await leadership.ensure()
                finally:
                    await leadership.release()
            assert asyncio.run(lead())
        # A config file's [store] url, read by a command that only reads.
        config = tmp_path / "pd.toml"
        config.write_text(f'[store]\nurl = "{libpq}"\n')
        result = runner.invoke(app, ["history", "requests", "--config", str(config), "--json"])
        assert result.exit_code == 0, result.stderr
        assert f'"id": {request_id}' in result.stdout and "via libpq" in result.stdout
        result = runner.invoke(app, ["status", "--config", str(config)])
        assert result.exit_code == 0, result.stderr
        assert "1 request(s) pending" in result.stdout
