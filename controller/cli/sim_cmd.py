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
        "cluster (SQLite store FILE.db beside it). With --workers-only, also a `pdctl router "
        "serve` config (--write-router-config, default FILE-router.toml).")] = None,
    write_router_config: Annotated[Path | None, typer.Option(
        "--write-router-config", metavar="FILE",
        help="Where the router config goes (with --workers-only).")] = None,
    tokenizer: Annotated[Path | None, typer.Option(
        "--tokenizer", help="tokenizer.json (or its directory) the workers count tokens "
        "with. Default: the scenario's [serve] tokenizer, else the bundled one.")] = None,
    host: Annotated[str, typer.Option(help="Loopback address to listen on.")] = "127.0.0.1",
) -> None:
    """Run SCENARIO.toml in wall time: per worker an OpenAI endpoint speaking vLLM's P/D
    protocol and /metrics; per router (unless --workers-only) /metrics, the gRPC agent
    servers and an OpenAI-compatible API. Stops cleanly on SIGTERM or Ctrl-C."""
    import asyncio
    import signal

    from controller.errors import ConfigError
    from controller.sim.live import LiveSim

    if host not in LOOPBACK:
        typer.echo(f"error: --host {host}: the simulator serves on loopback only "
                   "(127.0.0.1, localhost or ::1)", err=True)
        raise typer.Exit(2)
    try:
        scenario, initial = _load(scenario_path, policy, port_base, tokenizer)
    except (ConfigError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None

    async def main() -> None:
        sim = LiveSim(scenario, initial, host=host, traffic=not (no_traffic or workers_only),
                      routers=not workers_only)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        addresses = await sim.start()  # stops what it started when a port is taken
        try:
            if write_config is not None:
                addresses["configs"] = _write_configs(
                    addresses, sim, write_config, write_router_config, workers_only)
            _print_addresses(addresses, as_json)
            await stop.wait()
        finally:
            await sim.stop()
        typer.echo("stopped", err=True)

    try:
        asyncio.run(main())
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


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
