"""Operator commands: ``pdctl status`` and the requests the daemon's leader acts on.

``pdctl pause|resume|pin VERSION|unpin|fallback prefill|rollback [VERSION]|exploration
on|off|recalibrate`` each write ONE operator request to the store with who (``--who``,
default ``$USER@hostname``), when and why (``--reason``); the leader claims it in its next
cycle and records the outcome. ``--wait`` polls for that outcome (bounded by
``--timeout``). ``recalibrate --local`` instead fits here, on the stored windows, and
prints the candidate without storing anything.

Exit codes: 0 done, 1 the daemon refused the request, 2 bad input, 3 store unavailable,
4 ``--wait`` timed out.
"""

from __future__ import annotations

import json
import os
import pwd
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from controller.cli._app import app, load_settings_or_exit, table_console
from controller.cli.shown import shown, shown_doc
from controller.policy.validation import MAX_VERSION

if TYPE_CHECKING:
    from controller.store import Store

_EXIT_REFUSED = 1
_EXIT_BAD_INPUT = 2
_EXIT_UNAVAILABLE = 3
_EXIT_TIMEOUT = 4

ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="Config file ([store], [controller]).")
]
UrlOption = Annotated[str | None, typer.Option("--url", help="Database URL (overrides config).")]
ReasonOption = Annotated[str, typer.Option("--reason", "-m", help="Why (kept with the request).")]
WhoOption = Annotated[
    str | None, typer.Option("--who", help="Who asks (default: $USER@hostname).")
]
WaitOption = Annotated[
    bool, typer.Option("--wait", help="Wait for the daemon's outcome (bounded by --timeout).")
]
TimeoutOption = Annotated[float, typer.Option(
    "--timeout", min=0, help="Seconds --wait waits; after them the request stays pending and "
    "the leader still acts on it.")]
# Shown under each request command's --help (scripts branch on them).
EXIT_CODES = ("Exit codes: 0 done, 1 the daemon refused the request, 2 bad input, 3 store "
              "unavailable, 4 --wait timed out (the request stays pending).")
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON.")]


def default_who() -> str:
    """``$USER@hostname``; without $USER or $LOGNAME (a `kubectl exec` shell, a cron job) the
    account of the process's uid, so the audit trail still names someone."""
    user = os.environ.get("USER") or os.environ.get("LOGNAME")
    if not user:
        try:
            user = pwd.getpwuid(os.getuid()).pw_name
        except KeyError:  # an arbitrary uid with no passwd entry (OpenShift, some pods)
            user = f"uid{os.getuid()}"
    return f"{user}@{socket.gethostname()}"


def open_store(url: str | None, config: Path | None) -> Store:
    """The store of ``--url`` or the config, migrated; exits 3 when it is unavailable or
    has no schema."""
    from controller.cli.db_cmd import store_url
    from controller.errors import TransientError
    from controller.store import Store, StoreError

    store = Store(store_url(url, config, must_exist=True))
    try:
        store.require_schema()
    except StoreError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(_EXIT_UNAVAILABLE) from None
    except TransientError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(_EXIT_UNAVAILABLE) from None
    return store


def _submit(
    kind: str, args: dict[str, Any], *, reason: str, who: str | None, wait: bool,
    timeout: float, as_json: bool, url: str | None, config: Path | None,
) -> None:
    from controller.clock import WallClock

    clock = WallClock()
    store = open_store(url, config)
    try:
        request_id = store.add_request(kind, args, who or default_who(), reason)
        request = store.request(request_id)
        deadline = clock.monotonic() + timeout
        while wait and request is not None and request.status in ("pending", "claimed"):
            if clock.monotonic() >= deadline:
                break
            time.sleep(0.25)  # a CLI poll, not control logic
            request = store.request(request_id)
    finally:
        store.close()
    assert request is not None
    if as_json:
        typer.echo(json.dumps(_request_json(request), default=str))
    else:
        typer.echo(shown(request_line(request)))
    if wait and request.status in ("pending", "claimed"):
        if not as_json:
            typer.echo(f"no outcome within {timeout:g} s: request #{request.id} is still "
                       f"{request.status} and the leader acts on it when it next cycles (is "
                       "`pdctl run` running?); `pdctl history requests` shows its outcome",
                       err=True)
        raise typer.Exit(_EXIT_TIMEOUT)
    if request.status == "failed":
        raise typer.Exit(_EXIT_REFUSED)


def request_line(r: Any) -> str:
    """A request and its outcome in one line. A done dry run reads as what it would have
    done ("dry run: would approve …"), never "done — approved": it approved nothing (an
    outcome recorded by a daemon that wrote the guardrail's bare verdict is worded so too)."""
    from controller.loop.write import DRY_RUN_PREFIX, dry_run_verdict

    head = f"request #{r.id} {r.kind} {json.dumps(r.args)} by {r.who}"
    if r.kind == "recalibrate" and (r.args or {}).get("dry_run") and r.status == "done" \
            and r.outcome:
        outcome = r.outcome
        if not outcome.startswith(DRY_RUN_PREFIX):
            approved = outcome.startswith(("approved", "forced", "no current policy"))
            outcome = dry_run_verdict(approved, outcome)
        return f"{head}: {outcome}"
    return f"{head}: {r.status}" + (f" — {r.outcome}" if r.outcome else "")


def _request_json(r: Any) -> dict[str, Any]:
    return {"id": r.id, "kind": r.kind, "args": r.args, "who": r.who, "reason": r.reason,
            "status": r.status, "outcome": r.outcome, "created_at": r.created_at,
            "claimed_by": r.claimed_by, "finished_at": r.finished_at}


@app.command("pause", epilog=EXIT_CODES)
def pause(reason: ReasonOption = "", who: WhoOption = None, wait: WaitOption = False,
          timeout: TimeoutOption = 60.0, as_json: JsonOption = False, url: UrlOption = None,
          config: ConfigOption = None) -> None:
    """Stop approvals and pushes until `pdctl resume`."""
    _submit("pause", {"what": "approvals"}, reason=reason, who=who, wait=wait,
            timeout=timeout, as_json=as_json, url=url, config=config)


@app.command("resume", epilog=EXIT_CODES)
def resume(reason: ReasonOption = "", who: WhoOption = None, wait: WaitOption = False,
           timeout: TimeoutOption = 60.0, as_json: JsonOption = False, url: UrlOption = None,
           config: ConfigOption = None) -> None:
    """Restart approvals and pushes after `pdctl pause`."""
    _submit("resume", {"what": "approvals"}, reason=reason, who=who, wait=wait,
            timeout=timeout, as_json=as_json, url=url, config=config)


@app.command("pin", epilog=EXIT_CODES)
def pin(version: Annotated[int, typer.Argument(help="An approved policy version.", min=1,
                                                max=MAX_VERSION)],
        reason: ReasonOption = "", who: WhoOption = None, wait: WaitOption = False,
        timeout: TimeoutOption = 60.0, as_json: JsonOption = False, url: UrlOption = None,
        config: ConfigOption = None) -> None:
    """Put VERSION on every router and hold it (no approvals) until `pdctl unpin`."""
    _submit("pause", {"what": "pin", "version": version}, reason=reason, who=who, wait=wait,
            timeout=timeout, as_json=as_json, url=url, config=config)


@app.command("unpin", epilog=EXIT_CODES)
def unpin(reason: ReasonOption = "", who: WhoOption = None, wait: WaitOption = False,
          timeout: TimeoutOption = 60.0, as_json: JsonOption = False, url: UrlOption = None,
          config: ConfigOption = None) -> None:
    """Release a pin (or a fallback): approvals resume."""
    _submit("resume", {"what": "pin"}, reason=reason, who=who, wait=wait, timeout=timeout,
            as_json=as_json, url=url, config=config)


@app.command("fallback", epilog=EXIT_CODES)
def fallback(target: Annotated[str, typer.Argument(help="Only `prefill` (all-prefill-node).")],
             reason: ReasonOption = "", who: WhoOption = None, wait: WaitOption = False,
             timeout: TimeoutOption = 60.0, as_json: JsonOption = False,
             url: UrlOption = None, config: ConfigOption = None) -> None:
    """A safe all-prefill-node policy to every router at once, held until `pdctl unpin`."""
    if target != "prefill":
        typer.echo("the only fallback is `prefill`", err=True)
        raise typer.Exit(_EXIT_BAD_INPUT)
    _submit("rollback", {"to": "fallback-prefill"}, reason=reason, who=who, wait=wait,
            timeout=timeout, as_json=as_json, url=url, config=config)


@app.command("rollback", epilog=EXIT_CODES)
def rollback(
    version: Annotated[int | None, typer.Argument(
        help="Approved version to return to (default: the one before the newest).", min=1,
        max=MAX_VERSION)
    ] = None,
    reason: ReasonOption = "", who: WhoOption = None, wait: WaitOption = False,
    timeout: TimeoutOption = 60.0, as_json: JsonOption = False, url: UrlOption = None,
    config: ConfigOption = None,
) -> None:
    """Roll every router back to VERSION (newer approved versions become rolled_back)."""
    _submit("rollback", {"version": version}, reason=reason, who=who, wait=wait,
            timeout=timeout, as_json=as_json, url=url, config=config)


@app.command("exploration", epilog=EXIT_CODES)
def exploration(state: Annotated[str, typer.Argument(help="on | off")],
                reason: ReasonOption = "", who: WhoOption = None, wait: WaitOption = False,
                timeout: TimeoutOption = 60.0, as_json: JsonOption = False,
                url: UrlOption = None, config: ConfigOption = None) -> None:
    """Turn per-cell exploration off (the running policy is re-issued without it) or on."""
    if state not in ("on", "off"):
        typer.echo("exploration takes `on` or `off`", err=True)
        raise typer.Exit(_EXIT_BAD_INPUT)
    _submit("pause" if state == "off" else "resume", {"what": "exploration"}, reason=reason,
            who=who, wait=wait, timeout=timeout, as_json=as_json, url=url, config=config)


@app.command("recalibrate", epilog=EXIT_CODES)
def recalibrate(
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Fit and judge, store the calibration, approve nothing; the outcome "
        "says what it would have done (\"dry run: would approve …\" or \"would reject …\").")
    ] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="Approve even if the guardrail would refuse.")] = False,
    local: Annotated[bool, typer.Option(
        "--local", help="Fit here on the stored windows and print; writes nothing.")] = False,
    active: Annotated[bool, typer.Option(
        "--active", help="With --local and --openai: the cold-start active calibration "
        "(`pdctl calibrate-active` with its defaults).")] = False,
    openai: Annotated[list[str] | None, typer.Option(
        "--openai", help="OpenAI-compatible base URL for --active (repeatable).")] = None,
    reason: ReasonOption = "", who: WhoOption = None, wait: WaitOption = False,
    timeout: TimeoutOption = 300.0, as_json: JsonOption = False, url: UrlOption = None,
    config: ConfigOption = None,
) -> None:
    """Ask the leader to recalibrate now, or fit locally (--local)."""
    if active:
        if not local or config is None or not openai:
            typer.echo("--active runs here: it needs --local, --config and --openai URL",
                       err=True)
            raise typer.Exit(_EXIT_BAD_INPUT)
        from controller.cli.active_cmd import calibrate_active

        calibrate_active(config=config, openai=openai, as_json=as_json)
        return
    if local:
        _recalibrate_local(url, config, as_json, force)
        return
    _submit("recalibrate", {"dry_run": dry_run, "force": force}, reason=reason, who=who,
            wait=wait, timeout=timeout, as_json=as_json, url=url, config=config)


def _recalibrate_local(url: str | None, config: Path | None, as_json: bool, force: bool
                       ) -> None:
    from controller.loop.learning import CoreLearner, LearnerError
    from controller.loop.policies import read_rollout
    from controller.policy import loads

    settings = load_settings_or_exit(config)
    store = open_store(url, config)
    try:
        with store.read() as tx:
            stored = tx.windows(limit=settings.controller.training_windows)
            rollout = read_rollout(tx)
            rec = tx.policy(rollout.fleet_version) if rollout.fleet_version else None
        current = loads(rec.body_json) if rec is not None else None
        windows = [s.window for s in stored if not s.window.failures and s.window.outcomes]
        try:
            outcome = CoreLearner(settings).calibrate(
                windows, current, store.clock.now(), "pdctl recalibrate --local", force)
        except LearnerError as e:
            typer.echo(f"cannot calibrate: {e}", err=True)
            raise typer.Exit(_EXIT_REFUSED) from None
    finally:
        store.close()
    doc = {"approved": outcome.approved, "reason": outcome.reason,
           "predicted_goodput": {"current": outcome.predicted_goodput_current,
                                 "candidate": outcome.predicted_goodput_new},
           "heldout_error": outcome.heldout_error, "windows": len(windows)}
    if as_json:
        typer.echo(json.dumps(doc, default=str))
    else:
        typer.echo(f"{'approve' if outcome.approved else 'reject'}: {outcome.reason} "
                   f"({len(windows)} windows; nothing stored)")


# -- status ---------------------------------------------------------------------------


def status_doc(store: Store, calibrate_every_s: float | None,
               watch_s: float | None = None, configured: Sequence[str] = (),
               stalled_after_s: float | None = None) -> dict[str, Any]:
    """Everything `pdctl status` shows, as plain data. ``watch_s``: how long the cycle
    watches a promotion (None: no watch); ``stalled_after_s``: a newest window older than
    this is flagged stale (the leader has not observed since: Prometheus or the workers
    down, or no leader)."""
    from controller.core.rollout import operator_state
    from controller.store import PolicyKind, policy_kind

    now = store.clock.utcnow()
    s = _read_status(store, configured)
    ops = operator_state(s.done)
    fleet, rollout, latest, rolled_back, drift = (s.fleet, s.rollout, s.latest, s.rolled_back,
                                                  s.drift)
    last_cal, next_due = _last_calibration(s.cal, s.cal_policy, calibrate_every_s)
    return {
        "now": now,
        "leader": _leader(s.lease, now),
        "fleet_version": rollout.fleet_version,
        # A forced calibrate-active policy as the fleet's: only a calibrate-active run killed
        # before it sent the routers back leaves one.
        "fleet_forced": fleet is not None and policy_kind(fleet) is PolicyKind.FORCED,
        "canary": None if rollout.canary_version is None else {
            "version": rollout.canary_version, "routers": list(rollout.canary_routers)},
        "watch": _watch(fleet, now, watch_s),
        "newest_policy": None if not latest else {
            "version": latest[-1].version, "status": latest[-1].status,
            "reason": latest[-1].reason, "promoted_at": latest[-1].promoted_at},
        # The fleet's policy is the routers' own with exploration the daemon turned on
        # ([controller] adopted_exploration): the share, else None.
        "fleet_seeded_exploration": fleet.seeded_exploration if fleet is not None else None,
        # The newest version a canary, the promotion watch or an operator rolled back, and
        # why (the newest policy is often a later candidate by then).
        "last_rollback": None if not rolled_back else {
            "version": rolled_back[-1].version, "at": rolled_back[-1].updated_at,
            "reason": rolled_back[-1].reason},
        "routers": _router_rows(s.desired, s.routers, configured),
        "last_drift": None if not drift else {
            "at": drift[-1].at, "kind": drift[-1].kind, "statistic": drift[-1].statistic,
            "threshold": drift[-1].threshold},
        "last_calibration": last_cal,
        "operator": {"paused": ops.paused, "pinned": ops.pinned, "fallback": ops.fallback,
                     "exploration_off": ops.exploration_off,
                     "pending_requests": [_request_json(r) for r in s.pending]},
        "next_calibration_due": next_due,
        "observed": _observed(s.last_window_end, now, stalled_after_s),
    }


@dataclass(frozen=True, slots=True)
class _StatusRead:
    """What `pdctl status` reads from the store, in one read transaction."""

    lease: Any
    last_window_end: datetime | None
    rollout: Any
    desired: dict[str, int]
    routers: dict[str, Any]
    drift: list[Any]
    cal: list[Any]
    cal_policy: Any
    done: list[Any]
    pending: list[Any]
    latest: list[Any]
    rolled_back: list[Any]
    fleet: Any


def _read_status(store: Store, configured: Sequence[str]) -> _StatusRead:
    from controller.loop.policies import read_rollout

    with store.read() as tx:
        lease = tx.lease()
        last_window_end = tx.last_window_end()
        # The configured routers' rollout, as the cycle reads it: a router taken out of
        # [routers] targets keeps its rows, which must not hide the configured fleet's
        # canary or promotion watch.
        rollout = read_rollout(tx, list(configured) or None)
        desired = tx.desired_versions()
        routers = {r.router_id: r for r in tx.routers()}
        drift = tx.drift_events(limit=1)
        cal = tx.calibrations(limit=1)
        return _StatusRead(
            lease=lease, last_window_end=last_window_end, rollout=rollout, desired=desired,
            routers=routers, drift=drift, cal=cal,
            cal_policy=(tx.policy(cal[-1].policy_version)
                        if cal and cal[-1].policy_version is not None else None),
            done=tx.requests(status="done"),
            pending=tx.requests(status="pending") + tx.requests(status="claimed"),
            latest=tx.policies(limit=1), rolled_back=tx.policies(limit=1, status="rolled_back"),
            fleet=(tx.policy(rollout.fleet_version) if rollout.fleet_version is not None
                   else None))


def _watch(fleet: Any, now: datetime, watch_s: float | None) -> dict[str, Any] | None:
    """The promotion watch on the fleet's policy while it lasts, else None."""
    from datetime import timedelta

    if fleet is None or fleet.promoted_at is None or not watch_s:
        return None
    until = fleet.promoted_at + timedelta(seconds=watch_s)
    if fleet.promoted_at <= now <= until:
        return {"version": fleet.version, "promoted_at": fleet.promoted_at, "until": until}
    return None


def _leader(lease: Any, now: datetime) -> dict[str, Any] | None:
    if lease is None or lease.holder is None or lease.expires_at is None:
        return None
    return {"holder": lease.holder, "term": lease.term,
            "expires_in_s": round((lease.expires_at - now).total_seconds(), 1),
            "alive": lease.expires_at > now}


def _router_rows(desired: dict[str, int], routers: dict[str, Any],
                 configured: Sequence[str]) -> list[dict[str, Any]]:
    rows = []
    # The config's routers too: on a new store they have no row yet, and the table must
    # not read as "no routers".
    for rid in sorted(set(desired) | set(routers) | set(configured)):
        r = routers.get(rid)
        want = desired.get(rid)
        acked = r.acked_version if r else None
        healthy = r is not None and r.last_error is None and acked == want
        rows.append({
            "router": rid, "desired": want, "acked": acked,
            "last_seen": r.last_seen if r else None,
            "last_error": r.last_error if r else None,
            "health": "not in [routers] targets" if configured and rid not in configured
            else "ok" if healthy else ("error" if r and r.last_error else
                                       "no policy yet" if want is None and r is None
                                       else "behind"),
        })
    return rows


def _last_calibration(cal: list[Any], cal_policy: Any, calibrate_every_s: float | None
                      ) -> tuple[dict[str, Any] | None, datetime | None]:
    """The newest calibration as `pdctl status` shows it, and when the next one is due."""
    from datetime import timedelta

    if not cal:
        return None, None
    c = cal[-1]
    details = c.details or {}
    last_cal = {"id": c.id, "at": c.created_at, "policy_version": c.policy_version,
                "trigger": details.get("trigger"), "approved": details.get("approved"),
                # what became of its policy: "candidate" while an operator or a bake
                # held it, "rejected", "approved", later "superseded" or "rolled_back"
                # (a refused candidate kept with its calibration took no version)
                "policy_status": cal_policy.status if cal_policy is not None
                else "rejected" if c.rejected_candidate else None,
                "reason": details.get("reason"),
                # why no policy was stored: a dry run, or a canary refit whose bake an
                # operator action ended in the same cycle
                "not_stored": None if c.policy_version is not None else
                details.get("not_stored") or ("dry run" if details.get("dry_run") else None),
                "predicted_goodput": {"current": c.predicted_goodput_current,
                                      "candidate": c.predicted_goodput_new}}
    next_due = (c.created_at + timedelta(seconds=calibrate_every_s)
                if calibrate_every_s is not None else None)
    return last_cal, next_due


def _observed(end: datetime | None, now: datetime, stalled_after_s: float | None
              ) -> dict[str, Any]:
    if end is None:
        return {"last_window_end": None, "age_s": None, "stale": None}
    age = (now - end).total_seconds()
    return {"last_window_end": end, "age_s": round(age, 1),
            "stale": None if stalled_after_s is None else age > stalled_after_s}


def _t(value: datetime | None) -> str:
    return "—" if value is None else value.strftime("%Y-%m-%d %H:%M:%S UTC")


def _print_seeded(console: Any, doc: dict[str, Any]) -> None:
    """The fleet's policy is the routers' own with exploration the daemon turned on."""
    if doc.get("fleet_seeded_exploration") is not None:
        console.print(f"[bold]explore[/]  v{doc['fleet_version']} is the routers' own policy "
                      f"with exploration {doc['fleet_seeded_exploration']:g} in every cell, "
                      "turned on by the daemon ([controller] adopted_exploration) so that it "
                      "measures the route the routers never take")


def _print_status(doc: dict[str, Any]) -> None:
    from rich.table import Table

    console = table_console()
    leader = doc["leader"]
    console.print(
        f"[bold]leader[/]   {leader['holder']} (term {leader['term']}, lease "
        f"{'expires in' if leader['alive'] else 'EXPIRED'} {abs(leader['expires_in_s'])} s)"
        if leader else "[bold]leader[/]   none"
    )
    canary = doc["canary"]
    console.print(f"[bold]desired[/]  v{doc['fleet_version']}" if doc["fleet_version"]
                  else "[bold]desired[/]  no policy yet", end="")
    console.print(f"  canary v{canary['version']} on {', '.join(canary['routers'])}"
                  if canary else "")
    _print_seeded(console, doc)
    if doc["fleet_forced"]:
        console.print(f"[bold red]forced[/]   v{doc['fleet_version']} is a forced "
                      "`pdctl calibrate-active` policy that a killed run left behind: run "
                      "it again (a failed run ends on classic P/D) or `pdctl fallback "
                      "prefill` with the daemon running")
    watch = doc.get("watch")
    if watch:
        console.print(f"[bold]watch[/]    v{watch['version']} promoted at "
                      f"{_t(watch['promoted_at'])}: rolled back if the fleet's goodput falls, "
                      f"until {_t(watch['until'])}")
    table = Table("router", "desired", "acked", "health", "last seen", "last error")
    for r in doc["routers"]:
        table.add_row(r["router"], str(r["desired"] or "—"), str(r["acked"] or "—"),
                      r["health"], _t(r["last_seen"]), (r["last_error"] or "")[:60])
    console.print(table)
    back = doc["last_rollback"]
    if back:
        console.print(f"[bold]rollback[/] v{back['version']} at {_t(back['at'])}: "
                      f"{back['reason']}")
    drift = doc["last_drift"]
    console.print(f"[bold]drift[/]    {drift['kind']} {drift['statistic']:.3g} > "
                  f"{drift['threshold']:.3g} at {_t(drift['at'])}" if drift
                  else "[bold]drift[/]    none recorded")
    _print_calibration(console, doc["last_calibration"])
    _print_operator_and_observed(console, doc)


def _print_calibration(console: Any, cal: dict[str, Any] | None) -> None:
    if cal:
        verdict = ("held as a candidate" if cal.get("policy_status") == "candidate" else
                   "approved" if cal["approved"] else "not approved")
        what = (f"v{cal['policy_version']}" if cal["policy_version"] is not None
                else "(its candidate kept, no version: `pdctl table show --calibration "
                f"{cal['id']}`)" if cal.get("policy_status") == "rejected"
                else f"(not stored: {cal['not_stored'] or 'no policy'})")
        console.print(f"[bold]calib.[/]   #{cal['id']} at {_t(cal['at'])} ({cal['trigger']}): "
                      f"{verdict} {what} — {cal['reason']}")
    else:
        console.print("[bold]calib.[/]   none yet")


def _print_operator_and_observed(console: Any, doc: dict[str, Any]) -> None:
    ops = doc["operator"]
    flags = [name for name, on in (("PAUSED", ops["paused"]), ("FALLBACK", ops["fallback"]),
                                   ("exploration off", ops["exploration_off"])) if on]
    if ops["pinned"]:
        flags.append(f"PINNED v{ops['pinned']}")
    console.print(f"[bold]operator[/] {', '.join(flags) or 'normal'}; "
                  f"{len(ops['pending_requests'])} request(s) pending")
    console.print(f"[bold]next due[/] {_t(doc['next_calibration_due'])}")
    seen = doc["observed"]
    console.print(
        "[bold]observed[/] no window stored yet" if seen["last_window_end"] is None else
        f"[bold]observed[/] last window ended at {_t(seen['last_window_end'])} "
        f"({seen['age_s']:.0f} s ago)" + (
            "  [bold red]STALE[/]: the leader has not observed since (see the daemon's "
            "`cycle skipped` log lines)" if seen["stale"] else ""))


@app.command("status")
def status(as_json: JsonOption = False, url: UrlOption = None, config: ConfigOption = None
           ) -> None:
    """One screen: leader, desired versions (and a promotion under watch, and the exploration
    the daemon turned on in an adopted policy that explored nowhere), each router's
    acked version and health, last drift event, last calibration, operator state, next
    scheduled calibration, and when the newest window ended (STALE past
    [controller] stalled_after_s: nothing has been observed since)."""
    from controller.config import load_settings
    from controller.errors import ConfigError
    from controller.loop.cycle import CycleConfig

    try:
        settings = load_settings(config)
    except ConfigError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(_EXIT_BAD_INPUT) from None
    store = open_store(url, config)
    try:
        doc = status_doc(store, settings.controller.calibrate_every_s,
                         CycleConfig.from_settings(settings).watch_s,
                         settings.routers.targets, settings.controller.stalled_after())
    finally:
        store.close()
    if as_json:
        typer.echo(json.dumps(doc, default=str, indent=1))
    else:
        _print_status(shown_doc(doc, markup=True))  # store and peer text, escaped
