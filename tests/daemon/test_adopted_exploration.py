"""A daemon started against routers whose policy explores nowhere still learns: its first push
is the routers' own table with ``[controller] adopted_exploration`` in every cell, recorded as
the policy's provenance (``policies.seeded_exploration``) and shown by ``pdctl status``.

The cycle's rules on its fakes, then the real Cycle and learner inside the simulator on the
demo's cluster: without the seeded exploration every candidate is an extrapolation refused at
a predicted goodput of about 0; with it the learner measures both routes and, after the KV
link slows, approves a table."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from controller.bench.runner import slo_of
from controller.cli import app
from controller.config import load_settings
from controller.loop.cycle import CycleConfig
from controller.policy import Policy, Route, loads
from controller.sim.scenario import load_scenario
from controller.store import Store
from controller.store.kinds import ADOPTED_PREFIX
from tests.daemon.fakes import Rig, make_rig
from tests.support.sim_cycle import run_cycle_in_sim

REPO = Path(__file__).resolve().parents[2]
SHARE = 0.05


def _routers_run(rig: Rig, policy: Policy) -> None:
    for agent in rig.agents.values():
        assert agent.apply(policy).outcome.name == "APPLIED"


async def test_the_first_push_turns_exploration_on_in_a_policy_that_explores_nowhere(
        tmp_path: Path) -> None:
    rig = make_rig(tmp_path, adopted_exploration=SHARE, min_policy_interval_s=300.0)
    own = Policy.uniform(7, Route.PREFILL_NODE)
    _routers_run(rig, own)
    first = await rig.step()
    adopted, seeded = rig.store.policy(7), rig.store.policy(8)
    assert adopted is not None and adopted.reason.startswith(ADOPTED_PREFIX)
    assert adopted.seeded_exploration is None
    assert seeded is not None and seeded.status == "approved"
    assert seeded.seeded_exploration == SHARE  # the provenance, typed
    assert "v8: v7 with exploration 0.05 to every router" in first.reason, first.reason
    table = loads(seeded.body_json).table
    assert table.routes == own.table.routes and table.scores == own.table.scores
    assert set(table.exploration) == {SHARE}
    # Pushed to every router at once (no canary: the routes are the routers' own).
    assert rig.store.desired_versions() == dict.fromkeys(rig.agents, 8)
    assert {a.snapshot.version for a in rig.agents.values()} == {8}
    assert first.pushes == len(rig.agents)
    # It is a change for the rate limit: the first calibration waits for its measurements,
    # then is judged against it.
    for _ in range(3):
        assert (await rig.step()).trigger is None
    rig.clock.advance(300.0)
    report = await rig.step()
    assert report.trigger == "schedule" and rig.learner.judged_against == [8], report.reason


@pytest.mark.parametrize("case", ["explores already", "opted out", "advisory"])
async def test_nothing_is_seeded_where_it_must_not_be(tmp_path: Path, case: str) -> None:
    config: dict[str, Any] = {"adopted_exploration": 0.0 if case == "opted out" else SHARE}
    if case == "advisory":
        config["advisory"] = True
    rig = make_rig(tmp_path, **config)
    exploration = 0.1 if case == "explores already" else 0.0
    _routers_run(rig, Policy.uniform(7, Route.PREFILL_NODE, exploration=exploration))
    first = await rig.step()
    assert [p.version for p in rig.store.policies()] == [7]
    # Opted out, the cycle line says what that means, once, rather than refusing silently.
    said = "v7 explores nowhere and [controller] adopted_exploration is 0" in first.reason
    assert said == (case == "opted out"), first.reason
    assert rig.store.policy(7).seeded_exploration is None  # type: ignore[union-attr]
    assert not [c for c in rig.transport.calls if c[0] == "apply"]


def test_a_pinned_route_or_classic_pd_seeds_nothing() -> None:
    assert CycleConfig.from_settings(load_settings()).adopted_exploration == SHARE
    for ppd in ({"append_prefill_route": "prefill"}, {"append_prefill_route": "decode"},
                {"enabled": False}):
        assert CycleConfig.from_settings(load_settings(ppd=ppd)).adopted_exploration == 0.0
    opted_out = load_settings(controller={"adopted_exploration": 0})
    assert CycleConfig.from_settings(opted_out).adopted_exploration == 0.0


async def test_status_shows_the_seeded_exploration(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, adopted_exploration=SHARE)
    _routers_run(rig, Policy.uniform(7, Route.PREFILL_NODE))
    await rig.step()
    url = f"sqlite:///{tmp_path / 'history.db'}"
    runner = CliRunner()
    doc = json.loads(runner.invoke(app, ["status", "--url", url, "--json"]).output)
    assert doc["fleet_version"] == 8 and doc["fleet_seeded_exploration"] == SHARE
    text = runner.invoke(app, ["status", "--url", url], terminal_width=200).output
    assert "v8 is the routers' own policy with exploration 0.05 in every cell" in text, text
    history = json.loads(runner.invoke(app, ["history", "policies", "--url", url,
                                             "--json"]).output)
    assert [(p["version"], p["seeded_exploration"]) for p in history] == [(7, None), (8, SHARE)]


# -- the real cycle and learner in the simulator --------------------------------------------


def _demo_in_virtual_time(tmp_path: Path, share: float) -> tuple[Store, list[Any]]:
    """The demo's cluster (routers on classic P/D, no exploration, an empty store), the KV
    link slowed at 240 s, 360 s in all; 10 s windows, the daemon's defaults otherwise."""
    text = (REPO / "scenarios" / "demo.toml").read_text()
    assert re.search(r"^at_s = \d+$", text, re.M), "demo.toml changed: update this test"
    text = re.sub(r"^at_s = \d+$", "at_s = 240", text.replace("duration_s = 600",
                                                               "duration_s = 360"), flags=re.M)
    path = tmp_path / "demo.toml"
    path.write_text(text)
    scenario = load_scenario(path)
    settings = load_settings(
        slo={"ttft_s": scenario.ttft_slo_s, "tpot_s": scenario.tpot_slo_s},
        controller={"interval_s": 10.0, "min_policy_interval_s": 60.0,
                    "adopted_exploration": share},
        drift={"cooldown_s": 60.0})
    run = run_cycle_in_sim(scenario, Policy.uniform(1, Route.PREFILL_NODE, slo=slo_of(scenario)),
                           settings, f"sqlite:///{tmp_path / f'h{share}.db'}", planner=False)
    return run.store, run.reports


def test_a_daemon_on_routers_that_never_explore_learns_in_the_simulator(tmp_path: Path) -> None:
    store, reports = _demo_in_virtual_time(tmp_path, SHARE)
    assert all(r.result in ("ok", "skipped") for r in reports)
    seeded = store.policy(2)
    assert seeded is not None and seeded.seeded_exploration == SHARE
    cals = store.calibrations()
    assert cals
    # Both routes are measured: no candidate is an extrapolation predicted at about 0.
    assert all((c.predicted_goodput_new or 0.0) > 0.5 for c in cals), \
        [(c.details or {}).get("reason") for c in cals]
    # After the KV link slows (240 s) a table is learned and approved.
    after = [c for c in cals if c.created_at.timestamp() >= 240 + _t0(store)]
    assert any((c.details or {}).get("approved") for c in after), \
        [(c.details or {}).get("reason") for c in after]


def test_opted_out_the_same_start_learns_nothing(tmp_path: Path) -> None:
    """``adopted_exploration = 0``: what the first hour was before (and why it is on)."""
    store, _ = _demo_in_virtual_time(tmp_path, 0.0)
    assert all(p.seeded_exploration is None for p in store.policies())
    cals = store.calibrations()
    assert cals and not any((c.details or {}).get("approved") for c in cals)
    assert min(c.predicted_goodput_new or 0.0 for c in cals) < 0.05


def _t0(store: Store) -> float:
    """When the run started (its first window)."""
    return min(w.window.start for w in store.windows())
