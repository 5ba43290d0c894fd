"""A flapping target (issue 39, class 8): one prefill worker's scrape fails for two windows,
answers for two, and so on, for 40 windows of 30 s, through real ``Cycle.run_once`` cycles
on a real SQLite store; every candidate the learner fits is rejected.

Expected: scaling recalibrations are damped to at most one per role (cause) per
``Cycle.scaling_damping_s()`` (``max(min_policy_interval_s, 10 intervals)``); a flap that
returns to the counts the last calibration saw cancels its cause; and a refused candidate
takes no version number at all (it is kept with its calibration), so the versions stay
contiguous however many candidates are refused."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

from tests.daemon.fakes import make_rig
from tests.daemon.test_cycle import _bootstrap

WINDOWS = 40


async def test_a_flapping_worker_recalibrates_at_most_once_per_damping_period(
    tmp_path: Path,
) -> None:
    rig = make_rig(tmp_path, routers=1)  # min_policy_interval_s = 0: only the damping holds
    await _bootstrap(rig)
    rig.learner.approve = False  # every candidate is rejected, as in the report
    versions_before = rig.store.next_version()
    start = rig.clock.now()
    triggers = []
    for i in range(WINDOWS):
        rig.source.down = {"p1"} if (i // 2) % 2 == 0 else set()
        report = await rig.step()
        triggers.append(report.trigger)
    elapsed = rig.clock.now() - start
    scaling = [c for c in rig.store.calibrations() if (c.details or {}).get("trigger")
               == "scaling"]
    bound = rig.cycle.scaling_damping_s()
    assert bound == 10 * rig.config.interval_s
    # One role flaps: at most one scaling recalibration per damping period (and one at once).
    assert 1 <= len(scaling) <= math.ceil(elapsed / bound) + 1, (len(scaling), triggers)
    times = sorted(c.created_at.timestamp() for c in scaling)
    assert all(b - a >= bound for a, b in itertools.pairwise(times)), times
    # Without damping: a scaling recalibration every second window.
    assert len(scaling) <= WINDOWS // 8
    # Every candidate was refused: none took a version (each had one, v3-v10, and without
    # the damping one per two windows); each is kept with its calibration, and the stored
    # versions stay contiguous.
    assert rig.store.next_version() == versions_before
    assert all(c.rejected_candidate and c.policy_version is None for c in scaling)
    assert [c.details["approved"] for c in scaling] == [False] * len(scaling)
    stored = [p.version for p in rig.store.policies()]
    assert stored == list(range(1, versions_before)), stored
    assert all(p.status == "approved" for p in rig.store.policies())


async def test_a_flap_back_to_the_calibrated_counts_cancels_its_cause(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, routers=1)
    await _bootstrap(rig)
    rig.learner.approve = False
    calls = rig.learner.calibrations
    rig.source.down = {"p1"}
    triggers = [(await rig.step()).trigger for _ in range(2)]
    assert triggers == [None, "scaling"]  # lost for two windows: calibrated for (rejected)
    assert rig.learner.calibrations == calls + 1
    rig.source.down = set()  # back for two windows: a cause, held back by the damping
    assert [(await rig.step()).trigger for _ in range(2)] == [None, None]
    rig.source.down = {"p1"}  # and gone again: the counts the last calibration saw
    later = [(await rig.step()).trigger for _ in range(14)]  # past the damping period
    assert later == [None] * 14  # the cause was cancelled, not calibrated for late
    assert rig.learner.calibrations == calls + 1
