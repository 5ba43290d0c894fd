"""Capacity planning: the recommendation moves the right way, and its numbers hang together."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.core.capacity import (
    CapacityDemand,
    CapacityError,
    CapacityPlan,
    ObservedRange,
    SessionCache,
    decode_state,
    demand_at_shape,
    plan_capacity,
    prefill_state,
    sojourn_quantile,
    token_quantiles,
)
from controller.core.latency_model import ComponentParams

PARAMS = ComponentParams()
BASE = CapacityDemand(qps=20.0, input_tokens=2000.0, cached_fraction=0.3, output_tokens=250.0,
                      decode_local_share=0.3, local_append_tokens=200.0)
KV = 467_000.0


def plan(demand: CapacityDemand = BASE, **kw: object) -> CapacityPlan:
    args: dict[str, object] = {"slo_ttft_s": 1.0, "slo_tpot_s": 0.04, "kv_capacity_tokens": KV,
                               "max_num_seqs": 256}
    args.update(kw)
    return plan_capacity(demand, PARAMS, **args)  # type: ignore[arg-type]


def need(p: CapacityPlan) -> tuple[float, float]:
    """Fractional workers per role (before rounding up): the continuous form of the answer."""
    return (p.prefill.demand / p.prefill.per_worker_capacity,
            p.decode.demand / p.decode.per_worker_capacity)


def test_more_qps_needs_more_of_both() -> None:
    low, high = plan(replace(BASE, qps=10.0)), plan(replace(BASE, qps=80.0))
    assert high.prefill.workers > low.prefill.workers
    assert high.decode.workers > low.decode.workers


def test_longer_prompt_needs_more_prefill() -> None:
    short, long = plan(replace(BASE, input_tokens=1000.0)), plan(replace(BASE, input_tokens=6000.0))
    assert long.prefill.workers > short.prefill.workers
    assert need(long)[0] > need(short)[0]


def test_longer_output_needs_more_decode() -> None:
    short, long = plan(replace(BASE, output_tokens=100.0)), plan(replace(BASE, output_tokens=800.0))
    assert long.decode.workers > short.decode.workers
    # prefill is not asked to grow for longer outputs
    assert long.prefill.workers <= short.prefill.workers + 1


def test_decode_local_share_moves_work_from_prefill_to_decode() -> None:
    demand = replace(BASE, qps=60.0, cached_fraction=0.6, local_append_tokens=600.0)
    few, many = plan(replace(demand, decode_local_share=0.0)), plan(
        replace(demand, decode_local_share=0.8))
    assert many.prefill.workers < few.prefill.workers
    assert need(many)[1] > need(few)[1]
    assert many.decode.workers >= few.decode.workers


def test_headroom_adds_workers_and_caps_utilisation() -> None:
    loose, spare = plan(headroom=0.0), plan(headroom=1.0)
    assert spare.prefill.workers >= loose.prefill.workers
    assert spare.decode.workers > loose.decode.workers
    for rec in (spare.prefill, spare.decode):
        assert rec.utilisation <= 1.0 / 2.0 + 1e-9


def test_tighter_slo_needs_more_workers() -> None:
    demand = replace(BASE, qps=60.0)
    # a steady load: the pool is one queue whose p99 stays near the unloaded one until the
    # pool is nearly saturated, so throughput binds a loose SLO; a bursty load queues, and
    # the SLO decides
    bursty = replace(demand, rate_profile=(0.5, 0.5, 0.5, 2.5), profile_window_s=10.0)
    loose, tight = plan(bursty, slo_ttft_s=5.0), plan(bursty, slo_ttft_s=1.0)
    assert tight.prefill.workers > loose.prefill.workers
    assert tight.prefill.binding == "p99 TTFT"
    assert plan(demand, slo_ttft_s=5.0).prefill.binding == "compute saturation"
    loose_d, tight_d = plan(demand, slo_tpot_s=0.1), plan(demand, slo_tpot_s=0.012)
    assert tight_d.decode.workers > loose_d.decode.workers
    assert tight_d.decode.binding == "p99 TPOT"


def test_binding_names_the_limit_that_bites() -> None:
    # a loose TPOT SLO and long contexts: the KV cache fills before the step slows
    kv_bound = plan(replace(BASE, input_tokens=8000.0), slo_tpot_s=1.0)
    assert kv_bound.decode.binding == "KV cache"
    # short contexts and a loose SLO: max_num_seqs is reached first
    seqs = plan(replace(BASE, input_tokens=200.0, output_tokens=100.0), slo_tpot_s=1.0)
    assert seqs.decode.binding == "max_num_seqs"


def test_prediction_at_recommendation_is_within_slo() -> None:
    p = plan(replace(BASE, qps=50.0))
    assert p.prefill.predicted_p99_s <= p.slo_ttft_s
    assert p.decode.predicted_p99_s <= p.slo_tpot_s
    assert p.prefill.utilisation <= 1 / 1.2 + 1e-9


def test_unreachable_slo_is_said() -> None:
    p = plan(replace(BASE, input_tokens=30_000.0, cached_fraction=0.0), slo_ttft_s=0.2)
    assert p.prefill.binding.endswith("(unreachable)")
    assert any("even with no queueing" in line for line in p.prefill.explanation)


def test_a_tpot_slo_at_or_below_the_step_floor_never_asks_for_fewer_or_absurd_workers() -> None:
    # Near the floor the allowed load per worker goes to zero: the count grew without bound
    # (7.2e12 decode workers at the floor itself), and below it the unreachable branch
    # planned 2, fewer than any reachable SLO got.
    floor = PARAMS.step_base_s
    slos = [floor * f for f in (0.9, 0.99, 1.0, 1.001, 1.05, 1.2, 2.0, 5.0)]
    counts = [plan(replace(BASE, qps=60.0), slo_tpot_s=s, kv_capacity_tokens=None,
                   max_num_seqs=None).decode.workers for s in slos]
    assert counts == sorted(counts, reverse=True), counts  # tighter never asks for fewer
    assert counts[0] < 1000, counts  # sized for 10 % above the floor, not for the floor
    below = plan(replace(BASE, qps=60.0), slo_tpot_s=floor * 0.9)
    assert below.decode.binding.endswith("(unreachable)")
    at = plan(replace(BASE, qps=60.0), slo_tpot_s=floor * 1.001)
    assert any("within 10% of the step floor" in line for line in at.decode.explanation)
    assert at.decode.predicted_p99_s <= floor * 1.1 + 1e-9


def test_a_nearly_zero_append_spread_is_no_spread() -> None:
    # sd ~ 1e-144 s: m + 6 sd == m in floats, so the p99 search read every load as over the
    # SLO and planned ~1e10 decode workers for 10 tokens/s
    d = CapacityDemand(qps=1.0, input_tokens=50.0, cached_fraction=0.0, output_tokens=10.0,
                       decode_local_share=1.7e-276, local_append_tokens=1.0)
    p = plan(d)
    assert p.decode.workers == 1
    assert math.isfinite(p.decode.predicted_p99_s) and p.decode.predicted_p99_s < 0.04


def test_inputs_no_worker_count_can_serve_are_refused_with_the_reason() -> None:
    with pytest.raises(CapacityError, match="cannot hold one sequence"):
        plan(kv_capacity_tokens=float(BASE.input_tokens))  # less than one prompt + output
    with pytest.raises(CapacityError, match="more than 4096 decode workers"):
        plan(replace(BASE, qps=1e6))
    with pytest.raises(CapacityError, match="prefill workers: beyond the planner's range"):
        plan(replace(BASE, qps=1e6, output_tokens=1.0), slo_tpot_s=1.0, max_num_seqs=None)
    with pytest.raises(CapacityError, match="headroom: must be between 0 and 10"):
        plan(headroom=1e308)


def test_extrapolation_flag_follows_the_observed_range() -> None:
    inside = plan(observed=ObservedRange(prefill_rate_per_worker=1e6,
                                         decode_tokens_per_worker=1e9))
    assert not inside.prefill.extrapolated and not inside.decode.extrapolated
    beyond = plan(observed=ObservedRange(prefill_rate_per_worker=0.1,
                                         decode_tokens_per_worker=1.0))
    assert beyond.prefill.extrapolated and beyond.decode.extrapolated
    assert any("extrapolated" in line for line in beyond.decode.explanation)


def test_to_dict_is_json_and_carries_the_inputs() -> None:
    d = plan(current=(2, 3)).to_dict()
    text = json.dumps(d, allow_nan=False)
    back = json.loads(text)
    assert back["demand"]["qps"] == BASE.qps
    assert back["prefill"]["current_workers"] == 2 and back["decode"]["current_workers"] == 3
    assert back["decode"]["capacity_unit"] == "tokens/s"


@pytest.mark.parametrize("bad", [
    {"qps": -1.0}, {"cached_fraction": 1.5}, {"decode_local_share": math.nan},
    {"output_tokens": math.inf},
])
def test_bad_demand_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(CapacityError, match=next(iter(bad))):
        replace(BASE, **bad)


def test_bad_slo_is_refused() -> None:
    with pytest.raises(CapacityError, match="slo_tpot_s"):
        plan(slo_tpot_s=0.0)


def test_tail_quantile_matches_known_laws() -> None:
    exponential = token_quantiles(1.0, 1.0, 4096)
    assert exponential.mean() == pytest.approx(1.0)
    # no queueing, exponential own time: p99 = mean * ln(100)
    assert sojourn_quantile(0.0, exponential, exponential) == pytest.approx(math.log(100),
                                                                             rel=0.02)
    # M/M/1: the sojourn time is exponential with mean S / (1 - rho)
    for rho in (0.3, 0.7, 0.9):
        q = sojourn_quantile(rho, exponential, exponential)
        # (the grid of 1,024 token quantiles truncates the far tail: a few % low at 0.9)
        assert q == pytest.approx(math.log(100) / (1 - rho), rel=0.05), rho
    # M/D/1 at rho 0.5 (D = 1): P(W = 0) = 1 - rho, so the median sojourn is the service
    det = token_quantiles(1.0, 0.0)
    assert sojourn_quantile(0.5, det, det, 0.5) == pytest.approx(1.0, abs=0.01)
    # a deterministic law has no spread
    assert sojourn_quantile(0.0, det * 5, det * 5) == pytest.approx(5.0, rel=0.01)


def test_state_curves_rise_with_load() -> None:
    p1, p2 = prefill_state(PARAMS, BASE, 2.0, 0.01), prefill_state(PARAMS, BASE, 10.0, 0.01)
    assert p2.p99_ttft_s > p1.p99_ttft_s and p2.utilisation > p1.utilisation
    d1, d2 = decode_state(PARAMS, BASE, 500.0), decode_state(PARAMS, BASE, 5000.0)
    assert d2.step_s > d1.step_s and d2.p99_tpot_s > d1.p99_tpot_s and d2.batch > d1.batch


demands = st.builds(
    CapacityDemand,
    qps=st.floats(0.5, 200.0), input_tokens=st.floats(50.0, 16_000.0),
    cached_fraction=st.floats(0.0, 0.9), output_tokens=st.floats(10.0, 2000.0),
    decode_local_share=st.floats(0.0, 0.9), local_append_tokens=st.floats(1.0, 2000.0),
)


@settings(max_examples=40, deadline=None)
@given(demands, st.floats(1.05, 3.0))
def test_property_more_load_never_needs_fewer_workers(d: CapacityDemand, factor: float) -> None:
    a, b = plan(d), plan(replace(d, qps=d.qps * factor))
    assert b.prefill.workers >= a.prefill.workers
    assert b.decode.workers >= a.decode.workers


@settings(max_examples=40, deadline=None)
@given(demands, st.floats(0.0, 1.0))
def test_property_recommendation_respects_headroom(d: CapacityDemand, headroom: float) -> None:
    p = plan(d, headroom=headroom)
    for rec in (p.prefill, p.decode):
        assert rec.workers >= 1
        assert rec.utilisation <= 1.0 / (1.0 + headroom) + 1e-6
        assert rec.per_worker_capacity > 0


def test_bursty_arrivals_need_more_than_a_steady_rate() -> None:
    demand = replace(BASE, qps=40.0)
    steady = plan(demand)
    bursty = plan(replace(demand, rate_profile=(0.5, 0.5, 0.5, 2.5), profile_window_s=10.0))
    assert bursty.demand.qps == steady.demand.qps
    assert bursty.prefill.workers > steady.prefill.workers
    assert bursty.prefill.per_worker_capacity < steady.prefill.per_worker_capacity
    assert any("arrival rate varies" in line for line in bursty.prefill.explanation)
    # a longer overloaded window piles up more work
    longer = plan(replace(demand, rate_profile=(0.5, 0.5, 0.5, 2.5), profile_window_s=120.0))
    assert longer.prefill.per_worker_capacity <= bursty.prefill.per_worker_capacity


def test_rate_levels_keep_the_busiest_windows_and_the_mean() -> None:
    profile = (*(0.5 + (i % 7) / 6 for i in range(100)), 4.0)
    d = replace(BASE, rate_profile=profile)
    factors, weights = d.rate_levels()
    assert factors.size <= 24 and weights.sum() == pytest.approx(1.0)
    assert factors.max() == pytest.approx(4.0 / (sum(profile) / len(profile)))
    # factors are rates over the mean: time-weighted they average 1
    assert float((weights / factors).sum() ** -1) == pytest.approx(1.0, rel=1e-9)
    assert d.peak_factor() >= 1.0


def test_kv_limit_shrinks_with_prompt_spread() -> None:
    from controller.core.capacity import kv_batch_limit

    even = kv_batch_limit(KV, replace(BASE, input_scv=0.0))
    spread = kv_batch_limit(KV, replace(BASE, input_scv=3.0))
    mean_ctx = BASE.input_tokens + BASE.output_tokens / 2
    assert spread < even < KV / mean_ctx


def test_pool_of_one_worker_matches_the_mg1_law() -> None:
    from controller.core.capacity import pool_ttft_quantile

    exponential = token_quantiles(1.0, 1.0, 4096)
    for rho in (0.5, 0.8):
        simulated, _ = pool_ttft_quantile(rho, 1, exponential, exponential, 0.99,
                                          samples=200_000)
        # the Benes law of the M/G/1 sojourn, computed independently (FFT)
        assert simulated == pytest.approx(sojourn_quantile(rho, exponential, exponential),
                                          rel=0.1), rho


def test_pool_waits_follow_erlang_c() -> None:
    from controller.core.capacity import pool_ttft_quantile

    servers, rho = 3, 0.8
    rate = servers * rho  # unit-mean exponential service
    a = rate
    tail = a**servers / math.factorial(servers) / (1 - rho)
    erlang_c = tail / (sum(a**k / math.factorial(k) for k in range(servers)) + tail)
    # M/M/c: P(W > t) = C exp(-(c - rate) t), so the 0.99 quantile of the wait alone
    expected = math.log(erlang_c / 0.01) / (servers - rate)
    exponential = token_quantiles(1.0, 1.0, 4096)
    waits, mean_wait = pool_ttft_quantile(rate, servers, exponential, np.zeros(4096), 0.99,
                                          samples=200_000)
    assert waits == pytest.approx(expected, rel=0.1)
    assert mean_wait == pytest.approx(erlang_c / (servers - rate), rel=0.15)


def test_a_pool_absorbs_long_prompts_better_than_split_queues() -> None:
    from controller.core.capacity import pool_ttft_quantile

    heavy = token_quantiles(1.0, 4.0)
    split, _ = pool_ttft_quantile(0.6, 1, heavy, heavy, 0.99)  # each worker its own queue
    pooled, _ = pool_ttft_quantile(3 * 0.6, 3, heavy, heavy, 0.99)  # least-work dispatch
    assert pooled < 0.7 * split


def test_decode_sees_the_rate_averaged_over_a_stay() -> None:
    steady = replace(BASE, qps=40.0, rate_profile=(1.0,), profile_window_s=1.0)
    # one-second bursts (an arrival log): a decode request stays 250 tokens x 40 ms = 10 s
    spiky = replace(steady, rate_profile=(0.4, 0.4, 0.4, 2.8) * 30)
    assert max(spiky.smoothed(10.0).rate_profile) < 1.2
    assert spiky.smoothed(0.5) is spiky
    a, b = plan(steady), plan(spiky)
    assert b.decode.workers == a.decode.workers
    assert b.prefill.workers > a.prefill.workers
    assert any("averaged over" in line for line in b.decode.explanation)


# --- the shape feedback: the decode pool's session KV sets the decode-local share -----------

# the observed cluster: 12 decode workers of KV, a session working set 1.3x its idle capacity
# (the pool was evicting), 20 of the 30 cached points held by decode workers
CACHE = SessionCache(observed_decode_workers=12, kv_capacity_tokens=KV,
                     observed_running_tokens=200_000.0, decode_cached_fraction=0.2,
                     working_set_tokens=1.3 * (12 * KV - 200_000.0))


def prefill_token_demand(d: CapacityDemand) -> float:
    return d.prefill_rate * d.prefill_node_tokens


def test_fewer_decode_workers_hold_fewer_session_turns() -> None:
    ratios = [CACHE.held_ratio(n, 200_000.0) for n in (1, 2, 4, 8, 12, 24)]
    assert all(a < b for a, b in itertools.pairwise(ratios[:-1]))
    assert ratios[-2] == pytest.approx(1.0) and ratios[-1] == 1.0  # never above the observed
    # more running KV on the same workers leaves less for idle sessions
    assert CACHE.held_ratio(2, 600_000.0) < CACHE.held_ratio(2, 200_000.0)
    # less KV per worker: less held
    small = replace(CACHE, kv_capacity_tokens=KV / 2)
    assert small.held_ratio(4, 200_000.0) < CACHE.held_ratio(4, 200_000.0)
    # a working set the candidate pool still holds whole loses nothing
    tiny = replace(CACHE, working_set_tokens=100_000.0)
    assert tiny.held_ratio(1, 200_000.0) == 1.0


def test_less_held_session_kv_moves_prompt_tokens_to_prefill() -> None:
    shaped = [demand_at_shape(BASE, CACHE, n, 200_000.0)[0] for n in (1, 3, 6, 12)]
    shares = [d.decode_local_share for d in shaped]
    cached = [d.cached_fraction for d in shaped]
    tokens = [prefill_token_demand(d) for d in shaped]
    assert shares == sorted(shares) and shares[0] < shares[-1] == BASE.decode_local_share
    assert cached == sorted(cached) and cached[-1] == BASE.cached_fraction
    # only the decode-held part of the cached share goes
    assert cached[0] >= BASE.cached_fraction - CACHE.decode_cached_fraction
    assert tokens == sorted(tokens, reverse=True) and tokens[0] > 1.1 * tokens[-1]
    # prompt tokens are conserved: what is no longer cached is computed somewhere
    for d in shaped:
        computed = d.qps * d.input_tokens * (1 - d.cached_fraction)
        assert prefill_token_demand(d) + d.qps * d.decode_local_share * \
            d.local_append_tokens == pytest.approx(computed)


def test_prefill_workers_prefix_caches_win_back_part_of_it() -> None:
    lost = demand_at_shape(BASE, CACHE, 2, 200_000.0)[0]
    back = [demand_at_shape(BASE, CACHE, 2, 200_000.0, p)[0] for p in (1, 4, 16)]
    assert all(d.decode_local_share == lost.decode_local_share for d in back)
    assert lost.cached_fraction < back[0].cached_fraction < back[1].cached_fraction \
        <= back[2].cached_fraction <= BASE.cached_fraction


def test_joint_plan_prices_the_shape_feedback_and_converges() -> None:
    demand = replace(BASE, input_tokens=8000.0, cached_fraction=0.4, decode_local_share=0.4,
                     local_append_tokens=500.0)
    cache = replace(CACHE, decode_cached_fraction=0.35)
    flat = plan(demand)
    joint = plan(demand, session_cache=cache)
    shaped = joint.demand_at_shape
    assert flat.demand_at_shape is None and shaped is not None
    assert shaped.decode_local_share < demand.decode_local_share
    assert prefill_token_demand(shaped) > prefill_token_demand(demand)
    assert joint.prefill.workers >= flat.prefill.workers
    assert joint.prefill.predicted_p99_s > flat.prefill.predicted_p99_s or \
        joint.prefill.workers > flat.prefill.workers
    # a fixed point: the decode count planned on the shares it sustains is that count
    again = plan(shaped)
    assert again.decode.workers == joint.decode.workers
    assert any(line.startswith("shape: stable after") for line in joint.decode.explanation)
    # a working set the pool holds at any count changes nothing
    roomy = plan(demand, session_cache=replace(cache, working_set_tokens=1000.0))
    assert roomy.prefill.workers == flat.prefill.workers
    assert roomy.prefill.predicted_p99_s == pytest.approx(flat.prefill.predicted_p99_s)
    assert json.loads(json.dumps(joint.to_dict()))["demand_at_shape"][
        "decode_local_share"] == pytest.approx(shaped.decode_local_share)


@pytest.mark.parametrize("bad", [
    {"observed_decode_workers": 0}, {"kv_capacity_tokens": 0.0},
    {"decode_cached_fraction": 1.5}, {"working_set_tokens": -1.0},
    {"observed_running_tokens": math.inf},
])
def test_session_cache_rejects_bad_input(bad: dict[str, object]) -> None:
    with pytest.raises(CapacityError):
        replace(CACHE, **bad)
