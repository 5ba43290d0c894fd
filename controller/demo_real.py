"""``pdctl demo --router real``: the demo's cluster with the real router in front.

The simulated workers alone (:class:`controller.sim.live.LiveSim` with ``routers=False``, no
in-simulation traffic), one ``pdctl router serve`` SUBPROCESS on the config
``pdctl sim serve --workers-only --write-config`` would write (its initial policy the demo's
baseline, so it starts where the in-simulation routers do), and the scenario's traffic sent
through it over HTTP (:class:`controller.sim.drive.TrafficDriver`). The addresses have the
shape :meth:`LiveSim.addresses` has, one router, so the demo's daemon settings and story are
the same. :meth:`RealRouterCluster.stop` ends the traffic, the router (SIGTERM, then kill
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
    """Workers, a ``pdctl router serve`` subprocess, and the traffic through it."""

    def __init__(self, scenario: Scenario, baseline: Policy, tmp: Path) -> None:
        self.scenario = scenario
        self.baseline = baseline
        self.tmp = tmp
        self.sim = LiveSim(scenario, None, traffic=False, routers=False, grpc=False)
        self.router: asyncio.subprocess.Process | None = None
        self.stop_traffic = asyncio.Event()
        self.traffic: asyncio.Task[Any] | None = None
        self._log: IO[bytes] | None = None

    async def start(self) -> dict[str, Any]:
        """Start everything; the addresses (``routers``: the real router's)."""
        addresses = await self.sim.start()
        try:
            host = self.sim.host
            http, grpc = f"{host}:{_free_port(host)}", f"{host}:{_free_port(host)}"
            initial = self.tmp / "baseline.json"
            initial.write_text(dumps(self.baseline), encoding="utf-8")
            doc = router_config(addresses, http, grpc, Path(self.sim.tokenizer.source).parent)
            doc["grpc"]["initial_policy"] = str(initial)
            cfg = self.tmp / "router.toml"
            cfg.write_text(to_toml(doc), encoding="utf-8")
            self._log = (self.tmp / "router.log").open("wb")
            # argv from this interpreter and a file written here: no untrusted input
            self.router = await asyncio.create_subprocess_exec(
                *PDCTL, "router", "serve", "--config", str(cfg), stdout=self._log,
                stderr=subprocess.STDOUT)
            if not await wait_ready(f"http://{http}", self.stop_traffic, ROUTER_READY_S):
                raise ConfigError(f"pdctl router serve did not answer on {http} within "
                                  f"{ROUTER_READY_S:g} s (log: {self.tmp / 'router.log'})")
            driver = TrafficDriver(self.scenario, f"http://{http}",
                                   DriveLimits(self.scenario.duration_s, max_concurrency=256),
                                   tokenizer=self.sim.tokenizer, session_prefix="demo")
            self.traffic = asyncio.create_task(driver.run(self.stop_traffic))
        except BaseException:
            await self.stop()
            raise
        addresses["routers"] = [{"id": "router-0", "metrics": f"http://{http}/metrics",
                                 "openai": f"http://{http}/v1", "grpc": grpc}]
        return addresses

    async def stop(self) -> None:
        self.stop_traffic.set()
        if self.traffic is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.traffic, ROUTER_STOP_S)
        if self.router is not None and self.router.returncode is None:
            self.router.terminate()
            try:
                await asyncio.wait_for(self.router.wait(), ROUTER_STOP_S)
            except TimeoutError:
                self.router.kill()
                await asyncio.wait_for(self.router.wait(), ROUTER_STOP_S)
        await self.sim.stop()
        if self._log is not None:
            self._log.close()
