"""Nanoseconds per routing decision: the Go package (adopters/go) beside Python.

The same workload on both sides (controller/cli/bench_decide.py's): the default 10 x 10 x 10
table with a random route per cell and 0.05 exploration everywhere, valid later-turn features
spread log-uniformly over every bin, so each call takes the full table path (validation,
three bisections, an exploration draw). Timed as throughput (a loop of N calls / N), the
timer's cost excluded:

- Python ``controller.policy.decide`` (the pure reference) and ``RouterAgent.decide`` (what
  an embedding Python router calls: pre-resolved cells plus the decision counter);
- Go ``Policy.Decide`` (pure), ``Watcher.Decide`` + ``Metrics.CountDecision`` (what a Go
  router calls per request) and the latter from every CPU at once, from
  ``go test -bench`` in adopters/go (skipped when ``go`` is not installed).

    .venv/bin/python benchmarks/adopters_decide.py             # 3 repeats, best of each
    .venv/bin/python benchmarks/adopters_decide.py --n 200000 --repeats 5

Results in docs/adopting.md ("How fast"). The load average is printed before and after: on
a shared machine the best of several repeats is the figure to compare.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import time  # perf_counter only: benchmark timing, not control logic
from pathlib import Path

from controller.cli.bench_decide import random_features, random_policy
from controller.clock import WallClock
from controller.policy import decide
from controller.rollout.agent import RouterAgent

GO_DIR = Path(__file__).resolve().parents[1] / "adopters" / "go"


def python_ns(n: int, repeats: int) -> dict[str, float]:
    policy = random_policy(1)
    features = random_features(2, 8192)
    mask = len(features) - 1
    draw = random.Random(3).random
    agent = RouterAgent(clock=WallClock(), initial_policy=policy)
    out: dict[str, float] = {}
    for name, call in (("python decide()", lambda f: decide(policy, f, draw)),
                       ("python RouterAgent.decide()", agent.decide)):
        for i in range(20_000):  # warm-up
            call(features[i & mask])
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter_ns()
            for i in range(n):
                call(features[i & mask])
            best = min(best, (time.perf_counter_ns() - started) / n)
        out[name] = best
    return out


def go_ns(repeats: int) -> dict[str, float]:
    go = shutil.which("go")
    if go is None:
        return {}
    env = dict(os.environ, GOFLAGS="-buildvcs=false", GOPROXY="off", GOTOOLCHAIN="local",
               CGO_ENABLED="0")
    done = subprocess.run(  # noqa: S603 - the go toolchain on PATH, fixed arguments
        [go, "test", "-run", "^$", "-bench", ".", "-benchmem", "-count", str(repeats)],
        cwd=GO_DIR, env=env, capture_output=True, text=True, check=True, timeout=600)
    out: dict[str, float] = {}
    for name, ns in re.findall(r"^Benchmark(\S+?)(?:-\d+)?\s+\d+\s+([\d.]+) ns/op",
                               done.stdout, re.MULTILINE):
        key = f"go {name}"
        out[key] = min(out.get(key, float("inf")), float(ns))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200_000, help="Python calls per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    rows = {**python_ns(args.n, args.repeats), **go_ns(args.repeats)}
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print(f"{'implementation':<40} {'ns/decision':>12}")
    for name, ns in rows.items():
        print(f"{name:<40} {ns:>12.1f}")


if __name__ == "__main__":
    main()
