"""Fault-injection harness: real ``grpc.aio`` router servers on 127.0.0.1 with faults put in
through our own seams (a server interceptor, a :class:`RouterAgent` subclass), reached by the
real :class:`GrpcRouterTransport` and :class:`Reconciler` on the wall clock."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import grpc.aio
from prometheus_client import CollectorRegistry

from controller.clock import WallClock
from controller.config import SecurityConfig
from controller.policy import Policy
from controller.rollout.agent import ApplyResult, RouterAgent
from controller.rollout.client import GrpcRouterTransport
from controller.rollout.reconciler import Reconciler
from controller.rollout.server import RouterServer

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")

APPLY = "/pdcontrol.v1.RouterPolicyService/ApplyPolicy"
GET = "/pdcontrol.v1.RouterPolicyService/GetPolicy"


class RecordingClock(WallClock):
    """The wall clock, remembering every backoff the reconciler sleeps."""

    def __init__(self) -> None:
        super().__init__()
        self.slept: list[float] = []

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        await super().sleep(seconds)


class FaultInterceptor(grpc.aio.ServerInterceptor):
    """Answers the next ``fail[method]`` calls of a method with ``code`` instead of serving."""

    def __init__(self) -> None:
        self.fail: dict[str, int] = {}
        self.code = grpc.StatusCode.UNAVAILABLE
        self.injected = 0

        async def deny(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            await context.abort(self.code, f"injected {self.code.name}")

        self._deny: grpc.RpcMethodHandler[Any, Any] = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[_Req, _Resp] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[_Req, _Resp] | None:
        left = self.fail.get(handler_call_details.method, 0)
        if left > 0:
            self.fail[handler_call_details.method] = left - 1
            self.injected += 1
            return self._deny
        return await continuation(handler_call_details)


class SlowAgent(RouterAgent):
    """An agent whose next ``slow_applies`` updates wait for ``delay_s`` (or ``release``)
    before doing the real work: a router slower than the controller's deadline."""

    def __init__(self, *, slow_applies: int = 0, delay_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.slow_applies = slow_applies
        self.delay_s = delay_s
        self.entered = threading.Event()
        self.release = threading.Event()

    def apply(self, policy: Policy, *, rollback: bool = False) -> ApplyResult:
        if self.slow_applies > 0:
            self.slow_applies -= 1
            self.entered.set()
            self.release.wait(self.delay_s)  # runs in the server's worker thread
        return super().apply(policy, rollback=rollback)


def applied_count(agent: RouterAgent) -> float:
    value = agent.registry.get_sample_value("pdrouter_updates_total", {"result": "applied"})
    return value or 0.0


class Routers:
    """``n`` routers on fixed loopback ports, each persisting to its own state file; one can
    be stopped, restarted (a new agent loading its state file) or given faults."""

    def __init__(
        self,
        state_dir: Path,
        n: int,
        *,
        security: SecurityConfig | None = None,
        agent_factory: Callable[..., RouterAgent] = RouterAgent,
    ) -> None:
        self.state_dir = state_dir
        self.n = n
        self.security = security
        self.agent_factory = agent_factory
        self.servers: dict[str, RouterServer] = {}
        self.faults: dict[str, FaultInterceptor] = {}
        self.names: dict[str, str] = {}
        self.addresses: list[str] = []

    def state_file(self, address: str) -> Path:
        return self.state_dir / f"{self.names[address]}.json"

    def _agent(self, name: str, **kwargs: Any) -> RouterAgent:
        return self.agent_factory(
            router_id=name, registry=CollectorRegistry(),
            state_file=self.state_dir / f"{name}.json", **kwargs,
        )

    async def _serve(
        self, agent: RouterAgent, listen: str, fault: FaultInterceptor
    ) -> RouterServer:
        server = RouterServer(agent, listen=listen, security=self.security)
        # Our fault seam runs after the security interceptors, like any servicer would.
        server.security = dataclasses.replace(
            server.security, interceptors=(*server.security.interceptors, fault)
        )
        await server.start()
        return server

    async def start(self) -> None:
        for i in range(self.n):
            name = f"router-{i}"
            fault = FaultInterceptor()
            server = await self._serve(self._agent(name), "127.0.0.1:0", fault)
            self.servers[server.address] = server
            self.faults[server.address] = fault
            self.names[server.address] = name
            self.addresses.append(server.address)

    def agent(self, address: str) -> RouterAgent:
        return self.servers[address].agent

    async def stop(self, address: str) -> None:
        await self.servers[address].stop(grace=None)

    async def restart(self, address: str, **agent_kwargs: Any) -> RouterAgent:
        """A new agent (loading the state file) behind a new server on the same port."""
        agent = self._agent(self.names[address], **agent_kwargs)
        self.servers[address] = await self._serve(agent, address, self.faults[address])
        return agent

    def versions(self) -> dict[str, int]:
        out = {}
        for address, server in self.servers.items():
            snap = server.agent.snapshot
            out[address] = snap.version if snap is not None else 0
        return out

    async def close(self) -> None:
        for server in self.servers.values():
            await server.stop(grace=None)


def reconciler(
    transport: GrpcRouterTransport,
    clock: WallClock,
    *,
    deadline_s: float = 2.0,
    max_attempts: int = 4,
    backoff_initial_s: float = 0.05,
    backoff_max_s: float = 0.4,
) -> Reconciler:
    return Reconciler(
        transport, clock, max_concurrency=16, deadline_s=deadline_s, max_attempts=max_attempts,
        backoff_initial_s=backoff_initial_s, backoff_max_s=backoff_max_s,
    )
