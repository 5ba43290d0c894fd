"""Security under attack and rotation, on real gRPC servers on 127.0.0.1.

* mutual TLS + token: every unauthenticated, wrong-token or wrong-certificate update is
  refused, counted where gRPC lets Python see it, and never applied or persisted;
* certificates and token files rotated on disk are picked up without a restart; a
  half-written rotation is not taken;
* secrets (the database password, tokens) appear in no log line, error, repr or
  ``pdctl history`` output.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry
from pydantic import SecretStr
from typer.testing import CliRunner

from controller.config import SecurityConfig
from controller.policy import Policy, Route, loads
from controller.rollout.agent import RouterAgent
from controller.rollout.client import GrpcRouterTransport, RouterCallError, RouterRefusedCall
from controller.rollout.server import RouterServer
from tests.conftest import require
from tests.faults.harness import RecordingClock, reconciler
from tests.rollout.grpc_support import OPENSSL, Pki, make_pki

GOOD = Policy.uniform(2, Route.DECODE_LOCAL)
EVIL = Policy.uniform(99, Route.PREFILL_NODE)
TOKEN = "token-0f1e2d3c4b5a"
OTHER_TOKEN = "token-zzzz-not-it"


@pytest.fixture(scope="module")
def pkis(tmp_path_factory: pytest.TempPathFactory) -> tuple[Pki, Pki]:
    require("openssl CLI", OPENSSL is not None, "apt-get install openssl")
    return make_pki(tmp_path_factory.mktemp("pki1")), make_pki(tmp_path_factory.mktemp("pki2"))


def refusals(agent: RouterAgent, reason: str) -> float:
    value = agent.registry.get_sample_value("pdrouter_auth_refusals_total", {"reason": reason})
    return value or 0.0


def replace_file(src: Path, dst: Path) -> None:
    """Rotate like a secrets manager: a new file renamed over the old one."""
    tmp = dst.with_suffix(".new")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def write_token(path: Path, token: str) -> None:
    tmp = path.with_suffix(".new")
    tmp.write_text(token + "\n")
    os.replace(tmp, path)


@pytest.fixture
async def router(tmp_path: Path, pkis: tuple[Pki, Pki]) -> AsyncIterator[RouterServer]:
    """A router requiring a client certificate from pki1's CA and a token from a file; its
    certificate, key, CA and token are live files in tmp_path/live that tests may rotate."""
    pki = pkis[0]
    live = tmp_path / "live"
    live.mkdir()
    for src, name in ((pki.server_cert, "server.crt"), (pki.server_key, "server.key"),
                      (pki.ca, "ca.crt")):
        shutil.copyfile(src, live / name)
    write_token(live / "token", TOKEN)
    security = SecurityConfig(
        tls_cert=live / "server.crt", tls_key=live / "server.key", tls_ca=live / "ca.crt",
        token_file=live / "token",
    )
    agent = RouterAgent(
        registry=CollectorRegistry(), state_file=tmp_path / "router.json", initial_policy=GOOD
    )
    server = RouterServer(agent, security=security)
    await server.start()
    yield server
    await server.stop(grace=None)


def client(pki: Pki, *, cert: bool = True, rogue: bool = False, token: str | None = TOKEN,
           token_file: Path | None = None) -> SecurityConfig:
    return SecurityConfig(
        tls_ca=pki.ca,
        tls_cert=(pki.rogue_client_cert if rogue else pki.client_cert) if cert else None,
        tls_key=(pki.rogue_client_key if rogue else pki.client_key) if cert else None,
        token=SecretStr(token) if token is not None and token_file is None else None,
        token_file=token_file,
    )


async def push(address: str, security: SecurityConfig | None) -> object:
    transport = GrpcRouterTransport(security)
    try:
        return (await transport.apply(address, EVIL, True, 5.0)).outcome
    except (RouterCallError, RouterRefusedCall) as e:
        return e.code
    finally:
        await transport.close()


async def test_mtls_and_token_refuse_every_unauthenticated_update(
    router: RouterServer, pkis: tuple[Pki, Pki], tmp_path: Path
) -> None:
    pki = pkis[0]
    attacks = {
        "plaintext": None,
        "tls, no client certificate": client(pki, cert=False),
        "certificate from another CA": client(pki, rogue=True),
        "good certificate, no token": client(pki, token=None),
        "good certificate, wrong token": client(pki, token=OTHER_TOKEN),
    }
    codes = {name: await push(router.address, sec) for name, sec in attacks.items()}
    assert codes == {
        "plaintext": grpc.StatusCode.UNAVAILABLE,  # handshake refused inside gRPC core
        "tls, no client certificate": grpc.StatusCode.UNAVAILABLE,
        "certificate from another CA": grpc.StatusCode.UNAVAILABLE,
        "good certificate, no token": grpc.StatusCode.UNAUTHENTICATED,
        "good certificate, wrong token": grpc.StatusCode.UNAUTHENTICATED,
    }
    agent = router.agent
    assert refusals(agent, "missing_token") == 1 and refusals(agent, "wrong_token") == 1
    assert agent.snapshot is not None and agent.snapshot.version == GOOD.version
    assert not (tmp_path / "router.json").exists()  # nothing was ever persisted

    # The reconciler does not hammer a router that refuses its credentials.
    transport = GrpcRouterTransport(client(pki, token=OTHER_TOKEN))
    try:
        status = (await reconciler(transport, RecordingClock()).reconcile({router.address: EVIL}))[
            router.address
        ]
    finally:
        await transport.close()
    assert status.outcome == "refused" and status.attempts == 1
    assert refusals(agent, "wrong_token") == 2

    # And the rightful controller still gets through.
    assert await push(router.address, client(pki)) == "applied"
    assert loads((tmp_path / "router.json").read_bytes()).version == EVIL.version


async def test_token_file_rotation_is_picked_up_without_a_restart(
    router: RouterServer, pkis: tuple[Pki, Pki], tmp_path: Path
) -> None:
    pki = pkis[0]
    controller_token = tmp_path / "controller-token"
    write_token(controller_token, TOKEN)
    transport = GrpcRouterTransport(client(pki, token_file=controller_token))
    try:
        assert (await transport.get(router.address, 5.0)).version == GOOD.version
        write_token(tmp_path / "live" / "token", OTHER_TOKEN)  # the router rotates first
        with pytest.raises(RouterRefusedCall) as caught:
            await transport.get(router.address, 5.0)
        assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert refusals(router.agent, "wrong_token") == 1
        write_token(controller_token, OTHER_TOKEN)  # then the controller, same transport
        assert (await transport.get(router.address, 5.0)).version == GOOD.version
        # An empty (half-written) token file is not taken: the last token stays valid.
        (tmp_path / "live" / "token").write_text("")
        assert (await transport.get(router.address, 5.0)).version == GOOD.version
    finally:
        await transport.close()
    assert await push(router.address, client(pki, token=TOKEN)) == grpc.StatusCode.UNAUTHENTICATED


async def test_certificate_rotation_is_picked_up_for_new_connections(
    router: RouterServer, pkis: tuple[Pki, Pki], tmp_path: Path
) -> None:
    old, new = pkis
    live = tmp_path / "live"
    assert (await push(router.address, client(old))) == "applied"

    # Half-way: the new certificate is there, its key not yet. Not taken: old clients work.
    replace_file(new.server_cert, live / "server.crt")
    replace_file(new.ca, live / "ca.crt")
    transport = GrpcRouterTransport(client(old))
    try:
        assert (await transport.get(router.address, 5.0)).version == EVIL.version
    finally:
        await transport.close()

    replace_file(new.server_key, live / "server.key")  # the rotation completes
    assert await push(router.address, client(old)) == grpc.StatusCode.UNAVAILABLE
    transport = GrpcRouterTransport(client(new))
    try:
        assert (await transport.get(router.address, 5.0)).version == EVIL.version
    finally:
        await transport.close()


async def test_client_certificate_rotation_is_picked_up_without_a_new_transport(
    router: RouterServer, pkis: tuple[Pki, Pki], tmp_path: Path
) -> None:
    """The controller's own certificate, key and CA files rotated under one long-lived
    transport (as the daemon holds it): a half-way rotation is not taken; a complete one
    replaces the channels, so the next call handshakes with the new certificate."""
    old, new = pkis
    mine = tmp_path / "controller"
    mine.mkdir()
    for src, name in ((old.client_cert, "client.crt"), (old.client_key, "client.key"),
                      (old.ca, "ca.crt")):
        shutil.copyfile(src, mine / name)
    transport = GrpcRouterTransport(SecurityConfig(
        tls_cert=mine / "client.crt", tls_key=mine / "client.key", tls_ca=mine / "ca.crt",
        token=SecretStr(TOKEN)))
    try:
        assert (await transport.get(router.address, 5.0)).version == GOOD.version

        # Half-way: the new certificate without its key. Not taken: the same channel works.
        channel = transport.channel(router.address)
        replace_file(new.client_cert, mine / "client.crt")
        assert (await transport.get(router.address, 5.0)).version == GOOD.version
        assert transport.channel(router.address) is channel

        # The key follows: the rotation is complete and taken without a restart. The router
        # still trusts only the old CA, so the new handshake is refused — which shows the
        # new certificate is in use (the old connection would have gone on working).
        replace_file(new.client_key, mine / "client.key")
        with pytest.raises(RouterCallError) as refused:
            await transport.get(router.address, 5.0)
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        assert transport.channel(router.address) is not channel

        # The router moves to the new PKI and the controller to the new CA: accepted.
        live = tmp_path / "live"
        replace_file(new.server_cert, live / "server.crt")
        replace_file(new.ca, live / "ca.crt")
        replace_file(new.server_key, live / "server.key")
        replace_file(new.ca, mine / "ca.crt")
        assert (await transport.get(router.address, 5.0)).version == GOOD.version
    finally:
        await transport.close()


# -- secrets stay secret ------------------------------------------------------------------

DB_PASSWORD = "pw-9a8b7c6d5e"


def test_database_password_never_appears_in_logs_errors_or_reprs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from controller.store import Store
    from controller.store.repository import StoreUnavailable

    caplog.set_level(logging.DEBUG)
    url = f"postgresql+psycopg://pdc:{DB_PASSWORD}@127.0.0.1:1/pdc?connect_timeout=2"
    store = Store(url)
    try:
        with pytest.raises(StoreUnavailable) as caught:
            store.require_schema()
        seen = [str(caught.value), repr(caught.value), repr(store.engine), str(store.url),
                store.safe_url, caplog.text]
    finally:
        store.close()
    assert "127.0.0.1:1" in str(caught.value)  # the error does say where
    assert not [s for s in seen if DB_PASSWORD in s]


def test_pdctl_history_and_status_hide_the_password(pg_url: tuple[str, str]) -> None:
    """On a server that is down, and on the real one (which trusts loopback, so the
    password in the URL is accepted and ignored): the output never shows it."""
    from controller.cli import app
    from controller.store import Store

    down = f"postgresql://pdc:{DB_PASSWORD}@127.0.0.1:1/pdc?connect_timeout=2"
    url = pg_url[0].replace("postgresql+psycopg://postgres@",
                            f"postgresql+psycopg://postgres:{DB_PASSWORD}@")
    assert DB_PASSWORD in url
    with Store(url) as store:
        store.upgrade()
        store.add_policy(1, "aa" * 32, "{}", "approved", "seen by pdctl")
        store.set_desired("r1", 1)
    runner = CliRunner()
    for command, shown in ((["history", "policies"], "seen by pdctl"), (["status"], "r1"),
                           (["status", "--json"], '"r1"')):
        failed = runner.invoke(app, [*command, "--url", down])
        assert failed.exit_code != 0 and "127.0.0.1" in failed.output
        worked = runner.invoke(app, [*command, "--url", url])
        assert worked.exit_code == 0 and shown in worked.output, worked.output
        assert DB_PASSWORD not in failed.output + worked.output


async def test_tokens_never_appear_in_logs_or_errors(
    router: RouterServer, pkis: tuple[Pki, Pki], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    pki = pkis[0]
    config = client(pki, token=OTHER_TOKEN)
    transport = GrpcRouterTransport(config)
    try:
        with pytest.raises(RouterRefusedCall) as caught:
            await transport.apply(router.address, EVIL, False, 5.0)
    finally:
        await transport.close()
    seen = [str(caught.value), repr(config), str(config.model_dump()), caplog.text]
    assert not [s for s in seen if OTHER_TOKEN in s or TOKEN in s]
