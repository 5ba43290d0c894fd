"""`pdctl export` against a store holding a calibration the way the daemon records it, and
the [export] writer the daemon runs on every approval."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from controller.cli import app
from controller.config import ExportConfig, load_settings
from controller.exporter import ApprovalExporter, fragment
from controller.loop.learning import CoreLearner, calibration_config
from tests.core.synth import Mix, Truth, training_windows
from tests.support.cli_store import invoke_json, open_store, record_calibration, write_config

runner = CliRunner()


def export_json(config: Path, *args: str) -> dict[str, Any]:
    return invoke_json("export", *args, "--json", "--config", str(config))


def test_bad_input_and_an_empty_store_exit_2(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    open_store(config).close()
    for args in (["--format", "vllm"], ["--format", "llm-d"]):
        r = runner.invoke(app, ["export", *args, "--config", str(config)])
        assert r.exit_code == 2, r.output
    r = runner.invoke(app, ["export", "--format", "llm-d", "--config", str(config)])
    assert "no calibration" in r.output


def test_export_fits_the_running_policy_and_prints_the_peers_fragment(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    version, outcome = record_calibration(config)
    llmd = export_json(config, "--format", "llm-d", "--traffic-chars-per-token", "3")
    assert llmd["policy_version"] == version and llmd["training_windows"] == 60
    g = llmd["predicted_goodput"]
    assert g["rule"] >= g["always_prefill"] and g["given_up"] == pytest.approx(
        g["table"] - g["rule"])
    (plugin,) = yaml.safe_load(llmd["fragment"])["plugins"]
    tokens = plugin["parameters"]["nonCachedTokens"]
    # 3 chars per token of traffic, read by llm-d at 4 per token: the threshold x 3/4.
    threshold = llmd["threshold_tokens"]
    assert tokens == (0 if threshold == 0 else max(1, math.ceil(threshold * 3 / 4)))
    low, high = llmd["threshold_range"]
    assert llmd["threshold_tokens"] == 0 or low < llmd["threshold_tokens"] <= (high or 1e18)

    out = tmp_path / "dynamo.flags"
    r = runner.invoke(app, ["export", "--format", "dynamo", "--output", str(out),
                            "--config", str(config)])
    assert r.exit_code == 0, r.output
    assert out.read_text() == r.output  # printed and written alike
    assert f"policy v{version}" in r.output and "the full table" in r.output
    flags = [line for line in r.output.splitlines() if line.startswith("--")]
    assert json.loads(flags[0].split("'")[1])["policy"] == "isl_bounding"
    # The table's predicted goodput is the calibration's own for its candidate.
    dyn = export_json(config, "--format", "dynamo")
    assert dyn["predicted_goodput"]["table"] == pytest.approx(
        outcome.predicted_goodput_new, abs=1e-6)
    assert export_json(config, "--format", "dynamo") == dyn  # deterministic


def test_an_unknown_version_exits_2(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    version, _ = record_calibration(config)
    assert export_json(config, "--format", "llm-d", "--version", str(version))[
        "policy_version"] == version
    r = runner.invoke(app, ["export", "--format", "llm-d", "--version", "99",
                            "--config", str(config)])
    assert r.exit_code == 2 and "no policy v99" in r.output


def test_export_config_needs_format_and_path_together(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="together"):
        ExportConfig(format="llm-d")
    with pytest.raises(ValueError, match="together"):
        ExportConfig(path=tmp_path / "x")


def test_the_approval_writer_writes_the_fragment_atomically(tmp_path: Path) -> None:
    config = write_config(tmp_path, f"""[export]
format = "llm-d"
path = "{tmp_path / 'decider.yaml'}"
traffic_chars_per_token = 3.5
""")
    settings = load_settings(config)
    windows = training_windows(Truth(), Mix(), 60, seed=1)
    outcome = CoreLearner(settings).calibrate(windows, None, windows[-1].end, "test")
    policy = outcome.policy.with_version(7)
    slo = calibration_config(settings).slo
    writer = ApprovalExporter(settings.export, slo)
    writer(policy, outcome.basis)
    writer.join()
    assert writer.written == 1 and writer.failures == 0
    model, grid = outcome.basis
    _, expected = fragment(model, grid, policy, slo, "llm-d", 3.5, 4.0)
    assert (tmp_path / "decider.yaml").read_text() == expected
    assert "policy v7" in expected
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".decider")] == []
    # A directory that does not exist: counted and logged, never raised.
    bad = ApprovalExporter(ExportConfig(format="dynamo", path=tmp_path / "no" / "x"), slo)
    bad(policy, outcome.basis)
    bad.join()
    assert bad.failures == 1 and bad.written == 0
