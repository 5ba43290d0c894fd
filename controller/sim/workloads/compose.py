"""Time transforms and compositions of workloads: slices, rate scaling, rate events, switches.

All of them move **session start times only**; the turns inside a session keep their think
times, so "twice the rate" means twice as many conversations, not users who think twice as
fast.

- :class:`TransformedWorkload` — ``time_slice_s = (a, b)`` keeps the sessions whose start lies
  in ``[a, b)`` of the source's own time (later turns may run past ``b``) and shifts them so
  ``a`` becomes 0; then ``rate_scale`` divides start times (``2`` = twice the session rate).
- :class:`RateSchedule` — piecewise-constant factors of the base rate over *simulated* time,
  from scenario events ``{at_s, kind = "rate_scale", factor}``. Each factor replaces the
  previous one (factors of the base rate, not compounded) and multiplies the workload's own
  ``rate_scale``. Start times are warped: simulated time ``t`` has consumed
  ``F(t) = integral of factor`` seconds of the workload's own timeline, and a session at
  workload time ``s`` starts at the first ``t`` with ``F(t) >= s``. A factor of 0 pauses new
  sessions (running ones continue).
- :class:`PhasedWorkload` — scenario events ``{at_s, kind = "workload", ...}``: phase ``i``
  owns simulated time ``[at_i, at_(i+1))`` and starts the sessions its workload starts in
  that span (from the workload's ``offset_s`` on, default its beginning); sessions already
  running when a phase ends finish normally. The rate schedule is applied in every phase in
  simulated time, so an event lands exactly at its ``at_s``. Session ids get a ``p<i>/``
  prefix so the same source in two phases cannot collide; each phase draws from its own
  ``random.Random`` seeded from the caller's generator.

:func:`apply_events` builds the right composition from event lists; the simulator only
iterates the result.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from controller.sim.workloads.base import SessionSpec, Workload, WorkloadError, retime


class TransformedWorkload:
    def __init__(
        self,
        inner: Workload,
        *,
        time_slice_s: tuple[float, float] | None = None,
        rate_scale: float = 1.0,
    ) -> None:
        if not (rate_scale > 0 and math.isfinite(rate_scale)):
            raise WorkloadError(f"workload.rate_scale: must be a number > 0, got {rate_scale}")
        self.inner = inner
        self.name = inner.name
        self.time_slice_s = time_slice_s
        self.rate_scale = rate_scale

    def sessions(self, rng: random.Random) -> Iterator[SessionSpec]:
        lo, hi = self.time_slice_s or (0.0, math.inf)
        for session in self.inner.sessions(rng):
            if session.start_s < lo:
                continue
            if session.start_s >= hi:
                return
            yield retime(session, (session.start_s - lo) / self.rate_scale)


@dataclass(frozen=True)
class RateSchedule:
    """Factor of the base session rate over simulated time (``initial`` until the first change)."""

    initial: float = 1.0
    changes: tuple[tuple[float, float], ...] = ()  # (at_s, factor), at_s strictly increasing

    def __post_init__(self) -> None:
        object.__setattr__(self, "changes", tuple((float(a), float(f)) for a, f in self.changes))
        factors = [self.initial, *(f for _, f in self.changes)]
        if any(not (f >= 0 and math.isfinite(f)) for f in factors):
            raise WorkloadError(f"events.factor: rate factors must be >= 0, got {factors}")
        times = [a for a, _ in self.changes]
        if any(not (t >= 0 and math.isfinite(t)) for t in times) or any(
            b <= a for a, b in itertools.pairwise(times)
        ):
            raise WorkloadError(f"events.at_s: must be >= 0 and strictly increasing, got {times}")

    def _segments(self) -> list[tuple[float, float]]:
        """(start, factor) pieces covering [0, inf)."""
        pieces = [(0.0, self.initial)]
        for at, factor in self.changes:
            if at == 0.0:
                pieces[0] = (0.0, factor)
            else:
                pieces.append((at, factor))
        return pieces

    def factor_at(self, t: float) -> float:
        factor = self.initial
        for at, f in self.changes:
            if at > t:
                break
            factor = f
        return factor

    def consumed(self, t: float) -> float:
        """Seconds of the workload's own timeline consumed by simulated time ``t``."""
        total = 0.0
        pieces = self._segments()
        for (start, factor), (end, _) in zip(pieces, [*pieces[1:], (math.inf, 0.0)], strict=True):
            if t <= start:
                break
            total += factor * (min(t, end) - start)
        return total

    def warp(self, workload_s: float) -> float | None:
        """Simulated time at which workload time ``workload_s`` is reached (None: never)."""
        consumed = 0.0
        pieces = self._segments()
        for (start, factor), (end, _) in zip(pieces, [*pieces[1:], (math.inf, 0.0)], strict=True):
            if workload_s <= consumed:
                return start
            if factor > 0:
                reach = start + (workload_s - consumed) / factor
                if reach <= end:
                    return reach
                consumed += factor * (end - start)
        return None

    def shifted(self, origin_s: float) -> RateSchedule:
        """The schedule seen from local time 0 = simulated time ``origin_s``."""
        later = tuple((at - origin_s, f) for at, f in self.changes if at > origin_s)
        return RateSchedule(self.factor_at(origin_s), later)

    @property
    def is_identity(self) -> bool:
        return self.initial == 1.0 and all(f == 1.0 for _, f in self.changes)


class ScheduledWorkload:
    def __init__(self, inner: Workload, schedule: RateSchedule) -> None:
        self.inner = inner
        self.name = inner.name
        self.schedule = schedule

    def sessions(self, rng: random.Random) -> Iterator[SessionSpec]:
        for session in self.inner.sessions(rng):
            start = self.schedule.warp(session.start_s)
            if start is None:
                return  # the rate stays 0 from here on: no later session ever starts
            yield retime(session, start)


@dataclass(frozen=True)
class Phase:
    at_s: float  # simulated time at which this workload takes over
    workload: Workload
    offset_s: float = 0.0  # where in the workload's own timeline the phase begins


class PhasedWorkload:
    def __init__(self, phases: Sequence[Phase], schedule: RateSchedule | None = None) -> None:
        if not phases:
            raise WorkloadError("events: a phased workload needs at least one phase")
        times = [p.at_s for p in phases]
        if times[0] != 0.0 or any(b <= a for a, b in itertools.pairwise(times)):
            raise WorkloadError(
                f"events.at_s: workload switches must be > 0 and strictly increasing, "
                f"got {times[1:]}"
            )
        if any(p.offset_s < 0 for p in phases):
            raise WorkloadError("events.offset_s: must be >= 0")
        self.phases = tuple(phases)
        self.schedule = schedule or RateSchedule()
        self.name = "+".join(dict.fromkeys(p.workload.name for p in phases))

    def sessions(self, rng: random.Random) -> Iterator[SessionSpec]:
        seeds = [rng.getrandbits(64) for _ in self.phases]
        ends = [p.at_s for p in self.phases[1:]] + [math.inf]
        for index, (phase, end, seed) in enumerate(zip(self.phases, ends, seeds, strict=True)):
            local = self.schedule.shifted(phase.at_s)
            for session in phase.workload.sessions(random.Random(seed)):
                if session.start_s < phase.offset_s:
                    continue
                start = local.warp(session.start_s - phase.offset_s)
                if start is None or phase.at_s + start >= end:
                    break
                yield retime(session, phase.at_s + start, f"p{index}/{session.session_id}")


@dataclass(frozen=True)
class WorkloadSwitch:
    at_s: float
    workload: Workload
    offset_s: float = 0.0


def apply_events(
    base: Workload,
    *,
    rate_changes: Sequence[tuple[float, float]] = (),
    switches: Sequence[WorkloadSwitch] = (),
) -> Workload:
    """``base`` with scenario ``rate_scale`` events (``(at_s, factor)``) and workload switches."""
    schedule = RateSchedule(1.0, tuple(sorted(rate_changes)))
    if switches:
        ordered = sorted(switches, key=lambda s: s.at_s)
        if ordered[0].at_s <= 0:
            raise WorkloadError(
                f"events.at_s: a workload switch needs at_s > 0, got {ordered[0].at_s}"
            )
        phases = [Phase(0.0, base)] + [Phase(s.at_s, s.workload, s.offset_s) for s in ordered]
        return PhasedWorkload(phases, schedule)
    if schedule.is_identity:
        return base
    return ScheduledWorkload(base, schedule)


def switch_workload(
    current: Workload, at_s: float, new: Workload, offset_s: float = 0.0
) -> PhasedWorkload:
    """``current`` until simulated time ``at_s``, then ``new`` (from its ``offset_s``)."""
    if isinstance(current, PhasedWorkload):
        return PhasedWorkload([*current.phases, Phase(at_s, new, offset_s)], current.schedule)
    return PhasedWorkload([Phase(0.0, current), Phase(at_s, new, offset_s)])
