"""Slices, rate scaling, rate events and workload switches move session starts only."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from controller.sim.workloads import (
    Phase,
    PhasedWorkload,
    RateSchedule,
    SessionSpec,
    TransformedWorkload,
    TurnSpec,
    WorkloadConfig,
    WorkloadError,
    WorkloadSwitch,
    apply_events,
    build_workload,
    switch_workload,
)


class EverySecond:
    """A session at t = 0, 1, 2, ... (n of them), each with two turns, think 5 s."""

    def __init__(self, n: int, name: str = "tick") -> None:
        self.n = n
        self.name = name

    def sessions(self, rng: random.Random) -> Iterator[SessionSpec]:
        for i in range(self.n):
            sid = f"{self.name}-{i}"
            first = TurnSpec(sid, 1, float(i), 100, 100, 10, 16, 0.0)
            second = TurnSpec(sid, 2, i + 5.0 + rng.random(), 150, 40, 10, 16, 5.0, 1)
            yield SessionSpec(sid, float(i), (first, second))


def starts(workload: object, seed: int = 0) -> list[float]:
    return [s.start_s for s in workload.sessions(random.Random(seed))]  # type: ignore[attr-defined]


def test_rate_scale_divides_starts_and_keeps_gaps_inside_sessions() -> None:
    base = list(EverySecond(20).sessions(random.Random(0)))
    scaled = list(TransformedWorkload(EverySecond(20), rate_scale=4.0).sessions(random.Random(0)))
    assert [s.start_s for s in scaled] == pytest.approx([s.start_s / 4 for s in base])
    for a, b in zip(base, scaled, strict=True):
        assert [t.think_s for t in a.turns] == [t.think_s for t in b.turns]
        gap_a = a.turns[1].arrival_s - a.turns[0].arrival_s
        gap_b = b.turns[1].arrival_s - b.turns[0].arrival_s
        assert gap_b == pytest.approx(gap_a)


def test_time_slice_keeps_sessions_starting_inside_and_shifts_them_to_zero() -> None:
    sliced = TransformedWorkload(EverySecond(20), time_slice_s=(5.0, 9.0), rate_scale=2.0)
    sessions = list(sliced.sessions(random.Random(0)))
    assert [s.session_id for s in sessions] == ["tick-5", "tick-6", "tick-7", "tick-8"]
    assert [s.start_s for s in sessions] == pytest.approx([0.0, 0.5, 1.0, 1.5])


def test_rate_scale_on_the_real_mooncake_trace_keeps_think_times() -> None:
    from tests.sim.workloads.test_mooncake import real_trace_path

    real_trace_path()
    plain = build_workload(WorkloadConfig("mooncake"))
    fast = build_workload(WorkloadConfig("mooncake", rate_scale=3.0))
    a = list(plain.sessions(random.Random(4)))
    b = list(fast.sessions(random.Random(4)))
    assert [s.session_id for s in a] == [s.session_id for s in b]
    assert b[-1].start_s == pytest.approx(a[-1].start_s / 3)
    assert [t.think_s for s in a for t in s.turns] == [t.think_s for s in b for t in s.turns]


def test_schedule_warp_integrates_the_factors() -> None:
    schedule = RateSchedule(1.0, ((10.0, 2.0), (20.0, 0.5)))
    assert schedule.factor_at(5) == 1.0 and schedule.factor_at(10) == 2.0
    assert schedule.consumed(10) == pytest.approx(10)
    assert schedule.consumed(20) == pytest.approx(30)  # 10 + 2 * 10
    assert schedule.consumed(30) == pytest.approx(35)  # + 0.5 * 10
    for t in (0.0, 3.0, 10.0, 14.0, 20.0, 27.0, 100.0):
        assert schedule.warp(schedule.consumed(t)) == pytest.approx(t)


def test_doubling_the_rate_doubles_session_starts_after_the_event() -> None:
    workload = apply_events(EverySecond(200), rate_changes=[(50.0, 2.0)])
    got = starts(workload)
    before = [t for t in got if t < 50]
    after = [t for t in got if 50 <= t < 70]
    assert len(before) == 50
    assert len(after) == 40  # two per second


def test_a_zero_factor_pauses_new_sessions() -> None:
    paused = starts(apply_events(EverySecond(100), rate_changes=[(10.0, 0.0), (30.0, 1.0)]))
    assert not [t for t in paused if 10 < t < 30]
    assert len(paused) == 100
    stopped = starts(apply_events(EverySecond(100), rate_changes=[(10.0, 0.0)]))
    assert len(stopped) == 11  # t = 0..10, nothing after


def test_switch_hands_over_at_the_event_time() -> None:
    workload = switch_workload(EverySecond(100, "a"), 30.0, EverySecond(100, "b"))
    sessions = list(workload.sessions(random.Random(1)))
    a = [s for s in sessions if "/a-" in s.session_id]
    b = [s for s in sessions if "/b-" in s.session_id]
    assert max(s.start_s for s in a) < 30 <= min(s.start_s for s in b)
    assert b[0].start_s == 30.0 and b[0].session_id == "p1/b-0"
    assert len(a) == 30
    starts_all = [s.start_s for s in sessions]
    assert starts_all == sorted(starts_all)
    # sessions of the first phase keep their later turns after the switch
    assert a[-1].turns[1].think_s == 5.0


def test_switch_with_offset_starts_inside_the_new_source() -> None:
    workload = switch_workload(EverySecond(10, "a"), 5.0, EverySecond(100, "b"), offset_s=40.0)
    b = [s for s in workload.sessions(random.Random(1)) if "/b-" in s.session_id]
    assert b[0].session_id == "p1/b-40" and b[0].start_s == 5.0


def test_rate_events_apply_inside_every_phase_at_their_own_time() -> None:
    workload = apply_events(
        EverySecond(500, "a"),
        rate_changes=[(20.0, 2.0)],
        switches=[WorkloadSwitch(10.0, EverySecond(500, "b"))],
    )
    sessions = list(workload.sessions(random.Random(1)))
    b_starts = [s.start_s for s in sessions if "/b-" in s.session_id]
    assert len([t for t in b_starts if 10 <= t < 20]) == 10
    assert len([t for t in b_starts if 20 <= t < 30]) == 20


def test_phases_are_deterministic_per_seed() -> None:
    workload = switch_workload(EverySecond(30, "a"), 10.0, EverySecond(30, "b"))
    a = list(workload.sessions(random.Random(7)))
    assert a == list(workload.sessions(random.Random(7)))
    assert a != list(workload.sessions(random.Random(8)))


def test_bad_events_are_errors_naming_the_key() -> None:
    with pytest.raises(WorkloadError, match=r"events\.factor"):
        RateSchedule(1.0, ((10.0, -1.0),))
    with pytest.raises(WorkloadError, match=r"events\.at_s"):
        RateSchedule(1.0, ((10.0, 1.0), (5.0, 2.0)))
    with pytest.raises(WorkloadError, match=r"events\.at_s"):
        apply_events(EverySecond(3), switches=[WorkloadSwitch(0.0, EverySecond(3))])
    with pytest.raises(WorkloadError, match=r"events\.at_s"):
        PhasedWorkload([Phase(0.0, EverySecond(3)), Phase(0.0, EverySecond(3))])
