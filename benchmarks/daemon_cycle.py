"""Steady-state cost of the real daemon: CPU per control cycle and RSS, 64 workers + 16 routers.

Run from the repository root: ``.venv/bin/python benchmarks/daemon_cycle.py``.

What runs:

- a child process serves 64 worker ``/metrics`` (32 prefill + 32 decode, the simulator's
  complete vLLM families) and 16 router ``/metrics`` (``pdrouter_*``) on loopback, adding
  traffic and re-rendering between cycles (as ``benchmarks/observe_scrape.py`` does);
- a second child runs 16 real router agents behind their gRPC servers;
- ``pdctl run --config`` (a real process, SQLite store in a temporary directory) controls
  them with a short interval. The store is seeded with an approved policy on every router
  and the policy-change limit is high, so the measured cycles are the steady state: scrape
  80 targets, build and store the window, assess drift, read operator state, reconcile 16
  routers (one GetPolicy each; nothing to push).

Measured from outside the daemon: CPU time (``/proc/PID/stat`` utime + stime) and completed
cycles (``pdctl_cycles_total`` on its ``/metrics``) between two points after a warm-up, the
daemon's own cycle-duration histogram over the same span, and RSS / peak RSS
(``/proc/PID/status``). Linux only.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import tempfile
import time  # monotonic for bounded waits in the benchmark driver only
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PDCTL = [sys.executable, "-c", "from controller.cli import main; main()"]


def _observe_scrape() -> Any:
    # Imported by module name so a spawned child can unpickle its target function.
    bench_dir = str(REPO / "benchmarks")
    if bench_dir not in sys.path:
        sys.path.insert(0, bench_dir)
    return importlib.import_module("observe_scrape")


def serve_agents(n: int, conn: Any) -> None:
    from controller.rollout.agent import RouterAgent
    from controller.rollout.server import RouterServer

    async def main() -> None:
        servers = []
        for i in range(n):
            server = RouterServer(RouterAgent(router_id=f"bench-router-{i}"),
                                  listen="127.0.0.1:0")
            await server.start()
            servers.append(server)
        conn.send([s.address for s in servers])
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        for s in servers:
            await s.stop(0.2)

    asyncio.run(main())


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def _scrape(listen: str) -> str:
    import httpx

    try:
        return httpx.get(f"http://{listen}/metrics", timeout=5, trust_env=False).text
    except httpx.HTTPError:
        return ""


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime, stime


def _mem_mib(pid: int) -> tuple[float, float]:
    status = Path(f"/proc/{pid}/status").read_text()

    def kib(key: str) -> float:
        m = re.search(rf"^{key}:\s+(\d+) kB", status, re.MULTILINE)
        return float(m.group(1)) if m else float("nan")

    return kib("VmRSS") / 1024, kib("VmHWM") / 1024


def _seed_store(url: str, routers: list[str]) -> None:
    from controller.policy import Policy, Route, dumps
    from controller.store import Store

    with Store(url) as store:
        store.upgrade()
        policy = Policy.uniform(1, Route.PREFILL_NODE, exploration=0.02)
        with store.cycle() as tx:
            tx.add_policy(1, policy.checksum, dumps(policy), "approved", "benchmark seed")
            for r in routers:
                tx.set_desired(r, 1)


def run(workers: int, routers: int, interval_s: float, warmup: int, cycles: int) -> None:
    scrape = _observe_scrape()
    ctx = mp.get_context("spawn")
    metrics_parent, metrics_child = ctx.Pipe()
    metrics_proc = ctx.Process(target=scrape.serve, args=(workers, routers, metrics_child),
                               daemon=True)
    metrics_proc.start()
    agents_parent, agents_child = ctx.Pipe()
    agents_proc = ctx.Process(target=serve_agents, args=(routers, agents_child), daemon=True)
    agents_proc.start()
    ports = metrics_parent.recv()
    grpc_addresses = agents_parent.recv()
    half = workers // 2
    prefill = [f"127.0.0.1:{p}" for p in ports[:half]]
    decode = [f"127.0.0.1:{p}" for p in ports[half:workers]]
    router_metrics = [f"127.0.0.1:{p}" for p in ports[workers:]]

    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/history.db"
        _seed_store(url, grpc_addresses)
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            listen = f"127.0.0.1:{s.getsockname()[1]}"
        config = Path(tmp) / "bench.toml"
        config.write_text(f"""
[prefill_pool]
nodes = {prefill!r}
[decode_pool]
nodes = {decode!r}
[routers]
targets = {grpc_addresses!r}
metrics_targets = {router_metrics!r}
[metrics]
listen = "{listen}"
[store]
url = "{url}"
[controller]
interval_s = {interval_s}
min_policy_interval_s = 86400
calibrate_every_s = 86400
""".replace("'", '"'))
        # The seeded policy counts as "calibrated now": no bootstrap fit in the steady state.
        from controller.store import Store

        with Store(url) as store:
            store.add_calibration([], {}, None, None, policy_version=1,
                                  details={"trigger": "seed"})
        log = Path(tmp) / "daemon.log"
        daemon = subprocess.Popen([*PDCTL, "run", "--config", str(config)], cwd=REPO,  # noqa: S603
                                  stdout=subprocess.DEVNULL, stderr=log.open("wb"))
        try:
            deadline = time.monotonic() + 120
            while _metric(_scrape(listen), 'pdctl_cycles_total{result="ok"}') < warmup:
                if time.monotonic() > deadline or daemon.poll() is not None:
                    raise SystemExit("daemon did not warm up:\n" + log.read_text()[-2000:])
                metrics_parent.send("step")  # more traffic for the next window
                metrics_parent.recv()
                time.sleep(interval_s / 2)
            text0 = _scrape(listen)
            cpu0 = _cpu_s(daemon.pid)
            done0 = _metric(text0, 'pdctl_cycles_total{result="ok"}')
            deadline = time.monotonic() + (cycles + 10) * interval_s * 3
            while True:
                text1 = _scrape(listen)
                done1 = _metric(text1, 'pdctl_cycles_total{result="ok"}')
                if done1 - done0 >= cycles or time.monotonic() > deadline:
                    break
                metrics_parent.send("step")
                metrics_parent.recv()
                time.sleep(interval_s / 2)
            cpu1 = _cpu_s(daemon.pid)
            rss, peak = _mem_mib(daemon.pid)
            n = done1 - done0
            failed = _metric(text1, 'pdctl_cycles_total{result="failed"}')
            skipped = _metric(text1, 'pdctl_cycles_total{result="skipped"}')
            dur_s = (_metric(text1, "pdctl_cycle_duration_seconds_sum")
                     - _metric(text0, "pdctl_cycle_duration_seconds_sum"))
            dur_n = (_metric(text1, "pdctl_cycle_duration_seconds_count")
                     - _metric(text0, "pdctl_cycle_duration_seconds_count"))
        finally:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(20)
            except subprocess.TimeoutExpired:
                daemon.kill()
    metrics_parent.send("stop")
    agents_parent.send("stop")
    agents_proc.join(10)
    metrics_proc.join(5)
    print(f"pdctl run: {workers} workers + {routers} routers, interval {interval_s:g} s, "
          f"{n:.0f} steady-state cycles after {warmup} warm-up (failed {failed:.0f}, "
          f"skipped {skipped:.0f})")
    print(f"  CPU per cycle:        {1000 * (cpu1 - cpu0) / max(n, 1):.1f} ms "
          f"(process user+system)")
    print(f"  cycle wall duration:  {1000 * dur_s / max(dur_n, 1):.1f} ms mean "
          f"(pdctl_cycle_duration_seconds)")
    print(f"  CPU share at {interval_s:g} s:  "
          f"{100 * (cpu1 - cpu0) / max(n, 1) / interval_s:.1f} % of one core")
    print(f"  RSS:                  {rss:.0f} MiB (peak {peak:.0f} MiB)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--routers", type=int, default=16)
    p.add_argument("--interval", type=float, default=2.0)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cycles", type=int, default=20)
    a = p.parse_args()
    run(a.workers, a.routers, a.interval, a.warmup, a.cycles)


if __name__ == "__main__":
    main()
