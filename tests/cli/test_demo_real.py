"""``pdctl demo --router real``'s cluster: simulated workers, a real ``pdctl router serve``
subprocess per router starting on the demo's baseline, traffic through them; all of it gone
after stop. ``--help`` names the default (``real``) and the in-simulation path."""

from __future__ import annotations

import asyncio
import inspect
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from controller.cli import app
from controller.cli.demo_cmd import demo
from controller.demo import DEFAULT_ROUTER, DemoRouter, default_scenario, demo_cluster
from controller.demo_real import RealRouterCluster
from controller.policy import Policy, Route
from controller.sim.scenario import load_scenario
from tests.support.router import metric


def test_demo_help_names_the_real_router_default_and_the_sim_path() -> None:
    out = CliRunner().invoke(app, ["demo", "--help"], env={"COLUMNS": "200"}).output
    text = " ".join(out.split())
    assert re.search(r"--router \S+ real \(default\): a `pdctl router serve` subprocess per "
                     r"router", text), out
    assert "[default: real]" in text, out
    # rich may break "in-simulation" at its hyphen
    assert re.search(r"sim: the scenario's in- ?simulation routers, in process", text), out
    assert DEFAULT_ROUTER is DemoRouter.REAL
    assert inspect.signature(demo).parameters["router"].default == DEFAULT_ROUTER.value
    assert default_scenario(DemoRouter.REAL).name == "demo-real.toml"
    assert default_scenario(DemoRouter.SIM).name == "demo.toml"


@pytest.mark.integration
async def test_the_real_demo_cluster_routes_through_router_subprocesses_and_stops(
        tmp_path: Path) -> None:
    scenario = load_scenario(default_scenario(DemoRouter.REAL))
    # every later turn decode-local: a router without it would send them all to P
    baseline = Policy.uniform(1, Route.DECODE_LOCAL, exploration=0.0)
    cluster = demo_cluster(DemoRouter.REAL, scenario, baseline, tmp_path)
    assert isinstance(cluster, RealRouterCluster)
    addresses = await cluster.start()
    routers = addresses["routers"]
    try:
        # one `pdctl router serve` per router of the scenario, sharing the sessions
        assert len(routers) == len(cluster.routers) == scenario.cluster.routers == 2
        texts = []
        async with httpx.AsyncClient(timeout=10, trust_env=False) as http:
            for router in routers:
                local = 0.0
                for _ in range(100):  # bounded: 20 s
                    text = (await http.get(router["metrics"])).text
                    local = metric(text, "pdrouter_routes_executed_total", route="DECODE_LOCAL")
                    if local >= 3:
                        break
                    await asyncio.sleep(0.2)
                texts.append(text)
        for text in texts:
            # the baseline came from [grpc] initial_policy: later turns went decode-local
            assert metric(text, "pdrouter_routes_executed_total", route="DECODE_LOCAL") >= 3
            assert metric(text, "pdrouter_routes_executed_total", route="PREFILL_NODE") >= 3
        procs = list(cluster.routers)
        for proc in procs:
            assert proc.returncode is None
            # a subprocess running `pdctl router serve`, not a router in this process
            raw = await asyncio.to_thread(Path(f"/proc/{proc.pid}/cmdline").read_bytes)
            cmdline = raw.split(b"\0")
            assert b"router" in cmdline and b"serve" in cmdline, cmdline
    finally:
        await cluster.stop()
    assert all(proc.returncode is not None for proc in procs)  # the subprocesses are gone
    assert cluster.traffic is not None and cluster.traffic.done()
    async with httpx.AsyncClient(timeout=2, trust_env=False) as http:
        for router in routers:
            with pytest.raises(httpx.HTTPError):
                await http.get(router["metrics"])


def _children(pid: int) -> dict[int, bytes]:
    """The processes whose parent is ``pid``: their command lines."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return found


@pytest.mark.integration
def test_sigterm_stops_the_real_demo_and_its_router_subprocesses(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "from controller.cli import main; main()", "demo",
         "--router", "real", "--timeout-s", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        routers: dict[int, bytes] = {}
        for _ in range(300):  # bounded: 30 s for both routers to start
            routers = {p: c for p, c in _children(proc.pid).items() if b"serve" in c}
            if len(routers) == 2 or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert len(routers) == 2, routers
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 143, err[-2000:]
    assert "stopped by SIGTERM" in err
    assert "Traceback" not in err, err[-2000:]
    # the router subprocesses were stopped, not left running without their parent
    assert not [p for p in routers if Path(f"/proc/{p}").exists()
                and b"serve" in Path(f"/proc/{p}/cmdline").read_bytes()]
