"""The decode-local cost in the simulator stays within 20 % of the like-for-like published
figures (docs/simulator.md, "The decode-local cost"): the co-batching rows of
the published co-batching figures (derived from Vidur's profiles) and DistServe's profiled
prefill cost on A100 (OPT-13B, per billion parameters). ``benchmarks/sim_decode_local_cost.py``
prints the full comparison."""

from __future__ import annotations

import pytest

from controller.sim.profiles import Profile, load_profile

# latency-model.md §7: 32 decodes at 2,048 tokens co-batched with (q new tokens on k cached);
# step ms on H100, on A100.
LM7 = [
    (0, 0, 10.7, 17.2),
    (1024, 0, 30.3, 85.2),
    (4096, 0, 105.0, 313.0),
    (2048, 2048, 59.4, 170.0),
    (512, 2048, 20.4, 52.9),
    (256, 8192, 16.3, 38.6),
]
# LLMServe/DistServe @ 82831f1, profiler-a100-80g.distserve.json: OPT-13B TP1 prefill.
DISTSERVE_PREFILL = (18.10254647486372, 0.1019122572698738, 7.122264314252114e-06)


def step_ms(p: Profile, batch: int, ctx: int, q: int, k: int) -> float:
    return 1e3 * p.step_time_s(batch + q, float(batch * ctx), q * (k + q / 2))


@pytest.mark.parametrize(("q", "k", "h100", "a100"), LM7)
def test_co_batched_steps_match_latency_model_section_7(q: int, k: int, h100: float,
                                                        a100: float) -> None:
    for name, published in (("llama-3.1-8b-h100", h100), ("llama-3.1-8b-a100", a100)):
        ours = step_ms(load_profile(name), 32, 2048, q, k)
        assert ours == pytest.approx(published, rel=0.2), (name, q, k, ours)


def test_prefill_tokens_cost_what_distserve_measured_per_parameter() -> None:
    _, b, c = DISTSERVE_PREFILL  # the constant term cancels in a difference
    distserve = (b * 576 + c * 576**2) - (b * 64 + c * 64**2)  # 512 tokens added to 64
    p = load_profile("llama-3.1-8b-a100")
    ours = step_ms(p, 64, 0, 512, 0) - step_ms(p, 64, 0, 0, 0)
    assert ours / 8.03 == pytest.approx(distserve / 12.85, rel=0.2)


def test_an_append_stretches_the_step_more_the_more_new_tokens_it_has() -> None:
    p = load_profile("llama-3.1-8b-h100")
    base = step_ms(p, 64, 2048, 0, 0)
    stretch = [step_ms(p, 64, 2048, q, 2048) / base for q in (64, 128, 256, 512, 1024)]
    assert stretch == sorted(stretch) and stretch[0] < 1.02 < stretch[2]
