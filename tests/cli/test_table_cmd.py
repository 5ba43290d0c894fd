"""``pdctl table show|decide|new`` through the real typer app."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from controller.cli import app
from controller.policy import (
    Axes,
    Features,
    LookupTable,
    Overrides,
    Policy,
    Reason,
    Route,
    decide,
    dumps,
    loads,
    locate,
)
from tests.support.cli_store import upgraded_store

runner = CliRunner()
AXES = Axes(context_tokens=(1000.0, 8000.0, 64000.0), io_ratio=(0.5, 4.0), qps=(2.0, 16.0))


def mixed_policy(version: int = 4) -> Policy:
    n = AXES.n_cells
    routes = tuple(Route.DECODE_LOCAL if i % 3 == 0 else Route.PREFILL_NODE for i in range(n))
    scores = tuple(round(0.25 * i - 2.0, 2) for i in range(n))
    exploration = tuple(0.05 if i % 4 == 0 else 0.0 for i in range(n))
    return Policy(
        version=version,
        table=LookupTable(AXES, routes, scores, exploration),
        overrides=Overrides(bypass_append_tokens=32, first_turn_busy_waiting=2),
    )


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    path = tmp_path / "policy.json"
    path.write_text(dumps(mixed_policy()))
    return path


def grid_rows(text: str) -> list[list[str]]:
    """The body rows of every rich table in ``text``, as stripped cell strings."""
    return [
        [cell.strip() for cell in line.strip("│").split("│")]
        for line in text.splitlines()
        if line.startswith("│")
    ]


def test_show_prints_the_header_and_every_cell(policy_file: Path) -> None:
    result = runner.invoke(app, ["table", "show", str(policy_file)])
    assert result.exit_code == 0, result.output
    policy = mixed_policy()
    out = result.stdout
    assert "version 4" in out and policy.checksum in out
    assert "append_tokens < 32 -> DECODE_LOCAL" in out
    assert "io_ratio bin 0: [0, 0.5]" in out and "io_ratio bin 1: (0.5, +inf)" in out
    rows = grid_rows(out)
    n_ctx, n_io, n_qps = AXES.shape
    assert len(rows) == n_ctx * n_io
    for j in range(n_io):
        for i in range(n_ctx):
            row = rows[j * n_ctx + i]
            assert len(row) == 1 + n_qps
            for k in range(n_qps):
                idx = AXES.cell_index(i, j, k)
                letter = "L" if policy.table.routes[idx] is Route.DECODE_LOCAL else "P"
                mark = "*" if policy.table.exploration[idx] else ""
                assert row[1 + k] == f"{letter}{policy.table.scores[idx]:+.2f}{mark}"
    assert rows[0][0] == "[0, 1000]" and rows[n_ctx - 1][0] == "(8000, +inf)"


def test_show_refuses_a_bad_file_listing_every_problem(tmp_path: Path) -> None:
    data = json.loads(dumps(mixed_policy()))
    data["routes"][3] = "SIDEWAYS"
    data["exploration"][1] = 0.7
    del data["slo"]["ttft_s"]
    data["checksum"] = "0" * 64
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    result = runner.invoke(app, ["table", "show", str(bad)])
    assert result.exit_code == 2
    for path in ("routes[3]", "exploration[1]", "slo.ttft_s"):
        assert path in result.stderr
    assert "invalid policy" in result.stderr


def test_show_on_a_missing_file_exits_2(tmp_path: Path) -> None:
    result = runner.invoke(app, ["table", "show", str(tmp_path / "nope.json")])
    assert result.exit_code == 2
    assert "cannot read" in result.stderr


def test_show_plot_writes_a_readable_png(policy_file: Path, tmp_path: Path) -> None:
    import matplotlib.image

    png = tmp_path / "heat.png"
    result = runner.invoke(app, ["table", "show", str(policy_file), "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert png.stat().st_size > 0
    pixels = matplotlib.image.imread(png)
    height, width, channels = pixels.shape
    assert channels in (3, 4) and width > height > 100  # two panels side by side
    assert pixels[..., :3].std() > 0.05  # not a blank canvas


@pytest.mark.parametrize(
    "features",
    [
        Features(2, 5000.0, 900.0, 200.0, 3.0),
        Features(7, 100.0, 100.0, 400.0, 100.0),
        Features(3, 1e6, 50.0, 1.0, 0.0),
    ],
)
def test_decide_names_the_cell_and_agrees_with_the_contract(
    policy_file: Path, features: Features
) -> None:
    args = ["table", "decide", str(policy_file), "--turn", str(features.turn),
            "--context", str(features.context_tokens), "--append", str(features.append_tokens),
            "--output", str(features.expected_output_tokens), "--qps", str(features.qps)]
    policy = mixed_policy()
    want = decide(policy, features, lambda: 1.0)
    cell = locate(policy, features)

    as_json = runner.invoke(app, [*args, "--json"])
    assert as_json.exit_code == 0, as_json.output
    report = json.loads(as_json.stdout)
    assert report["route"] == want.route.name and report["reason"] == "table"
    assert report["cell"] == list(cell)
    idx = AXES.cell_index(*cell)
    assert report["cell_index"] == idx
    assert report["score"] == policy.table.scores[idx]
    assert report["exploration"] == policy.table.exploration[idx]
    ctx_bin = report["bins"]["context_tokens"]
    assert ctx_bin["index"] == cell[0]
    assert ctx_bin["upper_inclusive"] == (AXES.context_tokens[cell[0]]
                                          if cell[0] < len(AXES.context_tokens) - 1 else None)

    text = runner.invoke(app, args)
    assert text.exit_code == 0
    assert f"route: {want.route.name}" in text.stdout
    assert f"cell {cell}" in text.stdout


def test_decide_explains_overrides_and_invalid_input(policy_file: Path) -> None:
    def run(turn: int, append: float, output: float, *extra: str) -> dict[str, object]:
        result = runner.invoke(app, ["table", "decide", str(policy_file), "--turn", str(turn),
                                     "--context", "5000", "--append", str(append),
                                     "--output", str(output), "--qps", "3", "--json", *extra])
        assert result.exit_code == 0, result.output
        report: dict[str, object] = json.loads(result.stdout)
        return report

    first = run(1, 500, 100)
    assert (first["route"], first["reason"], first["cell"]) == ("PREFILL_NODE",
                                                                Reason.FIRST_TURN.value, None)
    assert "first_turn_route" in str(first["why"])
    calm = run(1, 500, 100, "--prefill-waiting", "1")
    assert calm["reason"] == Reason.FIRST_TURN.value
    busy = run(1, 500, 100, "--prefill-waiting", "3")
    assert (busy["route"], busy["reason"]) == ("DECODE_LOCAL", Reason.BUSY_PREFILL.value)
    assert "3 request(s) waiting, at least 2" in str(busy["why"])
    bypass = run(2, 31, 100)
    assert (bypass["route"], bypass["reason"]) == ("DECODE_LOCAL", Reason.BYPASS.value)
    assert "31 < 32" in str(bypass["why"])
    invalid = run(2, 500, 0)
    assert invalid["reason"] == Reason.INVALID_INPUT.value
    assert "expected_output_tokens must be > 0" in str(invalid["why"])
    for turn in (-1, 0):  # the same message for every turn below 1
        bad_turn = run(turn, 500, 100)
        assert bad_turn["reason"] == Reason.INVALID_INPUT.value
        assert f"turn={turn} must be >= 1" in str(bad_turn["why"])


def test_show_and_decide_explain_the_later_turn_busy_override(tmp_path: Path) -> None:
    base = mixed_policy()
    policy = dataclasses.replace(base, overrides=dataclasses.replace(
        base.overrides, bypass_append_tokens=0, later_turn_busy_waiting=3))
    path = tmp_path / "later.json"
    path.write_text(dumps(policy))
    shown = runner.invoke(app, ["table", "show", str(path)])
    assert shown.exit_code == 0, shown.output
    assert "PREFILL_NODE cells -> DECODE_LOCAL while every prefill worker has >= 3" \
        in " ".join(shown.stdout.split())
    prefill = next(f for f in (Features(2, c, 100.0, 100.0, 3.0) for c in (500.0, 5000.0, 9e4))
                   if decide(policy, f, lambda: 1.0).route is Route.PREFILL_NODE)

    def run(*extra: str) -> dict[str, object]:
        result = runner.invoke(app, ["table", "decide", str(path), "--turn", "2", "--context",
                                     f"{prefill.context_tokens:g}", "--append", "100",
                                     "--output", "100", "--qps", "3", "--json", *extra])
        assert result.exit_code == 0, result.output
        report: dict[str, object] = json.loads(result.stdout)
        return report

    busy = run("--prefill-waiting", "3")
    assert (busy["route"], busy["reason"]) == ("DECODE_LOCAL", Reason.BUSY_LATER_TURN.value)
    assert busy["cell"] == list(locate(policy, prefill))
    assert "3 request(s) waiting, at least 3" in str(busy["why"])
    assert "table cell: PREFILL_NODE" in str(busy["why"])
    calm = run("--prefill-waiting", "2")
    assert (calm["route"], calm["reason"]) == ("PREFILL_NODE", Reason.TABLE.value)


def test_new_writes_a_valid_uniform_policy(tmp_path: Path) -> None:
    out = tmp_path / "uniform.json"
    result = runner.invoke(app, ["table", "new", "--route", "decode", "--version", "5",
                                 "--exploration", "0.1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    policy = loads(out.read_text())
    assert policy.version == 5
    assert set(policy.table.routes) == {Route.DECODE_LOCAL}
    assert set(policy.table.exploration) == {0.1}
    assert policy.checksum in result.stderr

    to_stdout = runner.invoke(app, ["table", "new", "--route", "prefill"])
    assert to_stdout.exit_code == 0
    assert set(loads(to_stdout.stdout).table.routes) == {Route.PREFILL_NODE}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--route", "sideways"], "PREFILL_NODE (or prefill) or DECODE_LOCAL (or decode"),
        (["--route", "decode", "--out", "/nonexistent/dir/p.json"],
         "--out /nonexistent/dir/p.json: no directory /nonexistent/dir"),
        (["--route", "decode", "--exploration", "0.5"], "--exploration 0.5: must be within"),
        (["--route", "decode", "--version", "0"], "version"),
    ],
)
def test_new_refuses_bad_arguments(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["table", "new", *args])
    assert result.exit_code == 2
    assert message in result.stderr
    assert len(result.stderr.splitlines()) <= 2  # one problem said once, not once per cell


def _stored(tmp_path: Path) -> str:
    """A store holding v4 (approved, every router's) and v5 (a rejected policy, as stored
    before 0008), calibration #1 (v4's), #2 (a refused candidate, kept without a version)
    and #3 (a dry run)."""
    url = f"sqlite:///{tmp_path / 'history.db'}"
    with upgraded_store(url) as store, store.cycle() as tx:
        for v, status in ((4, "approved"), (5, "rejected")):
            p = mixed_policy(v)
            tx.add_policy(v, p.checksum, dumps(p), status, f"v{v} for the test")
        for router in ("r0", "r1"):
            tx.set_desired(router, 4)
        refused = mixed_policy(6)  # its version field a placeholder: none was taken
        tx.add_calibration([], {}, 0.80, 0.85, 4)
        tx.add_calibration([], {}, 0.80, 0.85, None,
                           {"approved": False, "reason": "predicted 0.80 < 0.85"},
                           candidate=(dumps(refused), refused.checksum))
        tx.add_calibration([], {}, 0.80, 0.85, None, {"dry_run": True,
                                                      "not_stored": "dry run"})
    return url


def test_show_reads_a_stored_version_or_the_desired_one_as_a_file_would(
        tmp_path: Path, policy_file: Path) -> None:
    url = _stored(tmp_path)
    from_file = runner.invoke(app, ["table", "show", str(policy_file)])
    desired = runner.invoke(app, ["table", "show", "--desired", "--url", url])
    assert desired.exit_code == 0, desired.output
    # The same table as the file's (the file holds v4), cell for cell.
    assert grid_rows(desired.stdout) == grid_rows(from_file.stdout)
    assert mixed_policy(4).checksum in desired.stdout
    assert "approved (the fleet's): v4 for the test" in desired.stdout
    assert "desired by r0, r1" in desired.stdout
    rejected = runner.invoke(app, ["table", "show", "--version", "5", "--url", url])
    assert rejected.exit_code == 0, rejected.output
    assert "version 5" in rejected.stdout and mixed_policy(5).checksum in rejected.stdout
    assert "rejected: v5 for the test" in rejected.stdout
    assert "desired by no router" in rejected.stdout


def test_show_by_calibration_reads_its_version_or_its_refused_candidate(
        tmp_path: Path) -> None:
    """A candidate the guardrail refused takes no version: it is kept with its calibration
    and shown by the calibration's id."""
    from controller.store import Store

    url = _stored(tmp_path)
    refused = mixed_policy(6)
    with Store(url) as store:
        assert store.next_version() == 6
    own = runner.invoke(app, ["table", "show", "--calibration", "1", "--url", url])
    assert own.exit_code == 0, own.output
    assert "version 4" in own.stdout and "produced by calibration #1" in own.stdout
    shown = runner.invoke(app, ["table", "show", "--calibration", "2", "--url", url])
    assert shown.exit_code == 0, shown.output
    assert "no version: the refused candidate of calibration #2" in shown.stdout
    assert refused.checksum in shown.stdout
    assert "rejected by the guardrail: predicted 0.80 < 0.85" in shown.stdout
    assert "desired by no router" in shown.stdout
    assert grid_rows(shown.stdout) == grid_rows(
        runner.invoke(app, ["table", "show", "--version", "5", "--url", url]).stdout)


@pytest.mark.parametrize(("args", "message"), [
    (["--version", "9"], "--version 9: no such policy version"),
    (["--version", "4", "FILE"], "one of: a policy file, --version N, --desired"),
    (["--version", "4", "--desired"], "one of: a policy file, --version N, --desired"),
    ([], "one of: a policy file, --version N, --desired"),
    (["--calibration", "9"], "--calibration 9: no such calibration"),
    (["--calibration", "3"], "--calibration 3: it stored no policy (dry run)"),
    (["--calibration", "1", "--version", "4"], "--desired, --calibration ID"),
])
def test_show_from_the_store_refuses_what_it_cannot_show(
        tmp_path: Path, policy_file: Path, args: list[str], message: str) -> None:
    url = _stored(tmp_path)
    args = [str(policy_file) if a == "FILE" else a for a in args]
    result = runner.invoke(app, ["table", "show", *args, "--url", url])
    assert result.exit_code == 2, result.output
    assert message in result.stderr


def test_show_desired_on_a_store_with_no_desired_version_exits_2(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    upgraded_store(url).close()
    result = runner.invoke(app, ["table", "show", "--desired", "--url", url])
    assert result.exit_code == 2 and "no router has a desired version" in result.stderr
    missing = runner.invoke(app, ["table", "show", "--desired", "--url",
                                  f"sqlite:///{tmp_path / 'nope.db'}"])
    assert missing.exit_code == 3, missing.output
