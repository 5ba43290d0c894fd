"""The quickstart's first minutes in virtual time: the settings `pdctl sim serve
--write-config` writes for scenarios/demo.toml, the daemon's Cycle started with the cluster
(empty, as `pdctl run` in the README's second terminal), the routers on the simulator's
default policy (classic P/D, no exploration). The first candidates must be judged on
measurements of both routes, not refused at a predicted goodput of 0 (issue 38)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from controller.bench.baselines import static_policy
from controller.bench.runner import slo_of
from controller.config import load_settings
from controller.policy import Route
from controller.sim.scenario import load_scenario
from controller.sim.serve_config import daemon_config
from controller.store.records import CalibrationRecord
from tests.support.sim_cycle import run_cycle_in_sim

DEMO = Path(__file__).resolve().parents[2] / "scenarios" / "demo.toml"
DURATION_S = 90.0  # 30 windows of 3 s at most
# The README's second terminal starts `pdctl run` once the cluster serves: its first window
# has sessions in flight (from 0 s the first windows held turn 1s only).
DAEMON_STARTS_S = 9.0


def _written_settings(store_url: str, **controller: Any) -> Any:
    """The daemon config `pdctl sim serve --write-config` writes (addresses aside: the
    in-process source reads the cluster directly), with ``controller`` overrides."""
    scenario = load_scenario(DEMO)
    addresses = {"workers": [{"role": "prefill", "metrics": "http://127.0.0.1:1/metrics"},
                             {"role": "decode", "metrics": "http://127.0.0.1:2/metrics"}]}
    doc = daemon_config(addresses, scenario, store_url, [("127.0.0.1:3", "127.0.0.1:4")], None)
    doc["controller"].update(controller)
    return load_settings(**doc)


def _first_start(tmp_path: Path, **controller: Any) -> list[CalibrationRecord]:
    scenario = load_scenario(DEMO)
    scenario = dataclasses.replace(scenario, duration_s=DURATION_S)
    url = f"sqlite:///{tmp_path / 'pdctl.db'}"
    settings = _written_settings(url, **controller)
    # `pdctl sim serve`'s default --policy pd: every turn to the prefill node, explored
    # nowhere.
    store = run_cycle_in_sim(scenario, static_policy(Route.PREFILL_NODE, slo_of(scenario)),
                             settings, url, starts_s=DAEMON_STARTS_S).store
    try:
        return list(store.calibrations())  # oldest first
    finally:
        store.close()


def _reason(c: CalibrationRecord) -> str:
    """The calibration's reason as `pdctl status` (calib. line) and history print it."""
    return str((c.details or {}).get("reason", ""))


def test_the_written_configs_first_candidates_are_judged_on_measurements(
        tmp_path: Path) -> None:
    cals = _first_start(tmp_path)
    assert len(cals) >= 3, [(c.policy_version, _reason(c)) for c in cals]
    for c in cals[:3]:
        assert c.predicted_goodput_new is not None and c.predicted_goodput_current is not None
        # 0.0000 was the signature of a prediction for a route nothing took.
        assert c.predicted_goodput_new > 0.2 and c.predicted_goodput_current > 0.2, \
            (c.policy_version, _reason(c))
        assert "extrapolation" not in _reason(c), _reason(c)
    approved = [c for c in cals if (c.details or {}).get("verdict", {}).get("approved")]
    assert approved, [(c.policy_version, _reason(c)) for c in cals]


def test_without_exploration_a_refusal_says_in_words_that_it_is_an_extrapolation(
        tmp_path: Path) -> None:
    # adopted_exploration = 0: the routers' own policy, as it is, explores nowhere, and the
    # first candidate's prediction for decode-local rests on no measurement at all.
    cals = _first_start(tmp_path, adopted_exploration=0.0)
    refused = [c for c in cals if not (c.details or {}).get("verdict", {}).get("approved")]
    assert refused, [(c.policy_version, _reason(c)) for c in cals]
    first = refused[0]
    assert "saw 0 decode-local request(s)" in _reason(first), _reason(first)
    assert "extrapolations, not measurements" in _reason(first), _reason(first)
