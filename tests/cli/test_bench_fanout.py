"""``pdctl bench fanout`` on a few routers: every router acks and persists (no timing asserted)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from controller.cli import app

runner = CliRunner()


@pytest.mark.parametrize("processes", [1, 2])
def test_fanout_reports_every_router_acked_and_persisted(processes: int) -> None:
    result = runner.invoke(
        app, ["bench", "fanout", "--routers", "6", "--processes", str(processes), "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["routers"] == 6 and report["processes"] == processes
    assert report["failed"] == 0 and report["warm_failed"] == 0
    assert report["persisted"] == 6
    assert report["cells"] == 1000
    assert report["noop_pushes"] == 0
    assert 0 < report["ack_p50_s"] <= report["ack_p99_s"] <= report["all_acked_s"]
