"""The evaluation's results over several runs: one Markdown table of every run (a scenario
and a seed each) and, for a scenario run with several seeds, one line over its seeds.

The README's results block is this module's output over the committed
``results/bench/*/*/summary.json`` (``benchmarks/bench_summary.py --readme README.md``
writes it; a test checks the README still matches the committed summaries).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from controller.bench.report import seconds_list
from controller.bench.runner import POLICIES, STATIC

README_BEGIN = "<!-- bench-results: begin (benchmarks/bench_summary.py --readme; do not edit) -->"
README_END = "<!-- bench-results: end -->"


def _best_static(policies: Mapping[str, Any]) -> str:
    return max((k for k in STATIC if k in policies), key=lambda k: policies[k]["goodput"])


def run_row(doc: Mapping[str, Any]) -> str:
    """One run: goodput per policy, adaptive against the best static policy and the
    oracle, the adaptive loop's policy changes, adaptation and detection time per event."""
    pol = doc["policies"]
    cells = [f"`{doc['scenario']}`", str(doc.get("seed", "-"))]
    cells += [f"{pol[k]['goodput']:.3f}" if k in pol else "-" for k in POLICIES]
    if "adaptive" in pol and any(k in pol for k in STATIC):
        best = _best_static(pol)
        ratio = doc.get("oracle_ratio")
        cells += [
            f"{pol['adaptive']['goodput'] - pol[best]['goodput']:+.3f} ({best})",
            "-" if ratio is None else f"{ratio:.3f}",
            str(pol["adaptive"]["policy_changes"]),
            seconds_list(pol["adaptive"]["adaptation_s"]),
            seconds_list(pol["adaptive"].get("detection_s")),
        ]
    else:
        cells += ["-"] * 5
    return "| " + " | ".join(cells) + " |"


def seed_rows(docs: Iterable[Mapping[str, Any]]) -> list[str]:
    """Per scenario run with two or more seeds: adaptive's margin over the best static
    policy per seed, on how many seeds it was above, the mean margin, the oracle ratios."""
    by_scenario: dict[str, list[Mapping[str, Any]]] = {}
    for doc in docs:
        if "adaptive" in doc["policies"]:
            by_scenario.setdefault(str(doc["scenario"]), []).append(doc)
    rows = []
    for name, runs in by_scenario.items():
        if len({d.get("seed") for d in runs}) < 2:
            continue
        margins = [d["policies"]["adaptive"]["goodput"]
                   - d["policies"][_best_static(d["policies"])]["goodput"] for d in runs]
        ratios = [float(d["oracle_ratio"]) for d in runs if d.get("oracle_ratio") is not None]
        ratio_range = f"{min(ratios):.3f}–{max(ratios):.3f}" if ratios else "-"
        rows.append(
            f"| `{name}` | {', '.join(str(d.get('seed', '-')) for d in runs)} "
            f"| {', '.join(f'{m:+.3f}' for m in margins)} "
            f"| {sum(m > 0 for m in margins)} of {len(runs)} "
            f"| {sum(margins) / len(runs):+.3f} | {ratio_range} |")
    return rows


def suite_markdown(docs: Iterable[Mapping[str, Any]]) -> str:
    """Both tables, runs ordered by scenario then seed."""
    ordered = sorted(docs, key=lambda d: (str(d["scenario"]), int(d.get("seed", 0))))
    lines = ["| scenario | seed | " + " | ".join(POLICIES)
             + " | adaptive - best static | adaptive / oracle | adaptive changes "
               "| adaptation s per event | detection s per event |",
             "|---" * (len(POLICIES) + 7) + "|"]
    lines += [run_row(d) for d in ordered]
    seeds = seed_rows(ordered)
    if seeds:
        lines += ["", "| scenario | seeds | adaptive - best static, per seed | adaptive above "
                  "| mean | adaptive / oracle |", "|---|---|---|---|---|---|", *seeds]
    return "\n".join(lines) + "\n"


_BLOCK = re.compile(re.escape(README_BEGIN) + r"\n(.*?)" + re.escape(README_END), re.S)


def readme_block(text: str) -> str | None:
    """The generated block of a README (None: it has no markers)."""
    m = _BLOCK.search(text)
    return m.group(1) if m else None


def with_readme_block(text: str, block: str) -> str:
    """``text`` with its generated block replaced; ValueError if it has no markers."""
    if readme_block(text) is None:
        raise ValueError(f"no results block: expected the lines {README_BEGIN!r} and "
                         f"{README_END!r}")
    return _BLOCK.sub(lambda _: f"{README_BEGIN}\n{block}{README_END}", text, count=1)
