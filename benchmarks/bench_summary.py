"""One Markdown table over several ``pdctl bench run --out`` directories (the results
blocks of docs/results.md): overall goodput per policy, adaptive vs the best static policy, the
oracle ratio, policy changes and adaptation times per run; when a scenario was run with
several seeds (``--seed``), a second table per scenario over its seeds.

    .venv/bin/python benchmarks/bench_summary.py results/bench/*/*/summary.json
    .venv/bin/python benchmarks/bench_summary.py --doc docs/results.md \
        results/bench/*/*/summary.json
    .venv/bin/python benchmarks/bench_summary.py --doc docs/results.md --block bench-heldout \
        results/bench-heldout/*/*/summary.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controller.bench.summary import (  # noqa: E402
    RESULTS_BLOCK,
    suite_markdown,
    with_doc_block,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("summaries", nargs="+", type=Path, help="summary.json files")
    ap.add_argument("--doc", type=Path, default=None,
                    help="rewrite this file's generated results block instead of printing")
    ap.add_argument("--block", default=RESULTS_BLOCK,
                    help=f"which generated block of --doc (default {RESULTS_BLOCK}; the "
                    "held-out seeds' is bench-heldout)")
    args = ap.parse_args()
    table = suite_markdown(json.loads(p.read_text()) for p in args.summaries)
    if args.doc is None:
        sys.stdout.write(table)
        return
    try:
        args.doc.write_text(with_doc_block(args.doc.read_text(), table, args.block))
    except ValueError as e:
        sys.exit(f"error: {args.doc}: {e}")
    print(f"{args.doc}: {args.block} block rewritten from {len(args.summaries)} run(s)")


if __name__ == "__main__":
    main()
