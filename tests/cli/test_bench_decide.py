"""``pdctl bench decide``: prints the numbers it promises (no timing is asserted)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from controller.cli import app
from controller.cli.bench_decide import random_features, random_policy
from controller.policy import Route
from controller.policy.decide import features_valid

runner = CliRunner()


def test_bench_decide_prints_latency_percentiles_as_json() -> None:
    result = runner.invoke(app, ["bench", "decide", "--json", "--n", "2000"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["cells"] == 1000 and report["n"] == 2000
    assert 0 < report["p50_us"] <= report["p99_us"] <= report["max_us"]
    assert report["decisions_per_s"] > 0
    # warm-up + timed + throughput loop: every call went through the counted path
    assert report["decisions_counted"] == 20_000 + 2 * 2000


def test_bench_inputs_are_a_mixed_table_and_valid_later_turns() -> None:
    policy = random_policy(seed=1)
    assert policy.table.axes.shape == (10, 10, 10)
    assert set(policy.table.routes) == set(Route)
    assert set(policy.table.exploration) == {0.05}
    features = random_features(seed=2, count=500)
    assert all(features_valid(f) and f.turn >= 2 for f in features)
