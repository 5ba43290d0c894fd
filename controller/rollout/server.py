"""The gRPC servers a router (or its agent sidecar) runs, wrapping one :class:`RouterAgent`.

* ``pdcontrol.v1.RouterPolicyService`` for the controller: ``ApplyPolicy`` / ``GetPolicy``,
  with the semantics of :meth:`RouterAgent.apply` (no-op, conflict, stale unless rollback,
  invalid refused keeping the last good policy, persisted before it goes live);
* ``pdcontrol.v1.RouterAgentService`` for routers not written in Python: ``Decide`` /
  ``Observe`` against the same agent;
* ``grpc.health.v1.Health`` (exempt from the bearer token) and, optionally, reflection
  (``grpc.reflection.v1`` and ``v1alpha``, :mod:`controller.rollout.reflection`).

Security comes from :mod:`controller.rollout.security`; a refused call never reaches the agent.
"""

from __future__ import annotations

import asyncio
import logging
from types import TracebackType
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from controller._proto.pdcontrol.v1 import policy_pb2 as pb
from controller._proto.pdcontrol.v1 import router_agent_service_pb2 as agent_pb
from controller._proto.pdcontrol.v1 import router_agent_service_pb2_grpc as agent_grpc
from controller._proto.pdcontrol.v1 import router_policy_service_pb2 as policy_pb
from controller._proto.pdcontrol.v1 import router_policy_service_pb2_grpc as policy_grpc
from controller.config import SecurityConfig
from controller.errors import ConfigError
from controller.policy import PolicyValidationError
from controller.rollout.agent import ApplyOutcome, PolicySnapshot, RouterAgent
from controller.rollout.codec import (
    MAX_MESSAGE_BYTES,
    decision_from_proto,
    decision_to_proto,
    epoch_to_timestamp,
    features_from_proto,
    policy_from_proto,
    policy_to_proto,
)
from controller.rollout.security import ServerSecurity, check_listen, server_security

POLICY_SERVICE = "pdcontrol.v1.RouterPolicyService"
AGENT_SERVICE = "pdcontrol.v1.RouterAgentService"

APPLY_RESULT_TO_PROTO: dict[ApplyOutcome, policy_pb.ApplyResult.ValueType] = {
    ApplyOutcome.APPLIED: policy_pb.APPLY_RESULT_APPLIED,
    ApplyOutcome.NOOP: policy_pb.APPLY_RESULT_NOOP,
    ApplyOutcome.CONFLICT: policy_pb.APPLY_RESULT_CONFLICT,
    ApplyOutcome.STALE: policy_pb.APPLY_RESULT_STALE,
    ApplyOutcome.INVALID: policy_pb.APPLY_RESULT_INVALID,
    ApplyOutcome.PERSIST_FAILED: policy_pb.APPLY_RESULT_PERSIST_FAILED,
}

_log = logging.getLogger(__name__)


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # Never share a port with another live server (gRPC enables SO_REUSEPORT by default).
        ("grpc.so_reuseport", 0),
    ]


class RouterPolicyServicer(policy_grpc.RouterPolicyServiceServicer):
    """``ApplyPolicy`` / ``GetPolicy`` over one agent.

    ``offload_apply`` runs :meth:`RouterAgent.apply` (validation, checksum, an fsynced file
    write) in a worker thread so one slow disk does not stall the event loop's other work.
    """

    def __init__(self, agent: RouterAgent, *, offload_apply: bool = True) -> None:
        self._agent = agent
        self._offload = offload_apply
        self._encoded: tuple[PolicySnapshot, pb.Policy] | None = None

    async def ApplyPolicy(
        self,
        request: policy_pb.ApplyPolicyRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> policy_pb.ApplyPolicyResponse:
        agent = self._agent
        if not request.HasField("policy"):
            return self._refused_invalid("policy: missing")
        try:
            # Decoding a large table takes ~0.2 s: off the loop, as the apply, else every
            # Decide call waited for it.
            policy = (await asyncio.to_thread(policy_from_proto, request.policy)
                      if self._offload else policy_from_proto(request.policy))
        except PolicyValidationError as e:
            listed = "; ".join(str(p) for p in e.problems)
            return self._refused_invalid(
                f"policy v{request.policy.version} is invalid ({len(e.problems)} problem(s)): "
                f"{listed}; keeping v{agent.snapshot.version if agent.snapshot else 0}"
            )
        if self._offload:
            result = await asyncio.to_thread(agent.apply, policy, rollback=request.rollback)
        else:
            result = agent.apply(policy, rollback=request.rollback)
        return policy_pb.ApplyPolicyResponse(
            applied_version=result.applied_version,
            checksum=result.checksum,
            result=APPLY_RESULT_TO_PROTO[result.outcome],
            message=result.message,
        )

    def _refused_invalid(self, message: str) -> policy_pb.ApplyPolicyResponse:
        # Refused before it could become a Policy: counted like the agent counts its refusals.
        agent = self._agent
        agent.metrics.updates.labels(ApplyOutcome.INVALID.value).inc()
        _log.warning("router %s: update refused: %s", agent.router_id, message)
        snap = agent.snapshot
        return policy_pb.ApplyPolicyResponse(
            applied_version=snap.version if snap is not None else 0,
            checksum=snap.checksum if snap is not None else "",
            result=policy_pb.APPLY_RESULT_INVALID,
            message=message,
        )

    async def GetPolicy(
        self,
        request: policy_pb.GetPolicyRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> policy_pb.GetPolicyResponse:
        snap = self._agent.snapshot  # one read: policy, checksum and time stay consistent
        if snap is None:
            return policy_pb.GetPolicyResponse()
        response = policy_pb.GetPolicyResponse(
            version=snap.version,
            checksum=snap.checksum,
            applied_at=epoch_to_timestamp(snap.applied_at),
        )
        if not request.omit_policy:
            cached = self._encoded
            if cached is None or cached[0] is not snap:
                cached = (snap, policy_to_proto(snap.policy, checksum=snap.checksum))
                self._encoded = cached
            response.policy.CopyFrom(cached[1])
        return response


class RouterAgentServicer(agent_grpc.RouterAgentServiceServicer):
    """``Decide`` / ``Observe`` for routers that call the agent over gRPC."""

    def __init__(self, agent: RouterAgent) -> None:
        self._agent = agent

    async def Decide(
        self,
        request: agent_pb.DecideRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> agent_pb.DecideResponse:
        decision = self._agent.decide(features_from_proto(request.features))
        snap = self._agent.snapshot
        return agent_pb.DecideResponse(
            decision=decision_to_proto(decision),
            policy_version=snap.version if snap is not None else 0,
        )

    async def Observe(
        self,
        request: agent_pb.ObserveRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> agent_pb.ObserveResponse:
        try:
            decision = decision_from_proto(request.decision)
        except PolicyValidationError as e:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "; ".join(str(p) for p in e.problems)
            )
            raise  # abort() raises; this keeps the type checker informed
        features = features_from_proto(request.features) if request.HasField("features") else None
        tpot = request.tpot_s if request.HasField("tpot_s") else None
        label = self._agent.observe(decision, request.ttft_s, tpot, features)
        return agent_pb.ObserveResponse(slo=label)


class RouterServer:
    """One ``grpc.aio`` server for one agent: policy service, agent service, health.

    ``listen`` is ``HOST:PORT`` (port 0 picks a free one; read :attr:`port` after
    :meth:`start`). A server without authentication refuses a non-loopback address unless
    ``allow_unauthenticated`` is set.
    """

    def __init__(
        self,
        agent: RouterAgent,
        *,
        listen: str = "127.0.0.1:0",
        security: SecurityConfig | None = None,
        serve_decisions: bool = True,
        reflection: bool = False,
        allow_unauthenticated: bool = False,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        offload_apply: bool = True,
    ) -> None:
        self.agent = agent
        self.listen = listen
        self.security: ServerSecurity = server_security(security, agent.registry)
        check_listen(listen, self.security, allow_unauthenticated=allow_unauthenticated)
        self._serve_decisions = serve_decisions
        self._reflection = reflection
        self._max_message_bytes = max_message_bytes
        self._offload_apply = offload_apply
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self.port = 0

    @property
    def address(self) -> str:
        host = self.listen.rpartition(":")[0]
        return f"{host}:{self.port}"

    async def start(self) -> int:
        if self._server is not None:
            raise RuntimeError("server already started")
        server = grpc.aio.server(
            interceptors=self.security.interceptors,
            options=server_options(self._max_message_bytes),
        )
        policy_grpc.add_RouterPolicyServiceServicer_to_server(
            RouterPolicyServicer(self.agent, offload_apply=self._offload_apply), server
        )
        services = [POLICY_SERVICE]
        if self._serve_decisions:
            agent_grpc.add_RouterAgentServiceServicer_to_server(
                RouterAgentServicer(self.agent), server
            )
            services.append(AGENT_SERVICE)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        if self._reflection:
            from controller.rollout.reflection import enable_reflection

            enable_reflection((*services, health.SERVICE_NAME), server)
        try:
            if self.security.credentials is None:
                port = server.add_insecure_port(self.listen)
            else:
                port = server.add_secure_port(self.listen, self.security.credentials)
        except RuntimeError as e:
            raise ConfigError(f"cannot listen on {self.listen}: {e}") from None
        await server.start()
        for name in ("", *services):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server, self._health, self.port = server, health_servicer, port
        _log.info(
            "router %s: serving %s on %s (%s)",
            self.agent.router_id, ", ".join(services), self.address, self.security.describe(),
        )
        return port

    async def stop(self, grace: float | None = 1.0) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        await server.stop(grace)

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    async def __aenter__(self) -> RouterServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
