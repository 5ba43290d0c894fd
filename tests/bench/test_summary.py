"""The evaluation's summary tables (``controller.bench.summary``) and the README's results
block, which must be what those tables say of the committed runs under ``results/bench``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from controller.bench.summary import (
    readme_block,
    run_row,
    suite_markdown,
    with_readme_block,
)

ROOT = Path(__file__).resolve().parents[2]


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
    assert rows[3] == "| `b` | 1, 3 | +0.050, -0.050 | 1 of 2 | +0.000 | 0.950–0.990 |"
    assert len(rows) == 4


def test_the_readme_block_is_replaced_between_its_markers_only() -> None:
    text = ROOT.joinpath("README.md").read_text()
    replaced = with_readme_block(text, "| new |\n")
    assert readme_block(replaced) == "| new |\n"
    before, after = text.split(readme_block(text) or "<missing>")
    assert replaced.startswith(before) and replaced.endswith(after)
    with pytest.raises(ValueError, match="no results block"):
        with_readme_block("# a README without markers\n", "| new |\n")


def test_the_readme_results_are_those_of_the_committed_runs() -> None:
    summaries = sorted(ROOT.glob("results/bench/*/*/summary.json"))
    assert len(summaries) >= 15, "results/bench/*/*/summary.json: the committed runs are missing"
    expected = suite_markdown(json.loads(p.read_text()) for p in summaries)
    assert readme_block(ROOT.joinpath("README.md").read_text()) == expected, (
        "README.md's results block is stale: run .venv/bin/python benchmarks/bench_summary.py "
        "--readme README.md results/bench/*/*/summary.json")
