"""``pdctl router-agent``: the standalone router agent (a sidecar for any router).

Serves ``RouterPolicyService`` (the controller pushes policies), ``RouterAgentService``
(routers not written in Python ask for decisions and report outcomes) and gRPC health on
``--listen``; exports the ``pdrouter_*`` metrics on ``--metrics-listen``. The applied policy
is persisted to ``--state-file`` and loaded on start; without one, ``[ppd] lookup_table`` is
the starting policy. With ``[prefill_pool] nodes`` set it polls their ``/metrics`` every
``[agent] prefill_poll_interval_s`` for the queue turn 1's busy override reads, when a
router's request does not carry ``prefill_waiting``. Stops cleanly on SIGTERM / SIGINT.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from controller.cli._app import app, load_settings_or_exit, writable_file_or_exit

if TYPE_CHECKING:
    from controller.clock import Clock
    from controller.config import Settings
    from controller.policy import Policy
    from controller.rollout.prefill_watch import PrefillQueueWatch

# How often the agent checks (and logs) policy staleness while idle.
STALENESS_CHECK_S = 30.0


def initial_policy(settings: Settings) -> Policy | None:
    from controller.errors import ConfigError
    from controller.policy import PolicyValidationError, loads

    path = settings.ppd.lookup_table
    if path is None:
        return None
    try:
        return loads(path.read_bytes())
    except (OSError, PolicyValidationError) as e:
        raise ConfigError(f"ppd.lookup_table {path}: {e}") from None


async def _prefill_watch(settings: Settings, clock: Clock) -> PrefillQueueWatch | None:
    """The poller of the prefill workers' queues, when configured (``[agent]
    prefill_poll_interval_s`` > 0 and ``[prefill_pool] nodes`` not empty)."""
    from controller.observe.discovery import static_targets_async
    from controller.rollout.prefill_watch import PrefillQueueWatch

    a = settings.agent
    if a.prefill_poll_interval_s <= 0 or not settings.prefill_pool.nodes:
        return None
    targets = await static_targets_async(settings.prefill_pool.nodes, [], [])
    return PrefillQueueWatch([t.metrics_url for t in targets], clock,
                             interval_s=a.prefill_poll_interval_s,
                             stale_after_s=a.prefill_stale_after_s)


async def serve_agent(
    settings: Settings,
    *,
    listen: str,
    state_file: Path | None,
    metrics_listen: str | None,
    router_id: str,
    allow_unauthenticated: bool,
) -> None:
    import asyncio
    import signal
    import socket

    from controller.clock import WallClock
    from controller.errors import ConfigError
    from controller.rollout.agent import RouterAgent
    from controller.rollout.security import split_host_port
    from controller.rollout.server import RouterServer

    clock = WallClock()
    watch = await _prefill_watch(settings, clock)
    agent = RouterAgent(
        router_id=router_id or socket.gethostname(),
        clock=clock,
        state_file=state_file,
        decision_timeout_ms=settings.ppd.decision_timeout_ms,
        stale_after_s=settings.agent.stale_after_s,
        initial_policy=initial_policy(settings),
        prefill_waiting=watch.value if watch is not None else None,
    )
    server = RouterServer(
        agent,
        listen=listen,
        security=settings.security,
        allow_unauthenticated=allow_unauthenticated,
    )
    metrics_server = None
    if metrics_listen:
        from prometheus_client import start_http_server

        host, port = split_host_port(metrics_listen)
        try:
            metrics_server, _ = start_http_server(port, addr=host, registry=agent.registry)
        except OSError as e:  # e.g. another agent already on the port
            raise ConfigError(f"cannot listen on --metrics-listen {metrics_listen}: "
                              f"{e.strerror or e}") from None
    await server.start()
    snap = agent.snapshot
    typer.echo(
        f"router-agent listening on {server.address} ({server.security.describe()}); "
        f"policy: {f'v{snap.version}' if snap else 'none'}",
    )
    if metrics_server is not None:
        m_host, m_port = metrics_server.server_address[:2]
        host_text = m_host.decode() if isinstance(m_host, bytes) else str(m_host)
        typer.echo(f"metrics on http://{host_text}:{m_port}/metrics")

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watching = asyncio.create_task(watch.run(stop)) if watch is not None else None
    if watch is not None:
        typer.echo(f"prefill queue: polling {len(watch.urls)} prefill worker(s) every "
                   f"{watch.interval_s:g} s")
    try:
        while not stop.is_set():
            agent.is_stale()  # logs once when the policy turns stale
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), STALENESS_CHECK_S)
    finally:
        stop.set()
        if watching is not None:
            await watching
        await server.stop(grace=2.0)
        if metrics_server is not None:
            metrics_server.shutdown()
        typer.echo("router-agent stopped")


@app.command("router-agent")
def router_agent(
    listen: Annotated[
        str | None, typer.Option(help="gRPC HOST:PORT (default: [agent] listen).")
    ] = None,
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="TOML config file.")
    ] = None,
    state_file: Annotated[
        Path | None,
        typer.Option(help="Persist the applied policy here (default: [agent] state_file)."),
    ] = None,
    metrics_listen: Annotated[
        str | None, typer.Option(help="HOST:PORT for /metrics (default: [agent] metrics_listen).")
    ] = None,
    router_id: Annotated[str, typer.Option(help="Name used in logs (default: host name).")] = "",
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="Allow a non-loopback listen address without a token or client certificates.",
        ),
    ] = False,
) -> None:
    """Serve the router agent over gRPC (policy push, decisions, health); with [prefill_pool]
    nodes set, also poll their queues for turn 1's busy override ([agent]
    prefill_poll_interval_s)."""
    import asyncio

    from controller.errors import ConfigError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    settings = load_settings_or_exit(config)
    state_file = state_file or settings.agent.state_file
    if state_file is not None:  # else it would start ready and refuse every push it is given
        writable_file_or_exit(state_file, "--state-file")
    try:
        asyncio.run(
            serve_agent(
                settings,
                listen=listen or settings.agent.listen,
                state_file=state_file,
                metrics_listen=metrics_listen or settings.agent.metrics_listen,
                router_id=router_id,
                allow_unauthenticated=insecure,
            )
        )
    except ConfigError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(2) from None
