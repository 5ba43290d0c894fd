"""``pdctl calibrate-active``: the cold-start active calibration (also ``recalibrate --active
--local``), run in this process against the configured store, routers and
metrics source, with load sent through OpenAI-compatible endpoints (``--openai``).

Exit codes: 0 first table recorded (approved or refused: see the output), 1 the run could
not finish (a router did not acknowledge, too few windows, a leader is running, what the
routers run cannot be told), 2 bad input, 3 store unavailable, 130 interrupted (Ctrl-C),
143 terminated (SIGTERM). Whenever it does not end on an approved table the routers are
sent back to what they ran before (classic P/D when they ran no policy).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Annotated, Any

import typer

from controller.cli._app import app
from controller.core.active import DEFAULT_CONTEXTS, DEFAULT_QPS, DEFAULT_TURNS

_EXIT_FAILED = 1
_DEFAULT_CONTEXTS = ",".join(str(c) for c in DEFAULT_CONTEXTS)
_DEFAULT_TURNS = ",".join(f"{a}:{o}" for a, o in DEFAULT_TURNS)
_DEFAULT_QPS = ",".join(f"{q:g}" for q in DEFAULT_QPS)
_EXIT_BAD_INPUT = 2


def _floats(text: str, what: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"{what}: comma-separated numbers") from None
    if not values:
        raise typer.BadParameter(f"{what}: at least one value")
    bad = [x for x in values if not 0 < x < float("inf")]
    if bad:  # a context class or QPS point of 0 or less would push forced policies for nothing
        raise typer.BadParameter(f"{what}: every value must be positive, got {bad[0]:g}")
    return values


def _token_counts(text: str, what: str) -> tuple[int, ...]:
    """Positive whole numbers: a fractional token count is refused, not truncated unsaid."""
    values = _floats(text, what)
    fractional = [x for x in values if not x.is_integer()]
    if fractional:
        raise typer.BadParameter(f"{what}: token counts are whole numbers, got {fractional[0]:g}")
    return tuple(int(x) for x in values)


def _endpoints(urls: list[str]) -> list[str]:
    from urllib.parse import urlsplit

    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise typer.BadParameter(f"--openai {url!r}: expected http(s)://HOST:PORT/v1")
    return urls


def _turns(text: str) -> tuple[tuple[int, int], ...]:
    out = []
    for part in text.split(","):
        a, sep, o = part.strip().partition(":")
        if not sep or not a.isdigit() or not o.isdigit() or int(o) < 1:
            raise typer.BadParameter("--turns: APPEND:OUTPUT pairs, e.g. 32:256,512:64")
        out.append((int(a), int(o)))
    return tuple(out)


def _where(report: Any) -> str:
    """Where a failed run left the routers: what it pushed them back to."""
    if report is None or report.final_version is None:
        return ""
    acked = [r for r, v in report.final_acked.items() if v == report.final_version]
    return (f"; routers sent back to v{report.final_version} (acknowledged by "
            f"{len(acked)} of {len(report.final_acked)})")


def _print_failure(as_json: bool, error: str, report: Any) -> None:
    """With --json, a script reading stdout gets the failure and what was done until it."""
    if as_json:
        done = report.to_dict() if report is not None else {}
        typer.echo(json.dumps({"error": error, **done}, default=str))


_ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="Config file ([store], "
                                          "[routers], pools, [slo], [rollout]).")]
_OpenaiOpt = Annotated[list[str], typer.Option(
    "--openai", help="OpenAI-compatible base URL (…/v1); repeat to spread the "
    "conversations over several.")]
_ModelOpt = Annotated[str | None, typer.Option(
    "--model", help="`model` field of the requests (omitted when not given).")]
_TokenizerOpt = Annotated[Path | None, typer.Option(
    "--tokenizer", help="tokenizer.json (or its directory) of the served model: prompts "
    "are sized with it. Default: the simulator's bundled tokenizer.")]
_ContextsOpt = Annotated[str, typer.Option(help="Context classes (turn-1 prompt tokens).")]
_TurnsOpt = Annotated[str, typer.Option(
    show_default=False, help="Turn-2 APPEND:OUTPUT token pairs (default "
    f"{_DEFAULT_TURNS.replace(',', ', ')}).")]
_QpsOpt = Annotated[str, typer.Option(help="QPS points (turns per second).")]
_SessionsOpt = Annotated[int, typer.Option(min=1, help="Conversations per load point.")]
_MinSessionsOpt = Annotated[int, typer.Option(
    min=1, help="Fewest conversations per point when shrinking to the bounds.")]
_MaxRequestsOpt = Annotated[int, typer.Option(min=1, help="Request budget (both phases).")]
_MaxDurationOpt = Annotated[float, typer.Option(
    min=1, help="Seconds of load at most (both phases).")]
_WindowOpt = Annotated[float, typer.Option(min=0.1, help="Metrics window length (s).")]
_ConcurrencyOpt = Annotated[int, typer.Option(min=1, help="Requests in flight at most.")]
_JsonOpt = Annotated[bool, typer.Option("--json", help="Print the report as JSON (on a "
                                        "failure too: its \"error\" and what was done).")]


@app.command("calibrate-active")
def calibrate_active(
    config: _ConfigOpt, openai: _OpenaiOpt, model: _ModelOpt = None,
    tokenizer: _TokenizerOpt = None, contexts: _ContextsOpt = _DEFAULT_CONTEXTS,
    turns: _TurnsOpt = _DEFAULT_TURNS, qps: _QpsOpt = _DEFAULT_QPS,
    sessions: _SessionsOpt = 20, min_sessions: _MinSessionsOpt = 4,
    max_requests: _MaxRequestsOpt = 4000, max_duration: _MaxDurationOpt = 1800.0,
    window: _WindowOpt = 10.0, concurrency: _ConcurrencyOpt = 32, as_json: _JsonOpt = False,
) -> None:
    """Cold start: force all-prefill-node, then all-decode-local, on every router while a
    bounded synthetic two-turn load covers the table's cells; build the first table from the
    windows observed. Run it with the daemon stopped (the run holds the leader lease) and no
    operator hold (pin, pause, fallback) set or waiting: it refuses before forcing anything.

    A run that does not end on an approved table (refused, failed, out of bounds, Ctrl-C)
    sends the routers back to what they ran: the stored fleet version, the routers' own
    policy when no configured router has a desired version (an empty store, or routers
    replaced under new addresses; adopted first), or classic P/D when they ran none.

    Exit 0 first table recorded (approved or refused), 1 the run could not finish, 2 bad
    input, 3 store unavailable, 130 interrupted (Ctrl-C), 143 terminated (SIGTERM)."""
    from controller.cli.ops_cmd import open_store

    openai = _endpoints(openai)
    settings, plan, limits, tok = _prepare(
        config, tokenizer, contexts, turns, qps, sessions, min_sessions, max_requests,
        max_duration, window, concurrency)
    routers = list(settings.routers.targets)
    if not routers:
        typer.echo("error: [routers] targets is empty", err=True)
        raise typer.Exit(_EXIT_BAD_INPUT)
    store = open_store(None, config)
    doc = _run_reporting(as_json, store, lambda runners: _run_active(
        settings, plan, limits, tok, store, routers, openai, model, runners))
    if as_json:
        typer.echo(json.dumps(doc, default=str))
        return
    _print_report(doc)


def _prepare(config: Path, tokenizer: Path | None, contexts: str, turns: str, qps: str,
             sessions: int, min_sessions: int, max_requests: int, max_duration: float,
             window: float, concurrency: int) -> tuple[Any, Any, Any, Any]:
    """The settings, the calibration plan, the runner's limits and the tokenizer; exit 2
    on bad input."""
    from controller.config import load_settings
    from controller.core.active import plan_active_calibration
    from controller.errors import ConfigError
    from controller.loop.calibration_runner import RunnerLimits
    from controller.policy import Axes, Slo
    from controller.tokenize import bundled_tokenizer_dir, load_tokenizer

    try:
        settings = load_settings(config)
        plan = plan_active_calibration(
            Axes(), Slo(settings.slo.ttft_s, settings.slo.tpot_s), 1,
            contexts=list(_token_counts(contexts, "--contexts")), turns=_turns(turns),
            qps_points=_floats(qps, "--qps"), sessions_per_point=max(sessions, min_sessions),
            min_sessions_per_point=min_sessions, max_requests=max_requests,
            # The plan's durations are send schedules; a fifth of the time is kept for the
            # answers (the runner's deadline is --max-duration).
            max_duration_s=0.8 * max_duration)
        limits = RunnerLimits(max_requests=max_requests, max_duration_s=max_duration,
                              concurrency=concurrency, window_s=window)
        tok = load_tokenizer(tokenizer or bundled_tokenizer_dir())
    except (ConfigError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(_EXIT_BAD_INPUT) from None
    return settings, plan, limits, tok


def _run_reporting(as_json: bool, store: Any,
                   main: Callable[[list[Any]], Coroutine[Any, Any, dict[str, Any]]]
                   ) -> dict[str, Any]:
    """Run ``main`` (which appends its runner to the list it is given) and turn how it ends
    into the exit codes of the module docstring; the store is closed either way."""
    import asyncio

    from controller.errors import ControllerError
    from controller.loop.calibration_runner import ActiveCalibrationError

    runners: list[Any] = []  # the run's report, after an interruption
    try:
        return asyncio.run(main(runners))
    except (KeyboardInterrupt, asyncio.CancelledError) as e:
        what = "interrupted" if isinstance(e, KeyboardInterrupt) else "terminated"
        report = runners[0].report if runners else None
        sent_back = _where(report) or "; the routers were sent back to what they ran before"
        typer.echo(f"{what}{sent_back} (see `pdctl status`)", err=True)
        _print_failure(as_json, what, report)
        raise typer.Exit(130 if isinstance(e, KeyboardInterrupt) else 143) from None
    except ActiveCalibrationError as e:
        typer.echo(f"active calibration failed: {e}{_where(e.report)}", err=True)
        _print_failure(as_json, str(e), e.report)
        raise typer.Exit(_EXIT_FAILED) from None
    except ControllerError as e:  # before any load: e.g. Prometheus or a dns+ name not answering
        typer.echo(f"active calibration failed: {e}", err=True)
        _print_failure(as_json, str(e), runners[0].report if runners else None)
        raise typer.Exit(_EXIT_FAILED) from None
    finally:
        store.close()


async def _run_active(settings: Any, plan: Any, limits: Any, tok: Any, store: Any,
                      routers: list[str], openai: list[str], model: str | None,
                      runners: list[Any]) -> dict[str, Any]:
    import asyncio
    import signal

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from controller.clock import WallClock
    from controller.loop.calibration_runner import ActiveCalibrationRunner
    from controller.loop.leader import default_holder, leadership_for
    from controller.loop.learning import CoreLearner
    from controller.observe.factory import source_from_settings
    from controller.rollout.client import GrpcRouterTransport
    from controller.rollout.reconciler import Reconciler

    # SIGTERM (systemd, kubectl, `timeout`), SIGHUP (a closed terminal) and SIGQUIT end
    # the run as Ctrl-C does: the routers are sent back and the lease released before
    # the process exits, not left on a forced policy.
    me = asyncio.current_task()
    assert me is not None
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        asyncio.get_running_loop().add_signal_handler(sig, me.cancel)
    console = Console(stderr=True)
    clock = WallClock()
    source = await source_from_settings(settings, clock=clock)
    transport = GrpcRouterTransport(settings.security)
    progress = Progress(TextColumn("{task.description}"), BarColumn(),
                        MofNCompleteColumn(), console=console,
                        disable=not console.is_terminal)
    try:
        runner = ActiveCalibrationRunner(
            plan=plan, store=store,
            reconciler=Reconciler.from_config(transport, clock, settings.rollout),
            routers=routers, endpoints=openai, source=source,
            learner=CoreLearner(settings), clock=clock, limits=limits, model=model,
            tokenizer=tok, progress=progress, leadership=leadership_for(
                store, clock, f"calibrate-active-{default_holder()}",
                settings.controller.lease_ttl_s),
            on_start=lambda: console.print(  # only once the run's checks passed
                f"plan: {plan.requests} requests over {len(plan.cells())} cells, about "
                f"{plan.duration_s:.0f} s of load ({plan.dropped_points} load points "
                "left out to fit the bounds)"))
        runners.append(runner)
        with progress:
            return (await runner.run()).to_dict()
    finally:
        await transport.close()
        await source.aclose()


def _print_report(doc: dict[str, Any]) -> None:
    for ph in doc["phases"]:
        typer.echo(f"v{ph['version']} {ph['name']}: acked by {len(ph['acked'])} router(s); "
                   f"{ph['requests_ok']}/{ph['requests_sent']} requests ok; "
                   f"{len(ph['usable_window_ids'])}/{len(ph['window_ids'])} windows usable"
                   + (f"; stopped: {ph['stopped']}" if ph["stopped"] else ""))
    g = doc["predicted_goodput"]
    table = ("(no version: kept with its calibration)" if doc["policy_version"] is None
             else f"v{doc['policy_version']}")
    typer.echo(f"first table {table} "
               f"{'approved' if doc['approved'] else 'REFUSED'} ({doc['reason']}); "
               f"predicted goodput {g['candidate']}; calibration #{doc['calibration_id']}; "
               f"routers now run v{doc['final_version']}")
