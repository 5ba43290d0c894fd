"""Peer-form rules (controller/core/peer_export.py): fits where the optimum is known."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from controller.core.calibrate import CalibrationConfig, CalibrationResult, calibrate
from controller.core.peer_export import (
    TIE,
    PeerFormat,
    RuleCells,
    export_rule,
    fit_threshold,
    goodput_of_rules,
    llmd_non_cached_tokens,
    render,
    rule_cells,
)
from controller.policy.model import Slo
from tests.core.synth import Mix, Truth, cell_tokens, training_windows
from tests.core.test_calibrate import true_goodput

SLO = Slo(ttft_s=1.0, tpot_s=0.05)
NOW = 1_900_000_000.0


def additive(cells: RuleCells, local_good: np.ndarray, prefill_good: np.ndarray):  # type: ignore[no-untyped-def]
    """Goodput when each cell's outcome depends only on its own route (no shared load)."""
    def evaluate(mask: np.ndarray) -> float:
        return float(np.sum(cells.mix * np.where(mask, local_good, prefill_good)))
    return evaluate


def cells_of(append: list[float], context: list[float] | None = None,
             mix: list[float] | None = None) -> RuleCells:
    n = len(append)
    return RuleCells(np.array(append, dtype=float),
                     np.array(context or [1000.0] * n, dtype=float),
                     np.array(mix or [1.0 / n] * n, dtype=float))


def test_llmd_threshold_between_the_last_winning_and_first_losing_append() -> None:
    cells = cells_of([10, 50, 200, 800, 3000])
    # Decode-local wins below 300 new tokens, loses above: the best T is in (200, 800].
    evaluate = additive(cells, np.where(cells.append < 300, 0.9, 0.5), np.full(5, 0.7))
    fit = fit_threshold(cells, evaluate)
    assert (fit.low, fit.high) == (200.0, 800.0)
    assert fit.threshold == 400.0  # the geometric middle
    assert fit.predicted_goodput == pytest.approx((0.9 * 3 + 0.7 * 2) / 5)
    assert fit.local_share == pytest.approx(0.6)
    assert fit.ratio is None and fit.evaluated == 6  # 5 appends: 6 intervals


def test_always_and_never_disaggregate() -> None:
    cells = cells_of([10, 50, 200])
    always = fit_threshold(cells, additive(cells, np.full(3, 0.2), np.full(3, 0.8)))
    assert always.threshold == 0.0 and always.local_share == 0.0  # llm-d: <= 0 = always
    never = fit_threshold(cells, additive(cells, np.full(3, 0.9), np.full(3, 0.1)))
    assert never.high == math.inf and never.threshold == 400.0 and never.local_share == 1.0


def test_a_flat_optimum_keeps_the_most_requests_on_prefill_nodes() -> None:
    cells = cells_of([10, 50, 200, 800])
    # Local and prefill alike for the two short cells (within TIE), local worse above.
    local = np.array([0.8, 0.8 + TIE / 2, 0.3, 0.3])
    fit = fit_threshold(cells, additive(cells, local, np.full(4, 0.8)))
    assert fit.threshold == 0.0 and fit.local_share == 0.0


def test_cells_without_traffic_are_not_candidates() -> None:
    cells = cells_of([10, 50, 200, 5000], mix=[0.5, 0.0, 0.5, 0.0])
    fit = fit_threshold(cells, additive(cells, np.array([0.9, 0.0, 0.2, 0.0]),
                                        np.array([0.5, 0.0, 0.5, 0.0])))
    assert fit.evaluated == 3 and (fit.low, fit.high) == (10.0, 200.0)


def test_dynamo_fits_both_thresholds() -> None:
    # Decode-local wins only for short appends on a long cached context (ratio < 0.25).
    append = [100, 100, 1500, 1500, 6000]
    context = [9900, 100, 8500, 500, 94000]  # ratios 0.01, 0.5, 0.15, 0.75, 0.06
    cells = cells_of(append, context)
    ratio = cells.cached_ratio
    win = (cells.append < 2000) & (ratio < 0.25)
    fit = fit_threshold(cells, additive(cells, np.where(win, 0.95, 0.3), np.full(5, 0.6)),
                        ratios=(0.1, 0.2, 0.3, 0.5, 1.0))
    assert (fit.low, fit.high) == (1500.0, 6000.0)
    assert fit.ratio == 0.2  # the lowest ratio threshold keeping both winning cells local
    assert fit.local_share == pytest.approx(0.4)


def test_llmd_conversion_to_its_token_estimate() -> None:
    assert llmd_non_cached_tokens(0.0, 3.0, 4.0) == 0
    assert llmd_non_cached_tokens(400.0, 4.0, 4.0) == 400
    # Traffic of 3 chars per token, estimated by llm-d at 4: 400 tokens read as 300.
    assert llmd_non_cached_tokens(400.0, 3.0, 4.0) == 300


# -- the real objective: latency model fitted on windows of a known cluster -----------------


# Long appends under load: decode-local wins up to a point, beyond it the prefill node does
# (on the ground truth: best with every append <= 2263 tokens local, 0.934 goodput at 4-8
# requests/s per router; all local 0.667, all on a prefill node 0.0).
HEAVY = Mix({(2, 2): 0.2, (3, 4): 0.2, (5, 6): 0.15, (4, 7): 0.15, (6, 8): 0.15, (7, 5): 0.15})
LOADS = (4.0, 6.0, 8.0)


@pytest.fixture(scope="module")
def fitted() -> tuple[CalibrationResult, Truth, Mix]:
    truth = Truth()
    windows = training_windows(truth, HEAVY, 120, seed=5, qps_range=(4.0, 8.0), slo=SLO)
    return calibrate(windows, NOW, config=CalibrationConfig(slo=SLO)), truth, HEAVY


def test_fitted_rule_is_the_best_threshold_of_a_fine_sweep(
        fitted: tuple[CalibrationResult, Truth, Mix]) -> None:
    result, _, _ = fitted
    for form in PeerFormat:
        export = export_rule(result.model, result.grid, result.policy, SLO, form)
        evaluate = goodput_of_rules(result.model, result.grid, SLO, form)
        cells = rule_cells(result.grid)
        ratio = export.rule.ratio if export.rule.ratio is not None else math.inf
        sweep = [evaluate((cells.append < t) & (cells.cached_ratio < ratio))
                 for t in [0.0, *np.geomspace(1.0, 1e6, 300)]]
        assert max(sweep) - TIE <= export.rule.predicted_goodput <= max(sweep) + 1e-12, form
        assert export.rule.predicted_goodput >= export.always_prefill_goodput
        assert export.table_goodput == pytest.approx(result.predicted_goodput_candidate,
                                                     abs=1e-9)


@pytest.mark.parametrize("form", list(PeerFormat))
def test_fitted_threshold_is_in_the_true_optimum(
        fitted: tuple[CalibrationResult, Truth, Mix], form: PeerFormat) -> None:
    """On the ground truth (not the model): the threshold that is truly best over the mix's
    cells at the windows' loads, and the fitted one, route every cell alike."""
    result, truth, mix = fitted
    export = export_rule(result.model, result.grid, result.policy, SLO, form)
    k, _ = mix.arrays()
    _, append = cell_tokens(truth, k)

    def truth_at(threshold: float) -> float:
        local = (append < threshold).astype(float)
        return float(np.mean([true_goodput(truth, mix, q, local, SLO) for q in LOADS]))

    edges = [0.0, *sorted(set(append.tolist())), math.inf]
    goodput = [truth_at(t + 1e-6) for t in edges[:-1]]
    best = int(np.argmax(goodput))
    assert goodput[best] > max(goodput[best - 1], goodput[best + 1]) + 0.03  # an interior optimum
    low, high = edges[best], edges[best + 1]
    # The model's cells are the windows' own (their output length differs from the truth's
    # by a few per cent): the fitted threshold lies in the same gap between appends.
    assert low * 1.05 < export.rule.threshold < high * 0.95, (low, high, export.to_dict())
    assert truth_at(export.rule.threshold) == pytest.approx(goodput[best], abs=1e-6)


def test_fragments_parse_in_the_peers_formats(fitted: tuple[CalibrationResult, Truth, Mix]
                                              ) -> None:
    import yaml

    result, _, _ = fitted
    llmd = export_rule(result.model, result.grid, result.policy, SLO, PeerFormat.LLM_D)
    doc = yaml.safe_load(render(llmd, traffic_chars_per_token=3.0, llmd_chars_per_token=4.0))
    (plugin,) = doc["plugins"]
    assert plugin["type"] == "prefix-based-pd-decider"
    assert plugin["parameters"]["nonCachedTokens"] == llmd_non_cached_tokens(
        llmd.rule.threshold, 3.0, 4.0)
    dyn = export_rule(result.model, result.grid, result.policy, SLO, PeerFormat.DYNAMO)
    text = render(dyn)
    assert f"the full table {dyn.table_goodput:.4f}" in text
    flags = [line for line in text.splitlines() if not line.startswith("#")]
    config = json.loads(flags[0].split("'")[1])
    assert config == {"policy": "isl_bounding", "eff_isl_threshold": math.ceil(
        dyn.rule.threshold), "eff_isl_ratio_threshold": dyn.rule.ratio}


@pytest.mark.parametrize(("threshold", "says_always"), [(110.0, False), (0.0, True)])
def test_the_dynamo_fragment_says_always_prefill_only_for_a_zero_threshold(
        fitted: tuple[CalibrationResult, Truth, Mix], threshold: float, says_always: bool
) -> None:
    import dataclasses

    result, _, _ = fitted
    dyn = export_rule(result.model, result.grid, result.policy, SLO, PeerFormat.DYNAMO)
    dyn = dataclasses.replace(dyn, rule=dataclasses.replace(dyn.rule, threshold=threshold))
    text = render(dyn)
    assert ("every request goes to a prefill node" in text) is says_always


def test_the_tables_unexplored_goodput_is_its_goodput_with_exploration_off(
        fitted: tuple[CalibrationResult, Truth, Mix]) -> None:
    """A rule explores nothing, the table does: the export prints the table's goodput both
    ways, so a rule that 'beats' the table only by its exploration's price is seen as such
    (issue 38: 0.9303 vs 0.9253 on the quickstart's store, 0.9303 without exploration)."""
    from dataclasses import replace

    result, _, _ = fitted
    policy = result.policy
    assert any(e > 0 for e in policy.table.exploration)  # the calibrated table explores
    dyn = export_rule(result.model, result.grid, policy, SLO, PeerFormat.DYNAMO)
    off = replace(policy, table=replace(
        policy.table, exploration=(0.0,) * len(policy.table.exploration)))
    dyn_off = export_rule(result.model, result.grid, off, SLO, PeerFormat.DYNAMO)
    assert dyn_off.table_goodput == pytest.approx(dyn.table_unexplored_goodput, abs=1e-12)
    assert dyn_off.table_unexplored_goodput == pytest.approx(dyn_off.table_goodput, abs=1e-12)
    assert dyn.table_unexplored_goodput != dyn.table_goodput
    text = render(dyn)
    cost = dyn.table_unexplored_goodput - dyn.table_goodput
    assert (f"the full table without its exploration {dyn.table_unexplored_goodput:.4f} "
            f"(its exploration costs {cost:+.4f}") in text
    assert dyn.to_dict()["predicted_goodput"]["table_unexplored"] == dyn.table_unexplored_goodput
