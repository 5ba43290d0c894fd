"""``pdctl bench run``: replay a scenario in virtual time under static policies."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from controller.cli._app import bench_app

if TYPE_CHECKING:
    from controller.policy import Policy
    from controller.sim.scenario import Scenario


def resolve_policy(spec: str, scenario: Scenario) -> tuple[str, Policy]:
    """``pd`` (every turn to a prefill node), ``local`` (every later turn decode-local) or a
    policy JSON file (keyed by its file name without extension)."""
    from dataclasses import replace

    from controller.policy import Policy, Route, Slo, loads, validate_policy

    slo = Slo(ttft_s=scenario.ttft_slo_s, tpot_s=scenario.tpot_slo_s)
    if spec == "pd":
        return "pd", replace(Policy.uniform(1, Route.PREFILL_NODE), slo=slo)
    if spec == "local":
        return "local", replace(Policy.uniform(1, Route.DECODE_LOCAL), slo=slo)
    path = Path(spec)
    if not path.is_file():
        raise typer.BadParameter(f"{spec!r} is not pd, local or a policy JSON file")
    policy = loads(path.read_text(encoding="utf-8"))
    validate_policy(policy)
    return path.stem, policy


@bench_app.command("run")
def bench_run(
    scenario_path: Annotated[Path, typer.Argument(metavar="SCENARIO.toml",
                                                  help="Scenario file (TOML).")],
    policy: Annotated[list[str] | None, typer.Option(
        "--policy", help="pd | local | PATH.json; repeat for several (default: pd and local).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the JSON summary.")] = False,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Write summary.json and per-request records (<policy>.jsonl) here.")
    ] = None,
) -> None:
    """Replay SCENARIO.toml in virtual time under each policy and compare them."""
    from dataclasses import asdict

    from controller.bench.report import bench_document
    from controller.errors import ConfigError
    from controller.sim.run import RunResult, run_scenario
    from controller.sim.scenario import load_scenario

    try:
        scenario = load_scenario(scenario_path)
        specs = policy or ["pd", "local"]
        policies = dict(resolve_policy(s, scenario) for s in specs)
    except (ConfigError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    results: dict[str, RunResult] = {}
    show_progress = sys.stdout.isatty()
    for key, pol in policies.items():
        if show_progress:
            from rich.progress import Progress

            with Progress(transient=True) as bar:
                task = bar.add_task(f"{scenario.name} / {key}", total=scenario.duration_s)

                def advance(t: float, bar: Progress = bar, task: Any = task) -> None:
                    bar.update(task, completed=t)

                results[key] = run_scenario(scenario, pol, policy_key=key, progress=advance)
        else:
            results[key] = run_scenario(scenario, pol, policy_key=key)
    doc = bench_document(scenario.name, results)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        for key, res in results.items():
            with (out / f"{key}.jsonl").open("w", encoding="utf-8") as f:
                for rec in res.records:
                    f.write(json.dumps(asdict(rec)) + "\n")
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
        return
    _print_table(doc, results)


def _fmt(v: Any, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def _print_table(doc: dict[str, Any], results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"scenario {doc['scenario']}")
    for col in ("policy", "goodput", "requests", "rejected", "T2+ TTFT mean ms",
                "T2+ TTFT p99 ms", "TPOT mean ms", "TPOT p99 ms", "KV GiB", "wall s"):
        table.add_column(col, justify="right")
    for key, s in doc["policies"].items():
        table.add_row(key, _fmt(s["goodput"]), str(s["requests"]), str(s["rejected"]),
                      _fmt(s["turn2_ttft_mean_s"], 1e3, 1), _fmt(s["turn2_ttft_p99_s"], 1e3, 1),
                      _fmt(s["tpot_mean_s"], 1e3, 2), _fmt(s["tpot_p99_s"], 1e3, 2),
                      _fmt(s["kv_bytes"], 1 / 2**30, 2), f"{results[key].wall_s:.1f}")
    Console().print(table)
