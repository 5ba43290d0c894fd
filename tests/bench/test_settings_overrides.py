"""``SECTION.KEY=VALUE`` overrides on the bench's adaptive settings (``bench_adaptive.py
--set``): parsed strictly, applied on top of the scenario's SLOs and interval, refused like a
bad config file."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.bench.runner import adaptive_settings, parse_setting_overrides
from controller.errors import ConfigError
from controller.sim.scenario import Scenario, load_scenario

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def scenario() -> Scenario:
    return load_scenario(ROOT / "scenarios/bench/1-mooncake-rising-load.toml")


def test_values_are_read_as_json_where_they_parse() -> None:
    got = parse_setting_overrides(["controller.guardrail_margin=0.008",
                                   "controller.canary_refit=false",
                                   "controller.bake_windows=5", "store.url=sqlite:///x.db"])
    assert got == {"controller": {"guardrail_margin": 0.008, "canary_refit": False,
                                  "bake_windows": 5},
                   "store": {"url": "sqlite:///x.db"}}


@pytest.mark.parametrize("item", ["controller.bake_windows", "bake_windows=5", ".x=1",
                                  "controller.=1"])
def test_a_malformed_item_is_refused(item: str) -> None:
    with pytest.raises(ValueError, match=r"SECTION\.KEY=VALUE"):
        parse_setting_overrides([item])


def test_overrides_go_on_top_of_the_scenarios_slos_and_interval(scenario: Scenario) -> None:
    plain = adaptive_settings(scenario)
    changed = adaptive_settings(scenario, overrides={"controller": {"guardrail_margin": 0.008,
                                                                    "bake_windows": 5}})
    assert (changed.controller.guardrail_margin, changed.controller.bake_windows) == (0.008, 5)
    assert plain.controller.guardrail_margin != 0.008
    assert changed.slo == plain.slo and changed.slo.ttft_s == scenario.ttft_slo_s
    assert changed.controller.interval_s == scenario.interval_s
    # a shortened run keeps its shortened time constants under an override of another key
    short = adaptive_settings(scenario, 0.5, {"controller": {"bake_windows": 5}})
    assert short.drift.cooldown_s == adaptive_settings(scenario, 0.5).drift.cooldown_s
    assert short.drift.cooldown_s == plain.drift.cooldown_s * 0.5


@pytest.mark.parametrize("overrides", [{"controller": {"bogus": 1}},
                                       {"nosuch": {"x": 1}},
                                       {"controller": {"bake_windows": 0}}])
def test_a_bad_override_fails_like_a_bad_config_file(
    scenario: Scenario, overrides: dict[str, dict[str, object]]
) -> None:
    with pytest.raises(ConfigError):
        adaptive_settings(scenario, overrides=overrides)
