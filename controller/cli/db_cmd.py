"""``pdctl db upgrade|downgrade|current|compact``: the history database's schema and retention."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Annotated

import typer

from controller.cli._app import app

db_app = typer.Typer(help="The history database: migrations and retention.", no_args_is_help=True)
app.add_typer(db_app, name="db")

UrlOption = Annotated[
    str | None,
    typer.Option("--url", help="Database URL (overrides the config), e.g. sqlite:///pd.db."),
]
ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="Config file whose [store] is used.")
]
_EXIT_BAD_INPUT = 2
_EXIT_UNAVAILABLE = 3


def store_url(url: str | None, config: Path | None) -> str:
    """``--url``, else the config file's ``[store] url``, else PDCTL_STORE__URL / default."""
    if url:
        return url
    from controller.config import load_settings
    from controller.errors import ConfigError

    try:
        return load_settings(config).store.url
    except ConfigError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(_EXIT_BAD_INPUT) from None


def _safe(url: str) -> str:
    from controller.store import normalize_url

    return normalize_url(url).render_as_string(hide_password=True)


def _fail_unavailable(url: str, e: Exception) -> typer.Exit:
    typer.echo(f"{_safe(url)}: {getattr(e, 'orig', None) or e}", err=True)
    return typer.Exit(_EXIT_UNAVAILABLE)


@db_app.command("upgrade")
def upgrade(
    url: UrlOption = None,
    config: ConfigOption = None,
    revision: Annotated[str, typer.Option(help="Target revision.")] = "head",
) -> None:
    """Apply the migrations up to REVISION (default: the latest)."""
    from sqlalchemy.exc import DBAPIError

    from controller.store import migrate

    target = store_url(url, config)
    try:
        before = migrate.current_revision(target)
        migrate.upgrade(target, revision)
        after = migrate.current_revision(target)
    except DBAPIError as e:
        raise _fail_unavailable(target, e) from None
    typer.echo(f"{_safe(target)}: {before or 'empty'} -> {after or 'empty'}")


@db_app.command("downgrade")
def downgrade(
    revision: Annotated[str, typer.Argument(help="Target revision ('base' removes everything).")],
    url: UrlOption = None,
    config: ConfigOption = None,
) -> None:
    """Revert the migrations down to REVISION."""
    from sqlalchemy.exc import DBAPIError

    from controller.store import migrate

    target = store_url(url, config)
    try:
        migrate.downgrade(target, revision)
        after = migrate.current_revision(target)
    except DBAPIError as e:
        raise _fail_unavailable(target, e) from None
    typer.echo(f"{_safe(target)}: now at {after or 'base'}")


@db_app.command("current")
def current(url: UrlOption = None, config: ConfigOption = None) -> None:
    """Print the database's revision and the code's; exit 1 when they differ."""
    from sqlalchemy.exc import DBAPIError

    from controller.store import migrate

    target = store_url(url, config)
    try:
        at = migrate.current_revision(target)
    except DBAPIError as e:
        raise _fail_unavailable(target, e) from None
    head = migrate.head_revision()
    state = "up to date" if at == head else "needs `pdctl db upgrade`"
    typer.echo(f"{_safe(target)}: revision {at or 'none'} (code: {head}) - {state}")
    if at != head:
        raise typer.Exit(1)


@db_app.command("compact")
def compact(
    url: UrlOption = None,
    config: ConfigOption = None,
    older_than_days: Annotated[
        float | None,
        typer.Option(help="Override [store] retention_days.", min=0.0),
    ] = None,
) -> None:
    """Delete windows older than the retention (policies, events and requests are kept)."""
    from controller.clock import WallClock
    from controller.config import load_settings
    from controller.errors import ControllerError
    from controller.store import Store

    target = store_url(url, config)
    days = older_than_days
    if days is None:
        days = load_settings(config).store.retention_days
    clock = WallClock()
    cutoff = clock.utcnow() - timedelta(days=days)
    try:
        with Store(target, clock) as store:
            store.require_schema()
            deleted = store.compact_windows(older_than=cutoff)
    except ControllerError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(_EXIT_UNAVAILABLE) from None
    typer.echo(f"{_safe(target)}: deleted {deleted} window(s) that ended before "
               f"{cutoff.isoformat(timespec='seconds')}")
