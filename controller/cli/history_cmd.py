"""``pdctl history windows|policies|calibrations|drift|pushes|requests``: what the store holds.

Rows come oldest first (the newest ``--limit`` of them); ``--json`` prints a JSON list.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Annotated, Any

import typer

from controller.cli._app import app
from controller.cli.db_cmd import ConfigOption, UrlOption, store_url

if TYPE_CHECKING:
    from controller.store import Store, Tx

history_app = typer.Typer(help="What the controller recorded (from the store).",
                          no_args_is_help=True)
app.add_typer(history_app, name="history")

SinceOption = Annotated[
    str | None,
    typer.Option(
        "--since", help="ISO time (2027-01-15T12:00:00Z) or a relative age: -30s, -15m, -1h, -2d."
    ),
]
LimitOption = Annotated[int, typer.Option("--limit", "-n", min=1, help="Newest N rows.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print a JSON list.")]
_EXIT_BAD_INPUT = 2
_EXIT_UNAVAILABLE = 3
_RELATIVE = re.compile(r"^-?(\d+(?:\.\d+)?)([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_since(text: str, now: datetime) -> datetime:
    """``-1h`` (relative to ``now``) or an ISO 8601 time (naive means UTC)."""
    m = _RELATIVE.match(text.strip())
    if m:
        return now - timedelta(seconds=float(m.group(1)) * _UNIT_S[m.group(2)])
    try:
        t = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"--since {text!r}: expected an ISO time or an age like -30m, -1h, -2d"
        ) from None
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def _run(
    url: str | None,
    config: Any,
    since: str | None,
    as_json: bool,
    fetch: Callable[[Tx, datetime | None], Sequence[Any]],
    to_json: Callable[[Any], dict[str, Any]],
    columns: Sequence[str],
    to_row: Callable[[Any], Sequence[str]],
    title: str,
) -> None:
    from controller.clock import WallClock
    from controller.errors import ControllerError
    from controller.store import Store

    target = store_url(url, config)
    clock = WallClock()
    try:
        start = None if since is None else parse_since(since, clock.utcnow())
    except ValueError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(_EXIT_BAD_INPUT) from None
    try:
        store: Store
        with Store(target, clock) as store:
            store.require_schema()
            with store.read() as tx:
                items = fetch(tx, start)
    except ControllerError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(_EXIT_UNAVAILABLE) from None
    if as_json:
        typer.echo(json.dumps([to_json(i) for i in items], indent=2, default=_json_default))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{title} ({len(items)})")
    for c in columns:
        table.add_column(c)
    for item in items:
        table.add_row(*to_row(item))
    Console(width=200).print(table)


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _record_json(record: Any) -> dict[str, Any]:
    return asdict(record)


def _t(value: datetime | None) -> str:
    return "-" if value is None else value.isoformat(timespec="seconds")


def _n(value: float | None, fmt: str = ".4g") -> str:
    return "-" if value is None else format(value, fmt)


def _text(value: str | None, width: int = 60) -> str:
    if not value:
        return "-"
    return value if len(value) <= width else value[: width - 1] + "…"


@history_app.command("windows")
def windows(
    url: UrlOption = None, config: ConfigOption = None, since: SinceOption = None,
    limit: LimitOption = 20, as_json: JsonOption = False,
) -> None:
    """Observed windows: load, outcomes, failed targets."""

    def to_json(sw: Any) -> dict[str, Any]:
        return {"id": sw.id, **sw.window.to_dict()}

    def to_row(sw: Any) -> list[str]:
        w = sw.window
        requests = sum(o.requests for o in w.outcomes)
        met = sum(o.met for o in w.outcomes)
        prefill, decode = w.roles.get("prefill"), w.roles.get("decode")
        return [
            str(sw.id), _t(datetime.fromtimestamp(w.start, tz=UTC)), _n(w.end - w.start, ".0f"),
            w.source or "-", str(len(w.workers)), str(len(w.failures)), _n(requests, ".0f"),
            _n(met / requests if requests else None, ".3f"),
            _n(prefill.ttft_s if prefill else None), _n(decode.tpot_s if decode else None),
        ]

    _run(
        url, config, since, as_json, lambda tx, s: tx.windows(since=s, limit=limit), to_json,
        ["id", "start (UTC)", "len s", "source", "workers", "failed", "requests", "goodput",
         "P ttft s", "D tpot s"],
        to_row, "windows",
    )


@history_app.command("policies")
def policies(
    url: UrlOption = None, config: ConfigOption = None, since: SinceOption = None,
    limit: LimitOption = 20, as_json: JsonOption = False,
) -> None:
    """Policy versions with status and reason."""

    def to_json(p: Any) -> dict[str, Any]:
        d = asdict(p)
        d["body"] = json.loads(d.pop("body_json"))
        return d

    _run(
        url, config, since, as_json, lambda tx, s: tx.policies(since=s, limit=limit), to_json,
        ["version", "status", "checksum", "created (UTC)", "updated (UTC)", "reason"],
        lambda p: [str(p.version), p.status, p.checksum[:12], _t(p.created_at),
                   _t(p.updated_at), _text(p.reason)],
        "policies",
    )


@history_app.command("calibrations")
def calibrations(
    url: UrlOption = None, config: ConfigOption = None, since: SinceOption = None,
    limit: LimitOption = 20, as_json: JsonOption = False,
) -> None:
    """Recalibrations: training windows, held-out error, predicted goodput."""
    _run(
        url, config, since, as_json, lambda tx, s: tx.calibrations(since=s, limit=limit),
        _record_json,
        ["id", "at (UTC)", "windows", "held-out error", "goodput new", "goodput current",
         "policy"],
        lambda c: [
            str(c.id), _t(c.created_at),
            f"{c.first_window_id}..{c.last_window_id} ({len(c.training_window_ids)})",
            _text(json.dumps(c.heldout_error), 40), _n(c.predicted_goodput_new, ".3f"),
            _n(c.predicted_goodput_current, ".3f"),
            "-" if c.policy_version is None else str(c.policy_version),
        ],
        "calibrations",
    )


@history_app.command("drift")
def drift(
    url: UrlOption = None, config: ConfigOption = None, since: SinceOption = None,
    limit: LimitOption = 20, as_json: JsonOption = False,
) -> None:
    """Drift events: kind, statistic vs threshold, the windows compared."""
    _run(
        url, config, since, as_json, lambda tx, s: tx.drift_events(since=s, limit=limit),
        _record_json,
        ["id", "at (UTC)", "kind", "statistic", "threshold", "windows", "details"],
        lambda e: [
            str(e.id), _t(e.at), e.kind, _n(e.statistic), _n(e.threshold),
            _text(",".join(map(str, e.window_ids)), 30),
            _text(None if e.details is None else json.dumps(e.details), 50),
        ],
        "drift events",
    )


@history_app.command("pushes")
def pushes(
    url: UrlOption = None, config: ConfigOption = None, since: SinceOption = None,
    limit: LimitOption = 20, as_json: JsonOption = False,
) -> None:
    """Policy pushes to routers: result, latency, error."""
    _run(
        url, config, since, as_json, lambda tx, s: tx.pushes(since=s, limit=limit),
        _record_json,
        ["id", "at (UTC)", "router", "version", "result", "latency ms", "error"],
        lambda p: [
            str(p.id), _t(p.at), p.router_id, str(p.version), p.result,
            _n(None if p.latency_s is None else p.latency_s * 1e3, ".2f"), _text(p.error),
        ],
        "pushes",
    )


@history_app.command("requests")
def requests(
    url: UrlOption = None, config: ConfigOption = None, since: SinceOption = None,
    limit: LimitOption = 20, as_json: JsonOption = False,
) -> None:
    """Operator requests (recalibrate, rollback, pause, resume): who, when, outcome."""
    _run(
        url, config, since, as_json, lambda tx, s: tx.requests(since=s, limit=limit),
        _record_json,
        ["id", "at (UTC)", "who", "kind", "args", "status", "outcome", "reason"],
        lambda r: [
            str(r.id), _t(r.created_at), r.who, r.kind, _text(json.dumps(r.args), 30),
            r.status, _text(r.outcome, 40), _text(r.reason, 40),
        ],
        "operator requests",
    )
