"""``pdctl observe --once``: print the current window (table or JSON)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from controller.cli._app import app, load_settings_or_exit
from controller.cli.shown import shown

if TYPE_CHECKING:
    from controller.config import Settings
    from controller.core.window import Summary, Window


@app.command("observe")
def observe(
    once: Annotated[bool, typer.Option("--once", help="Required: observe one window and exit "
                                       "(observing continuously is `pdctl run`'s job).")
                    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the window as JSON.")] = False,
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="TOML config file.")
    ] = None,
    source: Annotated[
        str | None,
        typer.Option("--source", help="scrape | prometheus (default: [observe] source)."),
    ] = None,
    interval: Annotated[
        float | None,
        typer.Option("--interval", help="Window length in seconds (default: "
                     "[controller] interval_s). The scrape source waits this long between "
                     "its two snapshots."),
    ] = None,
) -> None:
    """Observe the workers and routers once (pass --once) and print the window."""
    import asyncio

    from controller.errors import ConfigError, ControllerError, TransientError

    if not once:
        typer.echo("only --once is supported here; the daemon (pdctl run) observes "
                   "continuously", err=True)
        raise typer.Exit(2)
    if source not in (None, "scrape", "prometheus"):
        typer.echo(f"--source must be scrape or prometheus, not {source!r}", err=True)
        raise typer.Exit(2)
    settings = load_settings_or_exit(config)
    kind = source or settings.observe.source
    length = interval if interval is not None else settings.controller.interval_s
    if not length > 0:
        typer.echo("--interval must be > 0", err=True)
        raise typer.Exit(2)
    try:
        window = asyncio.run(_observe_once(settings, kind, length))
    except ConfigError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(2) from None
    except ControllerError as e:
        typer.echo(f"observe failed: {e}", err=True)
        raise typer.Exit(1 if isinstance(e, TransientError) else 2) from None
    if json_out:
        import json

        typer.echo(json.dumps(window.to_dict(), indent=2))
    else:
        typer.echo(shown(render_window(window), keep_newlines=True))  # peers' messages
    if not window.answered:
        raise typer.Exit(1)


async def _observe_once(settings: Settings, kind: str, length: float) -> Window:
    from controller.clock import WallClock
    from controller.errors import ConfigError
    from controller.observe.factory import source_from_settings

    clock = WallClock()
    src = await source_from_settings(settings, kind, clock)  # type: ignore[arg-type]
    if not src.targets():
        await src.aclose()
        p = settings.prometheus
        if kind == "prometheus" and p.discover_targets:
            raise ConfigError(
                f"no targets: none of Prometheus' active targets has a role (label "
                f"{p.role_label!r} = prefill, decode or router, or a job name containing "
                "one): set [prometheus] role_label, or relabel the scrape jobs")
        raise ConfigError(
            "no targets: set [prefill_pool].nodes, [decode_pool].nodes and "
            "[routers].metrics_targets, or [prometheus] discover_targets = true"
        )
    try:
        if kind == "prometheus":
            end = math.floor(clock.now() / length) * length  # the last whole interval
            return await src.window(end - length, end)
        start = clock.now()
        await src.window(start - length, start)  # baseline snapshot
        await clock.sleep(length)
        return await src.window(start, clock.now())
    finally:
        await src.aclose()


def _ms(s: Summary | None) -> str:
    if s is None or s.mean is None:
        return "-"
    return f"{s.mean * 1000:.1f}"


def _num(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def render_window(w: Window) -> str:
    """A plain-text table of the window; ``-`` marks a value the targets did not provide.

    ``req/s`` counts served requests (finished normally); ``aborted`` and ``errored`` are the
    window's requests that finished otherwise. A worker whose engine exports no series for a
    family the learning uses gets a ``missing_family`` line under the table."""
    from datetime import UTC, datetime

    def when(t: float) -> str:
        return datetime.fromtimestamp(t, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")

    lines = [
        f"window {when(w.start)} .. {when(w.end)} UTC ({w.interval_s:g} s, source {w.source}); "
        f"{len(w.answered)} target(s) answered, {len(w.failures)} problem(s)",
        "",
    ]
    header = ("worker", "role", "engine", "req/s", "aborted", "errored", "ttft ms", "itl ms",
              "tpot ms", "queue ms", "prefill ms", "kv xfer ms", "running", "waiting", "kv use")
    rows: list[tuple[str, ...]] = [header]
    for s in w.workers:
        rows.append((
            s.worker, s.role, s.engine or "-", _num(s.request_rate),
            _num(s.aborted, "{:g}"), _num(s.errored, "{:g}"), _ms(s.ttft_s),
            _ms(s.inter_token_s), _ms(s.tpot_s), _ms(s.queue_s), _ms(s.prefill_s),
            _ms(s.kv_transfer_s), _num(s.running, "{:g}"), _num(s.waiting, "{:g}"),
            _num(s.kv_cache_usage, "{:.0%}"),
        ))
    lines += _table(rows)
    lines += [f"  {s.worker}: missing_family: {', '.join(f.value for f in s.missing)} "
              "(the engine does not export it: '-' there is not 'nothing happened')"
              for s in w.workers if s.missing]
    routers: dict[str, dict[str, float]] = {}
    for o in w.outcomes:
        r = routers.setdefault(o.router, {})
        key = o.route.name
        r[key + ":n"] = r.get(key + ":n", 0.0) + o.requests
        r[key + ":met"] = r.get(key + ":met", 0.0) + o.met
    if routers or w.workload.qps_by_router:
        lines.append("")
        rrows: list[tuple[str, ...]] = [("router", "qps", "route", "requests", "met both SLOs")]
        for name in sorted(set(routers) | set(w.workload.qps_by_router)):
            r = routers.get(name, {})
            routes = sorted({k.split(":")[0] for k in r}) or ["-"]
            for route in routes:
                n, met = r.get(route + ":n", 0.0), r.get(route + ":met", 0.0)
                rrows.append((name, _num(w.workload.qps_by_router.get(name)), route, f"{n:g}",
                              f"{met / n:.0%}" if n else "-"))
        lines += _table(rrows)
    if w.failures:
        lines.append("")
        lines += [f"  {f.target}: {f.kind}: {f.message}" for f in w.failures]
    return "\n".join(lines)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows]
