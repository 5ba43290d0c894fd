"""``pdctl explain`` and ``pdctl drift``: what the learned model says, read from the store.

Both start from the calibration the routers run: the calibration stored for the fleet's (or
the baking canary's) policy version, else the newest calibration in the store. The latency
model itself is not stored, so it is refitted here on that calibration's stored training
windows with the same settings the daemon's learner uses (the fit is deterministic: same
windows, same seed, same model). ``explain`` then predicts under the load the stored policy
creates; ``drift`` replays the three detectors from the calibration's stored drift reference
over the windows stored since.

Exit codes: 0 done, 2 bad input or no calibration stored yet, 3 store unavailable.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from controller.cli._app import app, load_settings_or_exit, table_console
from controller.cli.shown import shown_doc

if TYPE_CHECKING:
    from controller.config import Settings
    from controller.core.calibrate import CalibrationResult
    from controller.core.window import Window
    from controller.policy import Policy
    from controller.store import Store, Tx
    from controller.store.records import CalibrationRecord, StoredWindow

_EXIT_BAD_INPUT = 2

ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="Config file ([store], [slo], [ppd]).")
]
UrlOption = Annotated[str | None, typer.Option("--url", help="Database URL (overrides config).")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON.")]


class NoCalibration(Exception):
    """The store holds no calibration (or none with usable training windows)."""


@dataclass(frozen=True, slots=True)
class Learned:
    """A stored calibration with its model refitted."""

    record: CalibrationRecord
    policy: Policy | None  # the stored policy of that calibration (None: a dry run)
    windows: list[Window]  # its training windows, oldest first
    result: CalibrationResult  # refit; ``policy``/``predictions`` are the stored policy's


def chosen_calibration(store: Store, calibration_id: int
                       ) -> tuple[CalibrationRecord, Policy | None, list[StoredWindow]]:
    """Calibration ``calibration_id`` with the policy it produced: its version's, or the
    candidate the guardrail refused (kept with it, no version); None for a dry run."""
    with store.read() as tx:
        record = tx.calibration(calibration_id)
        if record is None:
            raise NoCalibration(f"no calibration #{calibration_id} in the store")
        policy = _produced(tx, record)
        stored = tx.windows_by_ids(record.training_window_ids)
    return record, policy, stored


def _produced(tx: Tx, record: CalibrationRecord) -> Policy | None:
    """The policy a calibration produced: its version's, or its refused candidate."""
    from controller.policy import loads

    if record.candidate_body_json is not None:
        return loads(record.candidate_body_json)
    own = tx.policy(record.policy_version) if record.policy_version is not None else None
    return loads(own.body_json) if own is not None else None


def current_calibration(store: Store) -> tuple[CalibrationRecord, Policy | None,
                                               list[StoredWindow]]:
    """The version the routers should run (the baking canary's, else the fleet's) with the
    calibration its table came from: its own; for a version with none of its own (re-issued
    above a router that was ahead, exploration turned off, a fallback) the newest stored
    before it whose policy routes alike, else the newest stored before it — not a later
    candidate the guardrail refused; for an adopted version, with no calibration before it,
    the newest one (the routers' table, judged by the newest model). With no version desired
    yet, the newest calibration and its own policy."""
    from controller.loop.policies import read_rollout
    from controller.policy import loads
    from controller.store.repository import LINEAGE_LOOKBACK

    with store.read() as tx:
        rollout = read_rollout(tx)
        version = rollout.canary_version or rollout.fleet_version
        rec = tx.policy(version) if version is not None else None
        running = loads(rec.body_json) if rec is not None else None
        record = tx.calibration_for(version) if version is not None else None
        if record is None:
            before = tx.calibrations(limit=LINEAGE_LOOKBACK,
                                     until=rec.created_at if rec is not None else None)
            record = next((c for c in reversed(before) if running is not None
                           and _routes_alike(tx, c, running)), None) \
                or (before[-1] if before else None)
        if record is None and version is not None:
            # An adopted version (the routers' own policy on a first start) has no
            # calibration before it: explain it with the newest model fitted since.
            since = tx.calibrations(limit=1)
            record = since[-1] if since else None
        if record is None:
            raise NoCalibration("the store holds no calibration yet (run the daemon, "
                                "`pdctl recalibrate` or `pdctl calibrate-active` first)")
        if running is None:
            running = _produced(tx, record)
        stored = tx.windows_by_ids(record.training_window_ids)
    return record, running, stored


def _routes_alike(tx: Tx, record: CalibrationRecord, policy: Policy) -> bool:
    """The calibration's policy (its version's, or its refused candidate) routes every cell
    as ``policy`` does."""
    produced = _produced(tx, record)
    if produced is None:
        return False
    table = produced.table
    return table.axes == policy.table.axes and table.routes == policy.table.routes


def refit(store: Store, settings: Settings, calibration_id: int | None = None) -> Learned:
    """The current calibration (or calibration ``calibration_id``) with its model refitted
    on its stored training windows."""
    from controller.core.calibrate import (
        CalibrationError,
        calibrate,
        local_share,
        policy_routes_on,
        predicted_goodput,
        score_terms,
    )
    from controller.loop.learning import calibration_config

    record, policy, stored = (current_calibration(store) if calibration_id is None
                              else chosen_calibration(store, calibration_id))
    windows = [s.window for s in stored]
    cfg = calibration_config(settings)
    try:
        result = calibrate(windows, record.created_at.timestamp(), None, cfg)
    except CalibrationError as e:
        raise NoCalibration(f"calibration #{record.id}: its stored training windows "
                            f"({len(windows)}) cannot be refitted: {e}") from None
    if policy is not None and policy.table.axes == cfg.axes:
        # Predict under the load the stored policy creates, not the refit's own candidate;
        # what its scores compared, as the calibration's fixed point does (no exploration).
        routes, exploration = policy_routes_on(policy, result.grid)
        _, pred = predicted_goodput(result.model, result.grid, routes, exploration, cfg.slo)
        scored = result.grid.scenario(local_share(routes, 0.0))
        terms = score_terms(result.model.predict(scored), scored)
        result = replace(result, policy=policy, predictions=pred, score_terms=terms)
    return Learned(record, policy, windows, result)


def settings_and_store(config: Path | None, url: str | None) -> tuple[Settings, Store]:
    from controller.cli.ops_cmd import open_store

    settings = load_settings_or_exit(config)
    return settings, open_store(url, config)


def learned_or_exit(store: Store, settings: Settings, calibration_id: int | None = None
                    ) -> Learned:
    try:
        return refit(store, settings, calibration_id)
    except NoCalibration as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(_EXIT_BAD_INPUT) from None


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


# -- explain ----------------------------------------------------------------------------


def explain_doc(learned: Learned, turn: int, context: float, append: float, output: float,
                qps: float) -> dict[str, Any]:
    """``controller.core.calibrate.explain`` plus the samples behind the cell."""
    from controller.core.calibrate import cell_uncertainty, explain
    from controller.core.features import build_training_set
    from controller.policy import Features

    result = learned.result
    features = Features(turn, context, append, output, qps)
    axes = result.policy.table.axes
    samples, spread, _ = cell_uncertainty(build_training_set(learned.windows),
                                           result.model, axes)
    doc = explain(result, features, rarer_route_requests=samples)
    if "cell" in doc:
        c = doc["cell"]
        idx = axes.cell_index(c["context_bin"], c["io_bin"], c["qps_bin"])
        doc["samples"] = {
            # Requests of the cell's less-measured route: what bounds the estimate.
            "rarer_route_requests": float(samples[idx]),
            # Spread (sd of log observed/predicted TTFT) of the cell's windows.
            "residual_spread": float(spread[idx]),
        }
    out: dict[str, Any] = _finite({
        "features": {"turn": turn, "context_tokens": context, "append_tokens": append,
                     "expected_output_tokens": output, "qps": qps},
        "calibration_id": learned.record.id,
        # The version decided with (the routers'), and the one the calibration produced;
        # a refused candidate (kept with its calibration) has none.
        "policy_version": None if learned.record.rejected_candidate
        else learned.policy.version if learned.policy is not None
        else learned.record.policy_version,
        "calibration_policy_version": learned.record.policy_version,
        "rejected_candidate": learned.record.rejected_candidate,
        "training_windows": len(learned.windows),
        **doc,
    })
    return out


@app.command("explain")
def explain_command(
    turn: Annotated[int, typer.Option("--turn", min=1, help="Turn number (1 = first).")],
    context: Annotated[float, typer.Option("--context", min=0, help="Context tokens.")],
    append: Annotated[float, typer.Option("--append", min=0, help="Append (new) tokens.")],
    output: Annotated[float, typer.Option("--output", min=1,
                                          help="Expected output tokens.")],
    qps: Annotated[float, typer.Option("--qps", min=0, help="Router QPS.")],
    calibration: Annotated[int | None, typer.Option(
        "--calibration", min=1, help="Explain with calibration ID and the policy it produced "
        "(a candidate the guardrail refused too), not the routers' current one.")] = None,
    as_json: JsonOption = False, url: UrlOption = None, config: ConfigOption = None,
) -> None:
    """Predicted TTFT/TPOT per route, score, weights, decision and confidence for a request."""
    settings, store = settings_and_store(config, url)
    try:
        learned = learned_or_exit(store, settings, calibration)
    finally:
        store.close()
    doc = explain_doc(learned, turn, context, append, output, qps)
    if as_json:
        typer.echo(json.dumps(doc))
        return
    doc = shown_doc(doc)  # reasons come from the store: escaped for the terminal
    running, produced = doc["policy_version"], doc["calibration_policy_version"]
    if doc["rejected_candidate"]:
        source = "its candidate, refused by the guardrail: no version"
    elif running is None:
        source = "no stored policy: a dry run"
    elif produced == running:
        source = f"v{running}"
    else:
        source = f"v{running}, learned for {'v' + str(produced) if produced else 'a dry run'}"
    typer.echo(f"calibration #{doc['calibration_id']} (policy {source}, "
               f"model refitted on {doc['training_windows']} stored windows)")
    w = doc["weights"]
    typer.echo(f"decision  {doc['decision']} ({doc['reason']}); weights wtft={w['wtft']:.3g} "
               f"wtpot={w['wtpot']:.3g}")
    if "cell" not in doc:
        return
    c = doc["cell"]
    typer.echo(f"cell      context bin {c['context_bin']}, io bin {c['io_bin']}, "
               f"qps bin {c['qps_bin']}")
    compared = doc.get("compared") or {}
    for route, p in doc["predicted"].items():
        line = f"{route:<13} TTFT {p['ttft_s'] * 1e3:8.1f} ms   TPOT {p['tpot_s'] * 1e3:7.2f} ms"
        if route in compared:  # with the cost each route puts on the other requests
            c = compared[route]
            line += (f"   scored as TTFT {c['ttft_s'] * 1e3:8.1f} ms   "
                     f"TPOT {c['tpot_s'] * 1e3:7.2f} ms")
        typer.echo(line)
    s = doc["samples"]
    spread = "n/a" if s["residual_spread"] is None else f"{s['residual_spread']:.3f}"
    typer.echo(f"score     {doc['score']:+.4f} (> 0: decode-local; wtft (TTFT_p - TTFT_l) / "
               f"TTFT_p - wtpot (TPOT_l - TPOT_p) / TPOT_p, as scored); exploration "
               f"{doc['exploration']:.3f}")
    typer.echo(f"confidence {doc['confidence']}: {s['rarer_route_requests']:.0f} requests on "
               f"the rarer route, residual spread {spread}")


# -- drift ------------------------------------------------------------------------------


def _utc(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, tz=UTC)


def drift_doc(store: Store, settings: Settings, last: int, replay: int = 512
              ) -> dict[str, Any]:
    """Replay the detectors over the windows stored after the current drift reference (at
    most ``replay``, oldest first); the last ``last`` are reported. The reference is the one
    the daemon measures against (:func:`controller.loop.policies.reference_calibration`): the
    current calibration's, or a later refused one's that renewed it."""
    from controller.core import drift
    from controller.loop.learning import drift_config
    from controller.loop.policies import read_rollout, reference_calibration

    learned = refit(store, settings)
    record = learned.record
    with store.read() as tx:
        rollout = read_rollout(tx)
        running = rollout.canary_version or rollout.fleet_version
        # The running version's reference, as the daemon restores it: its own calibration or
        # the one that renewed it (an adopted version has only renewals); for a version
        # with neither (a re-issue), its table's calibration's. Never a dry run's, which
        # renews nothing.
        reference_record = (reference_calibration(tx, running) if running is not None
                            else None)
        if reference_record is None and record.policy_version is not None:
            reference_record = reference_calibration(tx, record.policy_version)
    record = reference_record or record
    details = record.details or {}
    if "drift_reference" not in details:
        raise NoCalibration(f"calibration #{record.id} stored no drift reference")
    reference = drift.DriftReference.from_dict(details["drift_reference"])
    cfg = drift_config(settings)
    with store.read() as tx:
        after = tx.windows(since=_utc(reference.window_range[1]), limit=replay)
    usable = [s for s in after if s.window.outcomes and not s.window.failures]
    state = drift.after_recalibration(drift.DriftState(), record.created_at.timestamp(), cfg)
    residuals = drift.performance_residuals(learned.result.model, [s.window for s in usable])
    history: list[dict[str, Any]] = []
    for stored, res in zip(usable, residuals, strict=True):
        state, verdicts = drift.assess(state, reference, stored.window, stored.window.end, res,
                                       cfg)
        history.append({
            "window_id": stored.id, "start": stored.window.start, "end": stored.window.end,
            "detectors": {v.kind: {"statistic": v.statistic, "threshold": v.threshold,
                                   "fired": v.fired, "samples": v.samples,
                                   "in_cooldown": v.in_cooldown, "reason": v.reason}
                          for v in verdicts},
        })
    out: dict[str, Any] = _finite({
        "calibration_id": record.id,
        "policy_version": running if running is not None else learned.record.policy_version,
        "reference_window_range": list(reference.window_range),
        "windows_after_calibration": len(after), "windows_replayed": len(usable),
        "now": history[-1] if history else None,
        "history": history[-last:] if last > 0 else [],
    })
    return out


@app.command("drift")
def drift_command(
    last: Annotated[int, typer.Option("--last", min=0,
                                      help="Windows of history to show.")] = 10,
    as_json: JsonOption = False, url: UrlOption = None, config: ConfigOption = None,
) -> None:
    """Each drift detector's statistic against its threshold, now and over the last windows."""
    settings, store = settings_and_store(config, url)
    try:
        doc = drift_doc(store, settings, last)
    except NoCalibration as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(_EXIT_BAD_INPUT) from None
    finally:
        store.close()
    if as_json:
        typer.echo(json.dumps(doc))
        return
    _print_drift(shown_doc(doc, markup=True))


def _print_drift(doc: dict[str, Any]) -> None:
    from rich.table import Table

    console = table_console()
    console.print(f"calibration #{doc['calibration_id']} (policy v{doc['policy_version']}); "
                  f"{doc['windows_replayed']} window(s) replayed since")
    if doc["now"] is None:
        console.print("no usable window stored since the calibration")
        return
    now = Table("detector", "statistic", "threshold", "fired", "samples", "why",
                title=f"now (window #{doc['now']['window_id']})")
    for kind, d in doc["now"]["detectors"].items():
        now.add_row(kind, _num(d["statistic"]), _num(d["threshold"]),
                    "FIRED" if d["fired"] else "-", _num(d["samples"]), d["reason"][:60])
    console.print(now)
    kinds = list(doc["now"]["detectors"])
    hist = Table("window", *(f"{k} stat/thr" for k in kinds), title="last windows")
    for h in doc["history"]:
        hist.add_row(f"#{h['window_id']}", *(
            f"{_num(h['detectors'][k]['statistic'])}/{_num(h['detectors'][k]['threshold'])}"
            + (" FIRED" if h["detectors"][k]["fired"] else "")
            if k in h["detectors"] else "—" for k in kinds))
    console.print(hist)


def _num(x: Any) -> str:
    return "n/a" if x is None else f"{x:.3g}"
