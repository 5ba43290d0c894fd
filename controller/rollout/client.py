"""The controller's gRPC client of ``RouterPolicyService`` (and ``RouterAgentService``).

:class:`GrpcRouterTransport` is the real :class:`~controller.rollout.reconciler.RouterTransport`:
one cached ``grpc.aio`` channel per router address (closed by :meth:`close`), a deadline on
every call, status codes mapped to the error taxonomy (transient: retry; terminal: do not).
Retries are the reconciler's job (with jitter on its clock), so the channel's own retry
policy stays off. A call that fails with a transient status (``UNAVAILABLE``, a deadline,
a connection cut mid-call) drops its channel: the next attempt connects afresh instead of
failing fast inside the old channel's reconnect backoff, so a router that comes back after
an outage is reached on the very next attempt.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import grpc.aio

from controller._proto.pdcontrol.v1 import router_agent_service_pb2 as agent_pb
from controller._proto.pdcontrol.v1 import router_agent_service_pb2_grpc as agent_grpc
from controller._proto.pdcontrol.v1 import router_policy_service_pb2 as policy_pb
from controller._proto.pdcontrol.v1 import router_policy_service_pb2_grpc as policy_grpc
from controller.config import SecurityConfig
from controller.errors import TerminalError, TransientError
from controller.policy import Decision, Features, Policy, PolicyValidationError
from controller.rollout.agent import ApplyOutcome
from controller.rollout.codec import (
    MAX_MESSAGE_BYTES,
    decision_from_proto,
    features_to_proto,
    policy_from_proto,
    policy_to_proto,
    timestamp_to_epoch,
    too_large,
)
from controller.rollout.reconciler import ApplyReply, RouterState
from controller.rollout.security import (
    channel_credentials,
    channel_options,
    reloading_channel_credentials,
)

T = TypeVar("T")

# Codes worth another attempt: the router may be restarting, overloaded or slow.
TRANSIENT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
    }
)

APPLY_RESULT_FROM_PROTO: dict[int, ApplyOutcome] = {
    policy_pb.APPLY_RESULT_APPLIED: ApplyOutcome.APPLIED,
    policy_pb.APPLY_RESULT_NOOP: ApplyOutcome.NOOP,
    policy_pb.APPLY_RESULT_CONFLICT: ApplyOutcome.CONFLICT,
    policy_pb.APPLY_RESULT_STALE: ApplyOutcome.STALE,
    policy_pb.APPLY_RESULT_INVALID: ApplyOutcome.INVALID,
    policy_pb.APPLY_RESULT_PERSIST_FAILED: ApplyOutcome.PERSIST_FAILED,
}


class RouterCallError(TransientError):
    """A call that may pass later (``code`` says why)."""

    def __init__(self, router: str, code: grpc.StatusCode, details: str) -> None:
        self.router, self.code, self.details = router, code, details
        super().__init__(f"router {router}: {code.name}: {details}")


class RouterRefusedCall(TerminalError):
    """A call that will fail the same way again (bad credentials, unimplemented, ...)."""

    def __init__(self, router: str, code: grpc.StatusCode, details: str) -> None:
        self.router, self.code, self.details = router, code, details
        super().__init__(f"router {router}: {code.name}: {details}")


# What a router may answer as its checksum: none (no policy), or sha256 hex as we compute it.
_CHECKSUM = re.compile(r"(?:[0-9a-f]{64})?")


def router_state(router: str, version: int, checksum: str) -> RouterState:
    """A router's answer as a state; a malformed checksum is refused (terminal), naming the
    router's breach of the contract: it can never equal ours, so the router would read as
    diverged and be pushed to on every pass, never in sync."""
    if not _CHECKSUM.fullmatch(checksum):
        raise RouterRefusedCall(router, grpc.StatusCode.DATA_LOSS,
                                f"router answered a malformed checksum {checksum[:80]!r} "
                                "(expected 64 lowercase hex digits, or none)")
    return RouterState(version, checksum)


def error_from_status(router: str, e: grpc.aio.AioRpcError) -> Exception:
    code = e.code()
    details = e.details() or ""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
        # A receive limit below the message (a router on gRPC's default 4 MiB, or ours below
        # a router's table): another attempt sends the same bytes. Retried, a push read as
        # "unreachable".
        side = "the router's" if details.startswith("SERVER") else "this controller's"
        return RouterRefusedCall(router, code, f"{details} ({side} gRPC message-size limit: "
                                 "sent again, it fails the same way)")
    if code in TRANSIENT_CODES:
        return RouterCallError(router, code, details)
    return RouterRefusedCall(router, code, details)


def client_options(
    security: SecurityConfig | None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    reconnect_backoff_max_s: float = 2.0,
) -> list[tuple[str, Any]]:
    backoff_ms = max(100, int(reconnect_backoff_max_s * 1000))
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.enable_retries", 0),
        # Not grpc.min_reconnect_backoff_ms: gRPC core also uses it as the minimum time a
        # connection attempt may take (20 s by default), and a busy router needs that.
        ("grpc.initial_reconnect_backoff_ms", min(100, backoff_ms)),
        ("grpc.max_reconnect_backoff_ms", backoff_ms),
        # gRPC shares subchannels between channels to the same address by default: the fresh
        # channel made after a transient failure would inherit the old one's subchannel, still
        # in reconnect backoff, and fail fast with its last error ("Connection refused" right
        # after a router restarts on the same port). Each channel gets its own.
        ("grpc.use_local_subchannel_pool", 1),
        *channel_options(security),
    ]


class GrpcRouterTransport:
    """Talks to routers at ``HOST:PORT`` addresses (the router id is its address)."""

    def __init__(
        self,
        security: SecurityConfig | None = None,
        *,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        reconnect_backoff_max_s: float = 2.0,
        retire_grace_s: float = 30.0,
    ) -> None:
        # Certificate, key and CA files are watched: a rotation rebuilds the credentials.
        self._credential_files = reloading_channel_credentials(security)
        self._credentials = (self._credential_files.value if self._credential_files is not None
                             else channel_credentials(security))
        self._options = client_options(security, max_message_bytes, reconnect_backoff_max_s)
        self._max_message_bytes = max_message_bytes
        self._retire_grace_s = retire_grace_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._closing: set[asyncio.Future[None]] = set()
        # The last encoded request: a push sends one policy to many routers.
        self._encoded: tuple[Policy, bool, policy_pb.ApplyPolicyRequest] | None = None

    def channel(self, router: str) -> grpc.aio.Channel:
        if self._credential_files is not None:
            credentials, changed = self._credential_files.current()
            if changed:
                # A channel keeps the credentials it was made with: new ones for every router.
                self._credentials = credentials
                for stale in self._channels.values():
                    self._retire(stale, self._retire_grace_s)
                self._channels = {}
        ch = self._channels.get(router)
        if ch is None:
            if self._credentials is None:
                ch = grpc.aio.insecure_channel(router, options=self._options)
            else:
                ch = grpc.aio.secure_channel(router, self._credentials, options=self._options)
            self._channels[router] = ch
        return ch

    async def _call(self, router: str, call: Callable[[grpc.aio.Channel], Awaitable[T]]) -> T:
        """``call`` on ``router``'s channel, its errors in the taxonomy. A transient failure
        retires that channel (only that one: another call may have replaced it already) with
        a grace, so the calls still in flight on it finish: closing it at once would cancel
        them, and their bare CancelledError would pass every handler and end the pass."""
        ch = self.channel(router)
        try:
            return await call(ch)
        except grpc.aio.AioRpcError as e:
            error = error_from_status(router, e)
            if isinstance(error, RouterCallError) and self._channels.get(router) is ch:
                del self._channels[router]
                self._retire(ch, self._retire_grace_s)
            raise error from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # our own caller is cancelled (shutdown): not the channel's doing
            # The channel was closed under the call (a retired channel's grace ran out).
            raise RouterCallError(router, grpc.StatusCode.CANCELLED,
                                  "the call's channel was closed under it") from None

    def _retire(self, channel: grpc.aio.Channel, grace_s: float | None) -> None:
        """Close ``channel`` in the background; calls in flight get ``grace_s`` to finish."""
        task = asyncio.ensure_future(channel.close(grace_s))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _request(self, policy: Policy, rollback: bool) -> policy_pb.ApplyPolicyRequest:
        cached = self._encoded
        if cached is not None and cached[0] is policy and cached[1] == rollback:
            return cached[2]
        request = policy_pb.ApplyPolicyRequest(policy=policy_to_proto(policy), rollback=rollback)
        self._encoded = (policy, rollback, request)
        return request

    async def apply(
        self, router: str, policy: Policy, rollback: bool, deadline_s: float
    ) -> ApplyReply:
        request = self._request(policy, rollback)
        if (size := request.ByteSize()) > self._max_message_bytes:
            # Terminal, refused before the call: gRPC's own RESOURCE_EXHAUSTED would be
            # retried and reported as an unreachable router.
            raise RouterRefusedCall(router, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    too_large(size, self._max_message_bytes))
        response: policy_pb.ApplyPolicyResponse = await self._call(
            router, lambda ch: policy_grpc.RouterPolicyServiceStub(ch).ApplyPolicy(
                request, timeout=deadline_s))
        outcome = APPLY_RESULT_FROM_PROTO.get(response.result)
        if outcome is None:
            raise RouterRefusedCall(
                router, grpc.StatusCode.UNKNOWN, f"unknown ApplyResult {response.result}"
            )
        state = router_state(router, response.applied_version, response.checksum)
        return ApplyReply(outcome, state.version, state.checksum, response.message)

    async def get(self, router: str, deadline_s: float) -> RouterState:
        response = await self._get(router, deadline_s, omit_policy=True)
        return router_state(router, response.version, response.checksum)

    async def get_policy(
        self, router: str, deadline_s: float
    ) -> tuple[Policy | None, RouterState, float | None]:
        """The router's policy (decoded and validated), its state and when it was applied."""
        response = await self._get(router, deadline_s, omit_policy=False)
        policy = None
        if response.HasField("policy"):
            try:
                policy = policy_from_proto(response.policy)
            except PolicyValidationError as e:
                raise RouterRefusedCall(
                    router, grpc.StatusCode.DATA_LOSS, f"router sent an invalid policy: {e}"
                ) from None
        applied_at = (
            timestamp_to_epoch(response.applied_at) if response.HasField("applied_at") else None
        )
        return policy, router_state(router, response.version, response.checksum), applied_at

    async def _get(
        self, router: str, deadline_s: float, *, omit_policy: bool
    ) -> policy_pb.GetPolicyResponse:
        request = policy_pb.GetPolicyRequest(omit_policy=omit_policy)
        response: policy_pb.GetPolicyResponse = await self._call(
            router, lambda ch: policy_grpc.RouterPolicyServiceStub(ch).GetPolicy(
                request, timeout=deadline_s))
        return response

    async def decide(
        self, router: str, features: Features, deadline_s: float
    ) -> tuple[Decision, int]:
        """Ask a router agent's ``RouterAgentService`` for a decision: (decision, version)."""
        request = agent_pb.DecideRequest(features=features_to_proto(features))
        response: agent_pb.DecideResponse = await self._call(
            router, lambda ch: agent_grpc.RouterAgentServiceStub(ch).Decide(
                request, timeout=deadline_s))
        try:
            return decision_from_proto(response.decision), response.policy_version
        except PolicyValidationError as e:
            raise RouterRefusedCall(router, grpc.StatusCode.DATA_LOSS, str(e)) from None

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for ch in channels.values():
            await ch.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    async def __aenter__(self) -> GrpcRouterTransport:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
