"""The whole evaluation as jobs: every scenario of a set with every seed of the set
(``scenarios/bench/seeds.toml``), one full :func:`controller.bench.runner.run_bench` each,
written with its fingerprint (:mod:`controller.bench.fingerprint`) so that the result can be
checked against the code later.

``benchmarks/eval_all.py`` runs the jobs (``--jobs N`` at once) and rewrites the generated
blocks of ``docs/results.md``; :func:`run_job` is one job, importable by a worker process.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controller.bench.fingerprint import (
    ROOT,
    FileReads,
    changed_during_run,
    current_fingerprint,
    package_digests,
)
from controller.errors import ConfigError

SEEDS_FILE = "scenarios/bench/seeds.toml"
SCRIPT = "benchmarks/eval_all.py"


class EvalSet(BaseModel):
    """One set of scenarios and the seeds each is replayed with."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    description: str = ""
    scenarios: str = Field(description="directory of N-*.toml scenario files, repo-relative")
    results: str = Field(description="where the set's results go, repo-relative")
    seeds: tuple[int, ...] = Field(min_length=1)


class SeedPlan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    sets: dict[str, EvalSet]


def load_seed_plan(path: Path | None = None) -> SeedPlan:
    """The committed seed plan (``scenarios/bench/seeds.toml``); ConfigError names a bad key."""
    path = path or ROOT / SEEDS_FILE
    try:
        return SeedPlan.model_validate(tomllib.loads(path.read_text(encoding="utf-8")))
    except (OSError, tomllib.TOMLDecodeError, ValidationError) as e:
        raise ConfigError(f"{path}: {e}") from None


def block_name(set_name: str) -> str:
    """The generated block of ``docs/results.md`` that holds a set's results."""
    return f"eval-{set_name}"


@dataclass(frozen=True, slots=True)
class Job:
    set_name: str
    scenario_file: str  # repo-relative
    scenario_name: str
    seed: int
    out_dir: str  # repo-relative directory of summary.json and report.md

    @property
    def command(self) -> str:
        """The command that regenerates exactly this result."""
        number = Path(self.scenario_file).name.split("-")[0]
        return (f".venv/bin/python {SCRIPT} --set {self.set_name} --scenario {number} "
                f"--seed {self.seed}")

    @property
    def label(self) -> str:
        return f"{self.set_name}/{self.scenario_name}/seed-{self.seed}"


def plan_jobs(plan: SeedPlan, sets: Sequence[str] = (), scenarios: Sequence[str] = (),
              seeds: Sequence[int] = (), root: Path = ROOT) -> list[Job]:
    """Every (set, scenario, seed) of ``plan``, narrowed to ``sets``, scenario numbers
    ``scenarios`` and ``seeds`` where given; in set, scenario, seed order."""
    from controller.bench.runner import numbered_scenarios

    unknown = sorted(set(sets) - set(plan.sets))
    if unknown:
        raise ConfigError(f"unknown set(s) {', '.join(unknown)}; the seed plan has "
                          f"{', '.join(plan.sets)}")
    jobs = []
    for name, s in plan.sets.items():
        if sets and name not in sets:
            continue
        for path, scenario in numbered_scenarios(root / s.scenarios, scenarios):
            for seed in s.seeds:
                if seeds and seed not in seeds:
                    continue
                jobs.append(Job(name, path.relative_to(root).as_posix(), scenario.name, seed,
                                f"{s.results}/{scenario.name}/seed-{seed}"))
    return jobs


def run_job(job: Job, root: Path = ROOT) -> dict[str, Any]:
    """Run one job (full length, every policy), write its ``summary.json`` (with its
    fingerprint) and ``report.md``; returns what the progress line needs."""
    from controller.bench.report import evaluation_document, markdown_report
    from controller.bench.runner import quiet_logs, run_bench
    from controller.clock import WallClock
    from controller.sim.scenario import load_scenario

    quiet_logs()
    wall = WallClock()
    t0 = wall.monotonic()
    before = package_digests(root)
    with FileReads(root) as reads:
        scenario = replace(load_scenario(root / job.scenario_file), seed=job.seed)
        bench = run_bench(scenario)
    doc = evaluation_document(bench)
    doc["fingerprint"] = current_fingerprint(job.command, sorted(reads.paths), root)
    edited = changed_during_run(before, doc["fingerprint"])
    if edited:  # the sources read now are not the code that ran: nothing written
        raise RuntimeError(f"{job.label}: {', '.join(edited)} changed during the run; "
                           f"run it again: {job.command}")
    out = root / job.out_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(markdown_report(doc, job.command), encoding="utf-8")
    partial = out / "summary.json.partial"
    partial.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    partial.replace(out / "summary.json")
    pol = doc["policies"]
    return {"job": job.label, "wall_s": round(wall.monotonic() - t0, 1),
            "goodput": {k: round(v["goodput"], 4) for k, v in pol.items()
                        if v.get("goodput") is not None}}
