"""The PPD paper's trade-off, from the committed scenario files (shortened to 60 s)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from controller.bench.report import summarize
from controller.policy import Policy, Route
from controller.sim.run import run_scenario
from controller.sim.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[2]


def _run(name: str) -> dict[str, dict[str, Any]]:
    sc = replace(load_scenario(ROOT / "scenarios" / f"{name}.toml"), duration_s=60.0)
    return {key: summarize(run_scenario(sc, Policy.uniform(1, route)))
            for key, route in (("pd", Route.PREFILL_NODE), ("local", Route.DECODE_LOCAL))}


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, dict[str, Any]]]:
    return {name: _run(name) for name in ("ppd-1p3d", "ppd-2p2d", "ppd-3p1d", "ppd-3p3d")}


def _cut(r: dict[str, dict[str, Any]]) -> float:
    return float(r["local"]["turn2_ttft_mean_s"] / r["pd"]["turn2_ttft_mean_s"] - 1.0)


def _tpot_rise(r: dict[str, dict[str, Any]]) -> float:
    return float(r["local"]["tpot_mean_s"] / r["pd"]["tpot_mean_s"] - 1.0)


def test_decode_local_cuts_turn2_ttft_by_tens_of_percent_on_1p3d(runs: Any) -> None:
    r = runs["ppd-1p3d"]
    assert r["pd"]["requests"] == r["local"]["requests"] > 0
    assert r["pd"]["rejected"] == r["local"]["rejected"] == 0
    assert _cut(r) <= -0.20


def test_the_cut_shrinks_as_prefill_workers_grow(runs: Any) -> None:
    cuts = [_cut(runs[n]) for n in ("ppd-1p3d", "ppd-2p2d", "ppd-3p1d")]
    assert cuts[0] < cuts[1] < cuts[2] < 0, cuts
    # same decode pool, more prefill workers: the P/D path queues less
    assert _cut(runs["ppd-1p3d"]) < _cut(runs["ppd-3p3d"]) < 0


def test_decode_local_raises_tpot_more_with_one_decode_worker(runs: Any) -> None:
    assert _tpot_rise(runs["ppd-3p1d"]) > _tpot_rise(runs["ppd-1p3d"]) + 0.02


def test_pd_moves_more_kv_than_local(runs: Any) -> None:
    for r in runs.values():
        assert r["pd"]["kv_bytes"] > r["local"]["kv_bytes"] > 0
