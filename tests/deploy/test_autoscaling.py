"""deploy/kubernetes/autoscaling.yaml and prometheus-adapter.yaml, checked offline.

- The HPAs validate strictly against the 1.29 schemas, and their arithmetic lands on the
  recommendation: the replica calculation of an External AverageValue target (upstream
  ``GetExternalPerPodMetricReplicas``: ``ceil(sum / target)`` outside the tolerance) gives
  ``desired == recommended`` for every count.
- The adapter config follows the documented format (kubernetes-sigs/prometheus-adapter
  ``docs/config.md``, ``docs/externalmetrics.md``; the loader is ``yaml.UnmarshalStrict`` into
  ``MetricsDiscoveryConfig``, so unknown keys are errors): keys and types per rule, a name
  mapping that matches the daemon's metric, a template that uses documented fields only.
- Its metricsQuery, rendered for each HPA's selector, is evaluated by ``promtool test rules``
  on the controller's own exposition (two replicas during a leader change included).
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from controller.loop.metrics import ROLES, ControllerMetrics
from tests.conftest import require
from tests.deploy.test_kubernetes import K8S, validate

HPA = K8S / "autoscaling.yaml"
ADAPTER = K8S / "prometheus-adapter.yaml"
METRIC = "pdctl_recommended_workers"
DEFAULT_TOLERANCE = 0.1  # kube-controller-manager --horizontal-pod-autoscaler-tolerance

# The adapter's config structs (pkg/config/config.go) as key -> type; nested dicts are
# structs, a list means "list of that struct". Every key is optional to the loader.
GROUP_RESOURCE = {"group": str, "resource": str}
RESOURCES = {"template": str, "overrides": dict, "namespaced": bool}
RULE = {
    "seriesQuery": str,
    "seriesFilters": [{"is": str, "isNot": str}],
    "resources": RESOURCES,
    "name": {"matches": str, "as": str},
    "metricsQuery": str,
    "labelValueReplacements": [{"find": str, "replace": str}],
}
TOP = {"rules": [RULE], "resourceRules": dict, "externalRules": [RULE]}
TEMPLATE_FIELDS = {"Series", "LabelMatchers", "GroupBy", "LabelValuesByName", "GroupBySlice"}


def hpas() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(HPA.read_text()) if d]


def adapter_config(text: str | None = None) -> Any:
    if text is None:
        (configmap,) = [d for d in yaml.safe_load_all(ADAPTER.read_text()) if d]
        assert configmap["kind"] == "ConfigMap"
        text = configmap["data"]["config.yaml"]
    return yaml.safe_load(text)


def format_errors(value: Any, spec: Any, where: str = "config") -> list[str]:
    """What the adapter's strict loader (or its use of the fields) would refuse."""
    if isinstance(spec, list):
        if not isinstance(value, list):
            return [f"{where}: expected a list, got {type(value).__name__}"]
        return [e for i, item in enumerate(value) for e in format_errors(item, spec[0],
                                                                          f"{where}[{i}]")]
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return [f"{where}: expected a mapping, got {type(value).__name__}"]
        errors = [f"{where}.{k}: unknown key" for k in value if k not in spec]
        for k, sub in spec.items():
            if k in value:
                errors += format_errors(value[k], sub, f"{where}.{k}")
        if spec is RESOURCES and isinstance(value.get("overrides"), dict):
            for label, gr in (value.get("overrides") or {}).items():
                errors += format_errors(gr, GROUP_RESOURCE, f"{where}.overrides.{label}")
                if isinstance(gr, dict) and "resource" not in gr:
                    errors.append(f"{where}.overrides.{label}: no resource")
        return errors
    if value is None or not isinstance(value, spec):
        return [f"{where}: expected {spec.__name__}, got {type(value).__name__}"]
    return []


def rule_errors(rule: dict[str, Any]) -> list[str]:
    """Beyond the types: what a rule needs to serve a metric at all."""
    errors = []
    for key in ("seriesQuery", "metricsQuery"):
        if not rule.get(key):
            errors.append(f"{key}: missing (no discovery or no query)")
    fields = set(re.findall(r"<<\s*\.(\w+)\s*>>", rule.get("metricsQuery", "")))
    errors += [f"metricsQuery: unknown template field .{f}" for f in fields - TEMPLATE_FIELDS]
    for f in rule.get("seriesFilters", []):
        if len([k for k in ("is", "isNot") if k in f]) != 1:
            errors.append(f"seriesFilters: exactly one of is/isNot per filter: {f}")
    name = rule.get("name", {})
    try:
        pattern = re.compile(name.get("matches") or ".*")
    except re.error as e:
        errors.append(f"name.matches: {e}")
    else:
        if pattern.groups > 1 and not name.get("as"):
            errors.append("name.as: required with more than one capture group")
    return errors


def exposed_name(rule: dict[str, Any], series: str) -> str | None:
    """The API name the adapter gives ``series`` (None: the rule does not match it)."""
    name = rule.get("name", {})
    m = re.search(name.get("matches") or ".*", series)
    if m is None:
        return None
    default = "$1" if m.re.groups == 1 else "$0"
    as_ = name.get("as") or default
    return re.sub(r"\$\{?(\d+)\}?", lambda g: m.group(int(g.group(1))), as_)


def render(query: str, matchers: dict[str, str]) -> str:
    text = query.replace("<<.Series>>", METRIC)
    text = text.replace("<<.LabelMatchers>>", ",".join(f'{k}="{v}"' for k, v in matchers.items()))
    assert "<<" not in text, f"unrendered template field in {text}"
    return text


def recommended_replicas(current: int, metric_values: list[float], average_value: float,
                         tolerance: float = DEFAULT_TOLERANCE) -> int:
    """The HPA's replica count for an External metric with an AverageValue target."""
    usage = sum(metric_values)
    ratio = usage / (average_value * current)
    if abs(1.0 - ratio) <= tolerance:
        return current
    return math.ceil(usage / average_value)


def quantity(text: str) -> float:
    """A Kubernetes quantity without binary suffixes (what a target value uses)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(m|k|M|G)?", str(text))
    assert m, f"unexpected quantity {text!r}"
    scale = {None: Decimal(1), "m": Decimal("0.001"), "k": Decimal(1000),
             "M": Decimal(10**6), "G": Decimal(10**9)}[m.group(2)]
    return float(Decimal(m.group(1)) * scale)


# -- the HPAs --------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("path", [HPA, ADAPTER], ids=lambda p: p.name)
def test_manifests_validate_strictly_for_1_29(path: Path) -> None:
    out = validate(path)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.integration
def test_strict_validation_catches_a_misspelt_target(tmp_path: Path) -> None:
    bad = tmp_path / "autoscaling.yaml"
    bad.write_text(HPA.read_text().replace("averageValue:", "averagevalue:"))
    assert validate(bad).returncode != 0


def test_one_hpa_per_role_on_the_recommended_workers_metric() -> None:
    docs = hpas()
    assert [d["kind"] for d in docs] == ["HorizontalPodAutoscaler"] * 2
    assert {d["apiVersion"] for d in docs} == {"autoscaling/v2"}
    roles, targets = [], set()
    for d in docs:
        spec = d["spec"]
        (metric,) = spec["metrics"]
        assert metric["type"] == "External"
        assert metric["external"]["metric"]["name"] == METRIC
        roles.append(metric["external"]["metric"]["selector"]["matchLabels"]["role"])
        ref = spec["scaleTargetRef"]
        assert ref["kind"] == "Deployment" and ref["apiVersion"] == "apps/v1"
        targets.add(ref["name"])
        assert 1 <= spec["minReplicas"] <= spec["maxReplicas"]
    assert sorted(roles) == sorted(ROLES)
    assert len(targets) == 2  # prefill and decode scale separately


@pytest.mark.parametrize("doc", hpas(), ids=lambda d: d["metadata"]["name"])
def test_desired_replicas_equal_the_recommendation(doc: dict[str, Any]) -> None:
    spec = doc["spec"]
    target = spec["metrics"][0]["external"]["target"]
    assert target["type"] == "AverageValue", "Value targets scale with the current count"
    average = quantity(target["averageValue"])
    top = spec["maxReplicas"]
    checked = 0
    for recommended in range(spec["minReplicas"], top + 1):
        for current in range(1, top + 1):
            desired = recommended_replicas(current, [float(recommended)], average)
            if abs(recommended / current - 1.0) > DEFAULT_TOLERANCE:
                assert desired == recommended, (current, recommended, desired)
                checked += 1
            else:
                assert desired == current  # within tolerance the HPA holds
    assert checked > top  # the comparison really ran over many shapes
    # The same arithmetic with a wrong target misses: the check can fail.
    assert recommended_replicas(4, [8.0], 2 * average) != 8


# -- the prometheus-adapter rule -------------------------------------------------------


def test_adapter_config_has_the_documented_format() -> None:
    config = adapter_config()
    assert format_errors(config, TOP) == []
    (rule,) = config["externalRules"]
    assert rule_errors(rule) == []
    # Served under the name the HPAs ask for, from the series the daemon exports.
    assert exposed_name(rule, METRIC) == METRIC
    assert {d["spec"]["metrics"][0]["external"]["metric"]["name"] for d in hpas()} == \
        {exposed_name(rule, METRIC)}
    assert exposed_name(rule, "pdctl_capacity_utilisation") is None
    assert rule["resources"] == {"namespaced": False}
    assert re.fullmatch(rf"{METRIC}\{{role!=\"\"\}}", rule["seriesQuery"])


def test_the_format_check_refuses_what_the_adapter_refuses() -> None:
    config = adapter_config()
    rule = dict(config["externalRules"][0])
    typo = {"externalRules": [{**rule, "metricQuery": rule["metricsQuery"]}]}
    assert format_errors(typo, TOP) == ["config.externalRules[0].metricQuery: unknown key"]
    assert format_errors({"externalRule": [rule]}, TOP) == ["config.externalRule: unknown key"]
    wrong_type = {"externalRules": [{**rule, "resources": {"namespaced": "no"}}]}
    assert format_errors(wrong_type, TOP) == [
        "config.externalRules[0].resources.namespaced: expected bool, got str"]
    no_resource = {"externalRules": [{**rule, "resources": {"overrides": {"ns": {"group": ""}}}}]}
    assert "no resource" in " ".join(format_errors(no_resource, TOP))
    assert rule_errors({**rule, "seriesQuery": ""}) == [
        "seriesQuery: missing (no discovery or no query)"]
    assert rule_errors({**rule, "metricsQuery": "sum(<<.Metric>>)"}) == [
        "metricsQuery: unknown template field .Metric"]


def _input_series(registries: list[tuple[str, CollectorRegistry]]) -> list[dict[str, str]]:
    """promtool input series from the controller's real exposition (one per instance)."""
    out = []
    for instance, registry in registries:
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for s in family.samples:
                if s.name != METRIC:
                    continue
                labels = {**s.labels, "instance": instance, "job": "pd-controller"}
                selector = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
                out.append({"series": f"{s.name}{{{selector}}}", "values": f"{s.value:g}x10"})
    return out


@pytest.mark.integration
def test_metrics_query_returns_one_series_per_role_with_the_recommendation(
    tmp_path: Path,
) -> None:
    require("promtool", shutil.which("promtool") is not None, "apt-get install prometheus")
    (rule,) = adapter_config()["externalRules"]
    # Around a change of leader: the new leader has planned prefill only so far, the old
    # one still exports its last (lower) prefill count and the decode count.
    leader, old_leader = CollectorRegistry(), CollectorRegistry()
    ControllerMetrics(leader).set_recommendation("prefill", 3, 0.7, 2, False)
    old = ControllerMetrics(old_leader)
    old.set_recommendation("prefill", 2, 0.6, 2, False)
    old.set_recommendation("decode", 5, 0.5, 5, False)
    series = _input_series([("ctl-0:9464", leader), ("ctl-1:9464", old_leader)])
    assert len(series) == 3
    records, tests = [], []
    for i, doc in enumerate(hpas()):
        selector = doc["spec"]["metrics"][0]["external"]["metric"]["selector"]["matchLabels"]
        name = f"hpa:query_{i}"
        records.append({"record": name, "expr": render(rule["metricsQuery"], selector)})
        want = {"prefill": 3.0, "decode": 5.0}[selector["role"]]
        tests.append({"expr": name, "eval_time": "5m",
                      "exp_samples": [{"labels": f'{name}{{role="{selector["role"]}"}}',
                                       "value": want}]})
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(
        {"groups": [{"name": "adapter", "rules": records}]}))
    (tmp_path / "test.yml").write_text(yaml.safe_dump({
        "rule_files": ["rules.yml"], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": tests}],
    }))
    out = subprocess.run(["promtool", "test", "rules", "test.yml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    # A sum (what the HPA itself does with several series) would double-count: the same
    # test against `sum by (role)` fails.
    for r in records:
        assert "max by" in r["expr"]
        r["expr"] = r["expr"].replace("max by", "sum by")
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(
        {"groups": [{"name": "adapter", "rules": records}]}))
    out = subprocess.run(["promtool", "test", "rules", "test.yml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode != 0
