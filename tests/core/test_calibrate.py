"""Calibration against a known ground truth (tests/core/synth.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from controller.core.calibrate import (
    CalibrationConfig,
    CalibrationError,
    CalibrationResult,
    calibrate,
    fixed_point,
)
from controller.core.features import N_IO_BINS, build_training_set
from controller.core.latency_model import fit_latency_model, heldout_error
from controller.policy.decide import bin_index
from controller.policy.model import Policy, Route, Slo
from controller.policy.validation import validate_policy
from tests.core.synth import (
    ROUTER_CTX_REP,
    ROUTER_IO_REP,
    Mix,
    Truth,
    _lognorm_cdf,
    cell_tokens,
    training_windows,
    true_latencies,
)

SLO = Slo(ttft_s=1.0, tpot_s=0.05)
NOW = 1_900_000_000.0


@pytest.fixture(scope="module")
def truth() -> Truth:
    return Truth()


@pytest.fixture(scope="module")
def train(truth: Truth) -> list:
    return training_windows(truth, Mix(), 300, seed=1, slo=SLO)


@pytest.fixture(scope="module")
def heldout(truth: Truth) -> list:
    return training_windows(truth, Mix(), 80, seed=2, slo=SLO, start=1_800_000_000.0)


@pytest.fixture(scope="module")
def result(train: list, heldout: list) -> CalibrationResult:
    return calibrate(train, NOW, config=CalibrationConfig(slo=SLO), heldout_windows=heldout)


def true_goodput(t: Truth, mix: Mix, qps_per_router: float, local: np.ndarray,
                 slo: Slo, n_routers: int = 2) -> float:
    """Expected goodput of the ground truth with per-cell local shares."""
    k, share = mix.arrays()
    context, append = cell_tokens(t, k)
    rate = qps_per_router * n_routers * share
    tl = true_latencies(t, context, append, rate * (1 - local), rate * local)
    g = 0.0
    for j in range(k.shape[0]):
        for col, w in ((0, 1 - local[j]), (1, local[j])):
            g += share[j] * w * (_lognorm_cdf(slo.ttft_s, tl.ttft[j, col], t.sigma_ttft)
                                 * _lognorm_cdf(slo.tpot_s, tl.tpot[j, col], t.sigma_tpot))
    return g


def policy_local(policy: Policy, mix: Mix, qps_per_router: float) -> np.ndarray:
    """Local share the policy gives each mix cell at this QPS (exploration included)."""
    k, _ = mix.arrays()
    axes = policy.table.axes
    out = []
    for cell in k:
        ctx = ROUTER_CTX_REP[cell // N_IO_BINS]
        ratio = ROUTER_IO_REP[cell % N_IO_BINS]
        idx = axes.cell_index(bin_index(axes.context_tokens, ctx),
                              bin_index(axes.io_ratio, ratio), bin_index(axes.qps, qps_per_router))
        route = policy.table.routes[idx]
        e = policy.table.exploration[idx]
        out.append(1 - e if route == Route.DECODE_LOCAL else e)
    return np.array(out)


def test_heldout_error_within_15_percent(result: CalibrationResult) -> None:
    for route in ("PREFILL_NODE", "DECODE_LOCAL"):
        for target in ("ttft", "tpot"):
            e = result.heldout[route][target]
            assert e.rows > 100
            assert e.mape is not None and e.mape <= 0.15, (route, target, e)
            assert e.r2 is not None and e.r2 > 0.5, (route, target, e)


def test_heldout_error_is_measured_not_assumed(truth: Truth, train: list) -> None:
    """A model fitted on a different cluster (4x slower KV link) must show a larger error."""
    model = fit_latency_model(build_training_set(train), SLO.ttft_s, SLO.tpot_s)
    slow = Truth(link_bw=truth.link_bw / 8, link_setup=0.02)
    other = build_training_set(training_windows(slow, Mix(), 40, seed=3, slo=SLO))
    same = build_training_set(training_windows(truth, Mix(), 40, seed=3, slo=SLO))
    err_other = heldout_error(model, other)["PREFILL_NODE"]["ttft"].mape
    err_same = heldout_error(model, same)["PREFILL_NODE"]["ttft"].mape
    assert err_other is not None and err_same is not None
    assert err_other > 2 * err_same


def test_fixed_point_records_rounds_and_converges(result: CalibrationResult) -> None:
    rounds = result.rounds
    assert [r.round for r in rounds] == list(range(1, len(rounds) + 1))
    assert 1 <= len(rounds) <= CalibrationConfig().max_rounds
    if result.converged:
        assert rounds[-1].changed_cells == 0
    # every round re-predicted under its own routes: goodput values are probabilities
    assert all(0.0 <= r.predicted_goodput <= 1.0 for r in rounds)


def test_fixed_point_is_a_fixed_point(result: CalibrationResult) -> None:
    """Starting from the final routes, one more round changes nothing in the stable rows."""
    stable = result.details["stable_qps_rows"]
    # the rows the current traffic lives in must have settled
    busy = [int(i) for i in np.flatnonzero(result.grid.qps_weight)]
    assert set(busy) <= set(stable)
    grid = result.grid
    n_ctx, n_io, n_qps = grid.axes.shape
    routes = np.array([r == Route.DECODE_LOCAL for r in result.policy.table.routes])
    start = routes.reshape(n_ctx * n_io, n_qps).T
    fp = fixed_point(result.model, grid, result.policy.weights, SLO, start, 0.0, 1)
    again = fp.routes
    assert np.array_equal(again[stable], start[stable])
    assert all(fp.stable_rows[stable])


def test_policy_is_valid_and_carries_provenance(result: CalibrationResult, train: list) -> None:
    p = result.policy
    validate_policy(p)
    assert p.version == 1
    assert p.slo == SLO
    assert p.provenance.trained_from is not None and p.provenance.trained_to is not None
    assert p.provenance.trained_from.timestamp() == train[0].start
    assert p.provenance.trained_to.timestamp() == train[-1].end
    assert result.approved  # no current policy: nothing to beat
    d = result.to_dict()
    assert d["predicted_goodput"]["candidate"] == result.predicted_goodput_candidate
    assert set(d["heldout_mape"]) == {"PREFILL_NODE", "DECODE_LOCAL"}


@pytest.mark.parametrize("qps", [0.7, 1.5, 3.0])
def test_table_matches_ground_truth_best_route(
    result: CalibrationResult, truth: Truth, qps: float
) -> None:
    """Per cell, flipping the learned route must not raise the TRUE goodput materially."""
    mix = Mix()
    local = policy_local(result.policy, mix, qps)
    base = true_goodput(truth, mix, qps, local, SLO)
    k, share = mix.arrays()
    agree = 0.0
    for j in range(k.shape[0]):
        flipped = local.copy()
        flipped[j] = 1.0 - local[j]
        g = true_goodput(truth, mix, qps, flipped, SLO)
        if g <= base + 0.002:  # the learned route is the (near-)best one for this cell
            agree += share[j]
    assert agree >= 0.75, f"learned routes match the truth for only {agree:.0%} of traffic"


@pytest.mark.parametrize("qps", [0.7, 1.5, 3.0])
def test_calibrated_policy_beats_uniform_baselines_on_truth(
    result: CalibrationResult, truth: Truth, qps: float
) -> None:
    mix = Mix()
    k, _ = mix.arrays()
    learned = true_goodput(truth, mix, qps, policy_local(result.policy, mix, qps), SLO)
    all_p = true_goodput(truth, mix, qps, np.zeros(k.shape[0]), SLO)
    all_l = true_goodput(truth, mix, qps, np.ones(k.shape[0]), SLO)
    assert learned >= max(all_p, all_l) - 0.01, (learned, all_p, all_l)


def test_guardrail_rejects_a_candidate_no_better_than_current(
    result: CalibrationResult, train: list, heldout: list
) -> None:
    again = calibrate(train, NOW + 60, current=result.policy,
                      config=CalibrationConfig(slo=SLO), heldout_windows=heldout)
    assert again.policy.version == result.policy.version + 1
    assert again.predicted_goodput_current is not None
    assert not again.approved
    assert "rejected" in again.verdict.reason
    assert again.changed_cells is not None


def test_guardrail_approves_over_a_bad_current_policy(
    result: CalibrationResult, train: list, heldout: list
) -> None:
    # all-prefill-node is predicted (and truly) worse here: the candidate must be approved
    bad = Policy.uniform(7, Route.PREFILL_NODE, slo=SLO)
    cand = calibrate(train, NOW, current=bad, config=CalibrationConfig(slo=SLO),
                     heldout_windows=heldout)
    assert cand.predicted_goodput_current is not None
    if cand.predicted_goodput_candidate >= cand.predicted_goodput_current + 0.005:
        assert cand.approved and cand.policy.version == 8
    else:
        assert not cand.approved


def test_overload_guardrail_uses_the_heldout_goodput_error(
    truth: Truth, train: list, heldout: list
) -> None:
    # Held-out windows from a decode pool 4x slower than the training ones: the model gets
    # their goodput wrong, and the recorded error says so.
    slow = Truth(floor=truth.floor * 4, c_dec=truth.c_dec * 4)
    other = training_windows(slow, Mix(), 80, seed=2, slo=SLO, start=1_800_000_000.0)
    bad = Policy.uniform(7, Route.PREFILL_NODE, slo=SLO)
    # Every regime counts as overloaded here (threshold 1), so the error sets the margin.
    cfg = CalibrationConfig(slo=SLO, guardrail_overload_goodput=1.0)
    same = calibrate(train, NOW, current=bad, config=cfg, heldout_windows=heldout)
    off = calibrate(train, NOW, current=bad, config=cfg, heldout_windows=other)
    err_same = same.details["heldout_goodput_error"]
    err_off = off.details["heldout_goodput_error"]
    assert err_same < 0.05 and err_off > 5 * err_same, (err_same, err_off)
    assert off.verdict.margin == pytest.approx(err_off)
    assert off.predicted_goodput_current is not None
    gain = off.predicted_goodput_candidate - off.predicted_goodput_current
    assert 0.005 < gain < err_off  # this set-up: a real predicted gain, within the error
    assert same.approved and not off.approved
    # Not overloaded (the default threshold): the absolute margin alone.
    assert calibrate(train, NOW, current=bad, config=CalibrationConfig(slo=SLO),
                     heldout_windows=other).approved


def test_calibration_refuses_empty_input() -> None:
    with pytest.raises(CalibrationError):
        calibrate([], NOW)


def test_exploration_is_zero_where_no_traffic(result: CalibrationResult) -> None:
    table = result.policy.table
    mix = Mix()
    k, _ = mix.arrays()
    seen_ctx_io = {
        (bin_index(table.axes.context_tokens, ROUTER_CTX_REP[c // N_IO_BINS]),
         bin_index(table.axes.io_ratio, ROUTER_IO_REP[c % N_IO_BINS])) for c in k
    }
    for idx, e in enumerate(table.exploration):
        i_ctx, i_io, _ = table.axes.cell_coords(idx)
        if (i_ctx, i_io) not in seen_ctx_io:
            assert e == 0.0
        assert 0.0 <= e <= 0.2
    assert any(e > 0 for e in table.exploration)
    assert math.isfinite(sum(table.scores))


def test_latency_rows_per_context_bin_are_spread_over_io_cells() -> None:
    """Routers export latency per (route, context bin): rows with io_bin = -1 (ALL_BINS)."""
    from controller.core.features import spread_bin_totals

    rows = np.array([
        # w, ctx, io, local, requests, met, ttft_sum, ttft_n, tpot_sum, tpot_n
        [0, 3, 2, 0, 30, 30, 0, 0, 0, 0],
        [0, 3, 5, 0, 10, 9, 0, 0, 0, 0],
        [0, 3, -1, 0, 0, 0, 8.0, 40, 0.4, 40],  # sums over both io cells above
        [0, 3, 2, 1, 5, 5, 0.5, 5, 0.05, 5],  # other route: untouched
        [0, -2, 1, 0, 3, 3, 0.3, 3, 0.03, 3],  # unknown context bin: dropped
        [1, 4, -1, 0, 0, 0, 1.0, 10, 0.1, 10],  # no request row to land on: dropped
    ], dtype=np.float64)
    out = spread_bin_totals(rows)
    assert out.shape[0] == 3
    a, b, c = out
    assert a[6] == pytest.approx(6.0) and a[7] == pytest.approx(30)  # 3/4 of the sums
    assert b[6] == pytest.approx(2.0) and b[7] == pytest.approx(10)
    assert a[6] / a[7] == pytest.approx(b[6] / b[7])  # the bin's mean in each cell
    assert c[6] == 0.5 and c[7] == 5
    assert out[:, 4].sum() == 45  # requests unchanged


def test_explain_matches_the_table(result: CalibrationResult) -> None:
    from controller.core.calibrate import explain
    from controller.policy.decide import Features

    f = Features(turn=3, context_tokens=3000.0, append_tokens=600.0,
                 expected_output_tokens=200.0, qps=2.0)
    out = explain(result, f)
    axes = result.policy.table.axes
    cell = out["cell"]
    idx = axes.cell_index(cell["context_bin"], cell["io_bin"], cell["qps_bin"])
    assert out["decision"] == result.policy.table.routes[idx].name
    assert out["score"] == result.policy.table.scores[idx]
    assert (out["score"] > 0) == (out["decision"] == "DECODE_LOCAL")
    for route in ("PREFILL_NODE", "DECODE_LOCAL"):
        assert out["predicted"][route]["ttft_s"] > 0 and out["predicted"][route]["tpot_s"] > 0
    first = explain(result, Features(1, 0.0, 2000.0, 200.0, 2.0))
    assert first["reason"] == "first_turn" and "predicted" not in first


def test_explain_calls_a_cell_measured_on_one_route_an_extrapolation(
    result: CalibrationResult,
) -> None:
    """Its score compares a measured route with one the model only extrapolates to, so a
    large |score| there is no confidence."""
    import numpy as np

    from controller.core.calibrate import explain
    from controller.policy.decide import Features

    covered = [f for f in (Features(3, float(c), float(c) / 5, 200.0, 2.0)
                           for c in (100, 300, 1000, 3000, 10000, 30000))
               if explain(result, f)["confidence"] != "extrapolated"]
    assert covered, "no cell of the training mix among the candidates"
    f = covered[0]
    n = result.policy.table.axes.n_cells
    measured = explain(result, f, rarer_route_requests=np.full(n, 50.0))
    one_route = explain(result, f, rarer_route_requests=np.zeros(n))
    assert measured["confidence"] == explain(result, f)["confidence"]
    assert one_route["confidence"] == "extrapolated"
    assert one_route["score"] == measured["score"]  # only the confidence changes


def test_exploration_is_capped_in_requests_per_second(train: list) -> None:
    """A busy cell reaches its samples with a smaller share (and pays the most for each
    explored request): no cell sends more than ``exploration_max_rate`` requests/s the
    other way, even below the floor; uncapped, the same cells explore at least the floor."""
    capped = calibrate(train, NOW, config=CalibrationConfig(slo=SLO, exploration_max_rate=0.005))
    free = calibrate(train, NOW, config=CalibrationConfig(slo=SLO,
                                                          exploration_max_rate=math.inf))
    g = capped.grid
    assert g.forced_p is not None and g.forced_l is not None
    decided = g.mix * (1.0 - g.forced_p - g.forced_l)  # share of traffic the table decides
    n_qps = g.qps.shape[0]
    below_floor = 0
    for idx, e in enumerate(capped.policy.table.exploration):
        k, s = divmod(idx, n_qps)  # policy order: (ctx, io) cell, then qps row
        rate = g.qps[s] * g.n_routers * decided[k]
        assert e * rate <= 0.005 * (1 + 1e-9)
        e_free = free.policy.table.exploration[idx]
        if rate > 0.5 and e_free > 0:
            assert e_free >= CalibrationConfig().exploration.floor
            assert e < e_free
            below_floor += 1
    assert below_floor > 0


@pytest.mark.parametrize("pin", list(Route))
def test_a_pinned_route_gives_a_uniform_table_without_exploration(
    train: list, heldout: list, result: CalibrationResult, pin: Route
) -> None:
    """[ppd] append_prefill_route = prefill | decode: every later turn on the pin, turn 1 on
    the configured route (not tuned), no exploration; the model and its prediction remain."""
    cfg = CalibrationConfig(slo=SLO, pinned_route=pin)
    pinned = calibrate(train, NOW, config=cfg, heldout_windows=heldout)
    table = pinned.policy.table
    assert set(table.routes) == {pin}
    assert set(table.exploration) == {0.0}
    assert pinned.policy.overrides == cfg.overrides
    assert pinned.details["pinned_route"] == pin.name
    assert len(set(result.policy.table.routes)) == 2  # unpinned, the same windows give a mix


def test_a_refusal_on_windows_that_never_took_a_route_says_so_in_words(truth: Truth) -> None:
    """Windows under classic P/D with no exploration: nothing measured decode-local. A
    refused candidate's reason says that its predictions for that route are extrapolations
    (the words behind a bare 'predicted goodput 0.0000', issue 38); measured windows do not
    get those words."""
    from controller.core.calibrate import explain_refusal
    from controller.core.guardrail import GuardrailVerdict
    from tests.core.synth import stationary

    refused = GuardrailVerdict(False, 0.0, 0.92, 0.005, False,
                               "rejected: predicted goodput 0.0000 vs current 0.9200")
    never = build_training_set(stationary(truth, Mix(), 2.0, 0.0, 12, seed=3, slo=SLO))
    said = explain_refusal(refused, never).reason
    assert said.startswith(refused.reason)
    assert "saw 0 decode-local request(s)" in said and "extrapolations" in said, said
    assert "prefill-node" not in said, said
    both = build_training_set(stationary(truth, Mix(), 2.0, 0.5, 12, seed=3, slo=SLO))
    assert explain_refusal(refused, both) == refused
    approved = GuardrailVerdict(True, 0.95, 0.92, 0.005, False, "approved: …")
    assert explain_refusal(approved, never) == approved
