"""Hostile policies on the wire: random bytes and mutated valid ``pdcontrol.v1.Policy``
messages through the decoder and a router's ``ApplyPolicy``.

Expected: the decoder returns a valid policy or raises PolicyValidationError (never another
exception); a router applies a message whole or not at all (what it runs and what it
persisted stay the last good policy on every refusal); memory stays bounded; the 16 MiB
message size limit holds on both sides.
"""

from __future__ import annotations

import asyncio
import math
import tracemalloc
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from controller._proto.pdcontrol.v1 import policy_pb2 as pb
from controller._proto.pdcontrol.v1 import router_policy_service_pb2 as policy_pb
from controller.policy import Axes, Policy, PolicyValidationError, Route, loads, validate_policy
from controller.rollout.agent import RouterAgent
from controller.rollout.client import GrpcRouterTransport, RouterRefusedCall
from controller.rollout.codec import MAX_MESSAGE_BYTES, policy_from_proto, policy_to_proto
from controller.rollout.server import RouterPolicyServicer, RouterServer
from tests.policy.strategies import policies

FUZZ = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
LAST_GOOD = Policy.uniform(5, Route.DECODE_LOCAL)
LAST_GOOD_WIRE = policy_to_proto(LAST_GOOD).SerializeToString()


def decode(data: bytes) -> Policy | None:
    """The router's decoding path: bytes -> message -> validated policy (None if refused)."""
    try:
        msg = pb.Policy.FromString(data)
    except DecodeError:
        return None
    try:
        policy = policy_from_proto(msg)
    except PolicyValidationError as e:
        assert e.problems, "a refusal names its problems"
        return None
    assert validate_policy(policy) == []
    assert policy.checksum == msg.checksum  # what the sender signed, exactly
    return policy


@st.composite
def mutated(draw: st.DrawFn, base: bytes = LAST_GOOD_WIRE) -> bytes:
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 8))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "splice"]))
        i = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete" and data:
            del data[i : i + draw(st.integers(1, 16))]
        else:
            data[i:i] = base[: draw(st.integers(0, len(base)))]
    return bytes(data)


@FUZZ
@given(st.binary(max_size=4096))
def test_random_bytes_never_crash_the_decoder(data: bytes) -> None:
    decode(data)


@FUZZ
@given(mutated())
def test_mutated_messages_are_decoded_whole_or_refused(data: bytes) -> None:
    policy = decode(data)
    if policy is not None:  # a mutation the checksum cannot see (e.g. in provenance)
        assert policy.checksum == LAST_GOOD.checksum


@st.composite
def field_mutations(draw: st.DrawFn) -> pb.Policy:
    """A valid message with one field set to a hostile value, checksum left as it was."""
    msg = policy_to_proto(draw(policies(max_edges=4)))
    bad_float = draw(st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, 1e308]))
    which = draw(st.integers(0, 9))
    if which == 0:
        msg.axes.context_tokens.append(bad_float)
    elif which == 1:
        msg.axes.qps.reverse()
        msg.axes.qps.append(msg.axes.qps[-1] if msg.axes.qps else 0.0)
    elif which == 2 and msg.scores:
        msg.scores[0] = bad_float
    elif which == 3 and msg.exploration:
        msg.exploration[-1] = bad_float
    elif which == 4:
        del msg.routes[:]
    elif which == 5:
        msg.routes.append(draw(st.integers(-5, 50)))  # type: ignore[arg-type]
    elif which == 6:
        msg.weights.wtft, msg.weights.wtpot = bad_float, bad_float
    elif which == 7:
        msg.slo.ttft_s = bad_float
    elif which == 8:
        msg.version = draw(st.sampled_from([0, -1, -(2**63)]))
    else:
        msg.ClearField(draw(st.sampled_from(["axes", "weights", "slo", "overrides"])))
    return msg


@FUZZ
@given(field_mutations())
def test_hostile_field_values_are_refused_with_a_path(msg: pb.Policy) -> None:
    try:
        policy = policy_from_proto(msg)
    except PolicyValidationError as e:
        assert e.problems and all(p.path for p in e.problems)
        return
    # Only a mutation that left the content as signed (e.g. the same score) may pass.
    assert validate_policy(policy) == [] and policy.checksum == msg.checksum


def _fresh_agent(tmp_path: Path) -> tuple[RouterAgent, Path]:
    state = tmp_path / "router.json"
    state.unlink(missing_ok=True)
    agent = RouterAgent(registry=CollectorRegistry(), state_file=state)
    assert agent.apply(LAST_GOOD).applied_version == 5
    return agent, state


@settings(FUZZ, max_examples=150)
@given(data=st.one_of(mutated(), st.binary(max_size=512)), rollback=st.booleans())
def test_a_router_applies_a_hostile_update_whole_or_not_at_all(
    tmp_path_factory: pytest.TempPathFactory, data: bytes, rollback: bool
) -> None:
    agent, state = _fresh_agent(tmp_path_factory.mktemp("agent"))
    try:
        request = policy_pb.ApplyPolicyRequest(policy=pb.Policy.FromString(data), rollback=rollback)
    except DecodeError:
        return  # gRPC would refuse to deserialize it before our code runs
    servicer = RouterPolicyServicer(agent, offload_apply=False)
    reply = asyncio.run(servicer.ApplyPolicy(request, None))  # type: ignore[arg-type]
    snap = agent.snapshot
    assert snap is not None
    assert (reply.applied_version, reply.checksum) == (snap.version, snap.checksum)
    on_disk = loads(state.read_bytes())
    assert (on_disk.version, on_disk.checksum) == (snap.version, snap.checksum)
    if reply.result != policy_pb.APPLY_RESULT_APPLIED:
        assert snap.policy is LAST_GOOD or snap.checksum == LAST_GOOD.checksum
        assert snap.version == 5
    else:
        assert decode(data) is not None


def test_decoding_memory_is_bounded_by_the_message() -> None:
    """Even a message claiming the largest table allocates a bounded multiple of its size."""
    big_axes = Axes(
        context_tokens=tuple(float(i) for i in range(1, 65)),
        io_ratio=tuple(i / 64 for i in range(1, 65)),
        qps=tuple(float(i) for i in range(1, 65)),
    )
    msg = policy_to_proto(Policy.uniform(7, Route.PREFILL_NODE, axes=big_axes))
    no_scores = pb.Policy()
    no_scores.CopyFrom(msg)
    del no_scores.scores[:]  # every route sent, no scores
    del msg.routes[1:]  # 262,144 cells announced, one route sent
    hostile = [msg.SerializeToString(), no_scores.SerializeToString(), LAST_GOOD_WIRE * 50]
    for data in hostile:
        tracemalloc.start()
        try:
            decode(data)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 64 * len(data) + 8 * 1024 * 1024, (len(data), peak)


async def test_message_size_limit_is_enforced_on_both_sides(tmp_path: Path) -> None:
    edges = tuple(float(i) for i in range(1, 65))
    huge = Policy.uniform(  # 64^3 cells: about 4.5 MB on the wire
        9, Route.PREFILL_NODE, axes=Axes(edges, tuple(e / 64 for e in edges), edges)
    )
    wire = len(policy_to_proto(huge).SerializeToString())
    assert 1 << 20 < wire < MAX_MESSAGE_BYTES
    limit = 1 << 20

    # Server side: a router that accepts at most 1 MiB refuses the 4.5 MB update unread.
    small_router = RouterServer(
        RouterAgent(registry=CollectorRegistry(), initial_policy=LAST_GOOD),
        max_message_bytes=limit,
    )
    await small_router.start()
    transport = GrpcRouterTransport()
    try:
        with pytest.raises(RouterRefusedCall, match="the router's gRPC message-size") as caught:
            await transport.apply(small_router.address, huge, False, 20.0)
        assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert small_router.agent.snapshot is not None
        assert small_router.agent.snapshot.version == 5
    finally:
        await transport.close()
        await small_router.stop(grace=None)

    # Client side: a controller that accepts at most 1 MiB refuses the router's answer.
    big_router = RouterServer(RouterAgent(registry=CollectorRegistry(), initial_policy=huge))
    await big_router.start()
    strict = GrpcRouterTransport(max_message_bytes=limit)
    normal = GrpcRouterTransport()
    try:
        with pytest.raises(RouterRefusedCall, match="this controller's") as caught:
            await strict.get_policy(big_router.address, 20.0)
        assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        fetched: Any = await normal.get_policy(big_router.address, 20.0)
        assert fetched[0].checksum == huge.checksum  # the default limit takes the largest table
    finally:
        await strict.close()
        await normal.close()
        await big_router.stop(grace=None)


async def test_raw_hostile_bytes_on_the_wire_never_take_the_router_down() -> None:
    """Undecodable and mutated request bytes sent straight to a live router's ApplyPolicy:
    every call gets an answer or a gRPC error, the router keeps serving, and what it runs
    only ever changes to a policy that decodes whole."""
    import random

    rng = random.Random(7)
    valid = policy_pb.ApplyPolicyRequest(policy=policy_to_proto(LAST_GOOD)).SerializeToString()
    payloads = [bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 300))) for _ in range(40)]
    for _ in range(40):
        data = bytearray(valid)
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(len(data))] = rng.getrandbits(8)
        payloads.append(bytes(data))
    server = RouterServer(RouterAgent(registry=CollectorRegistry(), initial_policy=LAST_GOOD))
    await server.start()
    channel = grpc.aio.insecure_channel(server.address)
    try:
        raw: Any = channel.unary_unary("/pdcontrol.v1.RouterPolicyService/ApplyPolicy")
        codes: set[str] = set()
        for payload in payloads:
            try:
                reply = policy_pb.ApplyPolicyResponse.FromString(await raw(payload, timeout=5))
                codes.add(policy_pb.ApplyResult.Name(reply.result))
            except grpc.aio.AioRpcError as e:
                codes.add(e.code().name)
            snap = server.agent.snapshot
            # The checksum covers every decision field: no mutation can change what routes.
            assert snap is not None and snap.checksum == LAST_GOOD.checksum
        get: Any = channel.unary_unary("/pdcontrol.v1.RouterPolicyService/GetPolicy")
        state = policy_pb.GetPolicyResponse.FromString(
            await get(policy_pb.GetPolicyRequest(omit_policy=True).SerializeToString(), timeout=5)
        )
        snap = server.agent.snapshot
        assert snap is not None and (state.version, state.checksum) == (snap.version, snap.checksum)
        assert "APPLY_RESULT_INVALID" in codes  # the hostile ones were refused, not ignored
        # A mutated version number is not covered by the checksum (the transport's
        # authentication is what stops a forged version): applied or refused as stale.
        assert codes <= {"APPLY_RESULT_INVALID", "APPLY_RESULT_NOOP", "APPLY_RESULT_APPLIED",
                         "APPLY_RESULT_STALE", "APPLY_RESULT_CONFLICT",
                         # bytes that are no protobuf: grpc.aio answers UNKNOWN
                         "UNKNOWN"}, codes
    finally:
        await channel.close()
        await server.stop(grace=None)
