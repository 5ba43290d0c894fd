"""``pdctl sim serve``: the simulated cluster in wall time behind real loopback sockets."""

from __future__ import annotations

import dataclasses
import json
import socket
from pathlib import Path
from typing import Annotated, Any

import typer

from controller.cli._app import sim_app

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@sim_app.command("serve")
def serve(
    scenario_path: Annotated[Path, typer.Argument(metavar="SCENARIO.toml",
                                                  help="Scenario file (TOML).")],
    policy: Annotated[str, typer.Option(
        "--policy", help="Initial policy of every router: pd | local | PATH.json | none "
        "(no policy, as new routers: turn by turn their default route).")] = "pd",
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print the addresses as one JSON line.")] = False,
    no_traffic: Annotated[bool, typer.Option(
        "--no-traffic", help="Serve only external (OpenAI API) traffic, not the scenario's.")
    ] = False,
    workers_only: Annotated[bool, typer.Option(
        "--workers-only", help="Serve the workers' endpoints only (no in-simulation routers, "
        "no scenario traffic): a `pdctl router serve` process goes in front of them.")
    ] = False,
    port_base: Annotated[int | None, typer.Option(
        "--port-base", min=1024, max=65135, help="Fixed ports from N (layout in "
        "docs/simulator.md: routers N+i, their gRPC N+100+i, prefill workers N+200+k, decode "
        "workers N+300+k, the daemon's metrics N+400). Default: the scenario's [serve] "
        "port_base, else ports the OS picks.")] = None,
    write_config: Annotated[Path | None, typer.Option(
        "--write-config", metavar="FILE", help="Write a ready `pdctl run` config for this "
        "cluster (its SQLite store beside it: FILE with the suffix .db). With --workers-only, "
        "also a `pdctl router serve` config (--write-router-config, default FILE-router.toml).")
    ] = None,
    write_router_config: Annotated[Path | None, typer.Option(
        "--write-router-config", metavar="FILE",
        help="Where the router config goes (with --workers-only).")] = None,
    tokenizer: Annotated[Path | None, typer.Option(
        "--tokenizer", help="tokenizer.json (or its directory) the workers count tokens "
        "with. Default: the scenario's [serve] tokenizer, else the bundled one.")] = None,
    drive: Annotated[str | None, typer.Option(
        "--drive", metavar="URL", help="Send the scenario's traffic as OpenAI chat requests "
        "to the router at URL (e.g. the `pdctl router serve` in front of --workers-only), "
        "once it answers /health; as `pdctl sim drive`, bounded by the scenario's duration.")
    ] = None,
    host: Annotated[str, typer.Option(help="Loopback address to listen on.")] = "127.0.0.1",
) -> None:
    """Run SCENARIO.toml in wall time: per worker an OpenAI endpoint speaking vLLM's P/D
    protocol and /metrics; per router (unless --workers-only) /metrics, the gRPC agent
    servers and an OpenAI-compatible API. Stops cleanly on SIGTERM or Ctrl-C."""
    import asyncio

    from controller.errors import ConfigError

    if host not in LOOPBACK:
        typer.echo(f"error: --host {host}: the simulator serves on loopback only "
                   "(127.0.0.1, localhost or ::1)", err=True)
        raise typer.Exit(2)
    try:
        scenario, initial = _load(scenario_path, policy, port_base, tokenizer)
    except (ConfigError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None

    try:
        asyncio.run(_serve(scenario, initial, host, traffic=not (no_traffic or workers_only),
                           workers_only=workers_only, as_json=as_json,
                           configs=(write_config, write_router_config), drive=drive))
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


async def _serve(scenario: Any, initial: Any, host: str, *, traffic: bool, workers_only: bool,
                 as_json: bool, configs: tuple[Path | None, Path | None],
                 drive: str | None = None) -> None:
    """Start the cluster, write the configs, print the addresses, serve until a signal
    (with ``drive``, also the scenario's traffic to that router meanwhile)."""
    import asyncio
    import signal

    from controller.sim.live import LiveSim

    sim = LiveSim(scenario, initial, host=host, traffic=traffic, routers=not workers_only)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    addresses = await sim.start()  # stops what it started when a port is taken
    try:
        if configs[0] is not None:
            addresses["configs"] = _write_configs(addresses, sim, configs[0], configs[1],
                                                  workers_only)
        _print_addresses(addresses, as_json)
        if drive is not None:
            from controller.sim.drive import DriveLimits, TrafficDriver, wait_ready

            driver = TrafficDriver(scenario, drive, DriveLimits(scenario.duration_s),
                                   tokenizer=sim.tokenizer)
            if await wait_ready(drive, stop):
                _print_stats((await driver.run(stop)).as_dict(), as_json)
        await stop.wait()
    finally:
        await sim.stop()
    typer.echo("stopped", err=True)


def _load(path: Path, policy: str, port_base: int | None,
          tokenizer: Path | None) -> tuple[Any, Any]:
    from controller.cli.bench_run import resolve_policy
    from controller.sim.scenario import load_scenario

    scenario = load_scenario(path)
    serve = scenario.serve
    if port_base is not None:
        serve = dataclasses.replace(serve, port_base=port_base)
    if tokenizer is not None:
        serve = dataclasses.replace(serve, tokenizer=tokenizer)
    scenario = dataclasses.replace(scenario, serve=serve)
    initial = None if policy == "none" else resolve_policy(policy, scenario)[1]
    return scenario, initial


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _write_configs(addresses: dict[str, Any], sim: Any, path: Path,
                   router_path: Path | None, workers_only: bool) -> dict[str, str]:
    """Write the daemon's config (and the router's with --workers-only); returns the paths."""
    from controller.sim.live import ROUTER_GRPC_OFFSET, ROUTER_HTTP_OFFSET
    from controller.sim.serve_config import daemon_config, hostport, router_config, to_toml

    base = sim.serve.port_base
    host = sim.host
    path = path.expanduser().resolve()
    written: dict[str, str] = {"daemon": str(path)}
    if workers_only:
        http = f"{host}:{base + ROUTER_HTTP_OFFSET if base else _free_port(host)}"
        grpc = f"{host}:{base + ROUTER_GRPC_OFFSET if base else _free_port(host)}"
        routers = [(grpc, http)]
        rpath = (router_path or path.with_name(f"{path.stem}-router.toml")).expanduser()
        rdoc = router_config(addresses, http, grpc, Path(sim.tokenizer.source).parent)
        _write(rpath, to_toml(rdoc, f"pdctl router serve --config {rpath}\n"
                              "(written by pdctl sim serve --workers-only)"))
        written["router"] = str(rpath.resolve())
        addresses["router"] = {"openai": f"http://{http}/v1", "grpc": grpc}
    else:
        routers = [(r["grpc"], hostport(r["metrics"])) for r in addresses["routers"]]
    store = f"sqlite:///{path.with_suffix('.db')}"
    metrics = f"{host}:{base + 400}" if base else None
    doc = daemon_config(addresses, sim.scenario, store, routers, metrics)
    _write(path, to_toml(doc, f"pdctl run --config {path}\n(written by pdctl sim serve "
                         f"for scenario {sim.scenario.name})"))
    return written


def _write(path: Path, text: str) -> None:
    from controller.errors import ConfigError

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot write {path}: {e}") from None


def _print_addresses(addresses: dict[str, Any], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(addresses))
        return
    typer.echo(f"scenario {addresses['scenario']}  model {addresses['model']}")
    for w in addresses["workers"]:
        typer.echo(f"worker {w['name']:<12} {w['role']:<8} {w['url']}  (OpenAI {w['openai']}, "
                   f"metrics {w['metrics']})")
    for r in addresses["routers"]:
        typer.echo(f"router {r['id']:<12} metrics {r['metrics']}  openai {r['openai']}  "
                   f"grpc {r['grpc']}")
    for kind, p in addresses.get("configs", {}).items():
        typer.echo(f"wrote {kind} config {p}")


def _print_stats(stats: dict[str, Any], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps({"drive": stats}))
        return
    reasons = ", ".join(f"{k} {v}" for k, v in stats["failed_by_reason"].items()) or "none"
    codes = ", ".join(f"{k}: {v}" for k, v in stats["http_statuses"].items())
    typer.echo(f"drive: {stats['sessions']} sessions, {stats['sent']} requests sent, "
               f"{stats['ok']} ok, {stats['failed']} failed ({reasons}"
               + (f"; HTTP {codes}" if codes else "") + ")"
               + (f"; stopped by {stats['stopped_by']}" if stats["stopped_by"] else ""))


@sim_app.command("drive")
def drive_cmd(
    scenario_path: Annotated[Path, typer.Argument(metavar="SCENARIO.toml",
                                                  help="Scenario file (TOML).")],
    target: Annotated[str, typer.Option(
        "--target", metavar="URL", help="The router: http://HOST:PORT (or .../v1).")],
    duration: Annotated[float | None, typer.Option(
        "--duration", min=0.001, help="Seconds during which sessions start (default: the "
        "scenario's duration_s).")] = None,
    max_concurrency: Annotated[int, typer.Option(
        "--max-concurrency", min=1, help="Requests in flight at most.")] = 64,
    max_requests: Annotated[int, typer.Option(
        "--max-requests", min=1, help="Requests sent at most.")] = 100_000,
    drain: Annotated[float, typer.Option(
        "--drain", min=0.0, help="Seconds after --duration that later turns may still run; "
        "then what is in flight is cancelled (counted failed, reason stopped).")] = 60.0,
    request_timeout: Annotated[float, typer.Option(
        "--request-timeout", min=0.001, help="Seconds per request.")] = 120.0,
    tokenizer: Annotated[Path | None, typer.Option(
        "--tokenizer", help="tokenizer.json (or its directory) prompts are sized with. "
        "Default: the scenario's [serve] tokenizer, else the bundled one.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the counts as JSON.")] = False,
) -> None:
    """Send SCENARIO.toml's sessions as streamed OpenAI chat requests (one conversation per
    session, header X-Session-Id) to the router at --target, paced to the wall clock; print
    the counts. Stops cleanly on SIGTERM or Ctrl-C. Exit 1 when a request failed."""
    import asyncio

    from controller.errors import ConfigError

    try:
        scenario, _ = _load(scenario_path, "none", None, tokenizer)
        from controller.sim.drive import DriveLimits

        limits = DriveLimits(duration or scenario.duration_s, max_concurrency, max_requests,
                             request_timeout, drain)
    except (ConfigError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    stats = asyncio.run(_drive(scenario, target, limits))
    _print_stats(stats, as_json)
    if stats["failed"]:
        raise typer.Exit(1)


async def _drive(scenario: Any, target: str, limits: Any) -> dict[str, Any]:
    import asyncio
    import signal

    from controller.sim.drive import TrafficDriver
    from controller.tokenize import bundled_tokenizer_dir, load_tokenizer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tok = load_tokenizer(scenario.serve.tokenizer or bundled_tokenizer_dir())
    return (await TrafficDriver(scenario, target, limits, tokenizer=tok).run(stop)).as_dict()
