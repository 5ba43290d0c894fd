"""The control cycle in virtual time: scripted windows whose goodput follows the policy each
router runs, in-memory router agents, a SQLite store, a scripted learner."""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable
from pathlib import Path
from statistics import NormalDist
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from controller.core.rollout import (
    canary_subset,
    operator_state,
    two_proportion_z,
    watch_critical,
)
from controller.loop.canary import UNPROMOTED
from controller.loop.report import CycleReport
from controller.policy import Policy, Route, dumps, loads
from controller.rollout.agent import RouterAgent
from controller.store.kinds import ADOPTED_PREFIX
from tests.daemon.fakes import Rig, make_rig


def _desired(rig: Rig) -> dict[str, int]:
    return rig.store.desired_versions()


def _running(rig: Rig) -> dict[str, int | None]:
    return {r: (a.snapshot.version if a.snapshot else None) for r, a in rig.agents.items()}


def _metric(registry: CollectorRegistry, name: str, labels: dict[str, str] | None = None
            ) -> float | None:
    return registry.get_sample_value(name, labels or {})


async def _bootstrap(rig: Rig) -> None:
    """Windows until the first calibration puts v1 on every router."""
    for _ in range(4):
        report = await rig.step()
        assert isinstance(report, CycleReport)
        if report.approved_version == 1:
            break
    assert _running(rig) == dict.fromkeys(rig.agents, 1)


async def _until_canary(rig: Rig, done: Callable[[str], bool],
                        between: Callable[[], None] | None = None) -> CycleReport:
    """Step until a cycle's canary report satisfies ``done``; ``between`` checks the cycles
    before it."""
    for _ in range(6):
        report = await rig.step()
        if report.canary and done(report.canary):
            return report
        if between is not None:
            between()
    raise AssertionError("the canary never got there")


async def _canary_v2(rig: Rig, goodput: dict[int, float], approve_refit: bool = False
                    ) -> None:
    """Bootstrap v1, then a drift whose candidate v2 starts baking on the canary share."""
    await _bootstrap(rig)
    rig.source.goodput = goodput
    rig.learner.approve_refit = approve_refit
    rig.learner.fire = True
    assert (await rig.step()).approved_version == 2
    # baking: the fleet's version is still v1 (the gauge read the canary's v2)
    assert _metric(rig.registry, "pdctl_desired_policy_version") == 1


async def test_drift_calibrate_canary_promote_all_acked(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    assert [p.status for p in rig.store.policies()] == ["approved"]

    rig.source.goodput = {1: 0.90, 2: 0.97}
    rig.learner.fire = True
    report = await rig.step()
    assert report.drift == ["workload"] and report.trigger == "drift"
    assert report.approved_version == 2
    # The drift panel's series: the detector's statistic, and per feature its share.
    labels = {"detector": "workload"}
    assert _metric(rig.registry, "pdctl_drift_statistic", labels | {"feature": "all"}) == 2.0
    assert _metric(rig.registry, "pdctl_drift_statistic",
                   labels | {"feature": "qps"}) == pytest.approx(2.0)
    canary = canary_subset(list(rig.agents), 0.25, 2)
    assert len(canary) == 1
    assert _desired(rig) == {r: (2 if r in canary else 1) for r in rig.agents}
    assert _running(rig) == {r: (2 if r in canary else 1) for r in rig.agents}
    assert _metric(rig.registry, "pdctl_canary_state", {"state": "baking"}) == 1

    promoted = None
    for _ in range(4):
        report = await rig.step()
        if report.canary and "promoted" in report.canary:
            promoted = report
            break
        assert report.canary is not None and "baking" in report.canary
    assert promoted is not None, "the canary was never judged"
    assert _desired(rig) == dict.fromkeys(rig.agents, 2)
    assert _running(rig) == dict.fromkeys(rig.agents, 2)
    assert {r.router_id: r.acked_version for r in rig.store.routers()} == \
        dict.fromkeys(rig.agents, 2)
    events = rig.store.drift_events()
    assert [(e.kind, e.statistic > e.threshold) for e in events] == [("workload", True)]
    cals = rig.store.calibrations()
    # The bootstrap, the drift, and the canary's refit at the end of its bake: refused (the
    # scripted refit finds nothing better), kept with its calibration, no version taken.
    assert [c.policy_version for c in cals] == [1, 2, None]
    assert [c.details["trigger"] for c in cals[1:]] == ["drift", "canary"]
    assert cals[2].rejected_candidate and rig.store.policy(3) is None
    assert rig.store.next_version() == 3
    # Exactly one approval per decision: the bootstrap and the drift.
    assert [p.version for p in rig.store.policies(status="approved")] == [1, 2]
    assert _metric(rig.registry, "pdctl_policy_changes_total") == 2
    for phase in ("observe", "assess", "calibrate", "reconcile"):
        assert (_metric(rig.registry, "pdctl_job_duration_seconds_count", {"job": phase})
                or 0) >= 1, phase
    assert (_metric(rig.registry, "pdctl_cycles_total", {"result": "ok"}) or 0) >= 6


async def test_a_refit_that_beats_its_canary_bakes_in_its_place(tmp_path: Path) -> None:
    """At the end of a bake the candidate is refitted on the windows that include its own
    traffic; a refit the guardrail prefers replaces it and bakes in turn, on the next canary
    share (not refitted again). The fleet goes from v1 to v3 once, never through v2."""
    rig = make_rig(tmp_path)
    await _canary_v2(rig, {1: 0.90, 2: 0.96, 3: 0.97}, approve_refit=True)
    first_canary = canary_subset(list(rig.agents), 0.25, 2)

    def fleet_on_v1() -> None:
        assert {v for r, v in _desired(rig).items() if r not in first_canary} == {1}

    superseded = await _until_canary(rig, lambda text: "superseded" in text, fleet_on_v1)
    assert superseded.approved_version == 3 and superseded.trigger == "canary"
    v2 = rig.store.policy(2)
    assert v2 is not None and v2.status == "superseded"
    assert v2.reason.startswith("superseded by its canary refit")
    canary = canary_subset(list(rig.agents), 0.25, 3)
    assert _desired(rig) == {r: (3 if r in canary else 1) for r in rig.agents}
    assert _running(rig) == {r: (3 if r in canary else 1) for r in rig.agents}
    # The refit trained as its candidate did (the learner picks the regime by the reason).
    assert rig.learner.reasons[-1] == "drift (canary refit of v2)"
    calibrations = len(rig.store.calibrations())
    await _until_canary(rig, lambda text: "promoted" in text)
    assert _desired(rig) == dict.fromkeys(rig.agents, 3)
    assert len(rig.store.calibrations()) == calibrations  # a refit is not refitted
    assert [p.version for p in rig.store.policies(status="approved")] == [1, 3]


async def test_a_window_a_judged_router_failed_in_is_no_bake_window(tmp_path: Path) -> None:
    """The canary router's metrics failed for one window (unreachable; after a restart the
    first read only sets the baseline): the bake counts the windows it saw requests in."""
    rig = make_rig(tmp_path)
    await _canary_v2(rig, {1: 0.90, 2: 0.97})
    canary = next(r for r, v in _desired(rig).items() if v == 2)
    counts = []
    for down in ({canary}, set(), set(), set()):
        rig.source.down = down
        report = await rig.step()
        counts.append(report.canary)
        if "promoted" in (report.canary or ""):
            break
    assert "over 0 window(s)" in (counts[0] or ""), counts
    assert "over 1 window(s)" in (counts[1] or ""), counts
    bake = rig.config.judge.bake_windows
    assert f"over {bake} window(s)" in (counts[-1] or "") and "promoted" in (counts[-1] or "")
    assert len(counts) == bake + 1  # one window more than without the failure


async def test_a_daemon_restarted_mid_bake_refits_the_canary_before_promoting_it(
        tmp_path: Path) -> None:
    """The restarted source's first read (no requests seen) is no bake window: the bake
    ends a window later, and its refit runs on a complete window instead of being deferred
    while the canary is promoted without it."""
    rig = make_rig(tmp_path)
    await _canary_v2(rig, {1: 0.90, 2: 0.96})
    await rig.step()  # one of the bake's two windows
    rig.new_cycle()
    first = await rig.step()
    assert first.trigger is None and "over 1 window(s)" in (first.canary or ""), first.canary
    report = await rig.step()
    assert report.trigger == "canary" and "promoted" in (report.canary or "")
    assert "deferred" not in report.reason
    assert rig.learner.reasons[-1] == "drift (canary refit of v2)"


async def _bake_to_verdict(rig: Rig) -> CycleReport:
    return await _until_canary(rig, lambda text: "baking:" not in text)


async def test_a_refused_refit_leaves_drift_measured_as_it_was(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    await _canary_v2(rig, {1: 0.90, 2: 0.96})
    adopted = list(rig.learner.adopted)
    report = await _bake_to_verdict(rig)
    assert report.trigger == "canary" and "promoted" in (report.canary or "")
    assert rig.learner.adopted == adopted  # the refit was fitted, judged, and not adopted
    assert rig.learner.reasons[-1] == "drift (canary refit of v2)"


async def test_a_failed_refit_promotes_the_canary_and_backs_nothing_off(tmp_path: Path
                                                                        ) -> None:
    rig = make_rig(tmp_path)
    await _canary_v2(rig, {1: 0.90, 2: 0.96})
    rig.learner.fail = True
    report = await _bake_to_verdict(rig)
    assert "promoted" in (report.canary or "") and "scripted fit failure" in report.reason
    assert _desired(rig) == dict.fromkeys(rig.agents, 2)
    rig.learner.fail = False
    rig.learner.fire = True
    assert (await rig.step()).trigger == "drift"  # no FIT_RETRY_INTERVALS wait


async def test_no_refit_when_canary_refit_is_off(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, canary_refit=False)
    await _canary_v2(rig, {1: 0.90, 2: 0.96}, approve_refit=True)
    report = await _bake_to_verdict(rig)
    assert report.trigger is None and "promoted" in (report.canary or "")
    assert [c.details["trigger"] for c in rig.store.calibrations()][1:] == ["drift"]


async def test_a_canary_that_is_not_promoted_is_not_refitted(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    await _canary_v2(rig, {1: 0.90, 2: 0.55}, approve_refit=True)
    calibrations = len(rig.store.calibrations())
    for _ in range(4):
        report = await rig.step()
        if report.canary and "worse" in report.canary:
            break
    else:
        raise AssertionError("the canary was never judged")
    assert report.trigger is None and report.candidate_version is None
    assert rig.store.policy(2).status == "rolled_back"  # type: ignore[union-attr]
    assert _desired(rig) == dict.fromkeys(rig.agents, 1)
    assert len(rig.store.calibrations()) == calibrations  # no refit was fitted or recorded
    assert rig.store.next_version() == 3


async def test_a_canary_waiting_for_traffic_is_refitted_only_when_the_judge_promotes(
        tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    await _canary_v2(rig, {1: 0.90, 2: 0.96}, approve_refit=True)
    requests = rig.source.requests
    rig.source.requests = 5  # too few per window to judge: the bake waits past its windows
    waits = 0
    for _ in range(4):
        report = await rig.step()
        assert report.trigger is None, report  # waiting: no refit fitted, none recorded
        waits += "baking:" in (report.canary or "")
    assert waits == 4 and [c.details["trigger"] for c in rig.store.calibrations()][-1] == "drift"
    rig.source.requests = requests
    report = await _until_canary(rig, lambda text: "superseded" in text)
    assert report.trigger == "canary" and report.approved_version == 3


async def test_a_regressing_canary_is_rolled_back_with_its_reason(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    await _canary_v2(rig, {1: 0.90, 2: 0.55})
    canary = canary_subset(list(rig.agents), 0.25, 2)
    await _until_canary(rig, lambda text: "worse" in text)
    v2 = rig.store.policy(2)
    assert v2 is not None and v2.status == "rolled_back"
    assert "canary worse than control" in v2.reason and "z " in v2.reason
    assert _desired(rig) == dict.fromkeys(rig.agents, 1)
    # The canary router was sent back to v1 by a rollback push, not a re-issue.
    assert _running(rig) == dict.fromkeys(rig.agents, 1)
    assert rig.store.next_version() == 3
    assert all(r in rig.agents for r in canary)
    assert _metric(rig.registry, "pdctl_canary_state", {"state": "rolled_back"}) == 1
    assert _metric(rig.registry, "pdctl_rollbacks_total", {"by": "canary"}) == 1


async def _promote_v2(rig: Rig) -> float:
    """v2 bakes on the canary share, beats control and is promoted: the promotion's time."""
    await _canary_v2(rig, {1: 0.90, 2: 0.97})
    await _until_canary(rig, lambda text: "promoted" in text)
    v2 = rig.store.policy(2)
    assert v2 is not None and v2.promoted_at is not None
    assert v2.promoted_at.timestamp() == rig.clock.now()
    assert _desired(rig) == dict.fromkeys(rig.agents, 2)
    return rig.clock.now()


async def test_a_promotion_that_overloads_the_fleet_is_rolled_back(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rig = make_rig(tmp_path)
    await _promote_v2(rig)
    # v2's routes were fine for the canary's share; for every router they overload a pool.
    rig.source.goodput = {1: 0.90, 2: 0.40}
    report = await rig.step()
    assert report.canary is not None and "rolled back after promotion to v1" in report.canary
    v2 = rig.store.policy(2)
    assert v2 is not None and v2.status == "rolled_back"
    assert v2.reason.startswith(UNPROMOTED)
    # Bake: three control routers at 0.90 and the canary at 0.97.
    assert "fleet goodput 0.4000 of 800 requests over 1 window(s) since the promotion vs " \
        "0.9175 of 1600 over the bake's 2" in v2.reason
    assert _desired(rig) == dict.fromkeys(rig.agents, 1)
    assert _running(rig) == dict.fromkeys(rig.agents, 1)
    assert _metric(rig.registry, "pdctl_canary_state", {"state": "rolled_back"}) == 1
    assert [_metric(rig.registry, "pdctl_rollbacks_total", {"by": by})
            for by in ("canary", "watch", "operator")] == [0, 1, 0]
    assert _metric(rig.registry, "pdctl_desired_policy_version") == 1
    assert rig.store.next_version() == 3  # the refit refused at the end of the bake took none
    from controller.cli.ops_cmd import _print_status, status_doc

    rig.learner.fire = True  # a later candidate: the newest policy is no longer v2
    await rig.step()
    doc = status_doc(rig.store, None, None)
    assert doc["last_rollback"]["version"] == 2
    assert "rolled back after promotion: fleet goodput 0.4000" in doc["last_rollback"]["reason"]
    _print_status(doc)
    assert "rollback v2 at " in capsys.readouterr().out


async def test_the_watch_keeps_a_promotion_when_the_load_rose_and_ends_after_its_windows(
        tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    await _promote_v2(rig)
    rig.source.goodput = {1: 0.90, 2: 0.40}
    rig.source.requests *= 2  # twice the bake's request rate: the load explains the fall
    reports = [await rig.step() for _ in range(3)]
    assert [r.canary.split(":")[1].strip() for r in reports if r.canary] == \
        ["watching the promotion", "watching the promotion", "kept after the promotion"]
    assert "the request rate rose 100%: not the policy's doing" in (reports[-1].canary or "")
    rig.source.requests /= 2  # the same fall at the bake's rate, once the watch is over
    for _ in range(2):  # the watch's windows counted, then its time
        report = await rig.step()
        assert report.canary is None
    v2 = rig.store.policy(2)
    assert v2 is not None and v2.status == "approved"
    assert _desired(rig) == dict.fromkeys(rig.agents, 2)


async def test_each_look_of_the_watch_spends_a_share_of_its_alpha(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    await _promote_v2(rig)
    rig.source.goodput = {1: 0.90, 2: 0.785}  # just over the allowed drop of 0.1
    # One window (800 requests) against the bake's 0.9175 of 1600: significant at alpha
    # for a single test, not at alpha / 3 for each of the watch's three looks.
    z = two_proportion_z(0.785 * 800, 800, 0.9175 * 1600, 1600, 0.1)
    assert z is not None and watch_critical(0.05, 3) < z < NormalDist().inv_cdf(0.05)
    report = await rig.step()
    assert report.canary is not None and "watching the promotion" in report.canary
    report = await rig.step()  # twice the requests: now below the per-look bound
    assert report.canary is not None and UNPROMOTED in report.canary
    assert f"< {watch_critical(0.05, 3):.2f}" in report.canary
    assert _desired(rig) == dict.fromkeys(rig.agents, 1)


def test_the_watch_bound_is_bonferroni_over_its_looks() -> None:
    assert watch_critical(0.05, 1) == pytest.approx(-1.6449, abs=1e-4)
    assert watch_critical(0.05, 3) == pytest.approx(-2.1280, abs=1e-4)
    assert watch_critical(0.05, 0) == watch_critical(0.05, 1)  # no watch: never a zero division


async def test_a_restarted_daemon_goes_on_watching_a_promotion(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    await _promote_v2(rig)
    await rig.step()  # one good window under watch
    rig.new_cycle()  # the watch lives in the store (promoted_at), not in the process
    rig.source.goodput = {1: 0.90, 2: 0.40}
    # The restarted source's first read only sets its baseline: no look of the watch.
    first = await rig.step()
    assert first.canary is not None and "over 1 window(s) since the promotion" in first.canary
    report = await rig.step()
    assert report.canary is not None and UNPROMOTED in report.canary
    assert "over 2 window(s) since the promotion" in report.canary
    assert _desired(rig) == dict.fromkeys(rig.agents, 1)


async def test_one_router_failing_a_window_leaves_it_a_look_of_the_watch(
        tmp_path: Path) -> None:
    """Only a window no router answered in (a restart's first read) is no look: in a large
    fleet one router often fails a scrape, and the watch would then see no window."""
    rig = make_rig(tmp_path)
    await _promote_v2(rig)
    rig.source.down = {"r0"}
    report = await rig.step()
    assert "over 1 window(s) since the promotion" in (report.canary or ""), report.canary


async def test_failed_observes_do_not_stretch_the_watch(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    await _promote_v2(rig)
    for _ in range(4):  # the watch's time passes without a window
        rig.source.fail_next = True
        assert (await rig.step()).result == "skipped"
    rig.source.goodput = {1: 0.90, 2: 0.40}
    report = await rig.step()
    assert report.window_id is not None and report.canary is None
    assert _desired(rig) == dict.fromkeys(rig.agents, 2)


async def test_the_watch_rolls_nothing_back_while_an_operator_holds(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    await _promote_v2(rig)
    rig.store.add_request("pause", {"what": "approvals"}, "bob@h", "change freeze")
    rig.source.goodput = {1: 0.90, 2: 0.40}
    report = await rig.step()
    assert report.canary is not None and report.canary.endswith("the operator holds")
    v2 = rig.store.policy(2)
    assert v2 is not None and v2.status == "approved"
    assert _desired(rig) == dict.fromkeys(rig.agents, 2)
    rig.store.add_request("resume", {"what": "approvals"}, "bob@h", "freeze over")
    report = await rig.step()  # the watch's last window: the fall is still there
    assert report.canary is not None and UNPROMOTED in report.canary
    assert _desired(rig) == dict.fromkeys(rig.agents, 1)


async def test_a_promotion_rolled_back_counts_as_a_change_for_the_change_limit(
        tmp_path: Path) -> None:
    rig = make_rig(tmp_path, min_policy_interval_s=150.0)
    await _bootstrap(rig)
    rig.source.goodput = {1: 0.90, 2: 0.97}
    rig.learner.fire = True
    for _ in range(15):  # v2 waits out v1's change limit, bakes and is promoted
        report = await rig.step()
        if report.canary and "promoted" in report.canary:
            break
    assert _desired(rig) == dict.fromkeys(rig.agents, 2)
    rig.source.goodput = {1: 0.90, 2: 0.40}
    report = await rig.step()
    assert report.canary is not None and UNPROMOTED in report.canary
    rolled_back_at = rig.clock.now()
    v2 = rig.store.policy(2)
    assert v2 is not None and rolled_back_at - v2.created_at.timestamp() < 150.0
    rig.learner.fire = True
    approved_at = None
    for _ in range(10):
        report = await rig.step()
        if report.approved_version is not None:
            approved_at = rig.clock.now()
            break
    assert approved_at is not None and approved_at - rolled_back_at >= 150.0


async def test_restart_and_rollback_restore_the_reference_last_renewed_for_the_policy(
        tmp_path: Path) -> None:
    # v1 from calibration 1; calibration 2, refused on the windows since a change alone,
    # renews v1's reference (v1 was judged on the new traffic and kept). A restart, and a
    # rollback from a regressing canary v3 back to v1, restore calibration 2's reference,
    # not calibration 1's: that one would fire the drift already judged again.
    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    rig.learner.approve, rig.learner.regime_only, rig.learner.fire = False, True, True
    report = await rig.step()
    assert report.trigger == "drift" and report.approved_version is None
    renewal = rig.store.calibrations()[-1]
    # the refused candidate took no version: kept with the calibration that renewed v1
    assert renewal.policy_version is None and renewal.rejected_candidate
    assert renewal.details["reference_for"] == 1
    first = rig.store.calibration_for(1)
    assert first is not None and first.details["reference_for"] == 1
    rig.learner.restored.clear()
    rig.new_cycle()
    await rig.step()
    assert rig.learner.restored == [2]
    rig.source.goodput = {1: 0.90, 2: 0.55}
    rig.learner.approve, rig.learner.regime_only, rig.learner.fire = True, False, True
    assert (await rig.step()).approved_version == 2
    await _until_canary(rig, lambda text: "worse" in text)
    assert _desired(rig) == dict.fromkeys(rig.agents, 1)
    await rig.step()
    assert rig.learner.restored == [2, 2]


async def test_failed_observe_skips_the_cycle_and_pushes_nothing(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    applies, windows = rig.applies(), len(rig.store.windows())
    rig.source.fail_next = True
    rig.learner.fire = True  # would fire if there were a window
    report = await rig.step()
    assert report.result == "skipped"
    assert "observe failed" in report.reason and "scripted observe failure" in report.reason
    assert len(rig.store.windows()) == windows
    assert rig.applies() == applies
    assert [p.version for p in rig.store.policies()] == [1]
    assert _metric(rig.registry, "pdctl_cycles_total", {"result": "skipped"}) == 1


async def test_incomplete_window_and_failed_fit_never_approve(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    rig.source.down = {"r3"}
    rig.learner.fire = True
    report = await rig.step()
    assert report.trigger is None and "deferred" in report.reason and "r3" in report.reason
    rig.source.down = set()
    rig.learner.fail = True
    rig.learner.fire = True
    report = await rig.step()
    assert report.trigger == "drift" and "scripted fit failure" in report.reason
    assert [p.version for p in rig.store.policies()] == [1]
    assert _running(rig) == dict.fromkeys(rig.agents, 1)
    # A failed fit is not retried every cycle...
    calls = rig.learner.calibrations
    rig.learner.fail = False
    rig.learner.fire = True
    assert (await rig.step()).trigger is None
    # ...but an operator can ask for one at once.
    rig.store.add_request("recalibrate", {}, "ops@h", "the fit is fixed")
    report = await rig.step()
    assert report.trigger == "operator" and report.approved_version == 2
    assert rig.learner.calibrations == calls + 1


async def test_an_empty_store_adopts_the_policy_every_router_runs(tmp_path: Path) -> None:
    """Nothing stored, every router on one policy of its own: it becomes the fleet's
    policy without a push, the first table is judged against it and goes to a canary, not
    approved unchecked to every router at once; adopting is not a change the limit
    counts."""
    rig = make_rig(tmp_path, min_policy_interval_s=300.0)
    own = Policy.uniform(7, Route.PREFILL_NODE, exploration=0.1)
    for agent in rig.agents.values():
        assert agent.apply(own).outcome.name == "APPLIED"
    first = await rig.step()
    adopted = rig.store.policy(7)
    assert adopted is not None and adopted.status == "approved"
    assert adopted.reason.startswith(ADOPTED_PREFIX) and adopted.checksum == own.checksum
    assert "adopted the routers' policy as v7" in first.reason, first.reason
    assert _desired(rig) == dict.fromkeys(rig.agents, 7)
    assert not [c for c in rig.transport.calls if c[0] == "apply"]
    report = first
    for _ in range(4):
        if report.approved_version is not None:
            break
        report = await rig.step()
    assert rig.learner.judged_against == [7]
    assert report.approved_version == 8, report.reason
    assert report.canary and report.canary.startswith("baking v8 on"), report.canary
    assert sorted(_desired(rig).values()).count(8) == 1  # one router of four


async def test_routers_on_different_policies_adopt_nothing(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    for i, agent in enumerate(rig.agents.values()):
        agent.apply(Policy.uniform(1 + (i == 0), Route.PREFILL_NODE))
    first = await rig.step()
    assert "no running policy adopted: the routers run different policies" in first.reason
    assert rig.store.policies() == []
    report = first
    for _ in range(4):
        if report.approved_version is not None:
            break
        report = await rig.step()
    # The first table, unchecked, to every router at once (re-issued above the router ahead).
    assert rig.learner.judged_against == [None]
    assert report.canary == "no previous policy: every router at once", report.canary
    assert len(set(_running(rig).values())) == 1


def _cycle_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    lines = [r.getMessage() for r in caplog.records if r.name == "pdctl.cycle"
             and r.getMessage().startswith("cycle ")]
    caplog.clear()
    return lines


@pytest.mark.parametrize("advisory", [False, True])
async def test_the_text_log_says_what_each_cycle_did(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, advisory: bool) -> None:
    """`pdctl run` logs plain text by default (the systemd unit, the Kubernetes manifests):
    a cycle that deferred, calibrated, approved or pushed says so in its line, not only in
    the JSON log's fields; a quiet cycle is one short line."""
    caplog.set_level(logging.INFO, logger="pdctl.cycle")
    rig = make_rig(tmp_path, advisory=advisory)
    await rig.step()
    assert _cycle_lines(caplog) == ["cycle ok"]  # one window: nothing to do yet
    rig.source.down = {"r3"}
    rig.learner.fire = True
    await rig.step()
    (line,) = _cycle_lines(caplog)
    assert "calibration (drift) deferred" in line and "r3" in line, line
    assert "drift: workload" in line, line
    rig.source.down = set()
    report = await rig.step()
    (line,) = _cycle_lines(caplog)
    version = report.candidate_version
    assert version is not None
    status = "advisory" if advisory else "approved"
    assert f"recalibration (drift): v{version} {status}, guardrail approved" in line, line
    if advisory:
        assert "push" not in line and "canary" not in line, line
    else:
        assert f"push(es); acked: r0 v{version}" in line, line
        assert "canary no previous policy" in line, line


async def test_a_target_gone_for_good_is_lost_capacity_not_missing_data(tmp_path: Path
                                                                         ) -> None:
    rig = make_rig(tmp_path, routers=1)  # no canary: each approval is promoted at once
    await _bootstrap(rig)
    calls = rig.learner.calibrations
    rig.source.down = {"p1"}  # a prefill worker dies and stays dead
    first = await rig.step()
    assert first.trigger is None and rig.learner.calibrations == calls  # one failure: wait
    second = await rig.step()
    # Failing two windows in a row: gone. The capacity change triggers a calibration on
    # windows that are complete but for the dead worker.
    assert second.trigger == "scaling", second.reason
    assert rig.learner.calibrations == calls + 1
    assert second.approved_version == 2
    # A transient failure of another target still defers.
    rig.source.down = {"p1", "d0"}
    rig.learner.fire = True
    report = await rig.step()
    assert report.trigger is None and "deferred" in report.reason and "d0" in report.reason
    rig.source.down = {"p1"}
    report = await rig.step()  # the drift was remembered; this window is usable again
    assert report.trigger == "drift" and report.approved_version == 3


@pytest.mark.parametrize("restart", [False, True])
async def test_a_scaling_held_back_by_the_change_limit_is_calibrated_for_later(
        tmp_path: Path, restart: bool) -> None:
    """A worker scaled away within the limit is calibrated for once the limit allows, by a
    restarted daemon too: it counts workers from the last calibration's windows."""
    rig = make_rig(tmp_path, routers=1, min_policy_interval_s=300.0)
    await _bootstrap(rig)
    del rig.source.workers["p1"]
    for _ in range(2):  # confirmed after two windows, held back by the limit
        assert (await rig.step()).trigger is None
    if restart:
        rig.new_cycle()
    first = rig.store.policy(1)
    assert first is not None
    for _ in range(12):
        report = await rig.step()
        if report.trigger is not None:
            break
    assert report.trigger == "scaling"
    assert rig.learner.reasons[-1] == "scaling: prefill workers 2 -> 1"
    assert rig.clock.now() - first.created_at.timestamp() >= 300.0


async def test_too_few_complete_windows_defer_a_calibration_without_the_fit_back_off(
    tmp_path: Path,
) -> None:
    """At start-up the first windows may each miss a target (not scraped yet): a cause
    found then (here the prefill count settling) waits for data; it is not a failed fit that
    backs off for FIT_RETRY_INTERVALS (found by the end-to-end test on Prometheus)."""
    rig = make_rig(tmp_path)
    rig.source.down = {"p1"}  # the first window counts one prefill worker
    assert (await rig.step()).trigger is None
    rig.source.down = {"d0"}  # the second misses a decode worker: unusable too
    assert (await rig.step()).trigger is None
    rig.source.down = set()
    third = await rig.step()  # prefill 1 → 2 for two windows: a scaling cause
    assert third.trigger == "scaling" and third.approved_version is None
    assert "deferred: only 1 complete window(s) stored" in third.reason
    assert rig.learner.calibrations == 0 and rig.store.calibrations() == []
    assert not _metric(rig.registry, "pdctl_recalibrations_total", {"trigger": "scaling"})
    fourth = await rig.step()  # two complete windows now: the cause is acted on at once
    assert fourth.trigger == "scaling" and fourth.approved_version == 1, fourth.reason
    assert rig.learner.calibrations == 1
    assert _running(rig) == dict.fromkeys(rig.agents, 1)


async def test_a_refused_drift_calibration_goes_to_the_learner_and_is_not_retried_on_a_timer(
    tmp_path: Path,
) -> None:
    """The learner keeps the running policy's workload reference when a candidate is refused
    (CoreLearner: tests/daemon/test_drift_reference.py), so a shift that persists fires
    again by itself after the cooldown; the cycle calibrates when drift fires, not on a
    timer (a one-off retry 8 windows later added approvals on gains of 0.006-0.015 in the
    bench, issue 7)."""
    from controller.loop.learning import MIN_REGIME_WINDOWS

    rig = make_rig(tmp_path, routers=1)
    await _bootstrap(rig)
    rig.learner.approve = False
    rig.learner.fire = True
    refused = await rig.step()
    assert refused.trigger == "drift" and refused.approved_version is None
    assert rig.learner.adopted[-1] is False, "the refused outcome reaches the learner"
    calls = rig.learner.calibrations
    for _ in range(2 * MIN_REGIME_WINDOWS):
        assert (await rig.step()).trigger is None
    assert rig.learner.calibrations == calls
    rig.learner.approve = True
    rig.learner.fire = True  # the same shift, measured against the kept reference
    again = await rig.step()
    assert again.trigger == "drift" and again.approved_version == 2  # the refusal took none
    assert [c.details["trigger"] for c in rig.store.calibrations()][1:] == ["drift", "drift"]


async def test_windows_whose_outcomes_count_no_requests_are_not_trained_on(
    tmp_path: Path,
) -> None:
    """At start-up Prometheus reports the routers' counters before they move: outcome rows
    with zero requests. They are no data to learn from (the real fit refuses them and the
    cycle backed off), so the first calibration waits for windows with requests."""
    rig = make_rig(tmp_path)
    rig.source.requests = 0.0
    for _ in range(3):
        report = await rig.step()
        assert report.approved_version is None
    assert rig.learner.calibrations == 0
    assert "deferred" in report.reason or report.trigger is None, report.reason
    rig.source.requests = 200.0
    await _bootstrap(rig)
    assert rig.learner.trained_on[0] >= 2 and rig.learner.calibrations == 1


async def test_guardrail_rejection_is_recorded_and_pushes_nothing(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    applies = rig.applies()
    rig.learner.approve = False
    rig.learner.fire = True
    report = await rig.step()
    # Refused: no version taken; the candidate is kept with its calibration.
    assert report.candidate_version is None and report.approved_version is None
    assert report.candidate_status == "rejected" and rig.store.policy(2) is None
    assert rig.store.next_version() == 2
    kept = rig.store.calibration(report.calibration_id)  # type: ignore[arg-type]
    assert kept is not None and kept.rejected_candidate and kept.policy_version is None
    assert "rejected" in kept.details["reason"]
    assert f"rejected, kept with calibration #{kept.id} (no version)" in report.summary()
    assert rig.applies() == applies
    assert _metric(rig.registry, "pdctl_guardrail_decisions_total",
                   {"decision": "rejected"}) == 1


async def test_a_new_leader_applies_a_request_its_killed_predecessor_claimed(
        tmp_path: Path) -> None:
    """SIGKILL right after a claim: the next leader's first cycle applies the request, not
    one five minutes (request_stale_after_s) later."""
    from controller.loop.leader import LeaseLeadership

    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    dead = LeaseLeadership(rig.store, rig.clock, "dead", ttl_s=15.0)
    assert await dead.ensure()
    rid = rig.store.add_request("pause", {}, "alice@host", "maintenance")
    assert rig.store.claim_next_request("dead").id == rid  # type: ignore[union-attr]
    rig.clock.advance(16)  # its lease ran out
    rig.cycle.leadership = LeaseLeadership(rig.store, rig.clock, "next", ttl_s=15.0)
    report = await rig.step()
    assert report.leader
    req = rig.store.request(rid)
    assert req is not None and req.status == "done" and req.claimed_by == "next"
    assert operator_state(rig.store.requests()).paused


async def test_pause_and_resume(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    rid = rig.store.add_request("pause", {}, "alice@host", "maintenance")
    await rig.step()
    req = rig.store.request(rid)
    assert req is not None and req.status == "done" and "paused" in (req.outcome or "")
    assert operator_state(rig.store.requests()).paused
    assert _metric(rig.registry, "pdctl_paused") == 1
    applies = rig.applies()
    rig.learner.fire = True
    report = await rig.step()
    assert report.trigger is None and report.approved_version is None
    # Paused means no pushes either: a router that lost its policy stays behind.
    rig.agents["r0"].apply(rig.agents["r0"].snapshot.policy.with_version(9))  # type: ignore[union-attr]
    await rig.step()
    assert rig.applies() == applies and _running(rig)["r0"] == 9

    rig.store.add_request("resume", {}, "alice@host", "done")
    await rig.step()
    assert not operator_state(rig.store.requests()).paused
    assert rig.applies() > applies
    rig.learner.fire = True
    assert (await rig.step()).approved_version is not None
    who = [(r.kind, r.who, r.reason) for r in rig.store.requests()]
    assert who == [("pause", "alice@host", "maintenance"), ("resume", "alice@host", "done")]


async def test_pin_holds_a_version_until_unpinned(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, canary_fraction=1.0, bake_windows=1)
    await _bootstrap(rig)
    rig.learner.fire = True
    await rig.step()
    for _ in range(3):
        await rig.step()
    assert _desired(rig) == dict.fromkeys(rig.agents, 2)

    assert _metric(rig.registry, "pdctl_desired_policy_version") == 2
    rig.store.add_request("pause", {"what": "pin", "version": 1}, "bob@h", "incident")
    await rig.step()
    assert _desired(rig) == dict.fromkeys(rig.agents, 1)
    assert _running(rig) == dict.fromkeys(rig.agents, 1)
    assert operator_state(rig.store.requests()).pinned == 1
    # what the fleet desires (it read 2, the pin's version never reached it)
    assert _metric(rig.registry, "pdctl_desired_policy_version") == 1
    assert _metric(rig.registry, "pdctl_pinned") == 1
    rig.learner.fire = True
    assert (await rig.step()).approved_version is None
    bad = rig.store.add_request("pause", {"what": "pin", "version": 42}, "bob@h", "")
    await rig.step()
    failed = rig.store.request(bad)
    assert failed is not None and failed.status == "failed" and "no such version" in str(
        failed.outcome)
    rig.store.add_request("resume", {"what": "pin"}, "bob@h", "incident over")
    await rig.step()
    assert operator_state(rig.store.requests()).pinned is None
    rig.learner.fire = True
    # The refused refit of v2's canary is kept with its calibration: it took no version.
    assert (await rig.step()).approved_version == 3


@pytest.mark.parametrize("args", [
    {"what": "pin", "version": 2**64},
    {"what": "pin", "version": "v1"},
    {"version": 2**64},  # rollback
    {"version": -3},
    {"what": "pin", "version": 1.5},  # it pinned v1
])
async def test_a_request_naming_no_possible_version_fails_alone(
        tmp_path: Path, args: dict[str, Any]) -> None:
    """Stored by hand or by a pdctl without the bound: looked up, 2**64 raised (SQLite's
    OverflowError, PostgreSQL's bigint out of range) and failed the cycle's whole write,
    its window included, each time the request was claimed again."""
    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    kind = "pause" if "what" in args else "rollback"
    rid = rig.store.add_request(kind, args, "bob@h", "typo")
    windows = len(rig.store.windows())
    report = await rig.step()
    assert report.result == "ok", report.reason
    assert len(rig.store.windows()) == windows + 1
    request = rig.store.request(rid)
    assert request is not None and request.status == "failed"
    assert "not a policy version" in str(request.outcome)
    assert _desired(rig) == dict.fromkeys(rig.agents, 1)


def test_a_version_argument_names_an_integral_version_or_none() -> None:
    from controller.core.rollout import version_arg

    assert [version_arg(v) for v in (3, "3", 3.0, 2**63 - 1)] == [3, 3, 3, 2**63 - 1]
    # JSON's 1e400 loads as inf (int() raised OverflowError and failed the cycle's write)
    for bad in (math.inf, -math.inf, math.nan, 2.7, True, None, "v3", 0, 2**63):
        assert version_arg(bad) is None, bad


async def test_a_decision_whose_commit_failed_is_counted_once_when_it_is_retried(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The drift event and the approval were counted inside the write transaction: a failed
    commit left them counted, and the retry next cycle counted them again."""
    from controller.store import StoreUnavailable
    from controller.store.repository import Tx

    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    names = ("pdctl_policy_changes_total", "pdctl_drift_events_total")

    def counted() -> tuple[float, float]:
        return (_metric(rig.registry, names[0]) or 0.0,
                _metric(rig.registry, names[1], {"detector": "workload"}) or 0.0)

    before = counted()
    stored = Tx.add_calibration

    def lost_at_commit(self: Tx, *args: Any, **kwargs: Any) -> Any:
        stored(self, *args, **kwargs)
        raise StoreUnavailable("server closed the connection unexpectedly")

    monkeypatch.setattr(Tx, "add_calibration", lost_at_commit)
    rig.learner.fire = True
    failed = await rig.step()
    assert failed.result == "failed" and rig.store.drift_events() == []
    assert counted() == before
    monkeypatch.setattr(Tx, "add_calibration", stored)
    rig.learner.fire = True  # the scripted learner fires once per setting
    retried = await rig.step()
    assert retried.result == "ok" and retried.approved_version == 2
    assert len(rig.store.drift_events()) == 1
    assert counted() == (before[0] + 1, before[1] + 1)


async def test_fallback_prefill_reaches_every_router_at_once(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    rig.store.add_request("rollback", {"to": "fallback-prefill"}, "carol@h", "kv link down")
    report = await rig.step()
    version = rig.store.next_version() - 1
    assert _running(rig) == dict.fromkeys(rig.agents, version)
    policy = rig.agents["r0"].snapshot.policy  # type: ignore[union-attr]
    assert set(policy.table.routes) == {Route.PREFILL_NODE}
    assert any("fallback" in r for r in report.requests)
    state = operator_state(rig.store.requests())
    assert state.fallback and state.holding
    assert _metric(rig.registry, "pdctl_pinned") == 1  # a fallback holds: it read 0
    assert _metric(rig.registry, "pdctl_desired_policy_version") == version
    rig.learner.fire = True
    assert (await rig.step()).approved_version is None


async def test_exploration_off_reissues_without_exploration(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    assert any(rig.agents["r0"].snapshot.policy.table.exploration)  # type: ignore[union-attr]
    rig.store.add_request("pause", {"what": "exploration"}, "dan@h", "measure cleanly")
    await rig.step()
    for agent in rig.agents.values():
        assert agent.snapshot is not None and not any(agent.snapshot.policy.table.exploration)
    assert operator_state(rig.store.requests()).exploration_off


async def test_a_rollback_while_exploration_is_off_does_not_turn_it_back_on(
    tmp_path: Path,
) -> None:
    """`exploration off` re-issued v1 as v2 without exploration. A rollback from v2 to v1
    would change nothing but the exploration the operator turned off: without a version
    there is nothing to roll back to, and to v1 by name v1 is re-issued without it."""
    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    rig.store.add_request("pause", {"what": "exploration"}, "dan@h", "measure cleanly")
    await rig.step()
    assert _desired(rig) == dict.fromkeys(rig.agents, 2)
    nothing = rig.store.add_request("rollback", {}, "dan@h", "")
    await rig.step()
    req = rig.store.request(nothing)
    assert req is not None and req.status == "failed" and req.outcome == "nothing to roll back to"
    named = rig.store.add_request("rollback", {"version": 1}, "dan@h", "")
    await rig.step()
    req = rig.store.request(named)
    assert req is not None and req.status == "done"
    assert req.outcome == "rolled back to v1, re-issued without exploration as v3"
    assert _running(rig) == dict.fromkeys(rig.agents, 3)
    for agent in rig.agents.values():
        assert agent.snapshot is not None and not any(agent.snapshot.policy.table.exploration)
    assert rig.store.policy(2).status == "rolled_back"  # type: ignore[union-attr]
    assert operator_state(rig.store.requests()).exploration_off


async def test_a_reissue_above_a_manually_pushed_router_skips_stored_versions(
    tmp_path: Path,
) -> None:
    """`pdctl push` put v2 on r0 while the store holds v2 and v3 as rejected candidates.
    The re-issue of v1's table above r0 must not be numbered 3: storing it failed the cycle
    after the router had applied it, and the push went unrecorded."""
    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    other = Policy.uniform(2, Route.DECODE_LOCAL)
    for version in (2, 3):
        rejected = other.with_version(version)
        rig.store.add_policy(version, rejected.checksum, dumps(rejected), "rejected", "worse")
    rig.agents["r0"].apply(other)  # the manual push
    report = await rig.step()
    assert report.result == "ok", report.reason
    assert _desired(rig) == dict.fromkeys(rig.agents, 4)
    assert _running(rig) == dict.fromkeys(rig.agents, 4)
    record = rig.store.policy(4)
    assert record is not None and record.status == "approved"
    assert record.checksum == rig.store.policy(1).checksum  # type: ignore[union-attr]
    assert [(p.router_id, p.version) for p in rig.store.pushes()
            if p.version == 4 and p.result == "ok"]  # recorded


async def test_a_window_no_target_answered_in_skips_the_cycle(tmp_path: Path) -> None:
    """Every worker and router down: the cycle is skipped (no successful-cycle timestamp,
    no window stored, no scaling event planned for), and the routers are still reconciled."""
    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    windows = len(rig.store.windows())
    stamp = _metric(rig.registry, "pdctl_last_cycle_success_timestamp_seconds")
    rig.source.down = set(rig.agents) | set(rig.source.workers)
    report = await rig.step()
    assert report.result == "skipped"
    assert "no target answered (8 failed" in report.reason
    assert len(rig.store.windows()) == windows
    assert rig.store.recommendations() == []
    assert _metric(rig.registry, "pdctl_last_cycle_success_timestamp_seconds") == stamp
    rig.source.down = set()
    assert (await rig.step()).result == "ok"


async def test_a_resume_with_nothing_held_says_so(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    outcomes = []
    for kind, what in (("resume", "pin"), ("resume", "approvals"), ("resume", "exploration"),
                       ("pause", "approvals"), ("resume", "approvals")):
        rid = rig.store.add_request(kind, {"what": what}, "dan@h", "")
        await rig.step()
        req = rig.store.request(rid)
        assert req is not None and req.status == "done"
        outcomes.append(req.outcome)
    assert outcomes == ["nothing was pinned (no change)", "was not paused (no change)",
                        "exploration was on (no change)",
                        "paused: no approvals and no pushes until resume", "resumed"]


async def test_operator_rollback_and_recalibrate(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, canary_fraction=1.0, bake_windows=1)
    await _bootstrap(rig)
    rig.learner.approve = False  # only a forced approval gets through
    rid = rig.store.add_request("recalibrate", {"force": True}, "erin@h", "new hardware")
    report = await rig.step()
    assert report.trigger == "operator" and report.approved_version == 2
    forced = rig.store.calibration_for(2)
    assert forced is not None and forced.details["approved"] is True
    req = rig.store.request(rid)
    assert req is not None and req.status == "done"
    dry = rig.store.add_request("recalibrate", {"dry_run": True}, "erin@h", "just looking")
    await rig.step()
    assert rig.store.request(dry).status == "done"  # type: ignore[union-attr]
    assert rig.store.next_version() == 3  # a dry run stores no policy
    for _ in range(2):
        await rig.step()
    rig.store.add_request("rollback", {}, "erin@h", "regression seen by users")
    await rig.step()
    assert _desired(rig) == dict.fromkeys(rig.agents, 1)
    assert _running(rig) == dict.fromkeys(rig.agents, 1)
    assert rig.store.policy(2).status == "rolled_back"  # type: ignore[union-attr]
    assert _metric(rig.registry, "pdctl_rollbacks_total", {"by": "operator"}) == 1


def _fail_next_write(rig: Rig) -> None:
    """The next cycle's write transaction fails at its commit (a PostgreSQL failover,
    SQLite's lock held by a compaction): nothing it wrote is stored."""
    from contextlib import contextmanager

    from controller.store import StoreUnavailable

    real_cycle, real_write = rig.store.cycle, rig.cycle._write

    @contextmanager
    def failing_commit():  # type: ignore[no-untyped-def]
        with real_cycle() as tx:
            yield tx
            raise StoreUnavailable("database error: database is locked")

    def write(*args: object, **kwargs: object) -> None:
        rig.store.cycle = failing_commit  # type: ignore[method-assign]
        try:
            real_write(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            del rig.store.cycle
            del rig.cycle._write

    rig.cycle._write = write  # type: ignore[method-assign]


async def test_a_failed_write_gives_back_the_requests_it_claimed(tmp_path: Path) -> None:
    """The operator's pause was claimed by a cycle whose write then failed: it waited
    request_stale_after_s (five minutes) while cycles went on unpaused and could push."""
    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    pause = rig.store.add_request("pause", {}, "alice@ops", "incident")
    _fail_next_write(rig)
    failed = await rig.step()
    assert failed.result == "failed" and "database is locked" in (failed.reason or "")
    assert rig.store.request(pause).status == "pending"  # type: ignore[union-attr]
    again = await rig.step()  # the next cycle, not five minutes later
    assert again.result == "ok" and any(r.startswith(f"pause#{pause}") for r in again.requests)
    assert rig.store.request(pause).status == "done"  # type: ignore[union-attr]


async def test_a_failed_write_keeps_the_drift_its_calibration_answered(tmp_path: Path) -> None:
    """A drift held back by a pause is calibrated for after the resume, and that cycle's
    write fails: the decision had cleared the pending drift, so it was never calibrated
    for (its event was stored; only a restart would have read it again)."""
    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    rig.store.add_request("pause", {}, "alice@ops", "incident")
    await rig.step()
    rig.learner.fire = True
    held = await rig.step()
    assert held.drift == ["workload"] and held.trigger is None
    rig.store.add_request("resume", {}, "alice@ops", "incident over")
    await rig.step()  # resumed (the requests of a cycle act after its trigger is chosen)
    calibrations = len(rig.store.calibrations())
    _fail_next_write(rig)
    failed = await rig.step()
    assert failed.result == "failed" and failed.trigger == "drift"
    assert len(rig.store.calibrations()) == calibrations  # nothing of it stored
    again = await rig.step()
    assert again.result == "ok" and again.trigger == "drift"
    assert len(rig.store.calibrations()) == calibrations + 1


async def test_a_table_whose_write_failed_is_never_served_from_memory(tmp_path: Path) -> None:
    """The policy cache took the candidate inside the write that failed. Another leader
    then stored a different table under that version; back as leader, this replica found
    the router's checksum differing from its cached one and re-issued its own uncommitted
    table (possibly a rejected candidate) as approved."""
    from controller.policy import loads

    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    first = rig.cycle
    rig.learner.route, rig.learner.fire = Route.DECODE_LOCAL, True
    _fail_next_write(rig)
    assert (await rig.step()).result == "failed"  # v2 (decode-local) never stored
    rig.new_cycle()  # another replica leads
    rig.learner.route, rig.learner.fire = Route.PREFILL_NODE, True
    for _ in range(3):
        if (await rig.step()).approved_version == 2:
            break
    assert loads(rig.store.policy(2).body_json).table.routes[0] is Route.PREFILL_NODE  # type: ignore[union-attr]
    rig.cycle = first  # the first replica leads again
    await rig.step()
    stored = {p.version: loads(p.body_json).table.routes[0] for p in rig.store.policies()}
    assert Route.DECODE_LOCAL not in {route for v, route in stored.items() if v >= 2}
    running = [a.snapshot.policy for a in rig.agents.values()]
    assert all(p.table.routes[0] is Route.PREFILL_NODE  # type: ignore[union-attr]
               for p in running if p.version >= 2)  # type: ignore[union-attr]


async def test_restart_does_not_repush_an_acknowledged_version(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    await rig.step()
    applies, policies = rig.applies(), len(rig.store.policies())
    rig.new_cycle()
    for _ in range(3):
        report = await rig.step()
        assert report.result == "ok" and report.pushes == 0
    assert rig.applies() == applies
    assert len(rig.store.policies()) == policies
    assert _metric(rig.registry, "pdctl_router_acked_version", {"router": "r1"}) == 1


@pytest.mark.parametrize("restart", [False, True])
async def test_policy_change_limit_defers_automatic_approvals(tmp_path: Path,
                                                              restart: bool) -> None:
    rig = make_rig(tmp_path, min_policy_interval_s=300.0)
    await _bootstrap(rig)
    first = rig.store.policy(1)
    assert first is not None
    rig.learner.fire = True
    report = await rig.step()
    assert report.drift == ["workload"]
    assert report.approved_version is None and report.trigger is None
    if restart:
        rig.new_cycle()  # the stored drift event is still pending for the restarted daemon
    # The drift is remembered, and acted on once the limit allows: no new drift needed.
    approved_at = None
    for _ in range(15):
        report = await rig.step()
        if report.approved_version is not None:
            assert report.trigger == "drift" and report.approved_version == 2
            approved_at = rig.clock.now()
            break
    assert approved_at is not None
    assert approved_at - first.created_at.timestamp() >= 300.0


async def test_a_drift_led_by_the_kv_link_is_not_held_back_by_the_change_limit(
        tmp_path: Path) -> None:
    """The limit holds back the model's second thoughts; a slower link is measured
    directly and calibrated for at once."""
    rig = make_rig(tmp_path, min_policy_interval_s=300.0)
    await _bootstrap(rig)
    rig.learner.fire = True  # a model's drift, within the limit: deferred
    report = await rig.step()
    assert report.drift == ["workload"] and report.trigger is None
    rig.learner.fire = rig.learner.measured = True  # the link's, a window later
    report = await rig.step()
    assert report.trigger == "drift" and report.approved_version == 2
    first = rig.store.policy(1)
    assert first is not None and rig.clock.now() - first.created_at.timestamp() < 300.0


@pytest.mark.parametrize("regime_only,restart", [(False, False), (True, False),
                                                  (False, True)])
async def test_a_refused_link_calibration_is_tried_once_more_on_the_new_links_windows(
        tmp_path: Path, regime_only: bool, restart: bool) -> None:
    """Calibrated at the link's detection, a refused candidate trained across the change:
    once, MIN_REGIME_WINDOWS intervals later, the cycle calibrates again without a new
    drift, a restarted daemon too (the retry is in the calibration's record). Not when the
    refusal was already judged on the windows since the change alone."""
    from controller.loop.learning import MIN_REGIME_WINDOWS

    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    rig.learner.approve, rig.learner.regime_only = False, regime_only
    rig.learner.fire = rig.learner.measured = True
    report = await rig.step()
    assert report.trigger == "drift" and report.approved_version is None
    refused_at = rig.clock.now()
    if restart:
        rig.new_cycle()
    triggers = []
    for _ in range(2 * MIN_REGIME_WINDOWS):
        report = await rig.step()
        if report.trigger is not None:
            triggers.append((rig.clock.now() - refused_at, report.trigger))
    assert triggers == ([] if regime_only else [(MIN_REGIME_WINDOWS * 30.0, "drift")])


async def test_a_restart_keeps_a_link_drift_held_by_the_operator_and_drops_a_voided_one(
        tmp_path: Path) -> None:
    """A drift stored while approvals are paused is pending after a restart, as the KV
    link's it was (the change limit does not hold it back); one stored before the last
    calibration is not."""
    rig = make_rig(tmp_path, min_policy_interval_s=300.0)
    await _bootstrap(rig)
    rig.store.add_request("pause", {}, "alice@host", "maintenance")
    await rig.step()
    rig.learner.fire = rig.learner.measured = True
    assert (await rig.step()).drift == ["workload"]
    rig.new_cycle()
    rig.store.add_request("resume", {}, "alice@host", "done")
    assert (await rig.step()).trigger is None  # the resume is applied after the decision
    report = await rig.step()
    assert report.trigger == "drift" and report.approved_version == 2
    first = rig.store.policy(1)
    assert first is not None and rig.clock.now() - first.created_at.timestamp() < 300.0
    await _until_canary(rig, lambda text: "promoted" in text)
    for _ in range(3):  # that drift was calibrated for: it is not pending again
        rig.new_cycle()
        assert (await rig.step()).trigger is None


async def test_a_restart_after_a_bake_drops_the_drift_seen_during_it(tmp_path: Path) -> None:
    """Routers ran two policies while the canary baked: its drift said nothing about the
    fleet's policy and was void then, and stays void for a daemon restarted after the
    promotion (here with no refit calibration to mark the bake's end)."""
    rig = make_rig(tmp_path, canary_refit=False)
    await _canary_v2(rig, {1: 0.90, 2: 0.97})
    rig.learner.fire = True
    report = await rig.step()
    assert report.drift == ["workload"] and report.trigger is None
    await _until_canary(rig, lambda text: "promoted" in text)
    calibrations = rig.learner.calibrations
    rig.new_cycle()
    for _ in range(3):
        assert (await rig.step()).trigger is None
    assert rig.learner.calibrations == calibrations


async def test_another_calibration_cancels_the_link_retry(tmp_path: Path) -> None:
    from controller.loop.learning import MIN_REGIME_WINDOWS

    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    rig.learner.approve = False
    rig.learner.fire = rig.learner.measured = True
    await rig.step()
    calibrations = rig.learner.calibrations
    rig.learner.fire = True  # a workload drift two windows later: calibrated for, refused
    await rig.step()
    await rig.step()
    assert rig.learner.calibrations == calibrations + 1
    for _ in range(2 * MIN_REGIME_WINDOWS):
        report = await rig.step()
        assert report.trigger is None


async def test_advisory_mode_records_candidates_and_pushes_nothing(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, advisory=True)
    for _ in range(4):
        await rig.step()
    assert rig.applies() == 0
    assert [p.status for p in rig.store.policies()] == ["advisory"]
    assert _desired(rig) == {}


def test_two_proportion_z() -> None:
    assert two_proportion_z(50, 100, 90, 100, 0.02) < -5  # type: ignore[operator]
    assert two_proportion_z(90, 100, 90, 100, 0.02) > 0  # type: ignore[operator]
    assert two_proportion_z(0, 0, 9, 10, 0.0) is None


@pytest.mark.parametrize("n,expected", [(1, 1), (2, 1), (4, 1), (5, 2), (8, 2), (16, 4)])
def test_canary_subset_size(n: int, expected: int) -> None:
    routers = [f"r{i}" for i in range(n)]
    got = canary_subset(routers, 0.25, 7)
    assert len(got) == min(expected, max(n - 1, 1)) and set(got) <= set(routers)


class _Follower:
    holder = "follower"
    term = None

    async def ensure(self) -> bool:
        return False

    def fence(self, tx: object) -> bool:
        return False


async def test_a_replica_that_stops_leading_withdraws_its_router_versions(tmp_path: Path
                                                                       ) -> None:
    """A standalone replica that lost leadership stops reconciling: its last
    pdctl_router_*_version values stayed on /metrics for as long as it ran (caught mid-push,
    desired above acked: a router that looks stuck behind). A sidecar keeps its own."""
    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    await rig.step()
    assert _metric(rig.registry, "pdctl_router_acked_version", {"router": "r1"}) == 1
    leading = rig.cycle.leadership
    rig.cycle.leadership = _Follower()  # type: ignore[assignment]
    report = await rig.step()
    assert not report.leader
    for name in ("pdctl_router_acked_version", "pdctl_router_desired_version"):
        assert _metric(rig.registry, name, {"router": "r1"}) is None
    rig.cycle.leadership = leading
    await rig.step()  # leading again: reconciled and exported again
    assert _metric(rig.registry, "pdctl_router_desired_version", {"router": "r1"}) == 1

    rig.cycle.reconcile_only = ["r1"]  # a sidecar follower still reconciles its router
    rig.cycle.leadership = _Follower()  # type: ignore[assignment]
    await rig.step()
    assert _metric(rig.registry, "pdctl_router_acked_version", {"router": "r1"}) == 1


async def test_followers_reconcile_only_their_own_router_in_sidecar_mode(tmp_path: Path
                                                                         ) -> None:
    from controller.loop.cycle import Cycle
    from controller.loop.metrics import ControllerMetrics
    from controller.rollout.reconciler import Reconciler

    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    rig.store.add_request("rollback", {"to": "fallback-prefill"}, "ops@h", "")
    # The leader is gone before it acts on it; two followers: standalone and sidecar.

    def follower(only: list[str] | None) -> Cycle:
        return Cycle(clock=rig.clock, source=rig.source, store=rig.store, learner=rig.learner,
                     reconciler=Reconciler(rig.transport, rig.clock, max_attempts=1),
                     metrics=ControllerMetrics(CollectorRegistry()), routers=list(rig.agents),
                     config=rig.config, leadership=_Follower(), reconcile_only=only)

    with rig.store.cycle() as tx:  # what the leader would have written
        for r in rig.agents:
            tx.set_desired(r, 1)
    applies = rig.applies()
    windows = len(rig.store.windows())
    report = await follower(None).run_once()
    assert not report.leader and report.pushes == 0 and rig.applies() == applies
    assert len(rig.store.windows()) == windows  # followers neither observe nor store
    rig.agents["r2"].apply(rig.agents["r2"].snapshot.policy.with_version(7))  # type: ignore[union-attr]
    rig.agents["r3"].apply(rig.agents["r3"].snapshot.policy.with_version(7))  # type: ignore[union-attr]
    report = await follower(["r2"]).run_once()
    # r2 was found ahead at a version the store never issued (a restored backup): its
    # desired policy is re-issued above it. r3 belongs to another sidecar: left alone.
    assert report.acked == {"r2": 8} and _running(rig)["r3"] == 7
    reissued = rig.store.policy(8)
    assert reissued is not None and "re-issued" in reissued.reason
    assert rig.store.desired_versions()["r2"] == 8
    assert rig.store.request(1) is not None and rig.store.request(1).status == "pending"  # type: ignore[union-attr]


class _Toggle:
    """Leadership that tests hand over by setting ``leading``; ``unreachable``: ``ensure``
    raises, as PgAdvisoryLeadership's does while its lock's server cannot be reached."""

    def __init__(self, holder: str, leading: bool, term: int = 1) -> None:
        self.holder, self.leading, self.unreachable, self.term = holder, leading, False, term

    async def ensure(self) -> bool:
        if self.unreachable:
            from controller.store import StoreUnavailable
            raise StoreUnavailable("cannot take the leader lock: server unreachable")
        return self.leading

    def fence(self, tx: object) -> bool:
        return self.leading


async def test_windows_tile_time_when_leadership_moves_between_replicas(tmp_path: Path
                                                                        ) -> None:
    from controller.loop.cycle import Cycle
    from controller.loop.metrics import ControllerMetrics
    from controller.rollout.reconciler import Reconciler

    rig = make_rig(tmp_path)
    a, b = _Toggle("a", True), _Toggle("b", False)

    def replica(lead: _Toggle) -> Cycle:
        return Cycle(clock=rig.clock, source=rig.source, store=rig.store, learner=rig.learner,
                     reconciler=Reconciler(rig.transport, rig.clock, max_attempts=1),
                     metrics=ControllerMetrics(CollectorRegistry()), routers=list(rig.agents),
                     config=rig.config, leadership=lead)

    ca, cb = replica(a), replica(b)
    step = rig.config.interval_s
    # a -> b -> a, one cycle each per step. While b leads, a's lock server is out of reach
    # meanwhile: a's ensure() raised, so a kept counting itself the leader and, leading
    # again, continued from its own last window, over b's.
    for leader, cut in (("a", False), ("a", False), ("b", True), ("b", True), ("a", False),
                        ("a", False)):
        a.leading, b.leading, a.unreachable = leader == "a", leader == "b", cut
        rig.clock.advance(step)
        await ca.run_once()
        await cb.run_once()
    spans = [(s.window.start, s.window.end) for s in rig.store.windows()]
    assert len(spans) == 6
    # each window starts where the one before it ended: none overlaps, none leaves a gap
    assert all(prev[1] == nxt[0] for prev, nxt in itertools.pairwise(spans))
    assert all(end - start == step for start, end in spans)

    # a's lease expired during a long cycle: b took it (term 2), stored windows and left;
    # a's next ensure() took a new term (3). a never saw itself not leading, and continued
    # from its own last window, over b's.
    b.leading, b.term = True, 2
    for _ in range(2):
        rig.clock.advance(step)
        await cb.run_once()
    b.leading, a.term = False, 3
    rig.clock.advance(step)
    await ca.run_once()
    spans = [(s.window.start, s.window.end) for s in rig.store.windows()]
    assert len(spans) == 9
    assert all(prev[1] == nxt[0] for prev, nxt in itertools.pairwise(spans)), spans[-4:]

    # A replica that starts after an outage longer than an interval begins one interval back.
    rig.clock.advance(10 * step)
    a.leading = True
    await replica(a).run_once()
    start, end = (lambda w: (w.start, w.end))(rig.store.windows()[-1].window)
    assert end - start == step


async def test_a_new_leader_acts_on_the_drift_its_predecessor_held_back_once(
        tmp_path: Path) -> None:
    """Replica a sees a drift the change limit holds back and loses the lead; b calibrates
    for it once the limit allows; a, leading again, does not calibrate for it a second
    time from what it remembered."""
    from controller.loop.cycle import Cycle
    from controller.loop.metrics import ControllerMetrics
    from controller.rollout.reconciler import Reconciler

    rig = make_rig(tmp_path, routers=1, min_policy_interval_s=300.0)
    a, b = _Toggle("a", True), _Toggle("b", False)
    replicas = {lead.holder: Cycle(
        clock=rig.clock, source=rig.source, store=rig.store, learner=rig.learner,
        reconciler=Reconciler(rig.transport, rig.clock, max_attempts=1),
        metrics=ControllerMetrics(CollectorRegistry()), routers=list(rig.agents),
        config=rig.config, leadership=lead) for lead in (a, b)}

    async def step(leader: str) -> CycleReport:
        a.leading, b.leading = leader == "a", leader == "b"
        rig.clock.advance(rig.config.interval_s)
        reports = {k: await c.run_once() for k, c in replicas.items()}
        return reports[leader]

    for _ in range(4):
        if (await step("a")).approved_version == 1:
            break
    rig.learner.fire = True
    assert (await step("a")).trigger is None  # held back by the limit
    triggers = [(await step("b")).trigger for _ in range(12)]
    assert triggers.count("drift") == 1
    assert [(await step("a")).trigger for _ in range(12)] == [None] * 12


async def test_a_store_outage_is_one_warning_line_per_cycle_not_a_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A temporary failure (the store down) is retried next cycle: one WARNING summary line
    naming it. A traceback each cycle (17 a minute at 3 s cycles) flooded an outage's log;
    a bug (any other exception) keeps its traceback."""

    from controller.store import StoreUnavailable

    rig = make_rig(tmp_path)
    await rig.step()

    def down() -> Any:
        raise StoreUnavailable("the database could not be reached: connection refused")

    real = rig.store.cycle
    rig.store.cycle = down  # type: ignore[method-assign]
    caplog.set_level(logging.INFO, logger="pdctl")
    report = await rig.step()
    assert report.result == "failed" and "StoreUnavailable" in (report.reason or "")
    lines = [r for r in caplog.records if r.name.startswith("pdctl")]
    assert [r.levelno for r in lines if r.getMessage().startswith("cycle ")] == [logging.WARNING]
    assert not any(r.exc_info for r in lines), [r.getMessage() for r in lines]

    def broken() -> Any:
        raise RuntimeError("a bug")

    caplog.clear()
    rig.store.cycle = broken  # type: ignore[method-assign]
    assert (await rig.step()).result == "failed"
    assert any(r.exc_info for r in caplog.records if r.name.startswith("pdctl"))
    rig.store.cycle = real  # type: ignore[method-assign]
    assert (await rig.step()).result == "ok"


async def test_routers_that_replaced_every_earlier_one_are_adopted_on_a_store_with_history(
    tmp_path: Path,
) -> None:
    """A redeploy under new addresses: no configured router has a desired version, though
    the store holds the old fleet's. Their running policy is adopted (under the store's next
    version when its own is taken) and the next table is judged against it and canaried;
    before, adoption ran only on an empty store, and the first table went unchecked to
    every router at once."""
    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    old_next = rig.store.next_version()
    for i in range(4, 8):  # the new routers, all on one policy of their own as v1
        rig.agents[f"r{i}"] = RouterAgent(router_id=f"r{i}", clock=rig.clock)
    for i in range(4):
        del rig.agents[f"r{i}"]
    rig.transport.agents = dict(rig.agents)  # it holds its own copy
    own = Policy.uniform(1, Route.PREFILL_NODE, exploration=0.1)
    for agent in rig.agents.values():
        assert agent.apply(own).outcome.name == "APPLIED"
    rig.new_cycle()
    first = await rig.step()
    assert f"adopted the routers' policy as v{old_next} (it ran as v1)" in first.reason, \
        first.reason
    adopted = rig.store.policy(old_next)
    assert adopted is not None and adopted.status == "approved"
    assert "the controller found no configured router with a desired version" in adopted.reason
    assert {r: v for r, v in _desired(rig).items() if r in rig.agents} == \
        dict.fromkeys(rig.agents, old_next)
    report = first
    for _ in range(4):
        if report.approved_version is not None:
            break
        rig.learner.fire = True
        report = await rig.step()
    assert rig.learner.judged_against[-1] == old_next
    assert report.canary and report.canary.startswith("baking"), report.canary


async def test_a_canary_a_pin_took_off_its_routers_is_never_rolled_back_to(
        tmp_path: Path) -> None:
    """Pinning v1 while v2 baked left v2 approved though it never ran on the fleet: a later
    `pdctl rollback` (no version) went to it. It is rolled back by the pin now."""
    rig = make_rig(tmp_path)
    await _canary_v2(rig, {1: 0.90, 2: 0.96})
    pin = rig.store.add_request("pause", {"what": "pin", "version": 1}, "ops", "incident")
    report = await rig.step()
    assert _desired(rig) == dict.fromkeys(rig.agents, 1)
    v2 = rig.store.policy(2)
    assert v2 is not None and v2.status == "rolled_back" and v2.promoted_at is None
    assert v2.reason == f"dropped from its bake by pause#{pin}: pinned v1 on every router"
    assert _metric(rig.registry, "pdctl_canary_state", {"state": "rolled_back"}) == 1
    assert report.canary is None
    rig.store.add_request("resume", {"what": "pin"}, "ops", "")
    rig.store.add_request("pause", {"what": "exploration"}, "ops", "")  # v1 re-issued as v3
    await rig.step()
    assert _desired(rig) == dict.fromkeys(rig.agents, 3)
    back = rig.store.add_request("rollback", {}, "ops", "")
    await rig.step()
    req = rig.store.request(back)
    # v3 is v1 without exploration: nothing older differs but the dropped v2, passed over
    assert req is not None and req.outcome == "nothing to roll back to", req


async def test_a_canary_is_not_judged_while_paused(tmp_path: Path) -> None:
    """A promotion is a push: paused, the judge waits (the log said `paused: no pushes;
    canary v9: promoted` and the watch then judged a fleet that had not received v9)."""
    rig = make_rig(tmp_path)
    await _canary_v2(rig, {1: 0.90, 2: 0.97})
    rig.store.add_request("pause", {}, "ops", "freeze")
    for _ in range(rig.config.judge.bake_windows + 1):
        report = await rig.step()
        assert report.canary is not None and "not judged while paused" in report.canary
    assert rig.store.policy(2).promoted_at is None  # type: ignore[union-attr]
    assert _metric(rig.registry, "pdctl_canary_state", {"state": "baking"}) == 1
    # the canary routers' gauges say what the store says while no push runs
    canary = next(r for r, v in _desired(rig).items() if v == 2)
    assert _metric(rig.registry, "pdctl_router_desired_version", {"router": canary}) == 2
    rig.store.add_request("resume", {}, "ops", "")
    report = await rig.step()
    assert "promoted" in (report.canary or ""), report.canary
    assert _running(rig) == dict.fromkeys(rig.agents, 2)


async def test_exploration_off_covers_a_candidate_approved_in_the_same_cycle(
        tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    rig.learner.fire = True  # a drift's candidate, approved in the cycle the request lands
    rig.store.add_request("pause", {"what": "exploration"}, "ops", "")
    report = await rig.step()
    assert report.approved_version is not None
    for version in set(_desired(rig).values()):
        body = rig.store.policy(version).body_json  # type: ignore[union-attr]
        assert not any(loads(body).table.exploration), version
    for agent in rig.agents.values():
        assert agent.snapshot is not None and not any(agent.snapshot.policy.table.exploration)


async def test_a_restart_mid_bake_exports_the_canary_as_baking(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    await _canary_v2(rig, {1: 0.90, 2: 0.96})
    rig.new_cycle()
    await rig.step()
    assert _metric(rig.registry, "pdctl_canary_state", {"state": "baking"}) == 1


async def test_a_rollback_to_the_version_every_router_runs_changes_nothing(
        tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    rid = rig.store.add_request("rollback", {"version": 1}, "ops", "")
    await rig.step()
    req = rig.store.request(rid)
    assert req is not None and req.status == "done"
    assert req.outcome == "v1 already runs on every router (no change)"
    assert _metric(rig.registry, "pdctl_rollbacks_total", {"by": "operator"}) == 0
    assert rig.store.policy(1).status == "approved"  # type: ignore[union-attr]


async def test_a_refit_whose_bake_a_pin_ended_says_why_it_was_not_stored(
        tmp_path: Path) -> None:
    """The refit ran before the cycle's pin was applied: it is only recorded, and the log
    and `pdctl status` said "dry run" (none was asked for) and "approved vNone"."""
    from controller.cli.ops_cmd import status_doc

    rig = make_rig(tmp_path)
    await _canary_v2(rig, {1: 0.90, 2: 0.96}, approve_refit=True)
    await rig.step()  # one of the bake's two windows: the next one's verdict promotes
    rig.store.add_request("pause", {"what": "pin", "version": 1}, "ops", "incident")
    report = await rig.step()
    assert report.trigger == "canary" and report.candidate_version is None
    assert ("not stored (the refit of v2, which an operator action in this cycle kept from "
            "its promotion)") in report.summary()
    cal = status_doc(rig.store, None, None, list(rig.agents))["last_calibration"]
    assert cal["policy_version"] is None
    assert cal["not_stored"].startswith("the refit of v2, which an operator action")


async def test_why_observation_failed_is_on_metrics(tmp_path: Path) -> None:
    """The metrics source down and a worker down looked the same on /metrics (a skipped
    cycle), and a window with failed targets counted only as ok."""
    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    rig.source.down = {"p0"}
    await rig.step()
    rig.source.down = set()
    rig.source.fail_next = True
    await rig.step()
    assert _metric(rig.registry, "pdctl_observe_failures_total", {"kind": "unreachable"}) == 1
    assert _metric(rig.registry, "pdctl_observe_failures_total", {"kind": "source"}) == 1
    assert _metric(rig.registry, "pdctl_observe_failures_total", {"kind": "stale"}) == 0


async def test_a_fleet_version_re_issued_mid_bake_is_not_taken_for_the_canary(
        tmp_path: Path) -> None:
    """A fleet router found ahead mid-bake (a restored backup, a manual push) gets the fleet
    table re-issued above it, under a number above the canary's: read as the newest
    approved version, the old fleet table was baked as the candidate, and the candidate
    judged as the fleet."""
    from controller.loop.policies import read_rollout

    rig = make_rig(tmp_path)
    await _canary_v2(rig, {1: 0.90, 2: 0.96})
    canary = canary_subset(list(rig.agents), 0.25, 2)
    fleet = sorted(set(rig.agents) - set(canary))
    ahead = rig.agents[fleet[0]]
    ahead.apply(ahead.snapshot.policy.with_version(7))  # type: ignore[union-attr]
    report = await rig.step()
    desired = _desired(rig)
    reissued = desired[fleet[0]]
    assert reissued > 7 and {desired[r] for r in fleet} == {reissued}
    assert {desired[r] for r in canary} == {2}
    with rig.store.read() as tx:
        rollout = read_rollout(tx, list(rig.agents))
    assert (rollout.fleet_version, rollout.canary_version) == (reissued, 2)
    assert rollout.canary_routers == tuple(canary)
    assert report.canary is None or "baking" in report.canary or "promoted" in report.canary
    for _ in range(6):  # the bake goes on, judging v2 against the re-issued fleet table
        report = await rig.step()
        if report.canary and "promoted" in report.canary:
            break
    assert report.canary is not None and "v2" in report.canary and "promoted" in report.canary
    assert _desired(rig) == dict.fromkeys(rig.agents, 2)


async def test_a_canary_gone_without_a_verdict_reads_idle(tmp_path: Path) -> None:
    """The state gauges are set inside the write, where the metrics object only queues
    updates: the read of the current state there was a queued call, never "baking", so a
    canary gone without its own verdict kept reading baking."""
    rig = make_rig(tmp_path)
    await _canary_v2(rig, {1: 0.90, 2: 0.96})
    assert _metric(rig.registry, "pdctl_canary_state", {"state": "baking"}) == 1
    with rig.store.cycle() as tx:  # every router back on v1 (an operator's hand)
        for r in rig.agents:
            tx.set_desired(r, 1)
    await rig.step()
    assert _metric(rig.registry, "pdctl_canary_state", {"state": "baking"}) == 0
    assert _metric(rig.registry, "pdctl_canary_state", {"state": "idle"}) == 1
