"""Issue 7's goals over a set of runs, as the figures variants of the adaptive loop are
compared by.

A run is one scenario replayed with one seed. Its static policies and oracle come from a
committed ``summary.json`` (``results/bench*/``); its adaptive policy either from the same
file or from an adaptive-only replay (``benchmarks/bench_adaptive.py``), which draws the same
workload and so meets the same static policies.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from controller.bench.runner import STATIC

# The evaluation's goal: adaptation within 3 control intervals of each event.
ADAPTATION_INTERVALS = 3
# Events that change the cluster rather than its traffic. The performance detector sees them
# within a window or two; a table for a workload shift waits for windows of the new traffic
# (``controller.loop.learning.MIN_REGIME_WINDOWS``), so the two are counted apart.
CLUSTER_EVENTS = frozenset({"remove_worker", "add_worker", "link_bandwidth"})


@dataclass(frozen=True, slots=True)
class AdaptiveRun:
    """What the goals need of one adaptive run."""

    goodput: float
    phases: tuple[float, ...]  # goodput per phase
    approved_at_s: tuple[float, ...]  # approvals after the starting policy
    adaptation_s: tuple[float | None, ...]  # per event
    rolled_back_at_s: tuple[float, ...] = ()  # promotions the watch undid: changes too
    # Per phase, goodput from adaptive's first approval in it ("once it has adapted"); None
    # for a replay, whose approvals differ from the committed run's spans.
    adapted_phases: tuple[float, ...] | None = None

    @property
    def changed_at_s(self) -> tuple[float, ...]:
        """Every change of the fleet's policy after the start."""
        return tuple(sorted(self.approved_at_s + self.rolled_back_at_s))

    @staticmethod
    def from_summary(doc: Mapping[str, Any]) -> AdaptiveRun:
        """The adaptive entry of a ``pdctl bench run`` summary."""
        a = doc["policies"]["adaptive"]
        controller = a.get("controller", {})
        approvals = controller.get("approved_at_s", [])
        adapted = [p.get("adapted_goodput") for p in a["phases"]]
        return AdaptiveRun(float(a["goodput"]), tuple(float(p["goodput"]) for p in a["phases"]),
                           tuple(float(t) for t in approvals[1:]),
                           tuple(a.get("adaptation_s") or ()),
                           tuple(float(t) for t in controller.get("rolled_back_at_s", [])),
                           None if None in adapted else tuple(float(g) for g in adapted))

    @staticmethod
    def from_replay(doc: Mapping[str, Any]) -> AdaptiveRun:
        """One line of ``bench_adaptive.py`` (approvals there exclude the starting policy)."""
        return AdaptiveRun(float(doc["goodput"]), tuple(float(g) for g in doc["phases"]),
                           tuple(float(t) for t in doc["approved_at_s"]),
                           tuple(doc.get("adaptation_s") or ()),
                           tuple(float(t) for t in doc.get("rolled_back_at_s", [])))


@dataclass(frozen=True, slots=True)
class GoalFigures:
    runs: int
    goodput_sum: float
    above_every_static: int  # runs where adaptive beat every static policy over the run
    lowest_phase: float | None  # adaptive − that phase's best static policy, worst phase
    phases_below: int  # phases more than 0.01 under their best static policy
    changes: int
    phases: int
    multi_change_phases: int  # phases holding more than one approval
    adaptations: int  # events followed by an approval before the next event
    fast_adaptations: int  # of them within ADAPTATION_INTERVALS control intervals
    oracle_ratio_min: float | None
    cluster_adaptations: int = 0  # adaptations after one of CLUSTER_EVENTS
    fast_cluster_adaptations: int = 0
    # The per-phase goal over each phase from adaptive's first approval in it; None when a
    # run lacks those figures (a replay, or a summary from before they were recorded).
    lowest_adapted_phase: float | None = None
    adapted_phases_below: int | None = None

    def line(self) -> str:
        lowest = "-" if self.lowest_phase is None else f"{self.lowest_phase:+.4f}"
        ratio = "-" if self.oracle_ratio_min is None else f"{self.oracle_ratio_min:.3f}"
        return (f"{self.runs} runs: goodput sum {self.goodput_sum:.4f}, above every static "
                f"{self.above_every_static}, lowest phase {lowest} ({self.phases_below} "
                f"below -0.01), changes {self.changes}, multi-change phases "
                f"{self.multi_change_phases} of {self.phases}, adaptations within "
                f"{ADAPTATION_INTERVALS} intervals {self.fast_adaptations} of "
                f"{self.adaptations} (after a worker or link event "
                f"{self.fast_cluster_adaptations} of {self.cluster_adaptations}), "
                f"oracle ratio min {ratio}" + self._adapted())

    def _adapted(self) -> str:
        if self.lowest_adapted_phase is None:
            return ""
        return (f", once adapted: lowest phase {self.lowest_adapted_phase:+.4f} "
                f"({self.adapted_phases_below} below -0.01)")


def phase_margins(policies: Mapping[str, Any], phases: Sequence[float],
                  field: str = "goodput") -> list[float]:
    """Per phase, ``phases`` (adaptive's goodput) minus the best static policy of that phase
    in ``policies`` (a summary's), by ``field`` (``adapted_goodput``: from adaptive's first
    approval in the phase); ValueError when their phases differ in number."""
    statics = [k for k in STATIC if k in policies]
    if any(len(policies[k].get("phases") or []) != len(phases) for k in statics):
        raise ValueError(f"{len(phases)} adaptive phases, the static policies have others")
    return [g - max(float(policies[k]["phases"][i][field]) for k in statics)
            for i, g in enumerate(phases)]


def goal_figures(runs: Iterable[tuple[Mapping[str, Any], AdaptiveRun]]) -> GoalFigures:
    """The goals over ``runs``: (a committed summary, the adaptive run to judge against it)."""
    n = above = changes = phases = multi = adaptations = fast = below = 0
    cluster = fast_cluster = 0
    total = 0.0
    lowest: float | None = None
    ratios: list[float] = []
    adapted: list[float] | None = []  # every run's once-adapted margins, None if any lacks them
    for doc, run in runs:
        pol = doc["policies"]
        statics = [k for k in STATIC if k in pol]
        n += 1
        total += run.goodput
        above += all(run.goodput > pol[k]["goodput"] for k in statics)
        bounds = [(float(p["start_s"]), float(p["end_s"]))
                  for p in pol[statics[0]]["phases"]] if statics else []
        if len(bounds) != len(run.phases):
            raise ValueError(f"{doc['scenario']} seed {doc.get('seed')}: the adaptive run has "
                             f"{len(run.phases)} phases, the summary {len(bounds)}")
        for margin in phase_margins(pol, run.phases):
            lowest = margin if lowest is None else min(lowest, margin)
            below += margin < -0.01
        if adapted is not None and run.adapted_phases is not None:
            adapted += phase_margins(pol, run.adapted_phases, "adapted_goodput")
        else:
            adapted = None
        for start, end in bounds:
            phases += 1
            multi += sum(start <= t < end for t in run.changed_at_s) > 1
        changes += len(run.changed_at_s)
        window = ADAPTATION_INTERVALS * float(doc["interval_s"])
        # adaptation_s follows the events in time order (runner.times_to_first).
        kinds = [str(e["kind"]) for e in sorted(doc.get("events") or [],
                                                key=lambda e: float(e["at_s"]))]
        if kinds and len(kinds) != len(run.adaptation_s):
            raise ValueError(f"{doc['scenario']} seed {doc.get('seed')}: {len(kinds)} events, "
                             f"{len(run.adaptation_s)} adaptation times")
        for i, a in enumerate(run.adaptation_s):
            if a is None:
                continue
            adaptations += 1
            fast += a <= window
            if i < len(kinds) and kinds[i] in CLUSTER_EVENTS:
                cluster += 1
                fast_cluster += a <= window
        oracle = pol.get("oracle", {}).get("goodput")
        if oracle:
            ratios.append(run.goodput / float(oracle))
    return GoalFigures(n, total, above, lowest, below, changes, phases, multi, adaptations,
                       fast, min(ratios) if ratios else None, cluster, fast_cluster,
                       min(adapted) if adapted else None,
                       sum(m < -0.01 for m in adapted) if adapted else None)
