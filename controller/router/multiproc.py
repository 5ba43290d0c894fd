"""Running ``pdctl router serve``: one process, or several sharing the HTTP port.

With ``[http] processes`` = N > 1 the parent process starts N worker processes that serve the
API on the same port (``SO_REUSEPORT``: the kernel spreads connections), and serves the gRPC
policy port itself with a :class:`FanoutAgent`: a push is validated, persisted and applied by
the parent, then sent to every worker, and acknowledged only once every worker reports the
same policy running (else the push fails and the controller sends it again). Workers start
from the policy the parent runs. ``/metrics`` on any port is every process's samples merged
(:mod:`controller.router.merge`). A worker that dies stops the instance (exit 1): a
supervisor restarts it whole, rather than it serving on with fewer processes unnoticed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import resource
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from controller.clock import Clock, WallClock
from controller.errors import ConfigError
from controller.policy import Policy, dumps, loads
from controller.rollout.agent import ApplyOutcome, ApplyResult, RouterAgent
from controller.rollout.security import split_host_port
from controller.rollout.server import RouterServer
from controller.router.config import RouterConfig
from controller.router.instances import Pool, Role
from controller.router.merge import merge_expositions
from controller.router.proxy import Router
from controller.router.serve import ProcessSpec, Started, initial_policy, make_agent, serve_router

log = logging.getLogger(__name__)

WORKER_REPLY_S = 10.0  # a worker answers an apply within this, or the push is not acked
START_S = 60.0


def raise_fd_limit() -> int:
    """Lift the soft open-files limit to the hard one: each request holds a client and an
    engine connection, and the common soft default (1,024) refused connections (EMFILE) at
    about 500 requests in flight. Returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft


async def run_router_processes(cfg: RouterConfig, *, echo: Callable[[str], None]) -> None:
    limit = raise_fd_limit()
    if limit < 4096:
        log.warning("router: open files limited to %d (about %d requests in flight)",
                    limit, limit // 2)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if cfg.http.processes == 1:
        def started(s: Started) -> None:
            echo(f"router listening on {s.http} (OpenAI API), policy gRPC on {s.grpc}; "
                 f"tokenizer: {s.tokenizer}; policy: v{s.policy_version}")

        await serve_router(cfg, stop, on_started=started)
    else:
        await _parent(cfg, stop, echo)
    echo("router stopped")


class FanoutAgent(RouterAgent):
    """The parent's agent: applies like any agent, then makes every worker run the same
    policy before answering; a worker that does not confirm fails the push."""

    def __init__(self, workers: list[Connection], *, clock: Clock, **kw: Any) -> None:
        super().__init__(clock=clock, **kw)
        self._monotonic = clock.monotonic
        self._workers = workers
        self._fan_lock = threading.Lock()
        self._seq = 0

    def _reply(self, conn: Connection, seq: int) -> str | None:
        """The checksum a worker reports for apply ``seq``; replies to earlier applies (a
        worker that was paused past their deadline) are skipped. None: no reply in time."""
        deadline = self._monotonic() + WORKER_REPLY_S
        while (left := deadline - self._monotonic()) > 0 and conn.poll(left):
            _, checksum, got = conn.recv()
            if got == seq:
                return str(checksum)
        return None

    def apply(self, policy: Policy, *, rollback: bool = False) -> ApplyResult:
        result = super().apply(policy, rollback=rollback)
        if result.outcome not in (ApplyOutcome.APPLIED, ApplyOutcome.NOOP):
            return result
        snap = self.snapshot
        assert snap is not None
        payload = dumps(snap.policy, indent=None)
        with self._fan_lock:
            self._seq += 1
            for conn in self._workers:
                conn.send(("apply", payload, self._seq))
            for i, conn in enumerate(self._workers):
                checksum = self._reply(conn, self._seq)
                if checksum is None:
                    raise RuntimeError(f"router process {i} did not confirm v{snap.version}")
                if checksum != snap.checksum:
                    raise RuntimeError(f"router process {i} runs {checksum[:12]}, not "
                                       f"v{snap.version} ({snap.checksum[:12]})")
        return result


def _worker_main(cfg: RouterConfig, index: int, conn: Connection,
                 policy: str | None) -> None:
    """A worker process: the API on the shared port, updates from the parent."""
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s [process {index}] %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops it (Ctrl-C hits all)
    asyncio.run(_worker(cfg, index, conn, loads(policy) if policy else None))


async def _worker(cfg: RouterConfig, index: int, conn: Connection,
                  policy: Policy | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    held: dict[str, Any] = {}

    def hook(agent: RouterAgent, router: Router) -> None:
        held["agent"], held["router"] = agent, router

    def started(s: Started) -> None:
        conn.send(("started", s.metrics_url))
        threading.Thread(target=_commands, args=(conn, held, loop, stop), daemon=True).start()

    spec = ProcessSpec(serve_grpc=False, reuse_port=True, private_metrics=True,
                       initial=policy, use_initial=True)
    await serve_router(cfg, stop, on_started=started, spec=spec, hook=hook)


def _commands(conn: Connection, held: dict[str, Any], loop: asyncio.AbstractEventLoop,
              stop: asyncio.Event) -> None:
    """The worker's side of the pipe: apply what the parent runs; peers' metrics URLs."""
    agent: RouterAgent = held["agent"]
    router: Router = held["router"]
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            loop.call_soon_threadsafe(stop.set)
            return
        if msg[0] == "apply":
            agent.apply(loads(msg[1]), rollback=True)
            conn.send(("applied", agent.checksum, msg[2]))
        elif msg[0] == "peers":
            router.metrics_peers = list(msg[1])


async def _start_workers(cfg: RouterConfig, policy: Policy | None
                         ) -> tuple[list[multiprocessing.process.BaseProcess], list[Connection],
                                    list[str]]:
    ctx = multiprocessing.get_context("spawn")
    procs: list[multiprocessing.process.BaseProcess] = []
    conns: list[Connection] = []
    urls: list[str] = []
    payload = dumps(policy, indent=None) if policy is not None else None
    for i in range(cfg.http.processes):
        parent_end, child_end = ctx.Pipe()
        p = ctx.Process(target=_worker_main, args=(cfg, i, child_end,
                                                     payload), name=f"pd-router-{i}")
        p.start()
        procs.append(p)
        conns.append(parent_end)
    for i, conn in enumerate(conns):
        ready = await asyncio.to_thread(conn.poll, START_S)
        if not ready:
            raise ConfigError(f"router process {i} did not start within {START_S:.0f} s")
        _, url = conn.recv()
        urls.append(url)
    for conn in conns:
        conn.send(("peers", urls))
    return procs, conns, urls


async def _parent(cfg: RouterConfig, stop: asyncio.Event, echo: Callable[[str], None]) -> None:
    workers: list[Connection] = []
    no_prefill = Pool(Role.PREFILL, [], unhealthy_after=1, waiting_stale_after_s=1.0,
                      clock=WallClock())
    base = make_agent(cfg, CollectorRegistry(), no_prefill, None, None)
    agent = FanoutAgent(workers, clock=WallClock(), router_id=base.router_id,
                        registry=CollectorRegistry(),
                        state_file=cfg.grpc.state_file,
                        decision_timeout_ms=cfg.grpc.decision_timeout_ms,
                        stale_after_s=cfg.grpc.stale_after_s,
                        initial_policy=initial_policy(cfg.grpc.initial_policy))
    procs, conns, urls = await _start_workers(cfg, agent.policy)
    workers.extend(conns)
    server = RouterServer(agent, listen=cfg.grpc.listen, security=cfg.security,
                          serve_decisions=False,
                          allow_unauthenticated=cfg.grpc.allow_unauthenticated)
    metrics_runner = await _merged_metrics(cfg, urls)
    try:
        await server.start()
        snap = agent.snapshot
        echo(f"router listening on http://{cfg.http.listen} (OpenAI API), policy gRPC on "
             f"{server.address}; processes: {','.join(str(p.pid) for p in procs)}; "
             f"policy: v{snap.version if snap else 0}")
        while not stop.is_set():
            dead = [p for p in procs if p.exitcode is not None]
            if dead:
                raise ConfigError(f"router process {dead[0].name} exited ({dead[0].exitcode}); "
                                  "stopping the instance")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
    finally:
        await server.stop(grace=2.0)
        if metrics_runner is not None:
            await metrics_runner.cleanup()
        await asyncio.to_thread(_stop_workers, procs)


def _stop_workers(procs: list[multiprocessing.process.BaseProcess]) -> None:
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    for p in procs:
        p.join(15)
        if p.exitcode is None:
            p.kill()
            p.join(5)


async def _merged_metrics(cfg: RouterConfig, urls: list[str]) -> web.AppRunner | None:
    """``[http] metrics_listen`` in the parent: every worker's samples, merged."""
    if cfg.http.metrics_listen is None:
        return None

    async def metrics(request: web.Request) -> web.Response:
        async with aiohttp.ClientSession(trust_env=False) as s:
            texts = []
            for url in urls:
                try:
                    async with s.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
                        texts.append(await r.text())
                except (aiohttp.ClientError, TimeoutError):
                    return web.Response(status=503, text=f"{url} did not answer")
        return web.Response(body=merge_expositions(texts).encode(),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, port = split_host_port(cfg.http.metrics_listen)
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as e:
        await runner.cleanup()
        raise ConfigError(f"cannot listen on http.metrics_listen {cfg.http.metrics_listen}: "
                          f"{e.strerror or e}") from None
    return runner
