"""``pdctl bench run``: the closed-loop evaluation of a scenario in virtual time."""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from controller.cli._app import (
    bench_app,
    load_policy_or_exit,
    table_console,
    writable_dir_or_exit,
)

if TYPE_CHECKING:
    from controller.policy import Policy
    from controller.sim.scenario import Scenario

SHORT_SCALE = 0.1


def resolve_policy(spec: str, scenario: Scenario) -> tuple[str, Policy]:
    """``pd`` (every turn to a prefill node), ``local`` (every later turn decode-local) or a
    policy JSON file (keyed by its file name without extension)."""
    from controller.bench.baselines import static_policy
    from controller.bench.runner import slo_of
    from controller.policy import Route

    if spec == "pd":
        return "pd", static_policy(Route.PREFILL_NODE, slo_of(scenario))
    if spec == "local":
        return "local", static_policy(Route.DECODE_LOCAL, slo_of(scenario))
    path = Path(spec)
    if not path.is_file():
        raise typer.BadParameter(f"{spec!r} is not a policy name or a policy JSON file")
    return path.stem, load_policy_or_exit(path)  # loads() validates


def _threshold_options(items: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--threshold {item!r}: expected KEY=VALUE")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--threshold {item!r}: {value!r} is not a number") from None
    return out


_PolicyOpt = Annotated[list[str] | None, typer.Option(
    "--policy", help="pd | local | ppd-static | ppd-static+overrides | threshold | "
    "adaptive | oracle | PATH.json (reported under its file name, which must not be "
    "another policy's); repeat for several (default: the seven policies).")]
_OutOpt = Annotated[Path | None, typer.Option(
    "--out", help="Write summary.json, report.md, PNG plots and per-request records "
    "(<policy>.jsonl) here.")]
_DurationScaleOpt = Annotated[float, typer.Option(
    "--duration-scale", help="Multiply duration and event times (and the control "
    "interval, not below 10 s) by this factor.")]
_SeedOpt = Annotated[int | None, typer.Option(
    "--seed", min=0, help="Replay with this seed instead of the scenario's (another draw of "
    "the same workload: arrivals, lengths, think times).")]
_ThresholdOpt = Annotated[list[str] | None, typer.Option(
    "--threshold", help="Override the threshold rule: max_uncached_tokens=N, "
    "max_uncached_ratio=R, prefill_waiting=N (0 disables busyness).")]
_ConfigOpt = Annotated[Path | None, typer.Option(
    "--config", help="pdctl settings for the adaptive controller (default: pdctl's "
    "defaults with the scenario's SLOs and control interval; a shortened run also "
    "shortens the approval rate limit, drift cooldown and recalibration period).")]


@bench_app.command("run")
def bench_run(
    scenario_path: Annotated[Path, typer.Argument(metavar="SCENARIO.toml",
                                                  help="Scenario file (TOML).")],
    policy: _PolicyOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the JSON summary.")] = False,
    out: _OutOpt = None,
    duration_scale: _DurationScaleOpt = 1.0,
    seed: _SeedOpt = None,
    short: Annotated[bool, typer.Option(
        "--short", help=f"CI-sized run: --duration-scale {SHORT_SCALE}.")] = False,
    threshold: _ThresholdOpt = None,
    config: _ConfigOpt = None,
) -> None:
    """Replay SCENARIO.toml in virtual time under each policy and compare them."""
    from controller.bench.report import evaluation_document

    time_scale = SHORT_SCALE if short else duration_scale
    scenario, names, extra, thr, settings = _bench_inputs(
        scenario_path, policy, seed, time_scale, threshold, config)
    if out is not None:  # before the run, which can take minutes
        writable_dir_or_exit(out)
    try:
        bench = _run(scenario, names, thr, settings, extra, time_scale)
    except ValueError as e:  # e.g. windows a table cannot be calibrated on
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        typer.echo("interrupted: nothing written", err=True)
        raise typer.Exit(130) from None
    doc = evaluation_document(bench)
    command = "pdctl bench run " + " ".join(shlex.quote(a) for a in sys.argv[3:]) \
        if len(sys.argv) > 3 and sys.argv[1:3] == ["bench", "run"] else None
    if out is not None:
        _write_outputs(out, bench, doc, command)
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
        return
    _print_table(doc, bench)


def _bench_inputs(scenario_path: Path, policy: list[str] | None, seed: int | None,
                  time_scale: float, threshold: list[str] | None, config: Path | None
                  ) -> tuple[Scenario, list[str], dict[str, Any], Any, Any]:
    """The scaled scenario, the built-in policies' names, the files' policies by name, the
    threshold rule and the settings; exit 2 on bad input."""
    from dataclasses import replace

    from controller.bench.baselines import threshold_from_options
    from controller.bench.runner import scale_scenario
    from controller.errors import ConfigError
    from controller.sim.scenario import load_scenario

    try:
        scenario = load_scenario(scenario_path)
        if seed is not None:
            scenario = replace(scenario, seed=seed)
        scenario = scale_scenario(scenario, time_scale)
        names, extra = _policies(policy, scenario)
        thr = threshold_from_options(_threshold_options(threshold or []))
        if threshold and not {"threshold", "oracle"} & set(names):
            typer.echo("warning: --threshold has no effect: neither threshold nor oracle is "
                       "run", err=True)
        settings = None
        if config is not None:
            from controller.config import load_settings

            settings = load_settings(config)
    except (ConfigError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    return scenario, names, extra, thr, settings


def _policies(policy: list[str] | None, scenario: Scenario
              ) -> tuple[list[str], dict[str, Any]]:
    """The built-in policies named, and the policy files' policies by report key."""
    from controller.bench.runner import POLICIES

    names: list[str] = []
    extra: dict[str, Any] = {}
    for spec in policy or list(POLICIES):
        if spec in POLICIES:
            names.append(spec)
        else:
            key, pol = resolve_policy(spec, scenario)
            if key in POLICIES or key.startswith("table-") or key in extra:
                # Results are keyed by name: one would replace the other's silently.
                taken = ("a built-in policy's" if key in POLICIES else "an oracle "
                         "candidate's" if key.startswith("table-") else "another file's")
                raise ValueError(f"{spec}: reported as {key!r}, {taken} name; rename "
                                 "the file")
            extra[key] = pol
    return names, extra


def _write_outputs(out: Path, bench: Any, doc: dict[str, Any], command: str | None) -> None:
    """Plots, per-request records and report.md, then summary.json last, whole or not at
    all: a directory without one is a run that did not finish writing (an earlier run's
    summary.json is removed first)."""
    from dataclasses import asdict

    from controller.bench.plots import write_plots
    from controller.bench.report import markdown_report

    summary = out / "summary.json"
    try:
        summary.unlink(missing_ok=True)
        write_plots(out, bench, doc)
        for key, run in bench.runs.items():
            with (out / f"{key}.jsonl").open("w", encoding="utf-8") as f:
                for rec in run.result.records:
                    f.write(json.dumps(asdict(rec)) + "\n")
        (out / "report.md").write_text(markdown_report(doc, command), encoding="utf-8")
        partial = out / "summary.json.partial"
        partial.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        partial.replace(summary)
    except KeyboardInterrupt:
        typer.echo(f"interrupted while writing {out}: incomplete (no summary.json)",
                   err=True)
        raise typer.Exit(130) from None


def _run(scenario: Scenario, names: list[str], thr: Any, settings: Any,
         extra: dict[str, Any], time_scale: float = 1.0) -> Any:
    from controller.bench.runner import quiet_logs, run_bench

    quiet_logs()
    with _progress(scenario) as advance:
        return run_bench(scenario, names, threshold=thr, settings=settings,
                         progress=advance, extra=extra, time_scale=time_scale)


@contextmanager
def _progress(scenario: Scenario) -> Iterator[Callable[[str, float, float], None]]:
    """Progress on stderr, so that ``--json``'s stdout stays one document: a bar per replay
    on a terminal; elsewhere (a CI log, a redirect) one line as each replay ends, so a run of
    several minutes still shows that it moves."""
    from rich.console import Console
    from rich.progress import Progress

    from controller.clock import WallClock

    console = Console(stderr=True)
    if console.is_terminal:
        with Progress(console=console, transient=True) as bar:
            tasks: dict[str, Any] = {}

            def advance(key: str, t: float, total: float) -> None:
                if key not in tasks:
                    tasks[key] = bar.add_task(f"{scenario.name} / {key}", total=total)
                bar.update(tasks[key], completed=t)

            yield advance
        return
    clock = WallClock()
    started: dict[str, float] = {}
    ended: set[str] = set()

    def log(key: str, t: float, total: float) -> None:
        started.setdefault(key, clock.monotonic())
        if t >= total and key not in ended:  # the last report and the run's end both say so
            ended.add(key)
            typer.echo(f"{scenario.name} / {key}: {total:g} virtual s replayed in "
                       f"{clock.monotonic() - started[key]:.1f} s", err=True)

    yield log


def _fmt(v: Any, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def _print_table(doc: dict[str, Any], bench: Any) -> None:
    from rich.table import Table

    from controller.bench.report import oracle_ratio_line, seconds_list

    table = Table(title=f"scenario {doc['scenario']}")
    for col in ("policy", "goodput", "phases", "requests", "T2+ TTFT mean ms",
                "T2+ TTFT p99 ms", "TPOT mean ms", "TPOT p99 ms", "KV GiB", "changes",
                "adapt s", "detect s", "wall s"):
        table.add_column(col, justify="right")
    for key, s in doc["policies"].items():
        phases = " ".join(_fmt(p["goodput"], 1.0, 2) for p in s["phases"])
        adapt, detect = seconds_list(s.get("adaptation_s")), seconds_list(s.get("detection_s"))
        run = bench.runs.get(key)
        table.add_row(key, _fmt(s["goodput"]), phases, str(s["requests"]),
                      _fmt(s["turn2_ttft_mean_s"], 1e3, 1), _fmt(s["turn2_ttft_p99_s"], 1e3, 1),
                      _fmt(s["tpot_mean_s"], 1e3, 2), _fmt(s["tpot_p99_s"], 1e3, 2),
                      _fmt(s["kv_bytes"], 1 / 2**30, 2), str(s.get("policy_changes", 0)),
                      adapt, detect, "-" if run is None else f"{run.result.wall_s:.1f}")
    console = table_console()
    console.print(table)
    console.print(oracle_ratio_line(doc))
    for note in doc.get("notes") or []:
        console.print(f"note: {note}")
