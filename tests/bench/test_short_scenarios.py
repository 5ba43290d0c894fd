"""Shortened built-in scenarios (``--duration-scale 0.1``): the orderings that hold for the
static policies, measured on the simulator.

- Scenario 1 (Mooncake, rising load): all decode-local cuts Turn-2+ TTFT against all
  prefill-node (the PPD direction); the threshold rule beats all prefill-node; the oracle is
  at least every static policy in every phase and strictly above the best single static
  policy over the whole run or equal to it.
- Scenario 3 (a prefill worker lost, then replaced): all prefill-node loses goodput when the
  worker is lost and gets it back when it is replaced; all decode-local loses less.

The adaptive controller's goals (issue 7) are asserted on scenarios 1 and 2 at 0.7x length
(``--duration-scale 0.7``, the controller's time constants scaled alike; ~30 s each on an
idle machine): adaptive strictly above every static policy and >= 95 % of the oracle. At 0.1x
they do not hold: 10 s windows hold fewer than the 50 requests the workload and SLO detectors
need, and the first fits have only a few such windows (``bench_suite.py --scale 0.1 1 3``:
adaptive 0.789 / 0.635 against best static 0.849 / 0.848); at 0.5x scenario 2 reaches 0.93
of the oracle. Measured at 0.7x (commit 9087785): scenario 1 adaptive 0.9035 against local
0.8647, oracle 0.9265; scenario 2 0.9020 against local 0.7344, oracle 0.9224. The static
policies include ``ppd-static+overrides`` (the table with adaptive's starting overrides), the
strongest of them at 0.7x: 0.8885 and 0.7660 against adaptive's 0.9155 and 0.9078
(``bench_suite.py --scale 0.7 1 2``, 2026-12-05).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.bench.report import evaluation_document
from controller.bench.runner import STATIC, quiet_logs, run_bench, scale_scenario
from controller.sim.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[2]


def test_mooncake_rising_load_orderings() -> None:
    scenario = scale_scenario(
        load_scenario(ROOT / "scenarios/bench/1-mooncake-rising-load.toml"), 0.1)
    bench = run_bench(scenario, ["pd", "local", "threshold", "ppd-static", "oracle"])
    doc = evaluation_document(bench)
    pol = doc["policies"]
    assert pol["local"]["turn2_ttft_mean_s"] < 0.5 * pol["pd"]["turn2_ttft_mean_s"]
    assert pol["threshold"]["goodput"] > pol["pd"]["goodput"] + 0.05
    statics = ("pd", "local", "threshold", "ppd-static")
    for i in range(len(scenario.phase_bounds())):
        best = max(pol[k]["phases"][i]["goodput"] for k in statics)
        assert pol["oracle"]["phases"][i]["goodput"] >= best
    assert pol["oracle"]["goodput"] >= max(pol[k]["goodput"] for k in statics)
    # Phase requests come from the chosen candidates: nothing lost, nothing doubled.
    assert abs(pol["oracle"]["requests"] - pol["pd"]["requests"]) <= 0.02 * pol["pd"]["requests"]


def test_prefill_worker_lost_then_replaced() -> None:
    scenario = scale_scenario(
        load_scenario(ROOT / "scenarios/bench/3-mooncake-prefill-lost.toml"), 0.1)
    doc = evaluation_document(run_bench(scenario, ["pd", "local"]))
    pd = [p["goodput"] for p in doc["policies"]["pd"]["phases"]]
    local = [p["goodput"] for p in doc["policies"]["local"]["phases"]]
    assert pd[1] < pd[0] - 0.05, pd
    assert pd[2] > pd[1] + 0.05, pd
    assert local[0] - local[1] < pd[0] - pd[1], (local, pd)


ADAPTIVE_SCALE = 0.7


@pytest.mark.parametrize("name", ["1-mooncake-rising-load", "2-mooncake-link-slowdown"])
def test_adaptive_beats_every_static_policy_and_nears_the_oracle(name: str) -> None:
    scenario = scale_scenario(load_scenario(ROOT / f"scenarios/bench/{name}.toml"),
                              ADAPTIVE_SCALE)
    quiet_logs()
    doc = evaluation_document(run_bench(scenario, time_scale=ADAPTIVE_SCALE))
    pol = doc["policies"]
    best = max(STATIC, key=lambda k: pol[k]["goodput"])  # ppd-static+overrides included
    assert pol["adaptive"]["goodput"] > pol[best]["goodput"], (best, pol[best]["goodput"],
                                                               pol["adaptive"]["goodput"])
    assert doc["oracle_ratio"] >= 0.95, doc["oracle_ratio"]
    # The adaptive run is the daemon's cycle: it changed policy at least once.
    assert pol["adaptive"]["policy_changes"] >= 1
