"""``pdctl history windows|policies|calibrations|drift|pushes|requests|recommendations``:
what the store holds.

Rows come oldest first (the newest ``--limit`` of them); ``--json`` prints a JSON list. Each
family is one :class:`Family`: how to fetch its records, how to turn one into JSON, and its
table columns; one renderer and one command factory serve them all. Records are rendered
as they are fetched (windows a chunk at a time), so a long history is not held in memory
whole: 5,000 windows as one JSON document had taken 7.3 GB.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Annotated, Any

import typer

from controller.cli._app import app
from controller.cli.db_cmd import ConfigOption, UrlOption, store_url
from controller.cli.shown import shown

if TYPE_CHECKING:
    from controller.store import Store, Tx

history_app = typer.Typer(help="What the controller recorded (from the store).",
                          no_args_is_help=True)
app.add_typer(history_app, name="history")

SinceOption = Annotated[
    str | None,
    typer.Option(
        "--since", help="ISO time (2027-01-15T12:00:00Z) or an age: -30s, -15m, -1h, -2d, "
        "-1w (the minus is optional)."
    ),
]
LimitOption = Annotated[int, typer.Option("--limit", "-n", min=1, help="Newest N rows.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print a JSON list.")]
_EXIT_BAD_INPUT = 2
_EXIT_UNAVAILABLE = 3
_WINDOW_CHUNK = 100
_RELATIVE = re.compile(r"^-?(\d+(?:\.\d+)?)([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_since(text: str, now: datetime) -> datetime:
    """``-1h`` (relative to ``now``) or an ISO 8601 time (naive means UTC)."""
    m = _RELATIVE.match(text.strip())
    if m:
        try:
            return now - timedelta(seconds=float(m.group(1)) * _UNIT_S[m.group(2)])
        except OverflowError:  # an age beyond year 1: nothing is that old
            raise ValueError(f"--since {text!r}: an age beyond the calendar "
                             "(year 1); give a smaller one or leave --since out") from None
    try:
        t = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"--since {text!r}: expected an ISO time or an age like -30m, -1h, -2d, -1w"
        ) from None
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class Column:
    header: str
    cell: Callable[[Any], str]


@dataclass(frozen=True, slots=True)
class Family:
    """One ``pdctl history NAME`` command."""

    name: str
    help: str
    title: str  # the table's title; the row count is appended
    fetch: Callable[[Tx, datetime | None, int], Iterable[Any]]  # (tx, since, limit)
    columns: tuple[Column, ...]
    to_json: Callable[[Any], dict[str, Any]] = lambda record: asdict(record)


def _run(family: Family, url: str | None, config: Any, since: str | None, limit: int,
         as_json: bool) -> None:
    from controller.clock import WallClock
    from controller.errors import ControllerError
    from controller.store import Store

    clock = WallClock()
    try:  # bad input is exit 2 before the store is looked for (exit 3)
        start = None if since is None else parse_since(since, clock.utcnow())
    except ValueError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(_EXIT_BAD_INPUT) from None
    target = store_url(url, config, must_exist=True)
    rows: list[tuple[str, ...]] = []
    try:
        store: Store
        with Store(target, clock) as store:
            store.require_schema()
            with store.read() as tx:
                items = family.fetch(tx, start, limit)
                if as_json:
                    for chunk in _json_list(family.to_json(i) for i in items):
                        typer.echo(chunk, nl=False)
                    return
                rows = [tuple(c.cell(i) for c in family.columns) for i in items]
    except ControllerError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(_EXIT_UNAVAILABLE) from None
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{family.title} ({len(rows)})")
    for c in family.columns:
        table.add_column(c.header)
    for row in rows:  # store text, escaped for the terminal (and for rich's markup)
        table.add_row(*(shown(cell, markup=True) for cell in row))
    Console(width=200).print(table)


def _json_list(records: Iterable[dict[str, Any]]) -> Iterator[str]:
    """``json.dumps(list(records), indent=2)`` plus a newline, one record at a time. JSON
    escapes newlines inside strings, so indenting each record's lines by two is exact."""
    first = True
    for record in records:
        body = json.dumps(record, indent=2, default=_json_default).replace("\n", "\n  ")
        yield ("[\n  " if first else ",\n  ") + body
        first = False
    yield "[]\n" if first else "\n]\n"


def _windows(tx: Tx, since: datetime | None, limit: int) -> Iterator[Any]:
    """The windows a chunk at a time: each holds dozens of objects per worker and route."""
    ids = tx.window_ids(since=since, limit=limit)
    for i in range(0, len(ids), _WINDOW_CHUNK):
        yield from tx.windows_by_ids(ids[i:i + _WINDOW_CHUNK])


def _register(family: Family) -> None:
    def command(
        url: UrlOption = None, config: ConfigOption = None, since: SinceOption = None,
        limit: LimitOption = 20, as_json: JsonOption = False,
    ) -> None:
        _run(family, url, config, since, limit, as_json)

    command.__name__ = family.name
    command.__doc__ = family.help
    history_app.command(family.name)(command)


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


# -- the families ------------------------------------------------------------------------


def _window_json(sw: Any) -> dict[str, Any]:
    return {"id": sw.id, **sw.window.to_dict()}


def _requests_in(sw: Any) -> float:
    return float(sum(o.requests for o in sw.window.outcomes))


def _goodput(sw: Any) -> str:
    requests = _requests_in(sw)
    met = sum(o.met for o in sw.window.outcomes)
    return _n(met / requests if requests else None, ".3f")


def _role_value(sw: Any, role: str, attr: str) -> str:
    stats = sw.window.roles.get(role)
    return _n(getattr(stats, attr) if stats else None)


def _policy_json(p: Any) -> dict[str, Any]:
    d = asdict(p)
    d["body"] = json.loads(d.pop("body_json"))
    return d


def _calibration_policy(c: Any) -> str:
    """Its version; a refused candidate (kept with it, no version) or nothing stored."""
    if c.policy_version is not None:
        return str(c.policy_version)
    return "refused, kept" if c.candidate_body_json is not None else "-"


def _calibration_json(c: Any) -> dict[str, Any]:
    """The record, with a refused candidate's policy as JSON (``candidate``; null when the
    calibration kept none)."""
    d = asdict(c)
    body = d.pop("candidate_body_json")
    d["candidate"] = None if body is None else json.loads(body)
    return d


def _window_range(first: int | None, last: int | None, ids: Sequence[int]) -> str:
    return f"{first}..{last} ({len(ids)})"


def _shape(rec: Any, role: str) -> str:
    """``3 (now 2)``: the recommended count, and the observed one when it differed."""
    now = rec.current_prefill if role == "prefill" else rec.current_decode
    want = rec.workers(role)
    return str(want) if now in (None, want) else f"{want} (now {now})"


FAMILIES = (
    Family(
        "windows", "Observed windows: load, outcomes, failed targets.", "windows",
        _windows,
        (
            Column("id", lambda sw: str(sw.id)),
            Column("start (UTC)", lambda sw: _t(datetime.fromtimestamp(sw.window.start, tz=UTC))),
            Column("len s", lambda sw: _n(sw.window.end - sw.window.start, ".0f")),
            Column("source", lambda sw: sw.window.source or "-"),
            Column("workers", lambda sw: str(len(sw.window.workers))),
            Column("failed", lambda sw: str(len(sw.window.failures))),
            Column("requests", lambda sw: _n(_requests_in(sw), ".0f")),
            Column("goodput", _goodput),
            Column("P ttft s", lambda sw: _role_value(sw, "prefill", "ttft_s")),
            Column("D tpot s", lambda sw: _role_value(sw, "decode", "tpot_s")),
        ),
        _window_json,
    ),
    Family(
        "policies", "Policy versions with status and reason.", "policies",
        lambda tx, s, n: tx.policies(since=s, limit=n),
        (
            Column("version", lambda p: str(p.version)),
            Column("status", lambda p: p.status),
            Column("checksum", lambda p: p.checksum[:12]),
            Column("created (UTC)", lambda p: _t(p.created_at)),
            Column("updated (UTC)", lambda p: _t(p.updated_at)),
            Column("promoted (UTC)", lambda p: _t(p.promoted_at)),
            Column("reason", lambda p: _text(p.reason)),
        ),
        _policy_json,
    ),
    Family(
        "calibrations", "Recalibrations: training windows, held-out error, predicted goodput.",
        "calibrations",
        lambda tx, s, n: tx.calibrations(since=s, limit=n),
        (
            Column("id", lambda c: str(c.id)),
            Column("at (UTC)", lambda c: _t(c.created_at)),
            Column("windows", lambda c: _window_range(c.first_window_id, c.last_window_id,
                                                      c.training_window_ids)),
            Column("held-out error", lambda c: _text(json.dumps(c.heldout_error), 40)),
            Column("goodput new", lambda c: _n(c.predicted_goodput_new, ".3f")),
            Column("goodput current", lambda c: _n(c.predicted_goodput_current, ".3f")),
            Column("policy", _calibration_policy),
        ),
        _calibration_json,
    ),
    Family(
        "drift", "Drift events: kind, statistic vs threshold, the windows compared.",
        "drift events",
        lambda tx, s, n: tx.drift_events(since=s, limit=n),
        (
            Column("id", lambda e: str(e.id)),
            Column("at (UTC)", lambda e: _t(e.at)),
            Column("kind", lambda e: e.kind),
            Column("statistic", lambda e: _n(e.statistic)),
            Column("threshold", lambda e: _n(e.threshold)),
            Column("windows", lambda e: _text(",".join(map(str, e.window_ids)), 30)),
            Column("details", lambda e: _text(
                None if e.details is None else json.dumps(e.details), 50)),
        ),
    ),
    Family(
        "pushes", "Policy pushes to routers: result, latency, error.", "pushes",
        lambda tx, s, n: tx.pushes(since=s, limit=n),
        (
            Column("id", lambda p: str(p.id)),
            Column("at (UTC)", lambda p: _t(p.at)),
            Column("router", lambda p: p.router_id),
            Column("version", lambda p: str(p.version)),
            Column("result", lambda p: p.result),
            Column("latency ms", lambda p: _n(
                None if p.latency_s is None else p.latency_s * 1e3, ".2f")),
            Column("error", lambda p: _text(p.error)),
        ),
    ),
    Family(
        "requests",
        "Operator requests (recalibrate, rollback, pause, resume): who, when, outcome.",
        "operator requests",
        lambda tx, s, n: tx.requests(since=s, limit=n),
        (
            Column("id", lambda r: str(r.id)),
            Column("at (UTC)", lambda r: _t(r.created_at)),
            Column("who", lambda r: r.who),
            Column("kind", lambda r: r.kind),
            Column("args", lambda r: _text(json.dumps(r.args), 30)),
            Column("status", lambda r: r.status),
            Column("outcome", lambda r: _text(r.outcome, 40)),
            Column("reason", lambda r: _text(r.reason, 40)),
        ),
    ),
    Family(
        "recommendations",
        "Capacity recommendations: prefill and decode workers, the constraint that binds each "
        "side, utilisation at the recommendation, and whether the cluster reached it "
        "(--json: with the plan's inputs and explanation).",
        "capacity recommendations",
        lambda tx, s, n: tx.recommendations(since=s, limit=n),
        (
            Column("id", lambda r: str(r.id)),
            Column("at (UTC)", lambda r: _t(r.created_at)),
            Column("windows", lambda r: _window_range(r.first_window_id, r.last_window_id,
                                                      r.window_ids)),
            Column("prefill", lambda r: _shape(r, "prefill")),
            Column("P binding", lambda r: _text(r.prefill_binding, 24)),
            Column("P util", lambda r: _n(r.prefill_utilisation, ".2f")),
            Column("decode", lambda r: _shape(r, "decode")),
            Column("D binding", lambda r: _text(r.decode_binding, 24)),
            Column("D util", lambda r: _n(r.decode_utilisation, ".2f")),
            Column("applied (UTC)", lambda r: _t(r.applied_at)),
        ),
    ),
)

for _family in FAMILIES:
    _register(_family)
