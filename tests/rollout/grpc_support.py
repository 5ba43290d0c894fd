"""Helpers for the gRPC tests: a throw-away PKI (openssl CLI), router clusters behind the
real gRPC transport and behind the in-memory fake, and a clock whose sleeps pass at once."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from controller.clock import VirtualClock
from controller.config import SecurityConfig
from controller.rollout.agent import RouterAgent
from controller.rollout.client import GrpcRouterTransport
from controller.rollout.reconciler import FakeRouterTransport
from controller.rollout.server import RouterServer

OPENSSL = shutil.which("openssl")


# -- PKI ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # an unrelated CA
    rogue_client_cert: Path  # a client certificate signed by other_ca
    rogue_client_key: Path
    named_server_cert: Path  # valid only for DNS:router.internal
    named_server_key: Path


def _run(*args: str, cwd: Path) -> None:
    assert OPENSSL is not None
    subprocess.run([OPENSSL, *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _ca(d: Path, name: str) -> None:
    _run(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN={name}",
        cwd=d,
    )


def _leaf(d: Path, name: str, ca: str, extensions: str) -> None:
    _run(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d,
    )
    (d / f"{name}.ext").write_text(extensions + "\n")
    _run(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext",
        cwd=d,
    )


def make_pki(d: Path) -> Pki:
    """CA, server certificate for 127.0.0.1/localhost, client certificate, and a wrong CA."""
    d.mkdir(parents=True, exist_ok=True)
    _ca(d, "ca")
    _ca(d, "other-ca")
    _leaf(d, "server", "ca",
          "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth")
    _leaf(d, "client", "ca", "extendedKeyUsage=clientAuth")
    _leaf(d, "rogue", "other-ca", "extendedKeyUsage=clientAuth")
    _leaf(d, "named", "ca", "subjectAltName=DNS:router.internal\nextendedKeyUsage=serverAuth")
    return Pki(
        ca=d / "ca.crt", server_cert=d / "server.crt", server_key=d / "server.key",
        client_cert=d / "client.crt", client_key=d / "client.key", other_ca=d / "other-ca.crt",
        rogue_client_cert=d / "rogue.crt", rogue_client_key=d / "rogue.key",
        named_server_cert=d / "named.crt", named_server_key=d / "named.key",
    )


# -- clocks -------------------------------------------------------------------------------


class InstantClock(VirtualClock):
    """A virtual clock whose sleeps complete at once (advancing it) and are recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.slept: list[float] = []

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.advance(max(0.0, seconds))
        await super().sleep(0)


# -- clusters -----------------------------------------------------------------------------


class FakeCluster:
    """Routers as in-memory agents behind :class:`FakeRouterTransport`."""

    kind = "fake"

    def __init__(self, state_dir: Path, n: int) -> None:
        self.state_dir = state_dir
        self.transport = FakeRouterTransport()
        self.routers = [f"router-{i}" for i in range(n)]
        for r in self.routers:
            self.transport.agents[r] = self._new_agent(r)

    def _new_agent(self, router: str) -> RouterAgent:
        return RouterAgent(
            router_id=router, registry=CollectorRegistry(),
            state_file=self.state_dir / f"{router}.json",
        )

    def agent(self, router: str) -> RouterAgent:
        return self.transport.agents[router]

    async def start(self) -> None:
        return None

    async def stop_router(self, router: str) -> None:
        self.transport.down.add(router)

    async def restart_router(self, router: str, *, lose_state: bool = False) -> None:
        if lose_state:
            (self.state_dir / f"{router}.json").unlink(missing_ok=True)
        self.transport.agents[router] = self._new_agent(router)
        self.transport.down.discard(router)

    async def close(self) -> None:
        return None


class RealCluster:
    """Routers as real ``grpc.aio`` servers on 127.0.0.1, reached by GrpcRouterTransport.

    A router restarts as a new agent and a new server on the same port.
    """

    kind = "grpc"

    def __init__(
        self,
        state_dir: Path,
        n: int,
        *,
        server_security: SecurityConfig | None = None,
        client_security: SecurityConfig | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.n = n
        self.server_security = server_security
        self.transport = GrpcRouterTransport(client_security, reconnect_backoff_max_s=0.2)
        self.servers: dict[str, RouterServer] = {}
        self.routers: list[str] = []
        self._names: dict[str, str] = {}

    async def start(self) -> None:
        for i in range(self.n):
            name = f"router-{i}"
            server = RouterServer(self._new_agent(name), security=self.server_security)
            await server.start()
            self.servers[server.address] = server
            self._names[server.address] = name
            self.routers.append(server.address)

    def _new_agent(self, name: str) -> RouterAgent:
        return RouterAgent(
            router_id=name, registry=CollectorRegistry(),
            state_file=self.state_dir / f"{name}.json",
        )

    def agent(self, router: str) -> RouterAgent:
        return self.servers[router].agent

    async def stop_router(self, router: str) -> None:
        await self.servers[router].stop(grace=None)

    async def restart_router(self, router: str, *, lose_state: bool = False) -> None:
        name = self._names[router]
        if lose_state:
            (self.state_dir / f"{name}.json").unlink(missing_ok=True)
        server = RouterServer(self._new_agent(name), listen=router, security=self.server_security)
        await server.start()
        self.servers[router] = server

    async def close(self) -> None:
        await self.transport.close()
        for server in self.servers.values():
            await server.stop(grace=None)
