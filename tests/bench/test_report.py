"""``pdctl bench run`` end to end on a small synthetic scenario: every policy (the adaptive
one is the daemon's cycle on a SQLite store), the JSON schema, the Markdown table, the PNGs,
and the store rows of the adaptive run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from controller.bench.runner import POLICIES, ppd_static_start, run_bench
from controller.cli import app
from controller.sim.scenario import load_scenario

SCENARIO = """
name = "bench-small"
seed = 7
duration_s = 160

[cluster]
prefill_workers = 1
decode_workers = 3
routers = 2

[workload]
source = "synthetic"

[workload.params]
qps = 4
turns = 4
turn1_input = 1024
turn1_output = 64
append_input = 256
append_output = 64
think_s = 1.0

[[events]]
at_s = 80
kind = "rate_scale"
factor = 3.0

[slo]
ttft_s = 0.4
tpot_s = 0.03

[controller]
interval_s = 10
"""

PHASE_KEYS = {"start_s", "end_s", "goodput", "turn2_ttft_mean_s", "turn2_ttft_p99_s",
              "tpot_mean_s", "tpot_p99_s", "kv_bytes", "adapted_goodput"}
POLICY_KEYS = {"goodput", "requests", "rejected", "turn2_ttft_mean_s", "turn2_ttft_p99_s",
               "tpot_mean_s", "tpot_p99_s", "kv_bytes", "phases", "policy_changes",
               "adaptation_s"}


@pytest.fixture(scope="module")
def scenario_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bench") / "small.toml"
    path.write_text(SCENARIO)
    return path


def test_cli_writes_json_markdown_and_plots(scenario_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["bench", "run", str(scenario_file), "--json",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)  # the progress goes to stderr: stdout is the document
    assert doc == json.loads((out / "summary.json").read_text())
    # Off a terminal, one progress line as each replay ends: every policy but the oracle
    # (picked from the others' replays, not replayed itself), and the two forced phases of
    # the active calibration behind ppd-static (its grid, not the scenario's 160 s).
    lines = [line for line in result.stderr.splitlines() if line.startswith("bench-small / ")]
    replayed = {line.split(": ")[0].removeprefix("bench-small / "): line for line in lines}
    assert len(replayed) == len(lines)
    assert sorted(replayed) == sorted([*(k for k in doc["policies"] if k != "oracle"),
                                       "active-pd", "active-local"])
    for key, line in replayed.items():
        assert ("160 virtual s replayed in" in line) == (not key.startswith("active-")), line
    assert doc["scenario"] == "bench-small"
    assert set(doc["policies"]) >= set(POLICIES)
    for key, entry in doc["policies"].items():
        assert set(entry) >= POLICY_KEYS, key
        assert len(entry["phases"]) == 2
        assert all(set(p) == PHASE_KEYS for p in entry["phases"])
        assert len(entry["adaptation_s"]) == 1
        assert 0.0 <= entry["goodput"] <= 1.0
    assert len(doc["policies"]["adaptive"]["detection_s"]) == 1
    for key in ("pd", "local", "ppd-static", "threshold"):
        assert doc["policies"][key]["policy_changes"] == 0
        assert doc["policies"][key]["adaptation_s"] == [None]
    ratio = doc["oracle_ratio"]
    assert ratio == doc["policies"]["adaptive"]["goodput"] / doc["policies"]["oracle"]["goodput"]
    # The oracle is at least every static candidate in every phase.
    for i in range(2):
        best = max(doc["policies"][k]["phases"][i]["goodput"]
                   for k in doc["policies"] if k not in ("adaptive", "oracle"))
        assert doc["policies"]["oracle"]["phases"][i]["goodput"] == pytest.approx(best)

    md = (out / "report.md").read_text()
    for key in doc["policies"]:
        assert f"| {key} | all |" in md
        assert f"| {key} | 0 (0-80 s) |" in md and f"| {key} | 1 (80-160 s) |" in md
    import matplotlib.image

    pngs = sorted(p.name for p in out.glob("*.png"))
    assert {"goodput.png", "ttft_cdf.png", "tpot_cdf.png", "tables-ppd-static.png",
            "tables-adaptive.png"} <= set(pngs)
    for name in pngs:
        img = matplotlib.image.imread(out / name)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    lines = (out / "pd.jsonl").read_text().splitlines()
    assert len(lines) == doc["policies"]["pd"]["requests"]

    # "Once adapted": every policy's goodput from adaptive's first approval in each phase.
    from controller.bench.report import adapted_from, summarize_records
    from controller.sim.run import RequestRecord

    approvals = doc["policies"]["adaptive"]["controller"]["approved_at_s"][1:]
    phases = [(p["start_s"], p["end_s"]) for p in doc["policies"]["pd"]["phases"]]
    assert doc["adapted_from_s"] == adapted_from(phases, approvals)
    for key in ("pd", "local"):
        records = [RequestRecord(**json.loads(line))
                   for line in (out / f"{key}.jsonl").read_text().splitlines()]
        for i, start in enumerate(doc["adapted_from_s"]):
            expected = summarize_records(
                [r for r in records if r.phase == i and r.arrival_s >= start], 0.4, 0.03)
            assert doc["policies"][key]["phases"][i]["adapted_goodput"] == expected["goodput"]


def test_adapted_from_is_the_first_approval_inside_each_phase() -> None:
    from controller.bench.report import adapted_from

    phases = [(0.0, 100.0), (100.0, 200.0), (200.0, 300.0)]
    # 150 and 180 in phase 1: the first counts; none in phase 2: its start.
    assert adapted_from(phases, [180.0, 40.0, 150.0]) == [40.0, 150.0, 200.0]


def test_adaptive_is_the_daemons_cycle_with_its_store(scenario_file: Path,
                                                      tmp_path: Path) -> None:
    from controller.clock import VirtualClock
    from controller.policy import loads
    from controller.store import Store

    scenario = load_scenario(scenario_file)
    bench = run_bench(scenario, ["adaptive"], workdir=tmp_path)
    run = bench.runs["adaptive"]
    outcome = run.adaptive
    assert outcome.cycles >= scenario.duration_s / scenario.interval_s - 1
    assert not outcome.failed_cycles
    store = Store(f"sqlite:///{tmp_path / 'bench-small-adaptive.db'}", VirtualClock(start=0.0))
    try:
        windows = store.windows()
        assert len(windows) == outcome.windows >= outcome.cycles - 1
        policies = sorted(store.policies(), key=lambda p: p.version)
        first = policies[0]
        # Version 1 is the ppd-static table the run started from, as the bench built it.
        assert first.version == 1 and first.status == "approved"
        assert loads(first.body_json).table == run.tables[0][1].table
        assert "ppd-static" in first.reason
        # ... with what `pdctl calibrate-active` records beside it: the calibration's drift
        # reference (the grid's newest windows), which the cycle restores at its start.
        active = [c for c in store.calibrations() if (c.details or {}).get("trigger") == "active"]
        assert [c.policy_version for c in active] == [1]
        expected = ppd_static_start(scenario).drift_reference
        assert active[0].details["drift_reference"] == json.loads(json.dumps(expected))
        approved = [p for p in policies if p.status == "approved"]
        assert run.policy_changes == len(approved) - 1
        assert len(store.calibrations()) == outcome.calibrations
        assert [(e.at.timestamp(), e.kind) for e in store.drift_events()] \
            == outcome.drift_events
        assert len(store.pushes()) == outcome.pushes
        # Detection: the first drift event or scaling calibration after each event.
        reactions = sorted([e.at.timestamp() for e in store.drift_events()]
                           + [c.created_at.timestamp() for c in store.calibrations()
                              if (c.details or {}).get("trigger") == "scaling"])
        assert outcome.reactions == reactions
        event = scenario.events[0].at_s
        # Strictly after: the cycle at the event's own time reads a window without it.
        first = next((t for t in reactions if t > event), None)
        assert run.detection_s == [None if first is None else first - event]
        # Every router ended on its desired version, as the store records it.
        acked = {r.router_id: r.acked_version for r in store.routers()}
        assert acked == store.desired_versions()
    finally:
        store.close()


def test_seed_replays_another_draw_of_the_scenario(scenario_file: Path) -> None:
    def pd_run(*extra: str) -> dict:
        result = CliRunner().invoke(app, ["bench", "run", str(scenario_file), "--policy", "pd",
                                          "--json", *extra])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    default, again, other = pd_run(), pd_run("--seed", "7"), pd_run("--seed", "8")
    assert (default["seed"], again["seed"], other["seed"]) == (7, 7, 8)
    # The scenario's own seed is 7: the same draw; seed 8 draws other arrivals.
    assert again["policies"]["pd"] == default["policies"]["pd"]
    assert other["policies"]["pd"] != default["policies"]["pd"]


def test_unknown_policy_is_an_error(scenario_file: Path) -> None:
    result = CliRunner().invoke(app, ["bench", "run", str(scenario_file), "--policy", "nope"])
    assert result.exit_code != 0


def test_ppd_static_comes_from_the_active_grid_not_the_scenarios_traffic(
        scenario_file: Path, tmp_path: Path) -> None:
    """The PPD paper's method: the table is calibrated on the active calibration's grid
    (context classes x io ratios x QPS points) run on the scenario's cluster, so a scenario
    whose traffic is far too short to calibrate on gets the same table."""
    from statistics import mean

    from controller.bench.runner import PPD_STATIC_REASON, active_calibration_windows, slo_of
    from controller.core.active import plan_active_calibration
    from controller.policy import Axes

    path = tmp_path / "tiny.toml"
    path.write_text(SCENARIO.replace("duration_s = 160", "duration_s = 20")
                    .replace("at_s = 80", "at_s = 15"))
    full, tiny = load_scenario(scenario_file), load_scenario(path)
    tables = [run_bench(s, ["ppd-static"]).runs["ppd-static"].tables[0][1]
              for s in (full, tiny)]
    assert tables[0].table == tables[1].table
    assert tables[0].provenance.reason == PPD_STATIC_REASON
    # The grid's windows read every QPS level of the plan, lowest to highest.
    levels = sorted({p.qps for p in plan_active_calibration(Axes(), slo_of(full), 1)
                     .phases[0].points})
    qps = [mean(w.workload.qps_by_router.values()) for w in active_calibration_windows(full)
           if w.workload.qps_by_router]
    assert min(qps) < 1.5 * levels[0] and max(qps) > 0.8 * levels[-1]


def test_the_table_off_a_terminal_is_whole(scenario_file: Path) -> None:
    """Printed to a pipe or a log, the comparison keeps every column whole (rich would cut
    each cell to fit 80 columns), and the progress goes to stderr, not into the table."""
    result = CliRunner().invoke(app, ["bench", "run", str(scenario_file), "--policy", "pd"])
    assert result.exit_code == 0, result.output
    header = next(line for line in result.stdout.splitlines() if "policy" in line)
    for column in ("goodput", "T2+ TTFT mean ms", "T2+ TTFT p99 ms", "TPOT p99 ms", "KV GiB",
                   "adapt s", "detect s"):
        assert column in header, column
    assert "replayed in" not in result.stdout
    assert "bench-small / pd: 160 virtual s replayed in" in result.stderr
