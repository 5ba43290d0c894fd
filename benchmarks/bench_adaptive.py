"""Adaptive-only replays of the built-in bench scenarios: the active calibration behind the
``ppd-static`` starting table and its drift reference (cached), then only the ``adaptive``
policy, printing its
goodput, approvals and adaptation times and, with ``--log``, every calibration (trigger,
verdict, predicted gain, held-out goodput error), policy (status and why) and drift event
from the run's store.
Deterministic (the same seed and code give the same figures): what the cycle variants of
issue 7 were compared with before a full ``bench_suite.py`` run.

    .venv/bin/python benchmarks/bench_adaptive.py 1 3 5 --log
    .venv/bin/python benchmarks/bench_adaptive.py --set controller.guardrail_margin=0.008
    .venv/bin/python benchmarks/bench_adaptive.py --runs all --jobs 2 --cache /tmp/ppd \
        --set controller.calibrate_every_s=900

``--runs tuning|heldout|all`` replays the committed runs (each with its seed) and ends with
issue 7's goal figures (``controller.bench.goals``) of the committed adaptive runs and of the
replays, against the committed static policies and oracle of each run. Judge a variant on
both sets: the defaults were tuned on ``results/bench``, ``results/bench-heldout`` was kept
out of it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controller.bench.adaptive import AdaptiveController, adaptive_start  # noqa: E402
from controller.bench.goals import AdaptiveRun, goal_figures  # noqa: E402
from controller.bench.report import summarize  # noqa: E402
from controller.bench.runner import (  # noqa: E402
    StaticStart,
    adaptive_settings,
    numbered_scenarios,
    parse_setting_overrides,
    ppd_static_start,
    quiet_logs,
    times_to_first,
)
from controller.clock import WallClock  # noqa: E402
from controller.core.drift import feature_statistics  # noqa: E402
from controller.errors import ConfigError  # noqa: E402
from controller.policy import dumps, loads  # noqa: E402
from controller.sim.run import run_scenario  # noqa: E402
from controller.sim.scenario import Scenario, load_scenario  # noqa: E402


def ppd_static(scenario: Scenario, cache: Path | None, reference_windows: int) -> StaticStart:
    """The bench's ``ppd-static`` table and its drift reference
    (:func:`controller.bench.runner.ppd_static_start`, what ``run_bench`` uses), cached by
    scenario, seed and reference size."""
    name = (f"{scenario.name}-seed{scenario.seed}-ref{reference_windows}"
            "-ppd-static-start.json")
    path = cache / name if cache is not None else None
    if path is not None and path.exists():
        doc = json.loads(path.read_text())
        return StaticStart(loads(doc["policy"]), doc["drift_reference"])
    start = ppd_static_start(scenario, reference_windows=reference_windows)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"policy": dumps(start.policy),
                                    "drift_reference": start.drift_reference}))
    return start


def _led_by(kind: str, details: object) -> str:
    """`` (led by FEATURE 1.23)``: the feature with the largest share of the statistic."""
    shares = feature_statistics(kind, details) if isinstance(details, dict) else {}
    if not shares:
        return ""
    feature = max(shares, key=lambda k: shares[k])
    return f" (led by {feature} {shares[feature]:.2f})"


def replay(scenario: Scenario, cache: Path | None, log: bool,
           sets: dict[str, dict[str, object]] | None = None
           ) -> tuple[dict[str, object], list[str]]:
    wall = WallClock()
    t0 = wall.perf_counter_ns()
    lines: list[str] = []
    try:
        settings = adaptive_settings(scenario, overrides=sets)
    except ConfigError as e:
        raise SystemExit(f"--set: {e}") from None
    start = ppd_static(scenario, cache, settings.drift.reference_windows)
    initial = adaptive_start(start.policy, settings)
    with tempfile.TemporaryDirectory(prefix="pdctl-bench-adaptive-") as tmp:
        hook = AdaptiveController(initial, settings, Path(tmp) / "a.db", start.drift_reference)
        result = run_scenario(
            scenario, initial, policy_key="adaptive", controller=hook, setup=hook.setup
        )
        store = hook.store
        if log and store is not None:
            for c in store.calibrations():
                d = c.details or {}
                new, cur = c.predicted_goodput_new, c.predicted_goodput_current
                gain = f"{new - cur:+.4f}" if new is not None and cur is not None else "n/a"
                err = d.get("heldout_goodput_error")
                error = f"{err:.4f}" if isinstance(err, float) else "n/a"
                lines.append(
                    f"  calibration {c.created_at.timestamp():.0f} s "
                    f"{d.get('trigger')}: {'approved' if d.get('approved') else 'refused'}"
                    f", gain {gain}, held-out goodput error "
                    f"{error}, regime only "
                    f"{d.get('regime_only')}"
                )
            lines += [
                f"  policy v{p.version} {p.created_at.timestamp():.0f} s → {p.status} "
                f"{p.updated_at.timestamp():.0f} s: {p.reason}"
                for p in sorted(store.policies(), key=lambda p: p.version)
            ]
            lines += [
                f"  drift {e.at.timestamp():.0f} s {e.kind} {e.statistic:.2f} > {e.threshold:.2f}"
                f"{_led_by(e.kind, e.details)}"
                for e in store.drift_events()
            ]
        outcome = hook.finish()
    approvals = [t for t, _ in outcome.approvals[1:]]
    summary = summarize(result)
    doc: dict[str, object] = {
        "scenario": scenario.name,
        "goodput": round(summary["goodput"], 4),
        "phases": [round(p["goodput"], 4) for p in summary["phases"]],
        "policy_changes": len(approvals) + len(outcome.rollbacks),
        "approved_at_s": [round(a) for a in approvals],
        "rolled_back_at_s": [round(t) for t, _ in outcome.rollbacks],
        "adaptation_s": times_to_first(scenario.events, approvals),
        "detection_s": times_to_first(scenario.events, outcome.reactions),
        "wall_s": round((wall.perf_counter_ns() - t0) / 1e9, 1),
    }
    return doc, lines


def _replay_job(job: tuple[Path, int | None, Path | None, bool,
                           dict[str, dict[str, object]] | None]
                ) -> tuple[dict[str, object], list[str]]:
    path, seed, cache, log, sets = job  # a path, not a Scenario: jobs cross processes
    scenario = load_scenario(path)
    if seed is not None:
        scenario = replace(scenario, seed=seed)
    quiet_logs()
    return replay(scenario, cache, log, sets)


RUN_SETS = {"tuning": "results/bench", "heldout": "results/bench-heldout"}


def committed_runs(which: str) -> list[tuple[str, dict[str, Any]]]:
    """(set, summary) of the committed runs of ``which``: a key of :data:`RUN_SETS` or
    ``all``."""
    names = list(RUN_SETS) if which == "all" else [which]
    return [(name, json.loads(p.read_text())) for name in names
            for p in sorted(ROOT.glob(f"{RUN_SETS[name]}/*/*/summary.json"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("which", nargs="*", help="scenario numbers (default: all)")
    ap.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="directory for the ppd-static starts (skips the active calibration's replays)",
    )
    ap.add_argument("--log", action="store_true",
                    help="print calibrations, policies and drift events")
    ap.add_argument("--seed", type=int, default=None,
                    help="replay with this seed instead of the scenario's")
    ap.add_argument("--runs", choices=("tuning", "heldout", "all"), default=None,
                    help="replay the committed runs of results/bench (tuning), "
                    "results/bench-heldout (heldout) or both, each with its own seed, and "
                    "print issue 7's goal figures of the replays beside the committed ones")
    ap.add_argument("--jobs", type=int, default=1, help="replays run at once (default 1)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one pdctl setting for adaptive (repeatable), e.g. "
                    "controller.bake_windows=5")
    args = ap.parse_args()
    if args.runs is not None and args.seed is not None:
        ap.error("--seed and --runs exclude each other (--runs replays each committed seed)")
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    try:
        sets = parse_setting_overrides(args.set)
    except ValueError as e:
        raise SystemExit(f"--set: {e}") from None
    quiet_logs()
    docs: list[tuple[str, dict[str, Any]]] = []
    if args.runs is None:
        runs = [(path, args.seed) for path, _ in
                numbered_scenarios(ROOT / "scenarios/bench", args.which)]
    else:
        docs = [(name, d) for name, d in committed_runs(args.runs)
                if not args.which or str(d["scenario"]).split("-")[1] in args.which]
        if not docs:
            raise SystemExit(f"no committed runs for --runs {args.runs}")
        paths = {s.name: path for path, s in numbered_scenarios(ROOT / "scenarios/bench")}
        runs = [(paths[str(d["scenario"])], int(d["seed"])) for _, d in docs]
    jobs = [(path, seed, args.cache, args.log, sets) for path, seed in runs]
    results: list[dict[str, object]] = []
    with ProcessPoolExecutor(args.jobs) if args.jobs > 1 else nullcontext() as pool:
        outcomes = pool.map(_replay_job, jobs) if pool is not None else map(_replay_job, jobs)
        for doc, lines in outcomes:
            print(json.dumps(doc), flush=True)
            for line in lines:
                print(line, flush=True)
            results.append(doc)
    paired = list(zip(docs, results, strict=True)) if docs else []
    for name in dict.fromkeys(n for n, _ in docs):
        mine = [(d, r) for (n, d), r in paired if n == name]
        committed = goal_figures((d, AdaptiveRun.from_summary(d)) for d, _ in mine)
        replayed = goal_figures((d, AdaptiveRun.from_replay(r)) for d, r in mine)
        print(f"{name} committed: {committed.line()}")
        print(f"{name} replayed:  {replayed.line()}")


if __name__ == "__main__":
    main()
