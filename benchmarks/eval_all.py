"""Regenerate every committed evaluation result: each scenario of each set of
``scenarios/bench/seeds.toml`` with each of its seeds, full length, every policy; each result
written with its fingerprint (``results/eval/<set>/<scenario>/seed-<N>/summary.json`` and
``report.md``), then the generated blocks of ``docs/results.md`` and the README's claims
rewritten from them.

    .venv/bin/python benchmarks/eval_all.py --jobs 2               # everything
    .venv/bin/python benchmarks/eval_all.py --list                 # the jobs, nothing run
    .venv/bin/python benchmarks/eval_all.py --stale --jobs 2       # only results the
                                                                   # freshness check rejects
    .venv/bin/python benchmarks/eval_all.py --set heldout --scenario 2 --seed 11

Progress: one line per finished job on stdout (JSON: job, wall seconds, goodput per policy)
and a running count with the estimated time left on stderr. Each job is one process's work
(``--jobs`` worker processes); a job takes 1-2 minutes of one core at full length.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controller.bench.evaluation import (  # noqa: E402
    Job,
    block_name,
    load_seed_plan,
    plan_jobs,
    run_job,
)
from controller.bench.fingerprint import stale_results  # noqa: E402
from controller.clock import WallClock  # noqa: E402
from controller.errors import ConfigError  # noqa: E402

RESULTS_DOC = ROOT / "docs/results.md"
README = ROOT / "README.md"


def _stale_only(jobs: list[Job]) -> list[Job]:
    """The jobs whose result is missing or fails the freshness check."""
    summaries = {job: ROOT / job.out_dir / "summary.json" for job in jobs}
    stale = {ROOT / s.result for s in stale_results(
        [p for p in summaries.values() if p.is_file()], ROOT)}
    return [job for job, p in summaries.items() if not p.is_file() or p in stale]


def rewrite_doc_blocks(sets: list[str]) -> None:
    """Each set's generated block of docs/results.md and the README's claims, from the
    committed summaries. Imported here, after the jobs: a worker's fingerprint lists the
    modules loaded when it started, and the summary tables play no part in a result."""
    from controller.bench.summary import (
        CLAIMS_BLOCK,
        evaluation_claims,
        set_docs,
        suite_markdown,
        with_doc_block,
    )

    plan = load_seed_plan()
    text = RESULTS_DOC.read_text(encoding="utf-8")
    for name in sets:
        docs = set_docs(plan, name, ROOT)
        if docs:
            text = with_doc_block(text, suite_markdown(docs), block_name(name))
            print(f"docs/results.md: {block_name(name)} block from {len(docs)} run(s)",
                  file=sys.stderr)
    RESULTS_DOC.write_text(text, encoding="utf-8")
    readme = README.read_text(encoding="utf-8")
    README.write_text(with_doc_block(readme, evaluation_claims(plan, ROOT), CLAIMS_BLOCK),
                      encoding="utf-8")
    print(f"README.md: {CLAIMS_BLOCK} block", file=sys.stderr)


def _run(jobs: list[Job], workers: int) -> int:
    wall = WallClock()
    t0 = wall.monotonic()
    failed = 0
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(run_job, job): job for job in jobs}
        for done, future in enumerate(as_completed(futures), 1):
            job = futures[future]
            try:
                print(json.dumps(future.result()), flush=True)
            except Exception as e:  # one job's failure must not lose the others' results
                failed += 1
                print(json.dumps({"job": job.label, "error": repr(e)}), flush=True)
            spent = wall.monotonic() - t0
            left = spent / done * (len(jobs) - done)
            print(f"[{done}/{len(jobs)}] {job.label} done; {spent / 60:.1f} min spent, "
                  f"about {left / 60:.1f} min left", file=sys.stderr, flush=True)
    return failed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", action="append", default=[], dest="sets",
                    help="only this set of seeds.toml (repeatable)")
    ap.add_argument("--scenario", action="append", default=[],
                    help="only scenario number N of each set (repeatable)")
    ap.add_argument("--seed", action="append", type=int, default=[], help="only this seed")
    ap.add_argument("--jobs", type=int, default=1, help="jobs at once (worker processes)")
    ap.add_argument("--stale", action="store_true",
                    help="only results missing or rejected by the freshness check")
    ap.add_argument("--list", action="store_true", help="print the jobs and exit")
    ap.add_argument("--no-doc", action="store_true",
                    help="leave docs/results.md's generated blocks as they are")
    args = ap.parse_args()
    try:
        plan = load_seed_plan()
        jobs = plan_jobs(plan, args.sets, args.scenario, args.seed)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    if args.stale:
        jobs = _stale_only(jobs)
    if args.list:
        for job in jobs:
            print(f"{job.label}: {job.command}")
        print(f"{len(jobs)} job(s)", file=sys.stderr)
        return
    failed = _run(jobs, max(1, args.jobs)) if jobs else 0
    if not args.no_doc:
        rewrite_doc_blocks(args.sets or list(plan.sets))
    if failed:
        sys.exit(f"{failed} job(s) failed")


if __name__ == "__main__":
    main()
