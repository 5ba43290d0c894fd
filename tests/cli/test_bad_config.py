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
    ["config", "check"],
    ["explain", "--turn", "2", "--context", "1000", "--append", "100", "--output", "100",
     "--qps", "1"],
    ["recalibrate", "--local"],
]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: a[0])
@pytest.mark.parametrize("problem", ["missing", "unknown-key"])
def test_bad_config_exits_2_with_the_reason(argv: list[str], problem: str, tmp_path: Path
                                            ) -> None:
    config = tmp_path / "pd.toml"
    if problem == "unknown-key":
        config.write_text("[controller]\nintervall_s = 5\n")
    cli_args = [*argv, "-c", str(config)] if argv != ["config", "check"] else [*argv, str(config)]
    result = CliRunner().invoke(app, cli_args)
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    expected = "not found" if problem == "missing" else "intervall_s"
    assert expected in result.output
