"""ControllerMetrics: names, labels and values as Prometheus sees them, and promtool's lint."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from controller import __version__
from controller.loop.metrics import (
    CANARY_STATES,
    CYCLE_RESULTS,
    GUARDRAIL_DECISIONS,
    JOBS,
    RECALIBRATION_TRIGGERS,
    ControllerMetrics,
)
from tests.conftest import require

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(registry: CollectorRegistry) -> Samples:
    text = generate_latest(registry).decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def test_enum_children_exist_from_the_first_scrape(registry: CollectorRegistry) -> None:
    ControllerMetrics(registry)
    s = scrape(registry)
    assert value(s, "pdctl_build_info", version=__version__) == 1
    for result in CYCLE_RESULTS:
        assert value(s, "pdctl_cycles_total", result=result) == 0
    for job in JOBS:
        assert value(s, "pdctl_job_duration_seconds_count", job=job) == 0
        for reason in ("overlap", "missed"):
            assert value(s, "pdctl_job_skipped_total", job=job, reason=reason) == 0
    for trigger in RECALIBRATION_TRIGGERS:
        assert value(s, "pdctl_recalibrations_total", trigger=trigger) == 0
    for decision in GUARDRAIL_DECISIONS:
        assert value(s, "pdctl_guardrail_decisions_total", decision=decision) == 0
    for detector in ("workload", "performance", "slo"):
        assert value(s, "pdctl_drift_events_total", detector=detector) == 0
    assert [value(s, "pdctl_canary_state", state=st) for st in CANARY_STATES] == [1, 0, 0, 0]
    assert value(s, "pdctl_last_cycle_success_timestamp_seconds") == 0


def test_cycles_move_counters_histogram_and_success_timestamp(
    registry: CollectorRegistry,
) -> None:
    m = ControllerMetrics(registry)
    m.observe_cycle("ok", 0.2, now=1_000.0)
    m.observe_cycle("failed", 3.0, now=1_030.0)
    m.observe_cycle("skipped", 0.0, now=1_060.0)
    m.observe_cycle("ok", 0.4, now=1_090.0)
    s = scrape(registry)
    assert value(s, "pdctl_cycles_total", result="ok") == 2
    assert value(s, "pdctl_cycles_total", result="failed") == 1
    assert value(s, "pdctl_cycles_total", result="skipped") == 1
    # Skipped cycles did not run: three durations, and the failed one is not a success.
    assert value(s, "pdctl_cycle_duration_seconds_count") == 3
    assert value(s, "pdctl_cycle_duration_seconds_sum") == pytest.approx(3.6)
    assert value(s, "pdctl_cycle_duration_seconds_bucket", le="0.25") == 1
    assert value(s, "pdctl_cycle_duration_seconds_bucket", le="0.5") == 2
    assert value(s, "pdctl_last_cycle_success_timestamp_seconds") == 1_090.0


def test_jobs_pushes_and_router_versions(registry: CollectorRegistry) -> None:
    m = ControllerMetrics(registry)
    m.observe_job("calibrate", 12.0)
    m.job_skipped_run("calibrate", "overlap")
    m.job_skipped_run("observe", "missed")
    m.observe_push("router-a", "ok", 0.004)
    m.observe_push("router-a", "failed", 2.0)
    m.observe_push("router-b", "ok", 0.002)
    m.set_router_versions("router-a", desired=7, acked=6)
    m.set_router_versions("router-b", desired=7, acked=7)
    s = scrape(registry)
    assert value(s, "pdctl_job_duration_seconds_sum", job="calibrate") == 12.0
    assert value(s, "pdctl_job_skipped_total", job="calibrate", reason="overlap") == 1
    assert value(s, "pdctl_job_skipped_total", job="observe", reason="missed") == 1
    assert value(s, "pdctl_push_total", router="router-a", result="ok") == 1
    assert value(s, "pdctl_push_total", router="router-a", result="failed") == 1
    assert value(s, "pdctl_push_duration_seconds_count", router="router-a") == 2
    assert value(s, "pdctl_push_duration_seconds_bucket", router="router-b", le="0.0025") == 1
    assert value(s, "pdctl_router_desired_version", router="router-a") == 7
    assert value(s, "pdctl_router_acked_version", router="router-a") == 6
    assert value(s, "pdctl_router_acked_version", router="router-b") == 7

    m.forget_router("router-a")
    m.forget_router("never-seen")  # no error
    s = scrape(registry)
    assert not [k for k in s if ("router", "router-a") in k[1]]
    assert value(s, "pdctl_router_acked_version", router="router-b") == 7


def test_drift_guardrail_goodput_and_operator_state(registry: CollectorRegistry) -> None:
    m = ControllerMetrics(registry)
    m.set_drift("workload", "context_tokens", statistic=0.31, threshold=0.2)
    m.drift_event("workload")
    m.drift_event("workload")
    m.recalibration("drift")
    m.guardrail_decision("rejected", "goodput_margin", now=500.0)
    m.guardrail_decision("approved", "better", now=600.0)
    m.set_predicted_goodput(current=0.81, candidate=0.9)
    m.policy_changed(8)
    m.set_leader(True)
    m.set_paused(True)
    m.set_pinned(False)
    m.set_canary_state("baking")
    s = scrape(registry)
    assert value(s, "pdctl_drift_statistic", detector="workload", feature="context_tokens") == 0.31
    assert value(s, "pdctl_drift_threshold", detector="workload", feature="context_tokens") == 0.2
    assert value(s, "pdctl_drift_events_total", detector="workload") == 2
    assert value(s, "pdctl_recalibrations_total", trigger="drift") == 1
    assert value(s, "pdctl_guardrail_decisions_total", decision="rejected") == 1
    assert value(s, "pdctl_guardrail_decisions_total", decision="approved") == 1
    # Only the latest verdict has a series.
    info = {k: v for k, v in s.items() if k[0] == "pdctl_last_decision_info"}
    assert info == {
        ("pdctl_last_decision_info", frozenset({("decision", "approved"), ("reason", "better")})): 1
    }
    assert value(s, "pdctl_last_decision_timestamp_seconds") == 600.0
    assert value(s, "pdctl_predicted_goodput_ratio", policy="current") == 0.81
    assert value(s, "pdctl_predicted_goodput_ratio", policy="candidate") == 0.9
    assert value(s, "pdctl_policy_changes_total") == 1
    assert value(s, "pdctl_desired_policy_version") == 8
    assert value(s, "pdctl_leader") == 1
    assert value(s, "pdctl_paused") == 1
    assert value(s, "pdctl_pinned") == 0
    assert [value(s, "pdctl_canary_state", state=st) for st in CANARY_STATES] == [0, 1, 0, 0]


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.observe_cycle("okay", 1.0, now=1.0),
        lambda m: m.observe_job("fit", 1.0),
        lambda m: m.job_skipped_run("observe", "late"),
        lambda m: m.observe_push("r", "timeout", 1.0),
        lambda m: m.recalibration("cron"),
        lambda m: m.guardrail_decision("maybe", "x", now=1.0),
        lambda m: m.set_canary_state("canary"),
        lambda m: m.drift_event("weather"),
        lambda m: m.set_recommendation("router", 2, 0.5, 2, False),
    ],
)
def test_unknown_enum_labels_are_refused(registry: CollectorRegistry, call: object) -> None:
    m = ControllerMetrics(registry)
    before = generate_latest(registry)
    with pytest.raises(ValueError, match="unknown"):
        call(m)  # type: ignore[operator]
    assert generate_latest(registry) == before


def test_capacity_recommendation_series(registry: CollectorRegistry) -> None:
    m = ControllerMetrics(registry)
    s = scrape(registry)
    # No recommendation yet: no per-role series an autoscaler could act on.
    assert not any(name == "pdctl_recommended_workers" for name, _ in s)
    assert value(s, "pdctl_last_recommendation_timestamp_seconds") == 0
    assert value(s, "pdctl_capacity_plan_failures_total") == 0

    m.set_recommendation("prefill", 3, 0.71, 2, True)
    m.set_recommendation("decode", 5, 0.64, None, False)
    m.recommended(now=1234.5)
    m.capacity_plan_failed()
    s = scrape(registry)
    assert value(s, "pdctl_recommended_workers", role="prefill") == 3
    assert value(s, "pdctl_recommended_workers", role="decode") == 5
    assert value(s, "pdctl_capacity_utilisation", role="prefill") == 0.71
    assert value(s, "pdctl_capacity_current_workers", role="prefill") == 2
    assert ("pdctl_capacity_current_workers", frozenset({("role", "decode")})) not in s
    assert value(s, "pdctl_capacity_extrapolated", role="prefill") == 1
    assert value(s, "pdctl_capacity_extrapolated", role="decode") == 0
    assert value(s, "pdctl_last_recommendation_timestamp_seconds") == 1234.5
    assert value(s, "pdctl_capacity_plan_failures_total") == 1

    m.clear_recommendation()  # lost leadership
    s = scrape(registry)
    assert not any(name.startswith(("pdctl_recommended", "pdctl_capacity_util"))
                   for name, _ in s)


def test_one_object_per_registry(registry: CollectorRegistry) -> None:
    ControllerMetrics(registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        ControllerMetrics(registry)
    ControllerMetrics(CollectorRegistry())  # a fresh registry is independent


@pytest.mark.integration
def test_exposition_passes_promtool_check_metrics(registry: CollectorRegistry) -> None:
    require("promtool", shutil.which("promtool") is not None, "apt-get install prometheus")
    m = ControllerMetrics(registry)
    m.observe_cycle("ok", 0.1, now=10.0)
    m.observe_push("router-a", "ok", 0.01)
    m.set_router_versions("router-a", 1, 1)
    m.set_drift("workload", "io_ratio", 0.1, 0.2)
    m.guardrail_decision("approved", "better", now=10.0)
    m.set_predicted_goodput(0.8, 0.85)
    m.set_recommendation("prefill", 3, 0.7, 2, False)
    m.recommended(now=10.0)
    out = subprocess.run(
        ["promtool", "check", "metrics"],
        input=generate_latest(registry),
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert out.returncode == 0, (out.stdout + out.stderr).decode()
    # promtool is not lenient: a counter without _total in the same pipe is refused.
    bad = b"# HELP x_latency_ms Bad.\n# TYPE x_latency_ms counter\nx_latency_ms 1\n"
    out = subprocess.run(
        ["promtool", "check", "metrics"], input=bad, capture_output=True, timeout=30, check=False
    )
    assert out.returncode != 0
