"""``pdctl db upgrade|downgrade|current|compact``: the history database's schema and retention."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Annotated

import typer

from controller.cli._app import app, load_settings_or_exit

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


def store_url(url: str | None, config: Path | None, *, must_exist: bool = False) -> str:
    """``--url``, else the config file's ``[store] url``, else PDCTL_STORE__URL / default.

    ``must_exist``: the command only reads or adds to a store the daemon made, so a SQLite
    file that is not there is an error (exit 3) instead of a new empty database left behind
    in the working directory."""

    if url:
        from pydantic import ValidationError

        from controller.config import StoreConfig

        try:
            url = StoreConfig(url=url).url
        except ValidationError as e:
            reason = "; ".join(str(err["msg"]).removeprefix("Value error, ")
                               for err in e.errors())
            typer.echo(f"error: --url: {reason}", err=True)
            raise typer.Exit(_EXIT_BAD_INPUT) from None
    else:
        url = load_settings_or_exit(config).store.url
    missing = missing_database(url) if must_exist else None
    if missing is not None:
        typer.echo(missing, err=True)
        raise typer.Exit(_EXIT_UNAVAILABLE)
    return url


def missing_database(url: str) -> str | None:
    """Why ``url`` names no database yet (a SQLite file that does not exist), else None."""
    from controller.store import normalize_url

    u = normalize_url(url)
    db = u.database or ""
    if u.get_backend_name() != "sqlite" or not db or db == ":memory:" or db.startswith("file:"):
        return None
    if Path(db).exists():
        return None
    return (f"no database at {db}: the daemon creates it on its first start (`pdctl db "
            "upgrade` makes an empty one); check [store] url, --config or --url")


def _in_memory(url: str) -> bool:
    from controller.store import normalize_url

    u = normalize_url(url)
    return u.get_backend_name() == "sqlite" and u.database in (None, "", ":memory:")


def _safe(url: str) -> str:
    from controller.store import normalize_url

    return normalize_url(url).render_as_string(hide_password=True)


def _migratable(url: str) -> str:
    if _in_memory(url):
        typer.echo("error: an in-memory SQLite database ends with this command; name a file "
                   "(sqlite:///PATH)", err=True)
        raise typer.Exit(_EXIT_BAD_INPUT)
    return url


def _fail_unavailable(url: str, e: Exception) -> typer.Exit:
    typer.echo(f"{_safe(url)}: {getattr(e, 'orig', None) or e}", err=True)
    return typer.Exit(_EXIT_UNAVAILABLE)


@db_app.command("upgrade")
def upgrade(
    url: UrlOption = None,
    config: ConfigOption = None,
    revision: Annotated[str, typer.Option(help="Target revision.")] = "head",
) -> None:
    """Apply the migrations up to REVISION (default: the latest). Exit 2 bad input (an
    unknown revision), 3 store unavailable or a database from a newer release (run that
    release's pdctl, or downgrade with it)."""
    from alembic.util import CommandError
    from sqlalchemy.exc import DBAPIError

    from controller.store import migrate

    target = _migratable(store_url(url, config))
    try:
        migrate.check_revision(revision)
        before = migrate.current_revision(target)
        problem = migrate.newer_release_problem(_safe(target), before)
        if problem is not None:
            typer.echo(f"error: {problem}", err=True)
            raise typer.Exit(_EXIT_UNAVAILABLE)
        migrate.upgrade(target, revision)
        after = migrate.current_revision(target)
    except DBAPIError as e:
        raise _fail_unavailable(target, e) from None
    except CommandError as e:  # e.g. an unknown revision
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(_EXIT_BAD_INPUT) from None
    typer.echo(f"{_safe(target)}: {before or 'empty'} -> {after or 'empty'}")


@db_app.command("downgrade")
def downgrade(
    revision: Annotated[str, typer.Argument(help="Target revision ('base' removes everything).")],
    url: UrlOption = None,
    config: ConfigOption = None,
) -> None:
    """Revert the migrations down to REVISION."""
    from alembic.util import CommandError
    from sqlalchemy.exc import DBAPIError

    from controller.store import migrate

    target = _migratable(store_url(url, config, must_exist=True))
    try:
        migrate.downgrade(target, revision)
        after = migrate.current_revision(target)
    except DBAPIError as e:
        raise _fail_unavailable(target, e) from None
    except CommandError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(_EXIT_BAD_INPUT) from None
    typer.echo(f"{_safe(target)}: now at {after or 'base'}")


@db_app.command("current")
def current(url: UrlOption = None, config: ConfigOption = None) -> None:
    """Print the database's revision and the code's; exit 1 when they differ (a SQLite file
    not created yet is at no revision, as an empty PostgreSQL database is), 2 bad input,
    3 store unavailable."""
    from sqlalchemy.exc import DBAPIError

    from controller.store import migrate

    target = store_url(url, config)
    missing = missing_database(target)
    if missing is not None:  # looking must not create the file
        typer.echo(missing, err=True)
        raise typer.Exit(1)
    try:
        at = migrate.current_revision(target)
    except DBAPIError as e:
        raise _fail_unavailable(target, e) from None
    head = migrate.head_revision()
    state = ("up to date" if at == head else migrate.schema_advice(at, head)
             if migrate.newer_than_code(at) else "needs `pdctl db upgrade`")
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
    """Delete windows older than the retention (policies, events and requests are kept).

    Kept whatever their age: the newest 2 x [controller] training_windows windows and the
    training windows of the versions still in use (docs/store.md, Retention)."""
    from controller.clock import WallClock
    from controller.config import windows_compaction_keeps
    from controller.errors import ControllerError
    from controller.store import Store

    target = store_url(url, config, must_exist=True)
    settings = load_settings_or_exit(config)
    days = settings.store.retention_days if older_than_days is None else older_than_days
    clock = WallClock()
    cutoff = clock.utcnow() - timedelta(days=days)
    keep = windows_compaction_keeps(settings)
    try:
        with Store(target, clock) as store:
            store.require_schema()
            deleted = store.compact_windows(older_than=cutoff, keep_newest=keep)
    except ControllerError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(_EXIT_UNAVAILABLE) from None
    typer.echo(f"{_safe(target)}: deleted {deleted} window(s) that ended before "
               f"{cutoff.isoformat(timespec='seconds')} (the newest {keep} are always kept)")
