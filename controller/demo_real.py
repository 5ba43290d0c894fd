"""``pdctl demo --router real``: the demo's cluster with real routers.

The simulated workers alone (:class:`controller.sim.live.LiveSim` with ``routers=False``, no
in-simulation traffic), one ``pdctl router serve`` SUBPROCESS per router of the scenario's
``[cluster] routers``, each on the config ``pdctl sim serve --workers-only --write-config``
would write (its initial policy the demo's baseline, so it starts where the in-simulation
routers do), and the scenario's traffic sent through them over HTTP
(:class:`controller.sim.drive.TrafficDriver`, each session to one router in turn). The
addresses have the shape :meth:`LiveSim.addresses` has, so the demo's daemon settings and
story are the same: a canary runs on a share of the routers and is judged against the
others. :meth:`RealRouterCluster.stop` ends the traffic, the routers (SIGTERM, then kill
after ``ROUTER_STOP_S``) and the workers, whatever state they are in.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

from controller.errors import ConfigError
from controller.policy import Policy, dumps
from controller.sim.drive import DriveLimits, TrafficDriver, wait_ready
from controller.sim.live import LiveSim
from controller.sim.scenario import Scenario
from controller.sim.serve_config import router_config, to_toml

ROUTER_READY_S = 60.0
ROUTER_STOP_S = 10.0
PDCTL = [sys.executable, "-c", "from controller.cli import main; main()"]


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class RealRouterCluster:
    """Workers, ``pdctl router serve`` subprocesses (as many as the scenario's
    ``[cluster] routers``: separate instances sharing nothing, each with its own gRPC port,
    so the daemon's canary is a share of them), and the traffic through them."""

    def __init__(self, scenario: Scenario, baseline: Policy, tmp: Path) -> None:
        self.scenario = scenario
        self.baseline = baseline
        self.tmp = tmp
        self.sim = LiveSim(scenario, None, traffic=False, routers=False, grpc=False)
        self.routers: list[asyncio.subprocess.Process] = []
        self.stop_traffic = asyncio.Event()
        self.traffic: asyncio.Task[Any] | None = None
        self._logs: list[IO[bytes]] = []

    @property
    def router(self) -> asyncio.subprocess.Process | None:
        """The first router subprocess (None before start)."""
        return self.routers[0] if self.routers else None

    async def start(self) -> dict[str, Any]:
        """Start everything; the addresses (``routers``: the real routers')."""
        addresses = await self.sim.start()
        try:
            initial = self.tmp / "baseline.json"
            initial.write_text(dumps(self.baseline), encoding="utf-8")
            routers = [await self._start_router(addresses, i, initial)
                       for i in range(self.scenario.cluster.routers)]
            for r in routers:
                if not await wait_ready(r["openai"], self.stop_traffic, ROUTER_READY_S):
                    raise ConfigError(f"pdctl router serve did not answer on {r['openai']} "
                                      f"within {ROUTER_READY_S:g} s (logs: {self.tmp})")
            driver = TrafficDriver(self.scenario, [r["openai"] for r in routers],
                                   DriveLimits(self.scenario.duration_s, max_concurrency=256),
                                   tokenizer=self.sim.tokenizer, session_prefix="demo")
            self.traffic = asyncio.create_task(driver.run(self.stop_traffic))
        except BaseException:
            await self.stop()
            raise
        addresses["routers"] = routers
        return addresses

    async def _start_router(self, addresses: dict[str, Any], i: int,
                            initial: Path) -> dict[str, str]:
        """Router ``i``'s subprocess on its own config; its addresses."""
        host = self.sim.host
        http, grpc = f"{host}:{_free_port(host)}", f"{host}:{_free_port(host)}"
        doc = router_config(addresses, http, grpc, Path(self.sim.tokenizer.source).parent)
        doc["router_id"] = f"router-{i}"
        doc["grpc"]["initial_policy"] = str(initial)
        cfg = self.tmp / f"router-{i}.toml"
        cfg.write_text(to_toml(doc), encoding="utf-8")
        log = (self.tmp / f"router-{i}.log").open("wb")
        self._logs.append(log)
        # argv from this interpreter and a file written here: no untrusted input
        self.routers.append(await asyncio.create_subprocess_exec(
            *PDCTL, "router", "serve", "--config", str(cfg), stdout=log,
            stderr=subprocess.STDOUT))
        return {"id": f"router-{i}", "metrics": f"http://{http}/metrics",
                "openai": f"http://{http}/v1", "grpc": grpc}

    async def stop(self) -> None:
        self.stop_traffic.set()
        if self.traffic is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.traffic, ROUTER_STOP_S)
        for proc in self.routers:
            if proc.returncode is None:
                proc.terminate()
        for proc in self.routers:
            try:
                await asyncio.wait_for(proc.wait(), ROUTER_STOP_S)
            except TimeoutError:
                proc.kill()
                await asyncio.wait_for(proc.wait(), ROUTER_STOP_S)
        await self.sim.stop()
        for log in self._logs:
            log.close()
