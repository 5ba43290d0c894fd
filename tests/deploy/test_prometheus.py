"""deploy/prometheus: promtool check config / check rules / test rules, and rule coverage."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import require

PROM = Path(__file__).parents[2] / "deploy" / "prometheus"
DOCS = Path(__file__).parents[2] / "docs" / "operations.md"

pytestmark = pytest.mark.integration


def promtool(*args: str, cwd: Path = PROM) -> subprocess.CompletedProcess[str]:
    require("promtool", shutil.which("promtool") is not None, "apt-get install prometheus")
    return subprocess.run(
        ["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def rules() -> list[dict[str, object]]:
    doc = yaml.safe_load((PROM / "rules.yml").read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def test_check_config() -> None:
    out = promtool("check", "config", "prometheus.yml")
    assert out.returncode == 0, out.stdout + out.stderr


def test_check_rules() -> None:
    out = promtool("check", "rules", "rules.yml")
    assert out.returncode == 0, out.stdout + out.stderr


def test_rule_unit_tests_pass() -> None:
    out = promtool("test", "rules", "rules_test.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_rule_unit_tests_can_fail(tmp_path: Path) -> None:
    # The same tests against a rules file whose stall threshold moved must fail.
    (tmp_path / "rules.yml").write_text(
        (PROM / "rules.yml").read_text().replace("> 300", "> 3000")
    )
    shutil.copy(PROM / "rules_test.yml", tmp_path / "rules_test.yml")
    out = promtool("test", "rules", "rules_test.yml", cwd=tmp_path)
    assert out.returncode != 0
    assert "PdControllerStalled" in out.stdout + out.stderr


def test_every_rule_has_a_unit_test_and_every_alert_a_runbook_entry() -> None:
    tests = yaml.safe_load((PROM / "rules_test.yml").read_text())["tests"]
    tested_exprs = " ".join(
        str(t["expr"]) for case in tests for t in case.get("promql_expr_test", [])
    )
    alert_cases: dict[str, list[bool]] = {}
    for case in tests:
        for t in case.get("alert_rule_test", []):
            alert_cases.setdefault(t["alertname"], []).append(bool(t.get("exp_alerts")))
    runbook = DOCS.read_text()
    anchors = {github_anchor(h) for h in re.findall(r"^#+ (.+)$", runbook, re.M)}
    for rule in rules():
        if "record" in rule:
            assert re.search(rf"\b{re.escape(str(rule['record']))}\b", tested_exprs), rule["record"]
        else:
            name = str(rule["alert"])
            # Each alert is tested both firing and not firing.
            assert sorted(set(alert_cases.get(name, []))) == [False, True], name
            annotations = rule["annotations"]
            assert isinstance(annotations, dict)
            anchor = str(annotations["runbook"]).split("#", 1)[1]
            assert anchor in anchors, f"docs/operations.md has no section #{anchor}"


def test_scrape_config_labels_roles_and_scrapes_the_controller() -> None:
    doc = yaml.safe_load((PROM / "prometheus.yml").read_text())
    roles = {
        sc["labels"]["role"]
        for job in doc["scrape_configs"]
        for sc in job.get("static_configs", [])
        if "role" in sc.get("labels", {})
    }
    assert roles == {"prefill", "decode", "router"}
    assert "pd-controller" in {job["job_name"] for job in doc["scrape_configs"]}
    assert doc["rule_files"] == ["rules.yml"]
