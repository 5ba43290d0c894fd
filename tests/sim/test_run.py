from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from controller.bench.report import percentile, summarize
from controller.policy import Policy, Route
from controller.sim.run import run_scenario, session_feed
from controller.sim.scenario import Scenario, parse_scenario


def _scenario(**over: Any) -> Scenario:
    data: dict[str, Any] = {
        "name": "t", "seed": 3, "duration_s": 20,
        "cluster": {"prefill_workers": 1, "decode_workers": 2, "routers": 2},
        "workload": {"source": "synthetic",
                     "params": {"qps": 6, "turns": 3, "turn1_input": 800, "turn1_output": 64,
                                "append_input": 100, "append_output": 64, "think_s": 1.0}},
        "slo": {"ttft_s": 0.5, "tpot_s": 0.05},
    }
    data.update(over)
    return parse_scenario(data)


def _expected_turns(sc: Scenario) -> int:
    feed = session_feed(sc, random.Random(sc.seed), None)
    return sum(len(spec.turns) for _, spec in feed)


def test_every_workload_request_is_recorded_once() -> None:
    sc = _scenario()
    res = run_scenario(sc, Policy.uniform(1, Route.DECODE_LOCAL))
    assert len(res.records) == _expected_turns(sc) > 0
    assert not any(r.rejected for r in res.records)
    routes = {(r.turn > 1, r.route) for r in res.records}
    assert routes == {(False, "PREFILL_NODE"), (True, "DECODE_LOCAL")}
    gen = sum(e.metrics.generation_tokens for e in res.cluster.decode)
    assert gen == sum(r.output_tokens for r in res.records)
    decided = sum(router.decisions for router in res.cluster.routers)
    assert decided == len(res.records)
    assert all(router.decisions > 0 for router in res.cluster.routers)


def test_every_policy_is_scored_on_the_same_requests_when_the_drain_runs_out() -> None:
    """A link too slow to finish in the drain: sessions still open at the horizon (a turn in
    flight, or between turns) count their remaining turns as unfinished. They were dropped,
    so a policy that left more sessions open was scored on fewer requests."""
    sc = _scenario(cluster={"prefill_workers": 1, "decode_workers": 2, "routers": 2,
                            "kv_link_gbps": 0.01})
    expected = _expected_turns(sc)
    for route in (Route.PREFILL_NODE, Route.DECODE_LOCAL):
        res = run_scenario(sc, Policy.uniform(1, route), drain_limit_s=30.0)
        assert len(res.records) == expected, route
        left = [r for r in res.records if r.reject_reason == "unfinished"]
        assert left and all(r.ttft_s is None for r in left), route
        # each session once per turn: nothing counted twice
        assert len({(r.session, r.turn) for r in res.records}) == expected, route


def test_same_seed_same_summary() -> None:
    sc = _scenario()
    a = summarize(run_scenario(sc, Policy.uniform(1, Route.PREFILL_NODE)))
    b = summarize(run_scenario(sc, Policy.uniform(1, Route.PREFILL_NODE)))
    assert a == b


def test_removed_decode_worker_requests_are_retried_and_accounted() -> None:
    sc = _scenario(events=[{"at_s": 8, "kind": "remove_worker", "role": "decode"},
                           {"at_s": 12, "kind": "add_worker", "role": "decode", "count": 2}])
    res = run_scenario(sc, Policy.uniform(1, Route.DECODE_LOCAL))
    assert len(res.records) == _expected_turns(sc)
    assert sum(r.retries for r in res.records) > 0
    assert not any(r.rejected for r in res.records)
    assert len(res.cluster.decode) == 3
    assert len(res.phases) == 3
    assert {r.phase for r in res.records} == {0, 1, 2}


def test_rate_scale_event_speeds_up_session_starts() -> None:
    base = _scenario()
    fast = _scenario(events=[{"at_s": 10, "kind": "rate_scale", "factor": 3.0}])
    n_base = _expected_turns(base)
    n_fast = _expected_turns(fast)
    assert n_fast > n_base * 1.5


def test_slow_links_raise_pd_ttft() -> None:
    sc = _scenario()
    slow = _scenario(events=[{"at_s": 0.001, "kind": "link_bandwidth", "factor": 0.01}])
    pol = Policy.uniform(1, Route.PREFILL_NODE)
    a = summarize(run_scenario(sc, pol))
    b = summarize(run_scenario(slow, pol))
    assert b["turn2_ttft_mean_s"] > a["turn2_ttft_mean_s"] * 2
    assert a["kv_bytes"] == b["kv_bytes"]


def test_percentile_is_nearest_rank() -> None:
    vals = [float(v) for v in range(1, 101)]
    random.Random(1).shuffle(vals)
    assert percentile(vals, 99) == 99.0
    assert percentile(vals, 50) == 50.0
    assert percentile([], 99) is None


def test_bench_run_json_has_the_documented_schema(tmp_path: Path) -> None:
    from controller.cli import app

    toml = tmp_path / "s.toml"
    toml.write_text(
        'name = "cli"\nseed = 1\nduration_s = 12\n'
        '[cluster]\nprefill_workers = 1\ndecode_workers = 2\n'
        '[workload]\nsource = "synthetic"\n[workload.params]\nqps = 4\nturns = 3\n'
        '[[events]]\nat_s = 6\nkind = "link_bandwidth"\nfactor = 0.5\n'
    )
    from controller.policy import dumps

    pfile = tmp_path / "mine.json"
    pfile.write_text(dumps(Policy.uniform(3, Route.DECODE_LOCAL)))
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["bench", "run", str(toml), "--policy", "pd", "--policy",
                                 "local", "--policy", str(pfile), "--json", "--out", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["scenario"] == "cli"
    assert set(doc["policies"]) == {"pd", "local", "mine"}
    keys = {"goodput", "requests", "rejected", "turn2_ttft_mean_s", "turn2_ttft_p99_s",
            "tpot_mean_s", "tpot_p99_s", "kv_bytes", "phases",
            "policy_changes", "adaptation_s"}  # the last two: issue 7's extension
    phase_keys = {"start_s", "end_s", "goodput", "turn2_ttft_mean_s", "turn2_ttft_p99_s",
                  "tpot_mean_s", "tpot_p99_s", "kv_bytes"}
    for s in doc["policies"].values():
        assert set(s) == keys
        assert 0 <= s["goodput"] <= 1
        assert [(p["start_s"], p["end_s"]) for p in s["phases"]] == [(0, 6), (6, 12)]
        assert all(set(p) == phase_keys for p in s["phases"])
    assert doc["policies"]["local"] == doc["policies"]["mine"]
    assert doc["policies"]["pd"]["kv_bytes"] > doc["policies"]["local"]["kv_bytes"]
    assert json.loads((out / "summary.json").read_text()) == doc
    lines = (out / "pd.jsonl").read_text().splitlines()
    assert len(lines) == doc["policies"]["pd"]["requests"]


def test_bench_run_names_a_bad_key(tmp_path: Path) -> None:
    from controller.cli import app

    toml = tmp_path / "s.toml"
    toml.write_text('name = "x"\nduration_s = 5\n[cluster]\nroutrs = 2\n'
                    '[workload]\nsource = "synthetic"\n')
    r = CliRunner().invoke(app, ["bench", "run", str(toml), "--json"])
    assert r.exit_code == 2
    assert "cluster.routrs" in r.output


def test_bench_run_refuses_two_policies_reported_under_one_name(tmp_path: Path) -> None:
    """Results are keyed by name: a file named like a built-in policy, an oracle candidate
    or another file replaced (or was replaced by) the other's results without a word."""
    from controller.cli import app
    from controller.policy import dumps

    toml = tmp_path / "s.toml"
    toml.write_text('name = "x"\nduration_s = 5\n[workload]\nsource = "synthetic"\n')
    body = dumps(Policy.uniform(1, Route.DECODE_LOCAL))
    for name in ("a/pd.json", "a/mine.json", "b/mine.json", "a/table-1:1.json"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(body)
    out = tmp_path / "out"
    for specs, said in ((["pd", "a/pd.json"], "a built-in policy's name"),
                        (["a/mine.json", "b/mine.json"], "another file's name"),
                        (["a/table-1:1.json"], "an oracle candidate's name")):
        args = [a for s in specs for a in ("--policy", s if "/" not in s
                                            else str(tmp_path / s))]
        r = CliRunner().invoke(app, ["bench", "run", str(toml), *args, "--out", str(out)])
        assert r.exit_code == 2, r.output
        assert said in r.output and "rename the file" in r.output
    assert not out.exists()  # refused before anything ran or was written


def test_bench_run_interrupted_while_writing_leaves_no_summary(
        tmp_path: Path, monkeypatch: Any) -> None:
    """summary.json is written last, whole: an interrupted run left summary.json and
    report.md beside missing plots, a report that looked complete (an earlier run's
    summary.json in the same directory too)."""
    import controller.bench.plots as plots
    from controller.cli import app

    toml = tmp_path / "s.toml"
    toml.write_text('name = "x"\nduration_s = 5\n[workload]\nsource = "synthetic"\n')
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text("{}")  # an earlier run's

    def interrupted(*_: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(plots, "write_plots", interrupted)
    r = CliRunner().invoke(app, ["bench", "run", str(toml), "--policy", "pd", "--out",
                                 str(out)])
    assert r.exit_code == 130, r.output
    assert "interrupted while writing" in r.output
    assert not (out / "summary.json").exists()
    monkeypatch.undo()
    r = CliRunner().invoke(app, ["bench", "run", str(toml), "--policy", "pd", "--out",
                                 str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "summary.json").read_text())["policies"].keys() == {"pd"}
    assert not (out / "summary.json.partial").exists()


def test_bench_run_refuses_a_duration_scale_it_could_not_finish(tmp_path: Path) -> None:
    from controller.cli import app

    toml = tmp_path / "s.toml"
    toml.write_text('name = "x"\nduration_s = 3600\n[workload]\nsource = "synthetic"\n')
    for scale, said in (("nan", "--duration-scale must be a number > 0"),
                        ("inf", "--duration-scale must be a number > 0"),
                        ("1e6", "at most 2592000 s"),
                        ("0", "--duration-scale must be a number > 0")):
        r = CliRunner().invoke(app, ["bench", "run", str(toml), "--duration-scale", scale])
        assert r.exit_code == 2, (scale, r.output)
        assert said in r.output, (scale, r.output)


def test_bench_run_out_at_a_file_says_it_is_not_a_directory(tmp_path: Path) -> None:
    from controller.cli import app

    toml = tmp_path / "s.toml"
    toml.write_text('name = "x"\nduration_s = 5\n[workload]\nsource = "synthetic"\n')
    (tmp_path / "afile").write_text("")
    r = CliRunner().invoke(app, ["bench", "run", str(toml), "--out", str(tmp_path / "afile")])
    assert r.exit_code == 2 and "afile: not a directory" in r.output, r.output


def test_the_oracle_ratio_line_tells_not_run_from_undefined() -> None:
    from controller.bench.report import oracle_ratio_line

    assert oracle_ratio_line({"oracle_ratio": 0.98765}) == "adaptive / oracle goodput: 0.988"
    both = {"oracle_ratio": None, "policies": {"adaptive": {}, "oracle": {}}}
    assert oracle_ratio_line(both).endswith("undefined (no oracle goodput)")
    assert oracle_ratio_line({"oracle_ratio": None, "policies": {"pd": {}}}).endswith("not run")
