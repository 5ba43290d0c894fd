"""The cycle's capacity recommendation: computed every ``capacity_interval_s`` from the recent
complete windows, stored in the cycle's transaction, exported for autoscalers; a failing plan
never fails the cycle; an applied recommendation is a known scaling event.

The planner is our seam: a scripted one that runs the real :func:`plan_capacity` on a demand
the test sets (the fake source's windows carry no worker signals to plan from).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from prometheus_client import CollectorRegistry

from controller.core.capacity import CapacityDemand, CapacityPlan, plan_capacity
from controller.core.latency_model import ComponentParams
from controller.core.window import Window
from tests.daemon.fakes import Rig, make_rig

INTERVAL_S = 30.0
CAPACITY_INTERVAL_S = 90.0  # a recommendation every third cycle


@dataclass
class ScriptedPlanner:
    """The real planning core on a scripted demand; ``fail`` raises, ``nan`` returns a plan
    the store cannot keep; ``seen`` records the windows of every call."""

    qps: float = 4.0
    fail: bool = False
    nan: bool = False
    seen: list[list[float]] = field(default_factory=list)

    def plan(self, windows: Sequence[Window]) -> CapacityPlan:
        self.seen.append([w.end for w in windows])
        if self.fail:
            raise RuntimeError("scripted planner failure")
        newest = windows[-1]
        current = (sum(1 for w in newest.workers if w.role == "prefill"),
                   sum(1 for w in newest.workers if w.role == "decode"))
        demand = CapacityDemand(qps=self.qps, input_tokens=2048, cached_fraction=0.3,
                                output_tokens=200, decode_local_share=0.2,
                                local_append_tokens=256)
        plan = plan_capacity(demand, ComponentParams(), slo_ttft_s=2.0, slo_tpot_s=0.1,
                             current=current)
        if self.nan:
            return replace(plan, decode=replace(plan.decode, utilisation=math.nan))
        return plan


def _rig(tmp_path: Path, planner: ScriptedPlanner, routers: int = 1) -> Rig:
    rig = make_rig(tmp_path, routers=routers, interval_s=INTERVAL_S,
                   capacity_interval_s=CAPACITY_INTERVAL_S, capacity_min_windows=2)
    rig.planner = planner
    rig.new_cycle()
    return rig


def _gauge(registry: CollectorRegistry, name: str, role: str | None = None) -> float | None:
    return registry.get_sample_value(name, {"role": role} if role else {})


async def test_the_cycle_stores_and_exports_a_recommendation_every_interval(
    tmp_path: Path,
) -> None:
    planner = ScriptedPlanner(qps=4.0)
    rig = _rig(tmp_path, planner)
    first = await rig.step()
    assert first.recommendation_id is None  # one window: fewer than capacity_min_windows
    assert _gauge(rig.registry, "pdctl_recommended_workers", "prefill") is None

    second = await rig.step()
    assert second.result == "ok" and second.recommendation_id is not None
    (rec,) = rig.store.recommendations()
    # What the store keeps is the plan as JSON (tuples come back as lists).
    expected = json.loads(json.dumps(planner.plan([w.window for w in rig.store.windows()])
                                     .to_dict()))
    # Planned on both windows, the cycle's own one included, and stored with its inputs.
    assert rec.window_ids == (first.window_id, second.window_id)
    assert rec.body == expected
    assert (rec.prefill_workers, rec.decode_workers) == (expected["prefill"]["workers"],
                                                         expected["decode"]["workers"])
    assert (rec.current_prefill, rec.current_decode) == (2, 2)  # the fake source's shape
    assert rec.prefill_binding == expected["prefill"]["binding"]
    assert rec.decode_utilisation == expected["decode"]["utilisation"]
    assert second.capacity is not None and f"decode {rec.decode_workers}" in second.capacity
    for role in ("prefill", "decode"):
        assert _gauge(rig.registry, "pdctl_recommended_workers", role) == rec.workers(role)
        assert _gauge(rig.registry, "pdctl_capacity_utilisation", role) == \
            expected[role]["utilisation"]
        assert _gauge(rig.registry, "pdctl_capacity_current_workers", role) == 2
    assert _gauge(rig.registry, "pdctl_last_recommendation_timestamp_seconds") == \
        rec.created_at.timestamp()

    # Not again before the interval; then again, and more load asks for more workers.
    planner.qps = 40.0
    assert (await rig.step()).recommendation_id is None
    assert (await rig.step()).recommendation_id is None
    fifth = await rig.step()
    assert fifth.recommendation_id is not None
    old, new = rig.store.recommendations()
    assert new.created_at.timestamp() - old.created_at.timestamp() == CAPACITY_INTERVAL_S
    assert new.decode_workers > old.decode_workers
    assert _gauge(rig.registry, "pdctl_recommended_workers", "decode") == new.decode_workers
    # It planned on the windows of the last interval only (capacity_interval_s / interval_s).
    stored = {w.id: w.window for w in rig.store.windows()}
    assert len(new.window_ids) == 3 and new.window_ids[-1] == fifth.window_id
    assert min(stored[i].start for i in new.window_ids) >= \
        new.created_at.timestamp() - CAPACITY_INTERVAL_S


async def test_a_failing_plan_never_fails_the_cycle(tmp_path: Path) -> None:
    planner = ScriptedPlanner(fail=True)
    rig = _rig(tmp_path, planner)
    await rig.step()
    report = await rig.step()
    assert report.result == "ok" and report.window_id is not None
    assert report.capacity is not None and "scripted planner failure" in report.capacity
    assert rig.store.recommendations() == []
    assert _gauge(rig.registry, "pdctl_capacity_plan_failures_total") == 1
    calls = len(planner.seen)
    # Retried once per capacity interval, not every cycle.
    await rig.step()
    await rig.step()
    assert len(planner.seen) == calls
    # A plan the store would refuse (non-finite utilisation) is a failed plan too, and the
    # cycle's other writes (its window) still commit.
    planner.fail, planner.nan = False, True
    report = await rig.step()
    assert report.result == "ok" and "utilisation" in (report.capacity or "")
    assert rig.store.recommendations() == []
    assert report.window_id in [w.id for w in rig.store.windows()]
    assert _gauge(rig.registry, "pdctl_capacity_plan_failures_total") == 2
    planner.nan = False
    for _ in range(3):
        report = await rig.step()
    assert len(rig.store.recommendations()) == 1
    (rec,) = rig.store.recommendations()
    assert _gauge(rig.registry, "pdctl_recommended_workers", "decode") == rec.decode_workers


async def test_a_recommendation_is_withdrawn_when_planning_keeps_failing(tmp_path: Path
                                                                         ) -> None:
    planner = ScriptedPlanner()
    rig = _rig(tmp_path, planner)
    await rig.step()
    await rig.step()
    (rec,) = rig.store.recommendations()
    planner.fail = True
    stale_after = 3 * CAPACITY_INTERVAL_S  # STALE_RECOMMENDATION_INTERVALS intervals
    while rig.clock.now() - rec.created_at.timestamp() < stale_after - INTERVAL_S:
        await rig.step()
        assert _gauge(rig.registry, "pdctl_recommended_workers", "prefill") == \
            rec.prefill_workers  # an autoscaler keeps following the last good one...
    await rig.step()
    # ...until it is stale: withdrawn, so the autoscaler holds its count.
    assert _gauge(rig.registry, "pdctl_recommended_workers", "prefill") is None
    assert (_gauge(rig.registry, "pdctl_capacity_plan_failures_total") or 0) >= 2
    planner.fail = False
    for _ in range(4):
        await rig.step()
    assert _gauge(rig.registry, "pdctl_recommended_workers", "prefill") is not None


async def test_a_restarted_leader_reexports_and_a_follower_clears(tmp_path: Path) -> None:
    planner = ScriptedPlanner()
    rig = _rig(tmp_path, planner)
    await rig.step()
    await rig.step()
    (rec,) = rig.store.recommendations()
    rig.new_cycle()  # a restart: a fresh registry, no recommendation due yet
    report = await rig.step()
    assert report.recommendation_id is None
    assert _gauge(rig.registry, "pdctl_recommended_workers", "decode") == rec.decode_workers
    assert _gauge(rig.registry, "pdctl_last_recommendation_timestamp_seconds") == \
        rec.created_at.timestamp()

    class Follower:
        holder = "other"
        term = None

        async def ensure(self) -> bool:
            return False

        def fence(self, tx: object) -> bool:
            return False

    rig.cycle.leadership = Follower()
    await rig.step()
    assert _gauge(rig.registry, "pdctl_recommended_workers", "decode") is None
    assert _gauge(rig.registry, "pdctl_capacity_utilisation", "prefill") is None


async def _recommend_more_prefill(tmp_path: Path) -> tuple[Rig, int]:
    """A bootstrapped rig whose last recommendation asks for one more prefill worker."""
    planner = ScriptedPlanner(qps=4.0)
    rig = _rig(tmp_path, planner)
    for _ in range(4):
        await rig.step()
    assert rig.store.policies(status="approved"), "no bootstrap policy"
    rec = rig.store.recommendations()[-1]
    # Script the recommendation the operator acts on: prefill 2 -> 3, decode unchanged.
    with rig.store.cycle() as tx:
        rid = tx.add_recommendation(
            window_ids=list(rec.window_ids), workers=(3, 2), current=(2, 2),
            binding=("p99 TTFT", rec.decode_binding), utilisation=(0.7, 0.5),
            body=rec.body,
        )
    return rig, rid


async def test_an_applied_recommendation_is_a_known_scaling_event(tmp_path: Path) -> None:
    rig, rid = await _recommend_more_prefill(tmp_path)
    calibrations = len(rig.store.calibrations())
    rig.source.workers["p2"] = "prefill"  # the operator applied it
    first = await rig.step()
    assert first.trigger is None  # one window at the new count: not yet confirmed
    rig.learner.fire = True  # the new shape also moves the drift statistics
    second = await rig.step()
    # Confirmed, matched, and recalibrated as the scaling it is, not as drift.
    assert second.trigger == "scaling", second.reason
    assert second.drift == ["workload"]
    cal = rig.store.calibrations()[-1]
    assert len(rig.store.calibrations()) == calibrations + 1
    assert cal.details["trigger"] == "scaling"
    assert cal.details["recommendation_id"] == rid
    assert "prefill workers 2 -> 3" in cal.details["scaling"]
    assert f"recommendation #{rid} applied" in cal.details["scaling"]
    assert rig.learner.reasons[-1] == f"scaling: {cal.details['scaling']}"  # provenance
    applied = {r.id: r.applied_at for r in rig.store.recommendations()}
    assert applied[rid] is not None and applied[rid] == cal.created_at
    # The drift that fired with it was answered by the same calibration.
    third = await rig.step()
    assert third.trigger is None


async def test_an_unrecommended_scaling_is_recalibrated_without_a_match(tmp_path: Path) -> None:
    rig, rid = await _recommend_more_prefill(tmp_path)
    assert all(r.decode_workers != 3 for r in rig.store.recommendations())
    rig.source.workers["d2"] = "decode"  # a decode worker nobody recommended
    await rig.step()
    report = await rig.step()
    assert report.trigger == "scaling", report.reason
    cal = rig.store.calibrations()[-1]
    assert cal.details["scaling"] == "decode workers 2 -> 3"
    assert "recommendation_id" not in cal.details
    assert all(r.applied_at is None for r in rig.store.recommendations())
    # Back to the shape the scripted recommendation saw: it asked for no change of decode
    # workers, so going back applies nothing either. A second scaling of decode workers so
    # soon is damped (issue 39): calibrated for once the damping period has passed.
    first_at = cal.created_at.timestamp()
    del rig.source.workers["d2"]
    for _ in range(14):
        report = await rig.step()
        if report.trigger is not None:
            break
    assert report.trigger == "scaling", report.reason
    assert rig.clock.now() - first_at >= rig.cycle.scaling_damping_s()
    assert rig.store.calibrations()[-1].details["scaling"] == "decode workers 3 -> 2"
    assert all(r.applied_at is None for r in rig.store.recommendations())
    assert rid in [r.id for r in rig.store.recommendations()]
