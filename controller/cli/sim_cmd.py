"""``pdctl sim serve``: the simulated cluster in wall time behind real loopback sockets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from controller.cli._app import sim_app


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
    host: Annotated[str, typer.Option(help="Loopback address to listen on.")] = "127.0.0.1",
) -> None:
    """Run SCENARIO.toml in wall time: /metrics per worker and router, the routers' gRPC
    agent servers and an OpenAI-compatible API. Stops cleanly on SIGTERM or Ctrl-C."""
    import asyncio
    import signal

    from controller.cli.bench_run import resolve_policy
    from controller.errors import ConfigError
    from controller.sim.live import LiveSim
    from controller.sim.scenario import load_scenario

    if host not in ("127.0.0.1", "localhost", "::1"):
        typer.echo(f"error: --host {host}: the simulator serves on loopback only "
                   "(127.0.0.1, localhost or ::1)", err=True)
        raise typer.Exit(2)
    try:
        scenario = load_scenario(scenario_path)
        initial = None if policy == "none" else resolve_policy(policy, scenario)[1]
    except (ConfigError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None

    async def main() -> None:
        sim = LiveSim(scenario, initial, host=host, traffic=not no_traffic)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            addresses = await sim.start()
        except ConfigError:  # a [workload.params] value only building the workload checks
            await sim.stop()
            raise
        _print_addresses(addresses, as_json)
        try:
            await stop.wait()
        finally:
            await sim.stop()
        typer.echo("stopped", err=True)

    try:
        asyncio.run(main())
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def _print_addresses(addresses: dict[str, Any], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(addresses))
        return
    typer.echo(f"scenario {addresses['scenario']}")
    for w in addresses["workers"]:
        typer.echo(f"worker {w['name']:<12} {w['role']:<8} {w['metrics']}")
    for r in addresses["routers"]:
        typer.echo(f"router {r['id']:<12} metrics {r['metrics']}  openai {r['openai']}  "
                   f"grpc {r['grpc']}")
