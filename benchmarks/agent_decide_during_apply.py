"""Decide latency at a router agent while a large table is pushed to it.

Run from the repository root: ``.venv/bin/python benchmarks/agent_decide_during_apply.py``.

A ``pdctl router-agent`` subprocess on 127.0.0.1; a client thread calls ``Decide`` every
2 ms over gRPC (bounded: at most ``--seconds`` per phase) while this process pushes a
64 x 64 x 64 table (262,144 cells) to it ``--pushes`` times. Prints the Decide latency
(p50, p99, max) with no push running and while the pushes run. The agent decodes and
validates the pushed message, then applies it (and persists it), off its event loop: a
decode on the loop stalled every Decide call for the length of the decode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from controller._proto.pdcontrol.v1 import router_agent_service_pb2 as agent_pb  # noqa: E402
from controller._proto.pdcontrol.v1 import (  # noqa: E402
    router_agent_service_pb2_grpc as agent_grpc,
)
from controller.policy import Axes, Policy, Route  # noqa: E402
from controller.rollout.client import GrpcRouterTransport  # noqa: E402


def start_agent(state_file: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(  # noqa: S603 - our own interpreter and CLI
        [sys.executable, "-c", "from controller.cli import main; main()", "router-agent",
         "--listen", "127.0.0.1:0", "--state-file", str(state_file)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("router-agent listening on"):
            return proc, line.split()[3]
    proc.kill()
    raise SystemExit("router-agent did not start")


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"n": len(ordered), "p50_ms": round(statistics.median(ordered) * 1e3, 2),
            "p99_ms": round(ordered[int(0.99 * (len(ordered) - 1))] * 1e3, 2),
            "max_ms": round(ordered[-1] * 1e3, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pushes", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=2.0, help="quiet phase length")
    args = ap.parse_args()
    workdir = tempfile.TemporaryDirectory(prefix="pdctl-bench-agent-")
    state = Path(workdir.name) / "state.json"
    proc, address = start_agent(state)
    edges = tuple(float(2 ** (i / 4)) for i in range(64))
    tables = [Policy.uniform(v, Route.DECODE_LOCAL if v % 2 else Route.PREFILL_NODE,
                             axes=Axes(edges, edges, edges)) for v in range(1, args.pushes + 1)]
    stub = agent_grpc.RouterAgentServiceStub(grpc.insecure_channel(address))
    features = agent_pb.Features(turn=2, context_tokens=3000, append_tokens=100,
                                 expected_output_tokens=200, qps=3)
    latencies: list[tuple[float, float]] = []  # (started, seconds)
    stop = threading.Event()

    def caller() -> None:
        until = time.monotonic() + args.seconds + 120  # bounded whatever happens
        while not stop.is_set() and time.monotonic() < until:
            t = time.perf_counter()
            stub.Decide(agent_pb.DecideRequest(features=features), timeout=10)
            latencies.append((time.monotonic(), time.perf_counter() - t))
            time.sleep(0.002)

    async def push_all() -> list[float]:
        transport = GrpcRouterTransport()
        took = []
        try:
            for policy in tables:
                t = time.perf_counter()
                reply = await transport.apply(address, policy, False, 60.0)
                took.append(time.perf_counter() - t)
                assert reply.applied_version == policy.version, reply
        finally:
            await transport.close()
        return took

    thread = threading.Thread(target=caller)
    try:
        thread.start()
        time.sleep(args.seconds)
        began = time.monotonic()
        took = asyncio.run(push_all())
        ended = time.monotonic()
        time.sleep(0.2)
    finally:
        stop.set()
        thread.join()
        proc.terminate()
        proc.wait(timeout=15)
        workdir.cleanup()
    quiet = [s for at, s in latencies if at < began]
    during = [s for at, s in latencies if began <= at <= ended]
    print(json.dumps({
        "cells": len(edges) ** 3, "pushes": len(tables),
        "push_s": [round(x, 3) for x in took],
        "decide_quiet": percentiles(quiet), "decide_during_pushes": percentiles(during),
        "load": round(os.getloadavg()[0], 2),
    }, indent=1))


if __name__ == "__main__":
    main()
