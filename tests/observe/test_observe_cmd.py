"""``pdctl observe --once`` against real HTTP targets on loopback and a real Prometheus."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from controller.cli import app
from controller.clock import WallClock
from tests.conftest import require
from tests.observe.cluster import Cluster, serve_http, stop_http
from tests.observe.promserver import HOW_TO_INSTALL, PROMETHEUS, PromServer


def _config(tmp_path: Path, cluster: Cluster, extra: str = "") -> Path:
    def names(role: str) -> str:
        return json.dumps([t.name for t in cluster.targets if t.role == role])

    cfg = tmp_path / "pd.toml"
    cfg.write_text(
        f"[prefill_pool]\nnodes = {names('prefill')}\n"
        f"[decode_pool]\nnodes = {names('decode')}\n"
        f"[routers]\nmetrics_targets = {names('router')}\n" + extra
    )
    return cfg


@pytest.mark.integration
def test_observe_once_scrape_json_and_table(tmp_path: Path) -> None:
    cluster, servers = serve_http(Cluster.build(prefill=1, decode=1, routers=1))
    try:
        cluster.traffic(random.Random(1))  # before the baseline: not in the window
        cfg = _config(tmp_path, cluster)
        runner = CliRunner()
        result = runner.invoke(app, ["observe", "--once", "--json", "--config", str(cfg),
                                     "--interval", "0.2"])
        assert result.exit_code == 0, result.output
        window = json.loads(result.stdout)
        assert window["source"] == "scrape"
        assert len(window["answered"]) == 3 and window["failures"] == []
        assert [w["worker"] for w in window["workers"]] == [
            t.name for t in cluster.targets if t.role != "router"]
        assert all(w["ttft_s"] is None for w in window["workers"])  # nothing new happened
        assert all(w["running"] is not None for w in window["workers"])

        stop_http(servers.pop(cluster.targets[0].name))
        table = runner.invoke(app, ["observe", "--once", "--config", str(cfg),
                                    "--interval", "0.1"])
        assert table.exit_code == 0, table.output
        assert cluster.targets[1].name in table.stdout
        assert f"{cluster.targets[0].name}: unreachable" in table.stdout
        assert "2 target(s) answered, 1 problem(s)" in table.stdout
    finally:
        for s in servers.values():
            stop_http(s)


def test_observe_without_targets_or_without_once_is_a_usage_error(tmp_path: Path) -> None:
    runner = CliRunner()
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    r = runner.invoke(app, ["observe", "--once", "--config", str(empty), "--interval", "0.1"])
    assert r.exit_code == 2 and "no targets" in r.output
    r = runner.invoke(app, ["observe", "--config", str(empty)])
    assert r.exit_code == 2 and "--once" in r.output


@pytest.mark.integration
def test_observe_once_prometheus_unreachable_is_transient(tmp_path: Path) -> None:
    cluster = Cluster.build(prefill=1, decode=0, routers=0)
    cfg = _config(tmp_path, cluster, '[prometheus]\nurl = "http://127.0.0.1:1"\nretries = 0\n')
    r = CliRunner().invoke(app, ["observe", "--once", "--source", "prometheus", "--config",
                                 str(cfg), "--interval", "5"])
    assert r.exit_code == 1 and "cannot reach Prometheus" in r.output


@pytest.mark.integration
def test_observe_once_prometheus_with_discovered_targets(tmp_path: Path) -> None:
    require("prometheus", PROMETHEUS is not None, HOW_TO_INSTALL)
    cluster, servers = serve_http(Cluster.build(prefill=1, decode=1, routers=1))
    prom = PromServer(cluster.targets)
    try:
        # the window ends on an interval boundary: let Prometheus hold samples from before it
        prom.wait_scraped_after(WallClock().now())
        prom.wait_scraped_after(WallClock().now() + 2.5)
        cfg = tmp_path / "prom.toml"
        cfg.write_text(f'[prometheus]\nurl = "{prom.url}"\ndiscover_targets = true\n'
                       "escaped_names = true\n")
        r = CliRunner().invoke(app, ["observe", "--once", "--json", "--source", "prometheus",
                                     "--config", str(cfg), "--interval", "2"])
        assert r.exit_code == 0, r.output
        window = json.loads(r.stdout)
        assert sorted(window["answered"]) == sorted(t.name for t in cluster.targets)
        roles = {w["worker"]: w["role"] for w in window["workers"]}
        assert roles == {t.name: t.role for t in cluster.targets if t.role != "router"}
        assert all(w["engine"] == "vllm" for w in window["workers"])
    finally:
        prom.stop()
        for s in servers.values():
            stop_http(s)
