"""The same Cycle the daemon runs, driven in virtual time inside a simulated cluster (as the
bench's `adaptive` policy runs it: tests/support/sim_cycle.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from controller.config import load_settings
from controller.policy import Policy, Route
from controller.sim.scenario import load_scenario
from controller.store.kinds import ADOPTED_PREFIX
from tests.support.sim_cycle import run_cycle_in_sim

SCENARIO = """
name = "cycle-in-sim"
seed = 5
duration_s = 400

[cluster]
prefill_workers = 1
decode_workers = 3
profile = "llama-3.1-8b-h100"
kv_link_gbps = 100
max_batch_tokens = 8192
routers = 2
prefill_prefix_cache = true
transfer_missing_only = true

[workload]
source = "synthetic"

[workload.params]
qps = 6
turns = 4
turn1_input = 1024
turn1_output = 128
append_input = 128
append_output = 128
think_s = 2.0

[[events]]
at_s = 200
kind = "rate_scale"
factor = 3.0

[slo]
ttft_s = 0.5
tpot_s = 0.05

[controller]
interval_s = 10
"""


def test_the_daemons_cycle_runs_in_virtual_time_inside_the_simulator(tmp_path: Path) -> None:
    path = tmp_path / "scenario.toml"
    path.write_text(SCENARIO)
    scenario = load_scenario(path)
    settings = load_settings(slo={"ttft_s": 0.5, "tpot_s": 0.05},
                             controller={"interval_s": 10.0, "min_policy_interval_s": 0.0},
                             drift={"cooldown_s": 60.0}, capacity={"interval_s": 60.0})
    run = run_cycle_in_sim(scenario, Policy.uniform(1, Route.PREFILL_NODE), settings,
                           f"sqlite:///{tmp_path / 'bench.db'}")
    store, reports = run.store, run.reports
    assert len(reports) >= 30
    assert all(r.result in ("ok", "skipped") for r in reports), \
        [r.reason for r in reports if r.result == "failed"]
    windows = store.windows()
    assert len(windows) == sum(1 for r in reports if r.window_id is not None)
    # Nothing stored: the routers' own policy (classic P/D, v1) is adopted, not pushed, and
    # every calibration is judged against it, not approved unchecked.
    adopted = store.policy(1)
    assert adopted is not None and adopted.status == "approved"
    assert adopted.reason.startswith(ADOPTED_PREFIX), adopted.reason
    assert adopted.checksum == Policy.uniform(1, Route.PREFILL_NODE).checksum
    cals = store.calibrations()
    assert cals and cals[0].heldout_error and cals[0].training_window_ids
    assert all(c.predicted_goodput_current is not None for c in cals)
    # Every router ended on its desired policy, and the store knows it; only approved
    # calibrations were pushed.
    desired = store.desired_versions()
    running = {r: a.snapshot.version for r, a in run.agents.items()}
    assert desired == running
    assert {r.router_id: r.acked_version for r in store.routers()} == running
    learned = {c.policy_version for c in cals if (c.details or {}).get("approved")}
    # ...and the first push: the routers' own table with exploration turned on
    # ([controller] adopted_exploration), since it explored nowhere.
    seeded = {p.version for p in store.policies() if p.seeded_exploration is not None}
    assert seeded == {2}
    assert {p.version for p in store.pushes()} <= learned | seeded
    # The rate triples at 200 s: the workload detector fires after it (not before), and the
    # drift triggers a calibration whose verdict is stored with its numbers.
    events = store.drift_events()
    assert events and all(e.at.timestamp() >= 200 for e in events)
    assert events[0].kind == "workload" and events[0].statistic > events[0].threshold
    on_drift = [c for c in store.calibrations() if (c.details or {}).get("trigger") == "drift"]
    assert on_drift and on_drift[0].created_at >= events[0].at
    assert "predicted goodput" in on_drift[0].details["reason"]
    # The first drift calibration trains across the shift and is refused: it does not become
    # the drift reference (that hid shifts, issue 7), so the shift fires again after the
    # cooldown (60 s) and is calibrated for on the windows since it alone. Refused again,
    # those windows are the new normal: nothing fires after that.
    assert len(events) >= 2 and events[1].kind == "workload"
    assert _ts(events[1].at) >= _ts(events[0].at) + 60
    assert on_drift[0].details["regime_only"] is False
    judged = [c for c in on_drift if c.details["regime_only"]]
    assert judged and not judged[0].details["approved"], [c.details for c in on_drift]
    assert all(e.at <= judged[0].created_at for e in events)
    # The capacity planner ran on the simulator's windows through the real adapter: every
    # interval, without failing a cycle, on windows that exist, seeing the running shape.
    recs = store.recommendations()
    assert not [r.capacity for r in reports if (r.capacity or "").startswith("plan failed")]
    assert len(recs) >= 5
    stored_ids = {w.id for w in windows}
    assert all(set(r.window_ids) <= stored_ids and r.window_ids for r in recs)
    assert {(r.current_prefill, r.current_decode) for r in recs} == {(1, 3)}
    before = [r for r in recs if r.last_window_id is not None
              and store.windows_by_ids([r.last_window_id])[0].window.end <= 200]
    after = [r for r in recs if min(r.window_ids) > max(before[-1].window_ids)]
    assert before and after
    # The arrival rate triples at 200 s: the demand seen and the workers asked for follow.
    assert after[-1].body["demand"]["qps"] > 2 * before[-1].body["demand"]["qps"]
    for role in ("prefill", "decode"):
        old, new = before[-1], after[-1]
        more = new.workers(role) > old.workers(role)
        busier = getattr(new, f"{role}_utilisation") > getattr(old, f"{role}_utilisation")
        assert new.workers(role) >= old.workers(role) and (more or busier), role
    print("recommendations", [(r.prefill_workers, r.decode_workers,
                               round(r.prefill_utilisation, 2), round(r.decode_utilisation, 2),
                               round(r.body["demand"]["qps"], 1)) for r in recs])
    approved = [p.version for p in store.policies(status="approved")]
    print(f"windows={len(windows)} approved={approved} "
          f"drift={[(e.kind, round(e.statistic, 2)) for e in store.drift_events()]} "
          f"pushes={len(store.pushes())} canary={[r.canary for r in reports if r.canary]}")
    store.close()


def _ts(at: Any) -> float:
    return float(at.timestamp())
