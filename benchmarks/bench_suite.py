"""Run the built-in evaluation scenarios (``scenarios/bench/N-*.toml``) under every policy
and print, per scenario, the wall time and the headline figures (the issue 7 goals). With
``--out`` each ``summary.json`` records its fingerprint (``controller.bench.fingerprint``).
The whole committed evaluation (every seed of ``scenarios/bench/seeds.toml``, the held-out
scenarios too) is ``benchmarks/eval_all.py``.

    .venv/bin/python benchmarks/bench_suite.py                     # full length, all five
    .venv/bin/python benchmarks/bench_suite.py --scale 0.1 1 3     # CI size, scenarios 1, 3
    .venv/bin/python benchmarks/bench_suite.py --out results/bench # + report.md, PNGs
    .venv/bin/python benchmarks/bench_suite.py --seed 2 1 2        # another draw of 1, 2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controller.bench.fingerprint import FileReads, current_fingerprint  # noqa: E402
from controller.bench.report import evaluation_document, markdown_report  # noqa: E402
from controller.bench.runner import (  # noqa: E402
    STATIC,
    numbered_scenarios,
    quiet_logs,
    run_bench,
    scale_scenario,
)
from controller.clock import WallClock  # noqa: E402
from controller.sim.scenario import load_scenario  # noqa: E402


def goals(doc: dict[str, object]) -> dict[str, object]:
    pol = doc["policies"]
    assert isinstance(pol, dict)
    out: dict[str, object] = {}
    if "adaptive" not in pol:
        return out
    a = pol["adaptive"]
    statics = [k for k in STATIC if k in pol]
    best_static = max(statics, key=lambda k: pol[k]["goodput"])
    out["adaptive_goodput"] = a["goodput"]
    out["best_static"] = f"{best_static} {pol[best_static]['goodput']:.4f}"
    out["adaptive_minus_best_static"] = a["goodput"] - pol[best_static]["goodput"]
    out["phase_gaps"] = [
        round(p["goodput"] - max(pol[k]["phases"][i]["goodput"] for k in statics), 4)
        for i, p in enumerate(a["phases"])]
    out["oracle_ratio"] = doc["oracle_ratio"]
    out["policy_changes"] = a["policy_changes"]
    out["adaptation_s"] = a["adaptation_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("which", nargs="*", help="scenario numbers (default: all)")
    ap.add_argument("--scale", type=float, default=1.0, help="--duration-scale")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=None,
                    help="replay with this seed instead of each scenario's")
    args = ap.parse_args()
    wall = WallClock()
    total0 = wall.perf_counter_ns()
    for f, scenario in numbered_scenarios(ROOT / "scenarios/bench", args.which, args.seed):
        scenario = scale_scenario(scenario, args.scale)
        t0 = wall.perf_counter_ns()
        quiet_logs()
        with FileReads(ROOT) as reads:
            load_scenario(f)  # read again while recording: the scenario and its profile
            bench = run_bench(scenario, time_scale=args.scale)
        seconds = (wall.perf_counter_ns() - t0) / 1e9
        doc = evaluation_document(bench)
        if args.out is not None:
            d = args.out / scenario.name
            d.mkdir(parents=True, exist_ok=True)
            cmd = f"pdctl bench run {f.relative_to(ROOT)} --duration-scale {args.scale:g}"
            if args.seed is not None:
                cmd += f" --seed {args.seed}"
            # What regenerates this file, fingerprint included (pdctl bench run writes none).
            again = (f".venv/bin/python benchmarks/bench_suite.py --out {args.out} "
                     f"--scale {args.scale:g}" + (f" --seed {args.seed}" if args.seed is not None
                                                  else "") + f" {f.name.split('-')[0]}")
            doc["fingerprint"] = current_fingerprint(again, sorted(reads.paths))
            (d / "summary.json").write_text(json.dumps(doc, indent=2) + "\n")
            (d / "report.md").write_text(markdown_report(doc, cmd))
            from controller.bench.plots import write_plots

            write_plots(d, bench, doc)
        print(json.dumps({"scenario": scenario.name, "seed": scenario.seed,
                          "wall_s": round(seconds, 1),
                          "goodput": {k: round(v["goodput"], 4)
                                      for k, v in doc["policies"].items()},
                          **goals(doc)}), flush=True)
    print(f"suite wall time: {(wall.perf_counter_ns() - total0) / 1e9:.1f} s")


if __name__ == "__main__":
    main()
