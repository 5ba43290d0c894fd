from __future__ import annotations

import pytest

from controller.config import load_settings
from controller.errors import ConfigError
from controller.observe.discovery import (
    static_targets,
    targets_from_prometheus,
    targets_from_settings,
)


def test_static_lists_keep_roles_and_order() -> None:
    ts = static_targets(["127.0.0.1:8101", "127.0.0.1:8102"], ["127.0.0.1:8201"],
                        ["127.0.0.1:9464"])
    assert [(t.name, t.role) for t in ts] == [
        ("127.0.0.1:8101", "prefill"), ("127.0.0.1:8102", "prefill"),
        ("127.0.0.1:8201", "decode"), ("127.0.0.1:9464", "router")]
    assert ts[0].metrics_url == "http://127.0.0.1:8101/metrics"


def test_dns_name_expands_to_every_address() -> None:
    ts = static_targets([], ["dns+localhost:8200"], [])
    names = {t.name for t in ts}
    assert "127.0.0.1:8200" in names
    assert all(t.role == "decode" for t in ts)
    assert names <= {"127.0.0.1:8200", "[::1]:8200"}


@pytest.mark.parametrize("bad", ["no-port", "host:", ":80", "dns+nonexistent.invalid:80"])
def test_bad_addresses_are_config_errors(bad: str) -> None:
    with pytest.raises(ConfigError):
        static_targets([bad], [], [])


def test_targets_from_the_seed_config(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = tmp_path / "ppd.toml"
    cfg.write_text(
        '[prefill_pool]\nnodes = ["127.0.0.1:8101"]\n'
        '[decode_pool]\nnodes = ["127.0.0.1:8201", "127.0.0.1:8202"]\n'
        '[routers]\ntargets = ["127.0.0.1:50151"]\nmetrics_targets = ["127.0.0.1:9464"]\n'
    )
    ts = targets_from_settings(load_settings(cfg))
    assert [t.role for t in ts] == ["prefill", "decode", "decode", "router"]
    assert ts[-1].name == "127.0.0.1:9464"  # the router's /metrics, not its gRPC port


def test_prometheus_targets_take_roles_from_labels_or_job() -> None:
    active = [
        {"labels": {"instance": "a:1", "job": "x", "role": "prefill"}, "scrapeUrl": "http://a:1/m"},
        {"labels": {"instance": "b:1", "job": "vllm-decode"}, "scrapeUrl": "http://b:1/metrics"},
        {"labels": {"instance": "c:1", "job": "node-exporter"}},
        {"labels": {"instance": "d:1", "job": "pd", "tier": "router"}},
    ]
    ts = targets_from_prometheus(active)
    assert [(t.name, t.role, t.url) for t in ts] == [
        ("a:1", "prefill", "http://a:1/m"), ("b:1", "decode", "http://b:1/metrics")]
    assert [t.role for t in targets_from_prometheus(active, role_label="tier")] == [
        "decode", "router"]
