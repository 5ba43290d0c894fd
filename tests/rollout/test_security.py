"""TLS, mutual TLS and bearer tokens on real servers: refused calls never reach the agent.

Certificates are made at test time with the openssl CLI (CA, server certificate for
127.0.0.1/localhost, client certificate, and a second, unrelated CA).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from controller.config import SecurityConfig
from controller.errors import ConfigError
from controller.policy import Policy, Route
from controller.rollout.agent import ApplyOutcome, RouterAgent
from controller.rollout.client import GrpcRouterTransport, RouterCallError, RouterRefusedCall
from controller.rollout.reconciler import Reconciler
from controller.rollout.security import (
    ServerSecurity,
    check_listen,
    is_loopback,
    server_security,
    split_host_port,
)
from controller.rollout.server import RouterServer
from tests.conftest import require
from tests.rollout.grpc_support import OPENSSL, InstantClock, Pki, make_pki

TOKEN = "correct horse battery staple"
DEADLINE_S = 5.0
GOOD = Policy.uniform(2, Route.DECODE_LOCAL)
EVIL = Policy.uniform(99, Route.PREFILL_NODE)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    require("openssl CLI", OPENSSL is not None, "apt-get install openssl")
    return make_pki(tmp_path_factory.mktemp("pki"))


def refusals(agent: RouterAgent, reason: str) -> float:
    value = agent.registry.get_sample_value("pdrouter_auth_refusals_total", {"reason": reason})
    return value or 0.0




@pytest.fixture
async def started() -> AsyncIterator[list[RouterServer]]:
    servers: list[RouterServer] = []
    yield servers
    for s in servers:
        await s.stop(grace=None)


async def serve(
    started: list[RouterServer], security: SecurityConfig | None, initial: Policy = GOOD
) -> RouterServer:
    agent = RouterAgent(registry=CollectorRegistry(), initial_policy=initial)
    server = RouterServer(agent, security=security)
    await server.start()
    started.append(server)
    return server


async def attempt_push(
    address: str, security: SecurityConfig | None, policy: Policy = EVIL
) -> Exception | ApplyOutcome:
    """Push ``policy`` as an attacker would; return the error or the outcome."""
    transport = GrpcRouterTransport(security)
    try:
        reply = await transport.apply(address, policy, True, DEADLINE_S)
        return reply.outcome
    except (RouterCallError, RouterRefusedCall) as e:
        return e
    finally:
        await transport.close()


def code(result: Exception | ApplyOutcome) -> grpc.StatusCode | None:
    return getattr(result, "code", None)


async def test_tls_server_refuses_plaintext_and_untrusting_clients(
    pki: Pki, started: list[RouterServer]
) -> None:
    server = await serve(
        started, SecurityConfig(tls_cert=pki.server_cert, tls_key=pki.server_key)
    )
    ok = await attempt_push(server.address, SecurityConfig(tls_ca=pki.ca), Policy.uniform(3,
                            Route.PREFILL_NODE))
    assert ok is ApplyOutcome.APPLIED

    plaintext = await attempt_push(server.address, None)
    wrong_ca = await attempt_push(server.address, SecurityConfig(tls_ca=pki.other_ca))
    assert code(plaintext) is grpc.StatusCode.UNAVAILABLE
    assert code(wrong_ca) is grpc.StatusCode.UNAVAILABLE
    assert server.agent.policy is not None and server.agent.policy.version == 3


async def test_server_name_override_checks_the_certificate_name(
    pki: Pki, started: list[RouterServer]
) -> None:
    server = await serve(
        started, SecurityConfig(tls_cert=pki.named_server_cert, tls_key=pki.named_server_key)
    )
    # The certificate names router.internal, not 127.0.0.1: refused unless told the name.
    mismatch = await attempt_push(server.address, SecurityConfig(tls_ca=pki.ca), GOOD)
    assert code(mismatch) is grpc.StatusCode.UNAVAILABLE
    named = await attempt_push(
        server.address, SecurityConfig(tls_ca=pki.ca, server_name="router.internal"), GOOD
    )
    assert named is ApplyOutcome.NOOP


async def test_mtls_refuses_clients_without_a_certificate_from_the_ca(
    pki: Pki, started: list[RouterServer]
) -> None:
    server = await serve(
        started,
        SecurityConfig(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_ca=pki.ca),
    )
    no_cert = await attempt_push(server.address, SecurityConfig(tls_ca=pki.ca))
    rogue = await attempt_push(
        server.address,
        SecurityConfig(
            tls_ca=pki.ca, tls_cert=pki.rogue_client_cert, tls_key=pki.rogue_client_key
        ),
    )
    # Refused in the handshake: the client sees UNAVAILABLE and the agent never sees a call.
    assert code(no_cert) is grpc.StatusCode.UNAVAILABLE
    assert code(rogue) is grpc.StatusCode.UNAVAILABLE
    assert server.agent.policy == GOOD

    trusted = SecurityConfig(tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key)
    v4 = Policy.uniform(4, Route.PREFILL_NODE)
    assert await attempt_push(server.address, trusted, v4) is ApplyOutcome.APPLIED
    assert server.agent.policy == v4


@pytest.mark.parametrize("with_tls", [True, False], ids=["tls+token", "loopback+token"])
async def test_bearer_token_refusals_are_counted_and_never_applied(
    pki: Pki, started: list[RouterServer], tmp_path: Path, with_tls: bool
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")  # a trailing newline is not part of the token
    tls = {"tls_cert": pki.server_cert, "tls_key": pki.server_key} if with_tls else {}
    server = await serve(started, SecurityConfig(token_file=token_file, **tls))
    client_tls = {"tls_ca": pki.ca} if with_tls else {}

    missing = await attempt_push(server.address, SecurityConfig(**client_tls))
    wrong = await attempt_push(
        server.address, SecurityConfig(token=SecretStr("guess"), **client_tls)
    )
    wrong_again = await attempt_push(
        server.address, SecurityConfig(token=SecretStr(TOKEN + "x"), **client_tls)
    )
    for refused in (missing, wrong, wrong_again):
        assert isinstance(refused, RouterRefusedCall)  # terminal: no point retrying
        assert refused.code is grpc.StatusCode.UNAUTHENTICATED
    assert server.agent.policy == GOOD
    assert refusals(server.agent, "missing_token") == 1
    assert refusals(server.agent, "wrong_token") == 2
    assert server.agent.registry.get_sample_value(
        "pdrouter_updates_total", {"result": "applied"}
    ) in (None, 0.0)

    good = SecurityConfig(token=SecretStr(TOKEN), **client_tls)
    v5 = Policy.uniform(5, Route.PREFILL_NODE)
    assert await attempt_push(server.address, good, v5) is ApplyOutcome.APPLIED
    assert server.agent.policy == v5
    assert refusals(server.agent, "missing_token") == 1


async def test_health_checks_need_no_token(pki: Pki, started: list[RouterServer]) -> None:
    server = await serve(started, SecurityConfig(token=SecretStr(TOKEN)))
    transport = GrpcRouterTransport(None)
    try:
        stub = health_pb2_grpc.HealthStub(transport.channel(server.address))
        response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=DEADLINE_S)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await transport.close()
    assert refusals(server.agent, "missing_token") == 0


async def test_reconciler_does_not_retry_refused_credentials(
    started: list[RouterServer],
) -> None:
    server = await serve(started, SecurityConfig(token=SecretStr(TOKEN)))
    transport = GrpcRouterTransport(SecurityConfig(token=SecretStr("wrong")))
    try:
        rec = Reconciler(transport, InstantClock(), max_attempts=4)
        statuses = await rec.reconcile({server.address: EVIL})
    finally:
        await transport.close()
    status = statuses[server.address]
    assert (status.ok, status.outcome, status.attempts) == (False, "refused", 1)
    assert "UNAUTHENTICATED" in (status.last_error or "")
    assert server.agent.policy == GOOD


def test_server_security_layers(pki: Pki) -> None:
    reg = CollectorRegistry()
    plain = server_security(None, reg)
    assert (plain.credentials, plain.authenticates, plain.describe()) == (None, False, "plaintext")
    mtls = server_security(
        SecurityConfig(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_ca=pki.ca), reg
    )
    assert mtls.client_certificates and mtls.authenticates and mtls.describe() == "mTLS"
    token = server_security(SecurityConfig(token=SecretStr("t")), reg)
    assert token.authenticates and token.describe() == "plaintext + bearer token"
    assert len(token.interceptors) == 1


def test_unreadable_or_empty_secrets_are_config_errors(tmp_path: Path, pki: Pki) -> None:
    reg = CollectorRegistry()
    with pytest.raises(ConfigError, match="tls_cert"):
        server_security(
            SecurityConfig(tls_cert=tmp_path / "missing.crt", tls_key=pki.server_key), reg
        )
    empty = tmp_path / "empty-token"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        server_security(SecurityConfig(token_file=empty), reg)
    with pytest.raises(ConfigError, match="tls_ca"):
        server_security(SecurityConfig(tls_ca=pki.ca), reg)
    # a private key for the CA: gRPC core failed the bind ("cannot listen on ...")
    with pytest.raises(ConfigError, match=r"tls_ca: .* holds no usable certificate"):
        server_security(SecurityConfig(tls_cert=pki.server_cert, tls_key=pki.server_key,
                                       tls_ca=pki.server_key), reg)
    # gRPC sends no such metadata ("Illegal metadata", read as an unreachable router)
    for bad in ("héllo", "to\tken"):
        with pytest.raises(ConfigError, match=r"security\.token: .* printable ASCII"):
            server_security(SecurityConfig(token=SecretStr(bad)), reg)
    accented = tmp_path / "token"
    accented.write_text("héllo\n")
    with pytest.raises(ConfigError, match=r"security\.token_file .* printable ASCII"):
        server_security(SecurityConfig(token_file=accented), reg)


def test_unauthenticated_server_stays_on_loopback() -> None:
    plain = ServerSecurity(None, (), False, False, False)
    check_listen("127.0.0.1:0", plain, allow_unauthenticated=False)
    check_listen("[::1]:50051", plain, allow_unauthenticated=False)
    check_listen("localhost:1", plain, allow_unauthenticated=False)
    with pytest.raises(ConfigError, match="without authentication"):
        check_listen("0.0.0.0:50051", plain, allow_unauthenticated=False)
    with pytest.raises(ConfigError, match="without authentication"):
        check_listen("router.example:50051", plain, allow_unauthenticated=False)
    check_listen("0.0.0.0:50051", plain, allow_unauthenticated=True)
    # A token without TLS: gRPC takes it from loopback peers only (local credentials), so a
    # wider listen served nobody, the kubelet's probe included.
    token_only = ServerSecurity(None, (), False, False, True)
    check_listen("127.0.0.1:50051", token_only, allow_unauthenticated=False)
    for insecure in (False, True):
        with pytest.raises(ConfigError, match="loopback peers only"):
            check_listen("0.0.0.0:50051", token_only, allow_unauthenticated=insecure)
    check_listen("0.0.0.0:50051", ServerSecurity(None, (), True, False, True),
                 allow_unauthenticated=False)
    with pytest.raises(ConfigError, match="HOST:PORT"):
        split_host_port("no-port")
    assert is_loopback("127.8.0.1") and not is_loopback("10.0.0.1")
