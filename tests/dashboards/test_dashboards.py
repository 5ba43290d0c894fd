"""dashboards/: generated JSON is current, well-formed, and every query parses and names
series our exporters really expose.

The live check (every query returns data from a Prometheus scraping the simulated cluster
and the daemon) belongs to the end-to-end integration test.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from controller.loop.metrics import ControllerMetrics
from controller.rollout.agent_metrics import RouterMetrics
from controller.router.metrics import RouterHttpMetrics
from controller.sim.sglang_metrics import SglangView
from controller.sim.vllm_metrics import WorkerMetrics
from tests.conftest import require

ROOT = Path(__file__).parents[2]
DASHBOARDS = ROOT / "dashboards"
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
SERIES = re.compile(r"\b(pdctl_\w+|pdrouter_\w+|vllm:\w+)")


def load_build() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dashboards_build", DASHBOARDS / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = load_build()


def committed() -> dict[str, dict[str, Any]]:
    return {name: json.loads((DASHBOARDS / name).read_text()) for name in build.DASHBOARDS}


def exprs(doc: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in build.panels(doc) for t in p.get("targets", [])]


def test_committed_files_are_what_the_code_generates(tmp_path: Path) -> None:
    assert sorted(p.name for p in DASHBOARDS.glob("*.json")) == sorted(build.DASHBOARDS)
    assert build.main(["--out", str(tmp_path)]) == 0
    for name in build.DASHBOARDS:
        assert (tmp_path / name).read_text() == (DASHBOARDS / name).read_text(), (
            f"dashboards/{name} is out of date: run python dashboards/build.py"
        )
    assert build.main(["--check"]) == 0


def test_check_mode_notices_a_hand_edit(tmp_path: Path) -> None:
    assert build.main(["--out", str(tmp_path)]) == 0
    path = tmp_path / "slo.json"
    path.write_text(path.read_text().replace("Goodput", "Goodput!", 1))
    assert build.main(["--check", "--out", str(tmp_path)]) == 1


def test_json_has_sorted_keys_and_schema_version() -> None:
    for name, doc in committed().items():
        text = (DASHBOARDS / name).read_text()
        assert text == json.dumps(doc, sort_keys=True, indent=2) + "\n", name
        assert doc["schemaVersion"] == 42, name  # grafana-foundation-sdk 0.0.21


def test_uids_ids_datasources_and_units() -> None:
    docs = committed()
    uids = [doc["uid"] for doc in docs.values()]
    assert len(set(uids)) == len(uids)
    for name, doc in docs.items():
        variables = {v["name"]: v for v in doc["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        all_panels = build.panels(doc)
        ids = [p["id"] for p in all_panels]
        assert len(set(ids)) == len(ids), f"{name}: duplicate panel ids"
        titles = [p["title"] for p in all_panels if p["type"] != "row"]
        assert len(set(titles)) == len(titles), f"{name}: duplicate panel titles"
        for panel in all_panels:
            if panel["type"] == "row":
                continue
            where = f"{name}: {panel['title']}"
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
            assert panel["fieldConfig"]["defaults"].get("unit"), f"{where}: no unit"
            assert panel["targets"], f"{where}: no query"
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}", where
            ref_ids = [t["refId"] for t in panel["targets"]]
            assert len(set(ref_ids)) == len(ref_ids), where


def promtool_check_exprs(
    tmp_path: Path, expressions: list[str]
) -> subprocess.CompletedProcess[str]:
    require("promtool", shutil.which("promtool") is not None, "apt-get install prometheus")
    rules = [
        {"record": f"dashboard:expr_{i}", "expr": e.replace("$__rate_interval", "5m")}
        for i, e in enumerate(expressions)
    ]
    path = tmp_path / "exprs.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    return subprocess.run(
        ["promtool", "check", "rules", str(path)],
        capture_output=True, text=True, timeout=120, check=False,
    )


@pytest.mark.integration
def test_every_panel_query_parses(tmp_path: Path) -> None:
    all_exprs = [e for doc in committed().values() for e in exprs(doc)]
    assert len(all_exprs) > 40
    out = promtool_check_exprs(tmp_path, all_exprs)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(all_exprs)} rules found" in out.stdout


@pytest.mark.integration
def test_the_parse_check_catches_a_broken_query(tmp_path: Path) -> None:
    out = promtool_check_exprs(tmp_path, ["sum(rate(pdctl_cycles_total[$__rate_interval])"])
    assert out.returncode != 0
    assert "parse error" in out.stdout + out.stderr


def exposed_names() -> set[str]:
    """Sample names our exporters really write: controller, router agent, simulated vLLM."""
    registries = []
    ctl = CollectorRegistry()
    m = ControllerMetrics(ctl)
    m.observe_push("r", "ok", 0.01)
    m.set_router_versions("r", 1, 1)
    m.set_drift("ks", "ctx", 0.1, 0.2)
    m.drift_event("workload")
    m.guardrail_decision("approved", "better", now=1.0)
    m.set_predicted_goodput(0.9, 0.9)
    m.set_recommendation("prefill", 2, 0.6, 2, False)  # per-role series exist once planned
    registries.append(ctl)
    router = CollectorRegistry()
    rm = RouterMetrics(router)
    rm.count_request("DECODE_LOCAL", "1024", "1", "met")
    rm.observe_ttft("DECODE_LOCAL", "1024", 0.1)  # labelled histograms appear once observed
    rm.observe_tpot("DECODE_LOCAL", "1024", 0.01)
    http = RouterHttpMetrics(router)  # pdctl router serve's own families
    http.decode_failures.labels("connect", "false").inc()
    http.client_disconnects.labels("decode").inc()
    http.responses.labels("/v1/completions", "200").inc()
    registries.append(router)
    for kv_role in ("kv_producer", "kv_consumer"):
        worker = WorkerMetrics(
            model_name="m", kv_role=kv_role, num_gpu_blocks=100, block_size=16, max_model_len=4096
        )
        registries.append(worker.registry)
        registries.append(SglangView(worker).registry)  # the same worker as SGLang ships it
    names: set[str] = set()
    for registry in registries:
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            names.update(s.name for s in family.samples)
    return names


def test_dashboards_and_rules_name_only_series_that_exist() -> None:
    names = exposed_names()
    used: dict[str, str] = {}
    for name, doc in committed().items():
        for e in exprs(doc):
            for series in SERIES.findall(e):
                used.setdefault(series, f"dashboards/{name}")
    rule_doc = yaml.safe_load(RULES.read_text())
    for group in rule_doc["groups"]:
        for rule in group["rules"]:
            for series in SERIES.findall(rule["expr"]):
                used.setdefault(series, "deploy/prometheus/rules.yml")
    assert len(used) > 20
    missing = {s: where for s, where in used.items() if s not in names}
    assert not missing, f"series no exporter writes: {missing}"
