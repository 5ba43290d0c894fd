"""One Markdown table over several ``pdctl bench run --out`` directories (the README's
results section): overall goodput per policy, adaptive vs the best static policy, the
oracle ratio, policy changes and adaptation times.

    .venv/bin/python benchmarks/bench_summary.py results/bench/*/summary.json
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
    cells = [f"`{doc['scenario']}`"]
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


def main() -> None:
    print("| scenario | " + " | ".join(POLICIES)
          + " | adaptive - best static | adaptive / oracle | adaptive changes "
            "| adaptation s per event |")
    print("|---" * (len(POLICIES) + 5) + "|")
    for path in sys.argv[1:]:
        print(row(json.loads(Path(path).read_text())))


if __name__ == "__main__":
    main()
