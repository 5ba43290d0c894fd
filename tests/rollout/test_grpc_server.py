"""RouterPolicyService / RouterAgentService on real grpc.aio servers on 127.0.0.1."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from controller._proto.pdcontrol.v1 import router_agent_service_pb2 as agent_pb
from controller._proto.pdcontrol.v1 import router_agent_service_pb2_grpc as agent_grpc
from controller._proto.pdcontrol.v1 import router_policy_service_pb2 as policy_pb
from controller._proto.pdcontrol.v1 import router_policy_service_pb2_grpc as policy_grpc
from controller.policy import (
    Axes,
    Decision,
    Features,
    LookupTable,
    Overrides,
    Policy,
    Reason,
    Route,
    decide,
)
from controller.rollout.agent import ApplyOutcome, RouterAgent
from controller.rollout.client import GrpcRouterTransport, RouterCallError
from controller.rollout.codec import decision_to_proto, policy_to_proto
from controller.rollout.server import AGENT_SERVICE, POLICY_SERVICE, RouterServer

DEADLINE_S = 5.0


def table_policy(version: int, flip: int = 0) -> Policy:
    """A 3 x 2 x 2 table with mixed routes; ``flip`` changes the content (not the version)."""
    axes = Axes((512.0, 4096.0, 32768.0), (1.0, 8.0), (4.0, 64.0))
    routes = tuple(
        Route.DECODE_LOCAL if (i + flip) % 2 else Route.PREFILL_NODE for i in range(axes.n_cells)
    )
    table = LookupTable(
        axes, routes, tuple(float(i) for i in range(axes.n_cells)), (0.0,) * axes.n_cells
    )
    return Policy(version=version, table=table)


def updates(agent: RouterAgent, result: str) -> float:
    value = agent.registry.get_sample_value("pdrouter_updates_total", {"result": result})
    return value or 0.0


@pytest.fixture
async def router(tmp_path: Path) -> AsyncIterator[RouterServer]:
    agent = RouterAgent(
        router_id="r", registry=CollectorRegistry(), state_file=tmp_path / "state.json"
    )
    server = RouterServer(agent, reflection=True)
    await server.start()
    yield server
    await server.stop(grace=None)


@pytest.fixture
async def transport() -> AsyncIterator[GrpcRouterTransport]:
    t = GrpcRouterTransport()
    yield t
    await t.close()


async def test_apply_semantics_over_the_wire(
    router: RouterServer, transport: GrpcRouterTransport
) -> None:
    addr = router.address
    v3 = table_policy(3)

    reply = await transport.apply(addr, v3, False, DEADLINE_S)
    assert (reply.outcome, reply.applied_version, reply.checksum) == (
        ApplyOutcome.APPLIED, 3, v3.checksum,
    )
    # Idempotent: the same version and checksum again changes nothing.
    reply = await transport.apply(addr, v3, False, DEADLINE_S)
    assert reply.outcome is ApplyOutcome.NOOP
    assert reply.applied_version == 3

    # Same version, other content: a conflict, refused.
    reply = await transport.apply(addr, table_policy(3, flip=1), False, DEADLINE_S)
    assert reply.outcome is ApplyOutcome.CONFLICT
    assert (reply.applied_version, reply.checksum) == (3, v3.checksum)

    # Lower version: stale unless marked as a rollback.
    v2 = table_policy(2, flip=1)
    reply = await transport.apply(addr, v2, False, DEADLINE_S)
    assert reply.outcome is ApplyOutcome.STALE
    assert reply.applied_version == 3
    reply = await transport.apply(addr, v2, True, DEADLINE_S)
    assert (reply.outcome, reply.applied_version, reply.checksum) == (
        ApplyOutcome.APPLIED, 2, v2.checksum,
    )
    assert router.agent.policy == v2

    state = await transport.get(addr, DEADLINE_S)
    assert (state.version, state.checksum) == (2, v2.checksum)


async def test_invalid_policy_is_refused_and_the_last_good_one_kept(
    router: RouterServer, transport: GrpcRouterTransport
) -> None:
    addr = router.address
    good = table_policy(4)
    await transport.apply(addr, good, False, DEADLINE_S)
    t = good.table
    bad = replace(
        good, version=5, table=replace(t, exploration=(0.5, *t.exploration[1:]))
    )
    reply = await transport.apply(addr, bad, False, DEADLINE_S)
    assert reply.outcome is ApplyOutcome.INVALID
    assert "exploration[0]" in reply.message
    assert (reply.applied_version, reply.checksum) == (4, good.checksum)
    assert router.agent.policy == good


async def test_malformed_messages_are_refused_with_field_paths(
    router: RouterServer, transport: GrpcRouterTransport
) -> None:
    good = table_policy(6)
    await transport.apply(router.address, good, False, DEADLINE_S)
    stub = policy_grpc.RouterPolicyServiceStub(transport.channel(router.address))
    before = updates(router.agent, "invalid")

    tampered = policy_to_proto(table_policy(7))
    tampered.scores[1] = 99.0  # content no longer matches its checksum
    unspecified = policy_to_proto(table_policy(8))
    unspecified.routes[3] = 0  # type: ignore[call-overload]
    cases = [
        (policy_pb.ApplyPolicyRequest(policy=tampered), "checksum"),
        (policy_pb.ApplyPolicyRequest(policy=unspecified), "routes[3]"),
        (policy_pb.ApplyPolicyRequest(), "policy: missing"),
    ]
    for request, expected in cases:
        response = await stub.ApplyPolicy(request, timeout=DEADLINE_S)
        assert response.result == policy_pb.APPLY_RESULT_INVALID
        assert expected in response.message
        assert (response.applied_version, response.checksum) == (6, good.checksum)
    assert router.agent.policy == good
    assert updates(router.agent, "invalid") == before + len(cases)


async def test_get_policy_returns_the_running_policy(
    router: RouterServer, transport: GrpcRouterTransport
) -> None:
    addr = router.address
    policy, state, applied_at = await transport.get_policy(addr, DEADLINE_S)
    assert policy is None and (state.version, state.checksum) == (0, "") and applied_at is None

    v9 = table_policy(9)
    await transport.apply(addr, v9, False, DEADLINE_S)
    policy, state, applied_at = await transport.get_policy(addr, DEADLINE_S)
    assert policy == v9
    assert (state.version, state.checksum) == (9, v9.checksum)
    assert applied_at == pytest.approx(router.agent.applied_at, abs=1e-6)

    stub = policy_grpc.RouterPolicyServiceStub(transport.channel(addr))
    slim = await stub.GetPolicy(policy_pb.GetPolicyRequest(omit_policy=True), timeout=DEADLINE_S)
    assert not slim.HasField("policy")
    assert (slim.version, slim.checksum) == (9, v9.checksum)


async def _restarted_with(transport: GrpcRouterTransport, state_file: Path,
                          policy: Policy) -> RouterServer:
    """A router that applied ``policy``, stopped (a call to it then fails) and started again
    on the same port with the same state file: the restarted server, running."""
    first = RouterServer(RouterAgent(registry=CollectorRegistry(), state_file=state_file))
    await first.start()
    port = first.port
    assert (await transport.apply(first.address, policy, False, DEADLINE_S)).outcome is (
        ApplyOutcome.APPLIED
    )
    await first.stop(grace=None)
    with pytest.raises(RouterCallError):
        await transport.get(first.address, 1.0)
    second = RouterServer(
        RouterAgent(registry=CollectorRegistry(), state_file=state_file),
        listen=f"127.0.0.1:{port}",
    )
    await second.start()
    return second


async def test_applied_policy_survives_a_router_restart(
    tmp_path: Path, transport: GrpcRouterTransport
) -> None:
    v5 = table_policy(5, flip=1)
    second = await _restarted_with(transport, tmp_path / "router.json", v5)
    try:
        policy, state, _ = await transport.get_policy(second.address, DEADLINE_S)
        assert policy == v5
        assert (state.version, state.checksum) == (5, v5.checksum)
        # And it still refuses to go back without a rollback.
        reply = await transport.apply(second.address, table_policy(4), False, DEADLINE_S)
        assert reply.outcome is ApplyOutcome.STALE
    finally:
        await second.stop(grace=None)


async def test_a_router_restarted_on_its_port_is_reached_by_the_next_call(
    tmp_path: Path,
) -> None:
    """After a transient failure the transport makes a fresh channel; with gRPC's shared
    subchannel pool that channel inherited the old subchannel, still in reconnect backoff,
    and failed fast ("Connection refused") in about 1 of 25 restarts. Repeated so that the
    old behaviour fails this test with near certainty (1 - 0.96^200)."""
    for i in range(200):
        transport = GrpcRouterTransport()
        second = await _restarted_with(transport, tmp_path / f"router-{i}.json",
                                       table_policy(5, flip=1))
        try:
            policy, _, _ = await transport.get_policy(second.address, DEADLINE_S)
            assert policy.version == 5, i
        finally:
            await second.stop(grace=None)
            await transport.close()


async def test_decide_and_observe_for_routers_in_other_languages(
    router: RouterServer, transport: GrpcRouterTransport
) -> None:
    addr = router.address
    no_policy, version = await transport.decide(addr, Features(2, 100, 10, 10, 1), DEADLINE_S)
    assert (no_policy.reason, version) == (Reason.NO_POLICY, 0)

    policy = replace(table_policy(11), overrides=Overrides(first_turn_busy_waiting=2,
                                                           later_turn_busy_waiting=2))
    await transport.apply(addr, policy, False, DEADLINE_S)
    samples = [
        Features(1, 0, 500, 100, 1.0),
        Features(1, 0, 500, 100, 1.0, prefill_waiting=3.0),  # every prefill worker busy
        Features(1, 0, 500, 100, 1.0, prefill_waiting=0.0),  # present and 0: not "unknown"
        Features(2, 300, 50, 100, 2.0),
        Features(2, 300, 50, 100, 2.0, prefill_waiting=3.0),
        Features(3, 5000, 2000, 100, 50.0),
        Features(3, 5000, 2000, 100, 50.0, prefill_waiting=3.0),
        Features(4, 1e6, 1, 1, 1e3),
        Features(2, float("nan"), 10, 10, 1),
        Features(2, 100, 10, 0, 1),
    ]
    for f in samples:
        got, version = await transport.decide(addr, f, DEADLINE_S)
        assert version == 11
        assert got == decide(policy, f, lambda: 0.99)
    assert decide(policy, samples[1], lambda: 0.99).reason is Reason.BUSY_PREFILL
    # A later turn its cell sends to a prefill node, every prefill worker busy (the cell
    # comes back over the wire too).
    assert Reason.BUSY_LATER_TURN in {decide(policy, f, lambda: 0.99).reason for f in samples}

    stub = agent_grpc.RouterAgentServiceStub(transport.channel(addr))
    decision = Decision(Route.DECODE_LOCAL, (0, 0, 0), Reason.TABLE)
    met = await stub.Observe(
        agent_pb.ObserveRequest(decision=decision_to_proto(decision), ttft_s=0.1, tpot_s=0.01),
        timeout=DEADLINE_S,
    )
    one_token = await stub.Observe(
        agent_pb.ObserveRequest(decision=decision_to_proto(decision), ttft_s=0.1),
        timeout=DEADLINE_S,
    )
    slow = await stub.Observe(
        agent_pb.ObserveRequest(decision=decision_to_proto(decision), ttft_s=60.0, tpot_s=9.0),
        timeout=DEADLINE_S,
    )
    assert (met.slo, one_token.slo, slow.slo) == ("met", "met", "both_miss")

    bad = decision_to_proto(decision)
    bad.reason = "made_up"
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Observe(agent_pb.ObserveRequest(decision=bad, ttft_s=0.1), timeout=DEADLINE_S)
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "decision.reason" in (e.value.details() or "")


async def test_health_and_reflection(router: RouterServer, transport: GrpcRouterTransport) -> None:
    channel = transport.channel(router.address)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", POLICY_SERVICE, AGENT_SERVICE):
        response = await health.Check(
            health_pb2.HealthCheckRequest(service=service), timeout=DEADLINE_S
        )
        assert response.status == health_pb2.HealthCheckResponse.SERVING

    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)

    async def requests() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    names: set[str] = set()
    async for response in stub.ServerReflectionInfo(requests(), timeout=DEADLINE_S):
        names |= {s.name for s in response.list_services_response.service}
    assert {POLICY_SERVICE, AGENT_SERVICE, "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection"} <= names


async def test_reflection_answers_on_v1(router: RouterServer,
                                        transport: GrpcRouterTransport) -> None:
    """A v1 client (v1's own message types, grpcurl's first try) lists the services and gets
    the file that defines one; a server without reflection answers UNIMPLEMENTED."""
    from google.protobuf import descriptor_pb2, descriptor_pool

    from controller.rollout.reflection import V1_METHOD, v1_messages

    request_cls, response_cls = v1_messages(descriptor_pool.DescriptorPool())
    assert request_cls.DESCRIPTOR.full_name == "grpc.reflection.v1.ServerReflectionRequest"
    call = transport.channel(router.address).stream_stream(
        V1_METHOD, request_serializer=request_cls.SerializeToString,
        response_deserializer=response_cls.FromString)

    async def ask() -> AsyncIterator[Any]:
        yield request_cls(list_services="")
        yield request_cls(file_containing_symbol=POLICY_SERVICE)
        yield request_cls(file_containing_symbol="grpc.reflection.v1.ServerReflection")

    answers = [r async for r in call(ask(), timeout=DEADLINE_S)]
    assert len(answers) == 3
    listed = {s.name for s in answers[0].list_services_response.service}
    assert {POLICY_SERVICE, AGENT_SERVICE, "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= listed
    assert answers[0].original_request.list_services == ""
    for answer, package in ((answers[1], "pdcontrol.v1"), (answers[2], "grpc.reflection.v1")):
        files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                 for b in answer.file_descriptor_response.file_descriptor_proto]
        assert answer.WhichOneof("message_response") == "file_descriptor_response"
        assert package in {f.package for f in files}

    plain = RouterServer(RouterAgent(registry=CollectorRegistry()))
    await plain.start()
    try:
        bare = transport.channel(plain.address).stream_stream(
            V1_METHOD, request_serializer=request_cls.SerializeToString,
            response_deserializer=response_cls.FromString)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in bare(iter([request_cls(list_services="")]), timeout=DEADLINE_S):
                pass
        assert e.value.code() is grpc.StatusCode.UNIMPLEMENTED
    finally:
        await plain.stop(grace=None)


async def test_largest_table_is_pushed_within_the_message_limit(
    transport: GrpcRouterTransport,
) -> None:
    edges = tuple(float(2**i) for i in range(64))
    big = Policy.uniform(2, Route.DECODE_LOCAL, axes=Axes(edges, edges, edges))
    server = RouterServer(RouterAgent(registry=CollectorRegistry()))
    await server.start()
    try:
        reply = await transport.apply(server.address, big, False, 60.0)
        assert reply.outcome is ApplyOutcome.APPLIED
        assert reply.checksum == big.checksum
    finally:
        await server.stop(grace=None)


async def test_a_policy_above_the_message_limit_is_refused_before_any_call() -> None:
    """gRPC's own RESOURCE_EXHAUSTED was retried five times and reported as unreachable."""
    from controller.rollout.client import RouterRefusedCall

    small = GrpcRouterTransport(max_message_bytes=1000)
    try:
        with pytest.raises(RouterRefusedCall, match="above the 1,000-byte limit") as e:
            await small.apply("127.0.0.1:9", Policy.uniform(2, Route.DECODE_LOCAL), False, 1.0)
        assert e.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await small.close()


async def test_a_call_that_times_out_leaves_the_other_calls_on_its_channel_alone(
    tmp_path: Path,
) -> None:
    """A transient failure retires the router's channel so the next attempt connects afresh.
    It was closed at once: every other call in flight on it was cancelled, and their bare
    CancelledError went past the reconciler's handlers and ended the whole pass."""
    import asyncio
    import time

    def slow_disk(path: Path, data: bytes) -> None:
        time.sleep(0.6)  # the router persists before it answers
        path.write_bytes(data)

    agent = RouterAgent(registry=CollectorRegistry(), state_file=tmp_path / "s.json",
                        writer=slow_disk)
    server = RouterServer(agent)
    await server.start()
    transport = GrpcRouterTransport()
    try:
        await transport.get(server.address, DEADLINE_S)  # one channel, already connected

        async def patient() -> ApplyOutcome:
            await asyncio.sleep(0.05)  # in flight when the impatient call's deadline passes
            return (await transport.apply(server.address, table_policy(2), False, 10.0)).outcome

        impatient = transport.apply(server.address, table_policy(1), False, 0.2)
        first, second = await asyncio.gather(impatient, patient(), return_exceptions=True)
        assert isinstance(first, RouterCallError)
        assert first.code is grpc.StatusCode.DEADLINE_EXCEEDED
        assert second is ApplyOutcome.APPLIED, repr(second)
        assert agent.snapshot.version == 2
    finally:
        await transport.close()
        await server.stop(grace=None)


async def test_a_router_whose_receive_limit_is_below_the_policy_refuses_it_once() -> None:
    """A router on a smaller receive limit (gRPC's default 4 MiB, in another language)
    answers RESOURCE_EXHAUSTED "larger than max": another attempt sends the same bytes.
    Retried, the push was reported as an unreachable router."""
    from controller.rollout.client import RouterRefusedCall
    from controller.rollout.reconciler import Reconciler

    edges = tuple(float(2**i) for i in range(40))
    big = Policy.uniform(2, Route.DECODE_LOCAL, axes=Axes(edges, edges, edges))
    server = RouterServer(RouterAgent(registry=CollectorRegistry()), max_message_bytes=1 << 20)
    await server.start()
    transport = GrpcRouterTransport()
    try:
        with pytest.raises(RouterRefusedCall, match="the router's gRPC message-size") as e:
            await transport.apply(server.address, big, False, DEADLINE_S)
        assert e.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        from controller.clock import WallClock

        status = (await Reconciler(transport, WallClock(), max_attempts=5).reconcile(
            {server.address: big}))[server.address]
        # Its GetPolicy and one ApplyPolicy (it was 1 + 5 pushes, then "unreachable").
        assert (status.outcome, status.attempts) == ("refused", 2)
        assert "message-size limit" in (status.last_error or "")
    finally:
        await transport.close()
        await server.stop(grace=None)


async def test_a_second_server_cannot_take_a_live_port(router: RouterServer) -> None:
    from controller.errors import ConfigError

    other = RouterServer(RouterAgent(registry=CollectorRegistry()), listen=router.address)
    with pytest.raises(ConfigError, match="cannot listen"):
        await other.start()


async def test_a_router_answering_a_malformed_checksum_is_refused_not_stored() -> None:
    """A router (another implementation) answering a checksum that is not sha256 hex can
    never match ours: it read as diverged and was pushed to on every pass. It is refused,
    with the reason, and no ack is taken from it."""
    from controller.clock import WallClock
    from controller.rollout.client import RouterRefusedCall
    from controller.rollout.reconciler import Reconciler

    bad = "sha256:" + "ab" * 32

    class Odd(policy_grpc.RouterPolicyServiceServicer):
        async def GetPolicy(self, request, context):  # type: ignore[no-untyped-def]
            return policy_pb.GetPolicyResponse(version=3, checksum=bad)

        async def ApplyPolicy(self, request, context):  # type: ignore[no-untyped-def]
            return policy_pb.ApplyPolicyResponse(
                result=policy_pb.APPLY_RESULT_APPLIED, applied_version=4, checksum=bad)

    server = grpc.aio.server()
    policy_grpc.add_RouterPolicyServiceServicer_to_server(Odd(), server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    transport = GrpcRouterTransport()
    try:
        for call in (transport.get(address, DEADLINE_S),
                     transport.apply(address, table_policy(4), False, DEADLINE_S)):
            with pytest.raises(RouterRefusedCall, match="malformed checksum") as e:
                await call
            assert e.value.code is grpc.StatusCode.DATA_LOSS
        status = (await Reconciler(transport, WallClock(), max_attempts=3).reconcile(
            {address: table_policy(4)}))[address]
        assert status.outcome == "refused" and status.acked_checksum is None
    finally:
        await transport.close()
        await server.stop(grace=None)
