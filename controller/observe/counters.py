"""Counter increases between two cumulative snapshots of one target: never a rate from a
lifetime total.

For each series of a cumulative family (``_total``, ``_bucket``, ``_sum``, ``_count``):

* **a series first seen** where series of the same family and process vanished since the
  previous snapshot (a label value that changed: the new series may carry the old one's
  lifetime), or whose previous value was NaN, sets its baseline and counts nothing in this
  window, noted ``no_baseline``. A series first seen with nothing vanished beside it was
  created since the previous snapshot (a router's first request in a cell, a new process's
  first series), so all it holds is from this window: it counts from zero. A family absent
  from the previous snapshot altogether is the caller's case (``diff_snapshots``);
* **a decrease within the tolerance** (at most ``max(COUNTER_TOLERANCE_ABS,
  COUNTER_TOLERANCE_REL * previous)``) counts as no increase, noted ``counter_decrease``:
  exporters that sum floats in another order, or drift by a little, are not restarts;
* **a process restart** counts from zero: the target's ``process_start_time_seconds``
  changed (every series of the target), or, for a process whose start time is not known
  to be the same, a series of its family fell by more than the tolerance (its family's
  series of that process, decided together, so a histogram's buckets, count and sum restart
  together), noted ``counter_reset``;
* **a drop beyond the tolerance with the same ``process_start_time_seconds``** is not a
  restart: that process's family counts nothing this window, noted ``counter_decrease``
  (its value is no count since anything we know).

A process is the target, or one of its ranks (:func:`~controller.core.catalog.process_of`
labels); a target's start time says nothing about one of several ranks, so "the same start
time" rules out a restart only for a target whose family has one process.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from controller.core.catalog import process_of
from controller.core.exposition import LabelKey, Snapshot
from controller.core.window import FailureKind, TargetFailure

COUNTER_TOLERANCE_ABS = 0.01
COUNTER_TOLERANCE_REL = 1e-4
PROCESS_START = "process_start_time_seconds"
_SHOWN = 6  # families named in one note


def decrease_tolerance(previous: float) -> float:
    """The largest fall of a counter from ``previous`` that still counts as no increase."""
    return max(COUNTER_TOLERANCE_ABS, COUNTER_TOLERANCE_REL * abs(previous))


def start_time(snapshot: Snapshot) -> float | None:
    """The target's ``process_start_time_seconds`` when it exposes exactly one."""
    values = [v for v in snapshot.samples.get(PROCESS_START, {}).values() if math.isfinite(v)]
    return values[0] if len(values) == 1 else None


@dataclass
class CounterNotes:
    """What one target's diff noticed, per kind, to report once per target."""

    unbaselined: list[str] = field(default_factory=list)  # families absent before
    new_series: list[str] = field(default_factory=list)
    jitter: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # beyond tolerance, same process
    reset: list[str] = field(default_factory=list)
    restarted: bool = False

    def failures(self, target: str) -> list[TargetFailure]:
        out = []
        if self.unbaselined or self.new_series:
            parts = []
            if self.unbaselined:
                parts.append("not in the previous snapshot: " + _names(self.unbaselined))
            if self.new_series:
                parts.append("new series (their baseline is set): " + _names(self.new_series))
            out.append(TargetFailure(target, FailureKind.NO_BASELINE,
                                     "; ".join(parts) + "; counted from the next window"))
        if self.jitter or self.dropped:
            parts = []
            if self.jitter:
                parts.append("counters fell within the tolerance (counted as no increase): "
                             + _names(self.jitter))
            if self.dropped:
                parts.append("counters fell beyond the tolerance with the same "
                             f"{PROCESS_START} (not a restart; counted nothing): "
                             + _names(self.dropped))
            out.append(TargetFailure(target, FailureKind.COUNTER_DECREASE, "; ".join(parts)))
        if self.reset:
            why = f"{PROCESS_START} changed" if self.restarted else "restart?"
            out.append(TargetFailure(target, FailureKind.COUNTER_RESET, f"counters reset ({why}): "
                                     + _names(self.reset) + "; the window counts from the reset"))
        return out


def _names(items: list[str]) -> str:
    shown = sorted(set(items))
    more = f" and {len(shown) - _SHOWN} more" if len(shown) > _SHOWN else ""
    return ", ".join(shown[:_SHOWN]) + more


def _process_names(processes: set[LabelKey]) -> str:
    """`` {engine="1"}`` for the processes named; nothing when the target is one."""
    named = sorted(",".join(f'{k}="{v}"' for k, v in p) for p in processes if p)
    return " {" + "; ".join(named) + "}" if named else ""


def _classify(prev: Snapshot, cur: Snapshot, names: list[str], same_process: bool
              ) -> tuple[set[LabelKey], set[LabelKey], bool]:
    """(processes reset, processes that fell beyond the tolerance without a restart,
    whether some series fell within the tolerance) over every series of one family."""
    reset: set[LabelKey] = set()
    dropped: set[LabelKey] = set()
    jitter = False
    # The target's start time speaks for its only process, not for one of several ranks.
    single = len({process_of(labels) for name in names for labels in cur.series(name)}) <= 1
    for name in names:
        old = prev.series(name)
        for labels, value in cur.series(name).items():
            before = old.get(labels)
            if before is None or math.isnan(before) or math.isnan(value) or value >= before:
                continue
            proc = process_of(labels)
            if before - value <= decrease_tolerance(before):
                jitter = True
            elif same_process and (single or not proc):
                dropped.add(proc)
            else:
                reset.add(proc)
    return reset, dropped - reset, jitter


def family_increases(prev: Snapshot, cur: Snapshot, family: str, names: list[str],
                     notes: CounterNotes) -> dict[str, dict[LabelKey, float]]:
    """Each series name's increases (by labels) for one family, by the rules above; a name
    none of whose series counts this window is left out (no value, not a zero)."""
    before_start, now_start = start_time(prev), start_time(cur)
    restarted = before_start is not None and now_start is not None and before_start != now_start
    reset, dropped, jitter = _classify(prev, cur, names, before_start is not None
                                       and before_start == now_start)
    notes.restarted |= restarted
    if restarted or reset:
        notes.reset.append(family + ("" if restarted else _process_names(reset)))
    if dropped:
        notes.dropped.append(family + _process_names(dropped))
    if jitter:
        notes.jitter.append(family)
    renamed = _vanished(prev, cur, names)
    out: dict[str, dict[LabelKey, float]] = {}
    for name in names:
        inc, first_seen = _series_increases(prev.series(name), cur.series(name),
                                            reset, dropped, renamed, restarted)
        if first_seen:
            notes.new_series.append(family)
        if inc or not cur.series(name):
            out[name] = inc
    return out


def _vanished(prev: Snapshot, cur: Snapshot, names: list[str]) -> set[LabelKey]:
    """Processes some series of which (in this family) vanished since ``prev``."""
    out: set[LabelKey] = set()
    for name in names:
        now = cur.series(name)
        out.update(process_of(labels) for labels in prev.series(name) if labels not in now)
    return out


def _series_increases(old: Mapping[LabelKey, float], new: Mapping[LabelKey, float],
                      reset: set[LabelKey], dropped: set[LabelKey], renamed: set[LabelKey],
                      restarted: bool) -> tuple[dict[LabelKey, float], bool]:
    """Increases of one series name (a series that counts nothing is left out), and
    whether some series set its baseline. ``dropped``: processes whose counters fell
    without a restart (nothing of theirs counts); ``renamed``: processes some series of
    which vanished (their new series may carry counts from before the window)."""
    inc: dict[LabelKey, float] = {}
    first_seen = False
    for labels, value in new.items():
        if math.isnan(value):
            continue
        proc = process_of(labels)
        before = old.get(labels)
        if restarted or proc in reset:
            inc[labels] = value  # a restarted process: counted from zero
        elif proc in dropped:
            continue  # fell with no restart: its values count from nothing we know
        elif before is None and proc not in renamed:
            inc[labels] = value  # created since the previous snapshot: all from this window
        elif before is None or math.isnan(before):
            first_seen = True  # its baseline is set: counted from the next window
        else:
            inc[labels] = max(0.0, value - before)
    return inc, first_seen
