"""The simulator serves only names the engines it imitates define (tests/sim/engine_names.py,
copied from vLLM 0.34.0 and SGLang 0.5.23): a name the engine does not export would be read
by the controller in tests and never in production."""

from __future__ import annotations

import pytest

from controller.sim.sglang_metrics import SglangView
from controller.sim.vllm_metrics import WorkerMetrics
from tests.sim.engine_names import SGLANG_0_5_23, VLLM_0_34


def _defined(family: str, names: frozenset[str]) -> bool:
    # prometheus_client names a counter family without "_total"; the engine may define it
    # with or without.
    return family in names or family + "_total" in names


@pytest.mark.parametrize("kv_role", ["kv_producer", "kv_consumer", None])
def test_every_simulated_family_is_one_the_engine_defines(kv_role: str | None) -> None:
    worker = WorkerMetrics(model_name="m", kv_role=kv_role, num_gpu_blocks=10, block_size=16,
                           max_model_len=1024)
    vllm = {f.name for f in worker.registry.collect()}
    sglang = {f.name for f in SglangView(worker, tp_size=2).registry.collect()}
    assert len(vllm) > 30 and len(sglang) > 10
    assert sorted(f for f in vllm if not _defined(f, VLLM_0_34)) == []
    assert sorted(f for f in sglang if not _defined(f, SGLANG_0_5_23)) == []


def test_the_check_can_fail() -> None:
    assert not _defined("vllm:gpu_cache_usage_perc", VLLM_0_34)  # removed before 0.34
    assert not _defined("vllm:time_per_output_token_seconds", VLLM_0_34)
    assert _defined("sglang:num_requests", SGLANG_0_5_23)  # defined as ..._total
