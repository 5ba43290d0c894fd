"""Alembic environment for the history store (SQLite batch mode + PostgreSQL).

The URL comes from ``config.attributes["url"]`` (set by :mod:`controller.store.migrate`), then
``PDCTL_STORE__URL``, then ``sqlalchemy.url``. On SQLite, foreign keys are OFF on the
migration connection (set when it connects, before any transaction): batch mode recreates
tables, and dropping a parent with foreign keys on would cascade-delete its children.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from alembic import context
from alembic.autogenerate.api import AutogenContext
from sqlalchemy.engine import Connection, Engine

from controller.store.engine import make_engine
from controller.store.models import Base
from controller.store.types import JsonText, UtcDateTime

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.attributes.get("url") or os.environ.get("PDCTL_STORE__URL")
    url = url or config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database URL: pass --url, set PDCTL_STORE__URL or sqlalchemy.url")
    return str(url)


def _render_item(type_: str, obj: Any, autogen_context: AutogenContext) -> str | Literal[False]:
    # Migrations must not depend on our Python types: render their plain column types.
    if type_ == "type" and isinstance(obj, UtcDateTime):
        return "sa.DateTime(timezone=True)"
    if type_ == "type" and isinstance(obj, JsonText):
        return "sa.Text()"
    return False


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        render_item=_render_item,
    )


def run_migrations_offline() -> None:
    context.configure(
        url=_url(), target_metadata=target_metadata, literal_binds=True,
        render_as_batch=_url().startswith("sqlite"), render_item=_render_item,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    given = config.attributes.get("connection")
    if isinstance(given, Connection):  # the caller owns it (and its pragmas)
        _configure(given)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine: Engine = given if isinstance(given, Engine) else make_engine(
        _url(), foreign_keys=False
    )
    try:
        with engine.connect() as connection:
            _configure(connection)
            with context.begin_transaction():
                context.run_migrations()
            connection.commit()
    finally:
        if not isinstance(given, Engine):
            engine.dispose()  # later connections get foreign_keys=ON from the store's engine


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
