"""The step-time model against raw profiling data (not against its own formula)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from controller.sim.profiles import load_profile

ROOT = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sim_fidelity",
                                                  ROOT / "benchmarks" / "sim_fidelity.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return _bench()


def test_linear_layers_within_10_percent_of_vidur_mlp_csv(bench: ModuleType) -> None:
    rows = bench.vidur_table(load_profile("llama-3.1-8b-a100"), bench.perf_profiles_dir())
    assert [r[0] for r in rows] == [1, 64, 512, 2048, 4096]
    for n, vidur, sim, err in rows:
        assert vidur > 0 and sim > 0
        assert abs(err) <= 0.10, (n, vidur, sim)


def test_h100_prefill_within_20_percent_of_blis(bench: ModuleType) -> None:
    for n, blis, sim, err in bench.blis_table(load_profile("llama-3.1-8b-h100")):
        assert abs(err) <= 0.20, (n, blis, sim)


def test_decode_step_flat_to_16_then_growing_like_splitwise(bench: ModuleType) -> None:
    table = bench.decode_table(load_profile("llama-3.1-8b-h100"), bench.perf_profiles_dir())
    assert len(table) == 3
    for name, row in table.items():
        assert row[16] <= 1.15, (name, row)  # nearly flat up to batch 16
        assert row[64] / row[16] >= 1.10, (name, row)  # and growing after
        assert row[1] < row[8] < row[16] < row[32] < row[64], (name, row)
