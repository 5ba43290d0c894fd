"""One Markdown table over several ``pdctl bench run --out`` directories (the README's
results section): overall goodput per policy, adaptive vs the best static policy, the
oracle ratio, policy changes and adaptation times; when a scenario was run with several
seeds (``--seed``), a second table per scenario over its seeds.

    .venv/bin/python benchmarks/bench_summary.py results/bench/*/summary.json
    .venv/bin/python benchmarks/bench_summary.py results/seed*/*/summary.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

POLICIES = ("pd", "local", "ppd-static", "threshold", "adaptive", "oracle")
STATIC = ("pd", "local", "ppd-static", "threshold")


def row(doc: dict[str, object]) -> str:
    pol = doc["policies"]
    assert isinstance(pol, dict)
    cells = [f"`{doc['scenario']}`", str(doc.get("seed", "-"))]
    for k in POLICIES:
        cells.append(f"{pol[k]['goodput']:.3f}" if k in pol else "-")
    statics = [k for k in STATIC if k in pol]
    if "adaptive" in pol and statics:
        best = max(statics, key=lambda k: pol[k]["goodput"])
        cells.append(f"{pol['adaptive']['goodput'] - pol[best]['goodput']:+.3f} ({best})")
        ratio = doc.get("oracle_ratio")
        cells.append("-" if ratio is None else f"{ratio:.3f}")
        cells.append(str(pol["adaptive"]["policy_changes"]))
        cells.append(", ".join("-" if a is None else f"{a:.0f}"
                               for a in pol["adaptive"]["adaptation_s"]) or "-")
    else:
        cells += ["-"] * 4
    return "| " + " | ".join(cells) + " |"


def adaptive_margin(doc: dict[str, object]) -> tuple[float, float | None]:
    """(adaptive - best static goodput, adaptive / oracle) of one run."""
    pol = doc["policies"]
    assert isinstance(pol, dict)
    best = max(pol[k]["goodput"] for k in STATIC if k in pol)
    ratio = doc.get("oracle_ratio")
    return pol["adaptive"]["goodput"] - best, ratio if isinstance(ratio, float) else None


def over_seeds(docs: list[dict[str, object]]) -> list[str]:
    """Per scenario run with two or more seeds: the margin over the best static policy per
    seed, how many seeds adaptive won, and the oracle ratio's range."""
    by_scenario: dict[str, list[dict[str, object]]] = {}
    for doc in docs:
        if "adaptive" in doc["policies"]:  # type: ignore[operator]
            by_scenario.setdefault(str(doc["scenario"]), []).append(doc)
    lines = []
    for name, runs in by_scenario.items():
        if len({d.get("seed") for d in runs}) < 2:
            continue
        runs.sort(key=lambda d: int(d.get("seed", 0)))  # type: ignore[call-overload]
        margins = [adaptive_margin(d) for d in runs]
        ratios = [r for _, r in margins if r is not None]
        lines.append(
            f"| `{name}` | {', '.join(str(d.get('seed')) for d in runs)} "
            f"| {', '.join(f'{m:+.3f}' for m, _ in margins)} "
            f"| {sum(m > 0 for m, _ in margins)} of {len(runs)} "
            f"| {sum(m for m, _ in margins) / len(runs):+.3f} "
            f"| {min(ratios):.3f}–{max(ratios):.3f} |" if ratios else "| - |")
    if not lines:
        return []
    return ["", "| scenario | seeds | adaptive - best static, per seed | adaptive above "
            "| mean | adaptive / oracle |", "|---|---|---|---|---|---|", *lines]


def main() -> None:
    docs = [json.loads(Path(path).read_text()) for path in sys.argv[1:]]
    print("| scenario | seed | " + " | ".join(POLICIES)
          + " | adaptive - best static | adaptive / oracle | adaptive changes "
            "| adaptation s per event |")
    print("|---" * (len(POLICIES) + 6) + "|")
    for doc in docs:
        print(row(doc))
    for line in over_seeds(docs):
        print(line)


if __name__ == "__main__":
    main()
