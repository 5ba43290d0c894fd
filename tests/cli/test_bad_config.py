"""A config file that is missing or invalid stops every command with exit 2 and the reason,
not a traceback (one code path: controller/cli/_app.py load_settings_or_exit)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from controller.cli import app
from tests.support.processes import PDCTL

COMMANDS = [
    ["run"],
    ["observe", "--once"],
    ["config", "check"],  # its file as the argument
    ["config", "check", "--config"],  # or as every other command takes it
    ["explain", "--turn", "2", "--context", "1000", "--append", "100", "--output", "100",
     "--qps", "1"],
    ["recalibrate", "--local"],
]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: "-".join(a))
@pytest.mark.parametrize("problem", ["missing", "unknown-key"])
def test_bad_config_exits_2_with_the_reason(argv: list[str], problem: str, tmp_path: Path
                                            ) -> None:
    config = tmp_path / "pd.toml"
    if problem == "unknown-key":
        config.write_text("[controller]\nintervall_s = 5\n")
    cli_args = [*argv, str(config)] if argv[:2] == ["config", "check"] else \
        [*argv, "-c", str(config)]
    result = CliRunner().invoke(app, cli_args)
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    expected = "not found" if problem == "missing" else "intervall_s"
    assert expected in result.output


def test_config_check_needs_exactly_one_file(tmp_path: Path) -> None:
    config = tmp_path / "pd.toml"
    config.write_text("")
    for args in ([], [str(config), "--config", str(config)]):
        result = CliRunner().invoke(app, ["config", "check", *args])
        assert result.exit_code == 2 and "name one config file" in result.output, args
    ok = CliRunner().invoke(app, ["config", "check", "-c", str(config)])
    assert ok.exit_code == 0 and "OK" in ok.output


def test_config_check_reads_the_files_the_config_names(tmp_path: Path) -> None:
    """What `pdctl run` / `router-agent` refuse at start is what `config check` reports (it
    said OK to a missing token file and a missing or invalid lookup table)."""
    from controller.policy import Policy, Route, dumps

    bad = tmp_path / "bad.json"
    bad.write_text('{"bad": 1}')
    config = tmp_path / "pd.toml"
    config.write_text(f'[security]\ntoken_file = "{tmp_path / "no-token"}"\n'
                      f'[ppd]\nlookup_table = "{bad}"\n')
    result = CliRunner().invoke(app, ["config", "check", str(config)])
    assert result.exit_code == 2, result.output
    assert "2 problem(s) `pdctl run` or `pdctl router-agent` would refuse" in result.output
    assert "security.token_file: cannot read" in result.output
    assert f"ppd.lookup_table {bad}: invalid policy" in result.output
    skipped = CliRunner().invoke(app, ["config", "check", "--skip-files", str(config)])
    assert skipped.exit_code == 0 and "OK" in skipped.output, skipped.output
    # the same files, readable and valid: OK, and no routers is said
    (tmp_path / "no-token").write_text("s3cret\n")
    bad.write_text(dumps(Policy.uniform(1, Route.PREFILL_NODE)))
    fixed = CliRunner().invoke(app, ["config", "check", str(config)])
    assert fixed.exit_code == 0, fixed.output
    assert "0 router(s) configured: `pdctl run`" in fixed.output


def test_config_check_refuses_a_sidecar_on_sqlite(tmp_path: Path) -> None:
    config = tmp_path / "pd.toml"
    config.write_text(f'[store]\nurl = "sqlite:///{tmp_path / "h.db"}"\n'
                      '[routers]\ntargets = ["127.0.0.1:50151"]\n'
                      '[controller]\nsidecar_router = "127.0.0.1:50151"\n')
    result = CliRunner().invoke(app, ["config", "check", "--skip-files", str(config)])
    assert result.exit_code == 2, result.output
    assert "sidecar_router needs PostgreSQL" in result.output


def test_config_check_and_run_refuse_routers_the_canary_could_not_tell_apart(
    tmp_path: Path,
) -> None:
    config = tmp_path / "pd.toml"
    config.write_text(f'[store]\nurl = "sqlite:///{tmp_path / "h.db"}"\n'
                      '[observe]\nsource = "prometheus"\n'
                      '[routers]\ntargets = ["127.0.0.1:50151", "127.0.0.1:50152"]\n'
                      'metrics_targets = ["dns+localhost:9465"]\n')
    result = CliRunner().invoke(app, ["config", "check", "--skip-files", str(config)])
    assert result.exit_code == 2, result.output
    assert "metrics_targets must name each of the 2 router targets" in result.output
    # `pdctl run` refuses it at start, before it observes (a subprocess: it would run on).
    run = subprocess.run([*PDCTL, "run", "--config", str(config)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert run.returncode == 2, run.stderr
    assert "metrics_targets must name each of the 2 router targets" in run.stderr
