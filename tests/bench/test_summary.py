"""The evaluation's summary tables (``controller.bench.summary``) and the generated blocks of
docs/results.md and the README, which must be what those tables say of the committed runs:
each evaluation set's results (``results/eval/``, every scenario with every seed of
``scenarios/bench/seeds.toml``) and the tuning runs the loop's variants are judged on
(``results/bench``, ``results/bench-heldout``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from controller.bench.evaluation import EvalSet, block_name, load_seed_plan, plan_jobs
from controller.bench.summary import (
    CLAIMS_BLOCK,
    HELDOUT_BLOCK,
    RESULTS_BLOCK,
    claims_markdown,
    doc_block,
    evaluation_claims,
    lowest_phase_margin,
    run_row,
    set_docs,
    set_title,
    suite_markdown,
    with_doc_block,
)

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DOC = "docs/results.md"
REGENERATE = ".venv/bin/python benchmarks/eval_all.py --jobs 2"


def _doc(scenario: str, seed: int, adaptive: float, local: float, threshold: float,
         oracle_ratio: float | None = 0.97) -> dict[str, Any]:
    def entry(goodput: float) -> dict[str, Any]:
        return {"goodput": goodput, "policy_changes": 2, "adaptation_s": [300.0, None],
                "detection_s": [60.0, 90.0]}

    return {"scenario": scenario, "seed": seed, "oracle_ratio": oracle_ratio,
            "policies": {"pd": entry(0.5), "local": entry(local),
                         "threshold": entry(threshold), "adaptive": entry(adaptive)}}


def test_a_run_row_compares_adaptive_with_the_best_static_policy() -> None:
    row = run_row(_doc("s", 1, adaptive=0.90, local=0.85, threshold=0.87))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:2] == ["`s`", "1"]
    assert "+0.030 (threshold)" in cells
    assert cells[-4:] == ["0.970", "2", "300, -", "60, 90"]


def test_the_seed_table_counts_the_seeds_adaptive_won_and_orders_runs() -> None:
    docs = [_doc("b", 3, 0.80, 0.85, 0.70, 0.95), _doc("b", 1, 0.90, 0.85, 0.70, 0.99),
            _doc("a", 1, 0.90, 0.85, 0.70)]
    text = suite_markdown(docs)
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    # Runs by scenario then seed; then one line for "b", the only scenario with two seeds.
    assert [r.split("|")[1:3] for r in rows[:3]] == [
        [" `a` ", " 1 "], [" `b` ", " 1 "], [" `b` ", " 3 "]]
    # local is b's strongest static policy (0.85 on both seeds): +0.05 and -0.05; two seeds
    # are too few for a claim.
    assert rows[3] == ("| `b` | 1, 3 | +0.050, -0.050 | 1 of 2 | +0.000 | - | 0.950–0.990 "
                       "| local | +0.0000 [-0.0500, +0.0500] | none (2 < 10 seeds) |")
    assert len(rows) == 4


def test_claims_need_ten_seeds_and_an_interval_clear_of_zero() -> None:
    """Ten seeds: "beats" where the interval excludes zero, "ties" (learning adds nothing
    measurable) where it does not; the claim lines and the table cells agree."""
    beats = [_doc("a", s, 0.90 + 0.001 * (s % 3), 0.85, 0.70) for s in range(10)]
    ties = [_doc("t", s, 0.85 + (0.01 if s % 2 else -0.01), 0.85, 0.70) for s in range(10)]
    text = suite_markdown(beats + ties)
    claims = [line for line in text.splitlines() if line.startswith("- ")]
    assert claims[0].startswith("- `a`: adaptive beats `local` (+0.0509, 95 % interval")
    assert claims[1].startswith("- `t`: adaptive ties with `local` (+0.0000")
    assert claims[1].endswith("learning adds nothing measurable here.")
    seed_rows = {line.split("|")[1].strip(): line for line in text.splitlines()
                 if line.startswith("| `") and "| 0, 1, 2" in line}
    assert seed_rows["`a`"].endswith("| beats |") and seed_rows["`t`"].endswith("| ties |")


def _with_phases(doc: dict[str, Any], phases: dict[str, list[float]]) -> dict[str, Any]:
    for name, goodputs in phases.items():
        doc["policies"][name]["phases"] = [{"goodput": g} for g in goodputs]
    return doc


def test_the_lowest_phase_is_against_each_phases_own_best_static_policy() -> None:
    doc = _with_phases(_doc("s", 1, adaptive=0.90, local=0.85, threshold=0.87), {
        "adaptive": [0.95, 0.80], "pd": [0.90, 0.70], "local": [0.96, 0.75],
        "threshold": [0.90, 0.83]})
    # Phase 1: 0.95 - local 0.96; phase 2: 0.80 - threshold 0.83 (the worse of the two).
    assert lowest_phase_margin(doc["policies"]) == pytest.approx(-0.03)
    assert run_row(doc).split("|")[-7].strip() == "-0.030"
    assert run_row(doc).split("|")[-6].strip() == "-"  # no once-adapted figures recorded
    for name, adapted in (("adaptive", [0.95, 0.86]), ("pd", [0.9, 0.7]),
                          ("local", [0.96, 0.8]), ("threshold", [0.9, 0.85])):
        for phase, g in zip(doc["policies"][name]["phases"], adapted, strict=True):
            phase["adapted_goodput"] = g
    assert lowest_phase_margin(doc["policies"], "adapted_goodput") == pytest.approx(-0.01)
    assert run_row(doc).split("|")[-6].strip() == "-0.010"
    # A run recorded without phases, or with a static policy missing one, says "-".
    assert lowest_phase_margin(_doc("s", 1, 0.9, 0.85, 0.87)["policies"]) is None
    doc["policies"]["pd"]["phases"] = doc["policies"]["pd"]["phases"][:1]
    assert lowest_phase_margin(doc["policies"]) is None
    seeds = suite_markdown([
        _with_phases(_doc("b", 1, 0.9, 0.85, 0.8), {
            "adaptive": [0.9], "pd": [0.5], "local": [0.85], "threshold": [0.8]}),
        _with_phases(_doc("b", 2, 0.9, 0.85, 0.8), {
            "adaptive": [0.9], "pd": [0.5], "local": [0.92], "threshold": [0.8]}),
    ]).splitlines()
    seeds = next(line for line in seeds if line.startswith("| `b` | 1, 2 |"))
    assert seeds.split("|")[-6].strip() == "-0.020"


@pytest.mark.parametrize("block", [RESULTS_BLOCK, HELDOUT_BLOCK])
def test_a_doc_block_is_replaced_between_its_own_markers_only(block: str) -> None:
    text = ROOT.joinpath(RESULTS_DOC).read_text()
    replaced = with_doc_block(text, "| new |\n", block)
    assert doc_block(replaced, block) == "| new |\n"
    before, after = text.split(doc_block(text, block) or "<missing>")
    assert replaced.startswith(before) and replaced.endswith(after)
    other = HELDOUT_BLOCK if block == RESULTS_BLOCK else RESULTS_BLOCK
    assert doc_block(replaced, other) == doc_block(text, other)
    with pytest.raises(ValueError, match=f"no {block} block"):
        with_doc_block("# a document without markers\n", "| new |\n", block)


TUNING_RUNS = [(RESULTS_BLOCK, "results/bench", 15), (HELDOUT_BLOCK, "results/bench-heldout", 15)]


@pytest.mark.parametrize(("block", "directory", "at_least"), TUNING_RUNS)
def test_the_tuning_runs_blocks_are_those_of_the_committed_runs(
        block: str, directory: str, at_least: int) -> None:
    summaries = sorted(ROOT.glob(f"{directory}/*/*/summary.json"))
    assert len(summaries) >= at_least, (
        f"{directory}/*/*/summary.json: the committed runs are missing")
    expected = suite_markdown(json.loads(p.read_text()) for p in summaries)
    assert doc_block(ROOT.joinpath(RESULTS_DOC).read_text(), block) == expected, (
        f"{RESULTS_DOC}'s {block} block is stale: run .venv/bin/python benchmarks/bench_summary.py "
        f"--doc {RESULTS_DOC} --block {block} {directory}/*/*/summary.json")


@pytest.mark.parametrize("name", sorted(load_seed_plan().sets))
def test_each_evaluation_sets_block_is_that_of_its_committed_results(name: str) -> None:
    """Every scenario of the set with every seed of the set (``scenarios/bench/seeds.toml``):
    none missing, none extra, and the block is the summary of exactly those."""
    plan = load_seed_plan()
    jobs = plan_jobs(plan, [name], [], [])
    found = sorted(ROOT.glob(f"{plan.sets[name].results}/*/seed-*/summary.json"))
    assert {ROOT / job.out_dir / "summary.json" for job in jobs} == set(found), (
        f"{plan.sets[name].results}: results missing or extra; run {REGENERATE}")
    expected = suite_markdown(set_docs(plan, name, ROOT))
    assert doc_block(ROOT.joinpath(RESULTS_DOC).read_text(), block_name(name)) == expected, (
        f"{RESULTS_DOC}'s {block_name(name)} block is stale: run {REGENERATE} --stale")


def test_the_readmes_claims_are_those_of_the_committed_results() -> None:
    expected = evaluation_claims(load_seed_plan(), ROOT)
    assert "adaptive" in expected
    assert doc_block(ROOT.joinpath("README.md").read_text(), CLAIMS_BLOCK) == expected, (
        f"README.md's {CLAIMS_BLOCK} block is stale: run {REGENERATE} --stale")


def test_the_claims_name_each_set_and_say_ties_where_learning_adds_nothing() -> None:
    beats = [_doc("a", s, 0.90 + 0.001 * (s % 3), 0.85, 0.70) for s in range(10)]
    ties = [_doc("t", s, 0.85 + (0.01 if s % 2 else -0.01), 0.85, 0.70) for s in range(10)]
    text = claims_markdown([("Tuned, seeds 0–9", beats), ("Empty", []), ("Held out", ties)])
    assert text.startswith("Tuned, seeds 0–9:\n\n- `a`: adaptive beats `local`")
    assert "Empty" not in text  # a set with no results says nothing
    assert "\nHeld out:\n\n- `t`: adaptive ties with `local`" in text
    assert text.endswith("learning adds nothing measurable here.\n")


def test_a_sets_title_says_its_seeds() -> None:
    made = EvalSet(description="the five scenarios", scenarios="s", results="r",
                   seeds=(13, 11, 12))
    assert set_title(made) == "The five scenarios, seeds 11–13"
    gaps = EvalSet(scenarios="s", results="r", seeds=(1, 5))
    assert set_title(gaps) == "Scenarios, seeds 1, 5"
