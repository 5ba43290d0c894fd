"""Shortened built-in scenarios (``--duration-scale 0.1``): the orderings that hold for the
static policies, measured on the simulator.

- Scenario 1 (Mooncake, rising load): all decode-local cuts Turn-2+ TTFT against all
  prefill-node (the PPD direction); the threshold rule beats all prefill-node; the oracle is
  at least every static policy in every phase and strictly above the best single static
  policy over the whole run or equal to it.
- Scenario 3 (a prefill worker lost, then replaced): all prefill-node loses goodput when the
  worker is lost and gets it back when it is replaced; all decode-local loses less.

The adaptive controller's goals (issue 7) hold at full length in scenarios 1-3 (adaptive
above every static policy, >= 95 % of the oracle; docs/bench.md) but not at this size: 10 s
windows hold fewer than the 50 requests the workload and SLO detectors need, and the first
fits have only a few such windows (``bench_suite.py --scale 0.1 1 3``: adaptive 0.789 / 0.635
against best static 0.849 / 0.848). They are therefore reported, not asserted here.
"""

from __future__ import annotations

from pathlib import Path

from controller.bench.report import evaluation_document
from controller.bench.runner import run_bench, scale_scenario
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
