"""``pdctl plan``: how many prefill and decode workers the load and the SLOs need.

By default the load is the one the stored windows of the last ``[capacity] interval_s`` show
(the same windows the daemon plans on) and the SLOs are ``[slo]``; every flag overrides one
input. Without stored windows, ``--qps``, ``--input-tokens`` and ``--output-tokens`` describe
the load by hand (the physics are then the defaults, and the plan says so). Windows carry
means and one rate per window: ``--prefill-scv``/``--input-scv``/``--append-scv`` give the
token-count spreads (estimated from the windows otherwise, on the high side) and ``--arrivals``
a finer arrival profile (bursts within a window otherwise go unseen); ``--session-gap`` the
mean wait between a session's turns (the session KV working set a decode count must hold).

Exit codes: 0 done, 2 bad input or nothing to plan for, 3 store unavailable.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from controller.cli._app import app, load_settings_or_exit

if TYPE_CHECKING:
    from controller.core.capacity import CapacityPlan, RoleRecommendation
    from controller.core.window import Window

_EXIT_BAD_INPUT = 2
_EXIT_UNAVAILABLE = 3

ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="Config file ([store], [slo], [capacity]).")
]


def recent_windows(config: Path | None, url: str | None, seconds: float, *,
                   optional: bool) -> list[Window]:
    """Stored windows that started in the last ``seconds`` (before the newest one's end).

    ``optional``: the load is given by hand, so an unavailable store is a warning, not an
    error."""
    from controller.cli.db_cmd import missing_database, store_url
    from controller.errors import TransientError
    from controller.store import Store, StoreError

    target = store_url(url, config)
    missing = missing_database(target)
    if missing is not None:
        if not optional:
            typer.echo(missing, err=True)
            raise typer.Exit(_EXIT_UNAVAILABLE)
        typer.echo(f"warning: no history ({missing}); planning on the given load only",
                   err=True)
        return []
    store = Store(target)
    try:
        store.require_schema()
        with store.read() as tx:
            newest = tx.windows(limit=1)
            if not newest:
                return []
            end = datetime.fromtimestamp(newest[-1].window.end, tz=UTC)
            stored = tx.windows(since=end - timedelta(seconds=seconds))
    except (StoreError, TransientError) as e:
        if not optional:
            typer.echo(str(e), err=True)
            raise typer.Exit(_EXIT_UNAVAILABLE) from None
        typer.echo(f"warning: no history ({e}); planning on the given load only", err=True)
        return []
    finally:
        store.close()
    return [s.window for s in stored]


def _fmt_s(x: float) -> str:
    if not math.isfinite(x):
        return "unbounded"
    return f"{x * 1e3:.1f} ms" if x < 1.0 else f"{x:.2f} s"


def _print_role(rec: RoleRecommendation, slo: float, skip: int) -> None:
    metric = "TTFT" if rec.role == "prefill" else "TPOT"
    now = "" if rec.current_workers is None else f" (running {rec.current_workers})"
    typer.echo(f"{rec.role:<8} {rec.workers} worker(s){now}")
    typer.echo(f"  binding       {rec.binding}")
    typer.echo(f"  per worker    {rec.per_worker_capacity:.4g} {rec.capacity_unit} "
               f"(demand {rec.demand:.4g} {rec.capacity_unit})")
    typer.echo(f"  utilisation   {rec.utilisation:.0%}")
    typer.echo(f"  p99 {metric}      {_fmt_s(rec.predicted_p99_s)} predicted (SLO {_fmt_s(slo)})")
    if rec.extrapolated:
        typer.echo("  WARNING       extrapolated: the model is used beyond the load it was "
                   "fitted on")
    for line in rec.explanation[skip:]:
        typer.echo(f"  - {line}")


def print_plan(plan: CapacityPlan) -> None:
    d = plan.demand
    typer.echo(f"load: {d.qps:.3g} req/s, {d.input_tokens:.0f} prompt tokens "
               f"({d.cached_fraction:.0%} cached), {d.output_tokens:.0f} output tokens, "
               f"{d.decode_local_share:.0%} decode-local; SLO p99 TTFT {_fmt_s(plan.slo_ttft_s)}, "
               f"p99 TPOT {_fmt_s(plan.slo_tpot_s)}; headroom {plan.headroom:.0%}")
    # the inputs' lines (demand, physics) lead both roles' explanations: print them once
    common = 0
    for a, b in zip(plan.prefill.explanation, plan.decode.explanation, strict=False):
        if a != b:
            break
        common += 1
    for line in plan.prefill.explanation[:common]:
        typer.echo(f"  {line}")
    typer.echo(f"recommendation: {plan.prefill.workers} prefill : {plan.decode.workers} decode")
    _print_role(plan.prefill, plan.slo_ttft_s, common)
    _print_role(plan.decode, plan.slo_tpot_s, common)


def read_arrivals(path: Path, interval_s: float) -> tuple[float, ...]:
    """The rate profile of a file of arrival counts (one per line, ``#`` comments), with the
    counting noise shrunk out as for the windows' profile."""
    from controller.loop.capacity import rate_profile

    counts: list[float] = []
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        text = raw.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"line {n}: {text!r} is not a count") from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"line {n}: a count must be a finite number >= 0, got {text!r}")
        counts.append(value)
    if sum(counts) <= 0:
        raise ValueError("no arrivals (needs counts with a positive sum)")
    return rate_profile([c / interval_s for c in counts], [interval_s] * len(counts))


@app.command("plan")
def plan_command(
    qps: Annotated[float | None, typer.Option("--qps", min=0.0,
                                              help="Requests/s (all turns).")] = None,
    input_tokens: Annotated[float | None, typer.Option(
        "--input-tokens", min=1.0, help="Mean prompt tokens per request.")] = None,
    output_tokens: Annotated[float | None, typer.Option(
        "--output-tokens", min=1.0, help="Mean generated tokens per request.")] = None,
    ttft_slo: Annotated[float | None, typer.Option(
        "--ttft-slo", help="p99 TTFT SLO, seconds, > 0 (default [slo] ttft_s).")] = None,
    tpot_slo: Annotated[float | None, typer.Option(
        "--tpot-slo", help="p99 TPOT SLO, seconds, > 0 (default [slo] tpot_s).")] = None,
    headroom: Annotated[float | None, typer.Option(
        "--headroom", min=0.0, help="Spare capacity (default [capacity] headroom).")] = None,
    kv_tokens: Annotated[float | None, typer.Option(
        "--kv-tokens", min=1.0,
        help="KV cache per decode worker in tokens (default: estimated from the windows).")
    ] = None,
    max_num_seqs: Annotated[int | None, typer.Option(
        "--max-num-seqs", min=1, help="Engine max_num_seqs of a decode worker.")] = None,
    prefill_scv: Annotated[float | None, typer.Option(
        "--prefill-scv", min=0.0,
        help="Squared CV of the tokens a prefill worker computes per request (default: from "
             "the spread of the workers' window means).")] = None,
    input_scv: Annotated[float | None, typer.Option(
        "--input-scv", min=0.0,
        help="Squared CV of whole prompts, the KV a decoding request holds (default: from "
             "the windows).")] = None,
    append_scv: Annotated[float | None, typer.Option(
        "--append-scv", min=0.0,
        help="Squared CV of the tokens a decode-local request computes (default 1).")] = None,
    session_gap_s: Annotated[float | None, typer.Option(
        "--session-gap", min=0.0,
        help="Mean seconds between a session's turns (a turn's finish to its next arrival, "
             "from a gateway's log): sizes the session KV a decode count must hold to keep "
             "the decode-local share (default: the observed pool is taken to have just held "
             "it, the cautious reading).")] = None,
    arrivals: Annotated[Path | None, typer.Option(
        "--arrivals", exists=True, dir_okay=False,
        help="Arrival counts per --arrivals-interval, one per line (e.g. from a gateway's "
             "access log): the rate profile, finer than the windows' (bursts within a window "
             "queue prefill).")] = None,
    arrivals_interval_s: Annotated[float, typer.Option(
        "--arrivals-interval", min=0.001,
        help="Seconds each --arrivals count covers.")] = 1.0,
    history_s: Annotated[float | None, typer.Option(
        "--history", min=1.0,
        help="Seconds of stored windows to plan on (default [capacity] interval_s).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    url: Annotated[str | None, typer.Option("--url", help="Database URL (overrides config).")
                   ] = None,
    config: ConfigOption = None,
) -> None:
    """Prefill and decode workers for the current load (or the given one) and the SLOs."""
    from controller.core.capacity import CapacityError
    from controller.loop.capacity import PlanOverrides, plan_from_windows

    settings = load_settings_or_exit(config)
    for flag, slo in (("--ttft-slo", ttft_slo), ("--tpot-slo", tpot_slo)):
        if slo is not None and not slo > 0:  # NaN too
            typer.echo(f"error: {flag} {slo:g}: must be > 0 seconds", err=True)
            raise typer.Exit(_EXIT_BAD_INPUT)
    # Any load given by hand makes the history optional: what is missing from both is then
    # named by its flag (CapacityError) instead of failing on the store.
    by_hand = qps is not None or input_tokens is not None or output_tokens is not None
    windows = recent_windows(config, url, history_s or settings.capacity.interval_s,
                             optional=by_hand)
    if not windows and qps is None:
        typer.echo("error: the store holds no windows to plan on; give the load with --qps, "
                   "--input-tokens and --output-tokens (or run the daemon first)", err=True)
        raise typer.Exit(_EXIT_BAD_INPUT)
    profile = None
    if arrivals is not None:
        try:
            profile = read_arrivals(arrivals, arrivals_interval_s)
        except ValueError as e:
            typer.echo(f"error: --arrivals {arrivals}: {e}", err=True)
            raise typer.Exit(_EXIT_BAD_INPUT) from None
    overrides = PlanOverrides(
        qps=qps, input_tokens=input_tokens, output_tokens=output_tokens, ttft_slo_s=ttft_slo,
        tpot_slo_s=tpot_slo, headroom=headroom, kv_capacity_tokens=kv_tokens,
        max_num_seqs=max_num_seqs, prefill_scv=prefill_scv, input_scv=input_scv,
        append_scv=append_scv, rate_profile=profile, session_gap_s=session_gap_s,
        profile_window_s=arrivals_interval_s if profile is not None else None,
    )
    try:
        plan = plan_from_windows(windows, settings, overrides)
    except CapacityError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(_EXIT_BAD_INPUT) from None
    if as_json:
        typer.echo(json.dumps(plan.to_dict(), allow_nan=False))
        return
    print_plan(plan)
