"""A config file that is missing or invalid stops every command with exit 2 and the reason,
not a traceback (one code path: controller/cli/_app.py load_settings_or_exit)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from controller.cli import app

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
