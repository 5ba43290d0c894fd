"""Wiring of one router process: agent, gRPC policy port, instance pools, HTTP API."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from controller.clock import WallClock
from controller.errors import ConfigError
from controller.policy import Policy, PolicyValidationError, loads
from controller.rollout.agent import RouterAgent
from controller.rollout.security import split_host_port
from controller.rollout.server import RouterServer
from controller.router.config import RouterConfig
from controller.router.http_errors import JsonErrorRunner
from controller.router.instances import HealthChecker, Instance, Pool, Role
from controller.router.metrics import RouterHttpMetrics
from controller.router.proxy import Router
from controller.router.tokens import load_counts

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Started:
    http: str  # http://HOST:PORT
    grpc: str  # HOST:PORT
    tokenizer: str
    policy_version: int
    metrics_url: str = ""  # a worker process's private /metrics


def initial_policy(path: Path | None) -> Policy | None:
    if path is None:
        return None
    try:
        return loads(path.read_bytes())
    except (OSError, PolicyValidationError) as e:
        raise ConfigError(f"grpc.initial_policy {path}: {e}") from None


def make_agent(cfg: RouterConfig, registry: CollectorRegistry, prefill: Pool,
               state_file: Path | None, initial: Policy | None) -> RouterAgent:
    return RouterAgent(
        router_id=cfg.router_id or socket.gethostname(),
        clock=WallClock(), registry=registry, state_file=state_file,
        decision_timeout_ms=cfg.grpc.decision_timeout_ms,
        stale_after_s=cfg.grpc.stale_after_s,
        initial_policy=initial,
        prefill_waiting=prefill.min_waiting,
    )


def make_pools(cfg: RouterConfig, metrics: RouterHttpMetrics) -> tuple[Pool, Pool]:
    clock = WallClock()
    i = cfg.instances

    def on_change(inst: Instance, healthy: bool) -> None:
        metrics.instance_healthy.labels(inst.role.value, inst.url).set(1 if healthy else 0)

    pools = tuple(Pool(role, entries, unhealthy_after=i.unhealthy_after,
                       waiting_stale_after_s=i.waiting_stale_after_s, clock=clock,
                       on_change=on_change)
                  for role, entries in ((Role.PREFILL, i.prefill), (Role.DECODE, i.decode)))
    return pools[0], pools[1]


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    """How one process of a router instance runs.

    The single process of a one-process router serves everything. With ``[http] processes``
    > 1 each worker process serves the API on the shared port (``reuse_port``) and its own
    registry on a private loopback port (``private_metrics``), starts from the policy the
    parent runs (``initial``) and takes updates from the parent, which alone serves gRPC.
    """

    serve_grpc: bool = True
    reuse_port: bool = False
    private_metrics: bool = False
    initial: Policy | None = None
    use_initial: bool = False


async def serve_router(cfg: RouterConfig, stop: asyncio.Event, *,
                       on_started: Callable[[Started], None] | None = None,
                       spec: ProcessSpec | None = None,
                       hook: Callable[[RouterAgent, Router], None] | None = None) -> None:
    """Run one router process until ``stop`` is set."""
    spec = spec or ProcessSpec()
    clock = WallClock()
    registry = CollectorRegistry()
    metrics = RouterHttpMetrics(registry)
    counts = load_counts(cfg.model.tokenizer)
    metrics.tokenizer_loaded.set(1 if counts.loaded else 0)
    prefill, decode = make_pools(cfg, metrics)
    for pool in (prefill, decode):
        await asyncio.to_thread(pool.resolve)
        for inst in pool.instances.values():
            metrics.instance_healthy.labels(inst.role.value, inst.url).set(1)
    agent = make_agent(cfg, registry, prefill, cfg.grpc.state_file if spec.serve_grpc else None,
                       initial=spec.initial if spec.use_initial else
                       initial_policy(cfg.grpc.initial_policy))
    t = cfg.timeouts
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=t.connect_s),
        auto_decompress=False, trust_env=False)
    router = Router(cfg, agent, counts, prefill, decode, metrics, session, clock)
    if hook is not None:
        hook(agent, router)
    checker = HealthChecker((prefill, decode), session, clock,
                            interval_s=cfg.instances.health_interval_s,
                            resolve_interval_s=cfg.instances.resolve_interval_s,
                            timeout_s=t.health_s)
    try:
        await _run(cfg, stop, spec, agent, router, checker, counts.source, on_started)
    finally:
        await session.close()


async def _run(cfg: RouterConfig, stop: asyncio.Event, spec: ProcessSpec, agent: RouterAgent,
               router: Router, checker: HealthChecker, tokenizer: str,
               on_started: Callable[[Started], None] | None) -> None:
    grpc_server = RouterServer(agent, listen=cfg.grpc.listen, security=cfg.security,
                               serve_decisions=False,
                               allow_unauthenticated=cfg.grpc.allow_unauthenticated)
    runner = JsonErrorRunner(router.app(), on_reject=router.rejected,
                             handler_cancellation=True, access_log=None)
    metrics_runner = JsonErrorRunner(router.metrics_app(private=spec.private_metrics),
                                     on_reject=router.rejected, access_log=None)
    checking: asyncio.Task[None] | None = None
    try:
        await runner.setup()
        host, _ = split_host_port(cfg.http.listen)
        await _listen(runner, "http.listen", cfg.http.listen, spec.reuse_port)
        metrics_url = ""
        if spec.private_metrics:
            await metrics_runner.setup()
            await _listen(metrics_runner, "private metrics", "127.0.0.1:0", False)
            metrics_url = f"http://127.0.0.1:{metrics_runner.addresses[0][1]}/metrics"
        elif spec.serve_grpc and cfg.http.metrics_listen is not None:
            await metrics_runner.setup()
            await _listen(metrics_runner, "http.metrics_listen", cfg.http.metrics_listen, False)
        if spec.serve_grpc:
            await grpc_server.start()
        checking = asyncio.create_task(checker.run(stop))
        snap = agent.snapshot
        if on_started is not None:
            on_started(Started(f"http://{host}:{runner.addresses[0][1]}",
                               grpc_server.address if spec.serve_grpc else "",
                               tokenizer, snap.version if snap else 0, metrics_url))
        while not stop.is_set():
            agent.is_stale()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 30.0)
    finally:
        stop.set()
        if checking is not None:
            await checking
        await grpc_server.stop(grace=2.0)
        await runner.cleanup()
        await metrics_runner.cleanup()


async def _listen(runner: web.AppRunner, key: str, address: str, reuse_port: bool) -> None:
    host, port = split_host_port(address)
    # A deep accept queue: a burst of clients waits in the kernel rather than being refused
    # (aiohttp's default is 128; vLLM's uvicorn uses 2,048).
    site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None, backlog=4096)
    try:
        await site.start()
    except OSError as e:
        raise ConfigError(f"cannot listen on {key} {address}: {e.strerror or e}") from None
