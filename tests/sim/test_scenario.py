from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Any

import pytest

from controller.sim.scenario import ScenarioError, load_scenario, parse_scenario

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "scenarios" / "examples").glob("*.toml"))
COMMITTED = sorted((ROOT / "scenarios").glob("*.toml"))


def _base() -> dict[str, Any]:
    return {
        "name": "t", "seed": 1, "duration_s": 10,
        "cluster": {"prefill_workers": 1, "decode_workers": 2},
        "workload": {"source": "synthetic", "params": {"qps": 1, "turns": 2}},
    }


@pytest.mark.parametrize("path", EXAMPLES + COMMITTED, ids=lambda p: p.name)
def test_every_shipped_scenario_parses(path: Path) -> None:
    sc = load_scenario(path)
    assert sc.name and sc.duration_s > 0


def test_examples_cover_every_source_and_event_kind() -> None:
    from controller.sim.scenario import EVENT_KINDS
    from controller.sim.workloads.base import SOURCES

    sources, kinds = set(), set()
    for p in EXAMPLES:
        data = tomllib.loads(p.read_text())
        sources.add(data["workload"]["source"])
        for ev in data.get("events", []):
            kinds.add(ev["kind"])
            if ev["kind"] == "workload":
                sources.add(ev["source"])
    assert sources == set(SOURCES)
    assert kinds == set(EVENT_KINDS)


@pytest.mark.parametrize(
    ("patch", "key"),
    [
        ({"cluster": {"prefill_workers": 1, "decode_workers": 2, "bogus": 1}}, "cluster.bogus"),
        ({"cluster": {"decode_workers": 0}}, "cluster.decode_workers"),
        ({"cluster": {"kv_link_gbps": -1}}, "cluster.kv_link_gbps"),
        ({"cluster": {"profile": "no-such-gpu"}}, "cluster.profile"),
        ({"cluster": {"metrics_engine": "tgi"}}, "cluster.metrics_engine"),
        ({"cluster": {"sglang_tp_ranks": 0}}, "cluster.sglang_tp_ranks"),
        ({"duration_s": 0}, "duration_s"),
        ({"colour": "red"}, "colour"),
        ({"workload": {"source": "nope"}}, "workload.source"),
        ({"slo": {"ttft_s": 0}}, "slo.ttft_s"),
        ({"events": [{"at_s": 1, "kind": "explode"}]}, "events[0].kind"),
        ({"events": [{"at_s": 99, "kind": "rate_scale", "factor": 2}]}, "events[0].at_s"),
        ({"events": [{"at_s": 1, "kind": "rate_scale"}]}, "events[0].factor"),
        ({"events": [{"at_s": 1, "kind": "link_bandwidth", "factor": 0.5, "role": "decode"}]},
         "events[0].role"),
        ({"events": [{"at_s": 1, "kind": "remove_worker", "role": "decode", "count": 2}]},
         "events[0].count"),
        # Beyond these a run hung silently (a billion workers, a microsecond interval).
        ({"cluster": {"prefill_workers": 10**9}}, "cluster.prefill_workers"),
        ({"cluster": {"decode_workers": 4097}}, "cluster.decode_workers"),
        ({"cluster": {"routers": 10**9}}, "cluster.routers"),
        ({"duration_s": 1e12}, "duration_s"),
        ({"controller": {"interval_s": 1e-6}}, "controller.interval_s"),
        ({"events": [{"at_s": 1, "kind": "rate_scale", "factor": 1e9}]}, "events[0].factor"),
        ({"events": [{"at_s": 1, "kind": "add_worker", "role": "decode", "count": 10**6}]},
         "events[0].count"),
        ({"cluster": {"custom_histogram_buckets": {"inter_token_latency": [0.01, math.nan,
                                                                           0.5]}}},
         "cluster.custom_histogram_buckets.inter_token_latency"),
        ({"description": 5}, "description"),
    ],
)
def test_bad_values_are_errors_naming_the_key(patch: dict[str, Any], key: str) -> None:
    data = _base()
    data.update(patch)
    with pytest.raises(ScenarioError) as e:
        parse_scenario(data)
    assert str(e.value).startswith(f"{key}:") or f" {key}:" in str(e.value)


def test_phases_split_at_events() -> None:
    data = _base()
    data["events"] = [{"at_s": 3, "kind": "rate_scale", "factor": 2},
                      {"at_s": 6, "kind": "link_bandwidth", "factor": 0.5}]
    sc = parse_scenario(data)
    assert sc.phase_bounds() == [(0.0, 3.0), (3.0, 6.0), (6.0, 10.0)]


def test_json_schema_accepts_the_examples_and_names_the_same_keys() -> None:
    import json

    schema = json.loads((ROOT / "controller" / "sim" / "scenario.schema.json").read_text())
    from controller.sim.scenario import CLUSTER_KEYS, SERVE_KEYS, WORKLOAD_KEYS

    assert set(schema["properties"]["serve"]["properties"]) == SERVE_KEYS
    assert schema["properties"]["serve"]["additionalProperties"] is False
    assert set(schema["properties"]["cluster"]["properties"]) == CLUSTER_KEYS
    assert set(schema["properties"]["workload"]["properties"]) == WORKLOAD_KEYS
    assert schema["additionalProperties"] is False


def test_serve_table(tmp_path: Path) -> None:
    data = _base()
    assert parse_scenario(data).serve.port_base is None  # the OS picks ports
    data["serve"] = {"port_base": 18000, "tokenizer": "tok", "abort_timeout_s": 120,
                     "no_handle_fraction": 0.25, "default_max_tokens": 32}
    sc = parse_scenario(data, source_path=tmp_path / "s.toml")
    assert sc.serve.port_base == 18000 and sc.serve.abort_timeout_s == 120
    assert sc.serve.tokenizer == tmp_path / "tok"  # relative to the scenario file
    assert (sc.serve.no_handle_fraction, sc.serve.default_max_tokens) == (0.25, 32)
    for bad, where in (({"port_base": 80}, "serve.port_base"),
                       ({"port_base": 65500}, "serve.port_base"),
                       ({"no_handle_fraction": 1.5}, "serve.no_handle_fraction"),
                       ({"abort_timeout_s": 0}, "serve.abort_timeout_s"),
                       ({"ports": 1}, "serve.ports")):
        data["serve"] = bad
        with pytest.raises(ScenarioError, match=where.replace(".", r"\.")):
            parse_scenario(data)
