"""``pdctl demo``: the embedded default, runnable on any laptop with no GPU or services.

A live simulated cluster and the real daemon (``controller.demo``), the story on one live
screen (rich Live on a terminal, one line per event otherwise), then a summary.
``ppd_policy`` (a hand-written PPD-style table) serves ``pdctl bench fanout``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from controller.cli._app import app

if TYPE_CHECKING:
    from controller.demo import DemoState
    from controller.policy import Policy

DEMO_TIMEOUT_S = 170.0


def ppd_policy(version: int, *, reason: str = "pdctl demo") -> Policy:
    """A PPD-style 10 x 10 x 10 table on the default axes.

    Decode-local where the append is cheap relative to the conversation already on the
    decode worker (context up to 16k tokens, io ratio up to 2) and the router is not
    saturated (qps up to 64); prefill-node elsewhere. The score's sign matches the route
    (> 0: decode-local), its size grows with the distance from the boundary.
    """
    from controller.clock import WallClock
    from controller.policy import Axes, LookupTable, Policy, Provenance, Route

    axes = Axes()
    routes: list[Route] = []
    scores: list[float] = []
    for ctx in axes.context_tokens:
        for io in axes.io_ratio:
            for qps in axes.qps:
                margin = min(
                    math.log2(16384 / ctx), math.log2(2 / io) + 0.5, math.log2(64 / qps) + 0.5
                )
                local = margin >= 0
                routes.append(Route.DECODE_LOCAL if local else Route.PREFILL_NODE)
                scores.append(round((margin + 0.25) / 10 if local else margin / 10, 4))
    table = LookupTable(axes, tuple(routes), tuple(scores), (0.0,) * axes.n_cells)
    return Policy(
        version=version,
        table=table,
        provenance=Provenance(
            created_at=WallClock().utcnow(), reason=reason, created_by="pdctl demo"
        ),
    )


def _screen(state: DemoState) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Text.assemble(
        ("pdctl demo", "bold"), f"  t = {state.now:5.1f} s   ", (state.stage, "cyan"))
    events = Table(title="events", expand=True, show_lines=False)
    events.add_column("t (s)", justify="right", width=6)
    events.add_column("what")
    for e in state.events[-12:]:
        style = {"drift": "yellow", "shift": "red", "promotion": "green",
                 "operator": "magenta", "rollback": "red"}.get(e.kind, "")
        events.add_row(f"{e.at:.1f}", Text(e.text, style=style))
    recent = Table(title="goodput per window (routers' measurements)", expand=True)
    recent.add_column("window (s)")
    recent.add_column("requests", justify="right")
    recent.add_column("goodput", justify="right")
    recent.add_column("", ratio=1)
    for start, end, goodput, n in state.windows[-8:]:
        bar = "█" * round(30 * goodput) if goodput is not None else ""
        recent.add_row(f"{start:5.1f}–{end:5.1f}", f"{n:.0f}",
                       "n/a" if goodput is None else f"{100 * goodput:.0f}%",
                       Text(bar, style="green" if (goodput or 0) >= 0.8 else "red"))
    routers = Table(title="routers", expand=True)
    routers.add_column("router")
    routers.add_column("desired")
    routers.add_column("acknowledged")
    for r in state.routers:
        routers.add_row(r, f"v{state.desired.get(r)}", f"v{state.acked.get(r)}")
    return Group(head, events, recent, routers)


async def _until_sigterm(demo: Coroutine[Any, Any, DemoState]) -> DemoState:
    """``demo``, cancelled by SIGTERM as by Ctrl-C, so that its cleanup runs (the daemon,
    the router subprocesses and the workers stopped) instead of the process dying with its
    children left running."""
    import asyncio
    import signal

    task = asyncio.current_task()
    if task is not None:
        with contextlib.suppress(NotImplementedError):  # no signal handlers on Windows
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await demo


def _run(demo: Coroutine[Any, Any, DemoState]) -> DemoState:
    """Run ``demo`` to its end; SIGTERM stops it (exit 143) once it has cleaned up."""
    import asyncio

    try:
        return asyncio.run(_until_sigterm(demo))
    except asyncio.CancelledError:
        typer.echo("demo: stopped by SIGTERM (the daemon, routers and workers were stopped)",
                   err=True)
        raise typer.Exit(143) from None


@app.command("demo")
def demo(
    timeout_s: Annotated[float, typer.Option(
        min=30.0, help="Give up (exit 1) after this many seconds.")] = DEMO_TIMEOUT_S,
    force_after_s: Annotated[float, typer.Option(
        min=1.0, help="Ask for an operator recalibration --force when nothing was approved "
        "this long after the shift.")] = 60.0,
    scenario: Annotated[Path | None, typer.Option(
        help="Scenario file (default: scenarios/demo-real.toml with --router real, "
        "scenarios/demo.toml with --router sim).")] = None,
    router: Annotated[str, typer.Option(
        "--router", help="real (default): a `pdctl router serve` subprocess per router in "
        "front of the simulated workers, the scenario's traffic sent through them over HTTP; "
        "sim: the scenario's in-simulation routers, in process (docs/demo.md).")
    ] = "real",
) -> None:
    """A live simulated cluster and the daemon: baseline, a scripted shift, drift detection,
    recalibration, guardrail, canary, promotion and recovery on one screen, then a summary."""
    import sys

    from rich.console import Console
    from rich.live import Live

    from controller.demo import (
        DemoRouter,
        default_scenario,
        quiet_daemon_logs,
        run_demo,
        summary_lines,
    )

    if router not in tuple(DemoRouter):
        typer.echo(f"error: --router {router}: sim or real", err=True)
        raise typer.Exit(2)
    quiet_daemon_logs()
    console = Console()
    path = scenario or default_scenario(DemoRouter(router))
    if not path.is_file():
        typer.echo(f"error: scenario file not found: {path}", err=True)
        raise typer.Exit(2)

    streamed = not sys.stdout.isatty()  # off a terminal every event is printed as it happens
    if not streamed:
        with Live(console=console, refresh_per_second=4, transient=False) as live:
            def show(state: DemoState) -> None:
                live.update(_screen(state))

            state = _run(run_demo(scenario_path=path, timeout_s=timeout_s,
                                  force_after_s=force_after_s, on_update=show,
                                  router=DemoRouter(router)))
    else:
        printed = 0

        def lines(state: DemoState) -> None:
            nonlocal printed
            for e in state.events[printed:]:
                typer.echo(f"{e.at:6.1f} s  {e.text}")
            printed = len(state.events)

        state = _run(run_demo(scenario_path=path, timeout_s=timeout_s,
                              force_after_s=force_after_s, on_update=lines,
                              router=DemoRouter(router)))
    # The live screen keeps only the latest events, so its summary lists them all again.
    for line in summary_lines(state, events=not streamed):
        typer.echo(line)
    if state.failure or not state.done:
        raise typer.Exit(1)
