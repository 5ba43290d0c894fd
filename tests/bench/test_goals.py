"""Issue 7's goal figures over a set of runs (``controller.bench.goals``): what
``bench_adaptive.py --runs`` prints for the committed runs and for their replays."""

from __future__ import annotations

from typing import Any

import pytest

from controller.bench.goals import AdaptiveRun, goal_figures


def _summary(adaptive: float, phases: list[float], approvals: list[float],
             adaptation: list[float | None], threshold_phases: list[float],
             oracle: float = 0.95,
             events: tuple[str, ...] = ("rate_scale", "remove_worker")) -> dict[str, Any]:
    bounds = [(0.0, 1200.0), (1200.0, 3600.0)][: len(phases)]

    def static(goodput: float, per_phase: list[float]) -> dict[str, Any]:
        return {"goodput": goodput, "phases": [
            {"start_s": a, "end_s": b, "goodput": g}
            for (a, b), g in zip(bounds, per_phase, strict=True)]}

    return {
        "scenario": "s", "seed": 1, "interval_s": 30.0,
        # Listed out of time order: the figures pair adaptation times with events by time.
        "events": [{"at_s": 2400.0 - 1200.0 * i, "kind": k}
                   for i, k in enumerate(reversed(events))],
        "policies": {
            "pd": static(0.5, [0.5] * len(phases)),
            "local": static(0.8, [0.85, 0.75][: len(phases)]),
            "threshold": static(0.85, threshold_phases),
            "oracle": {"goodput": oracle},
            "adaptive": {
                "goodput": adaptive, "adaptation_s": adaptation,
                "phases": [{"goodput": g} for g in phases],
                "controller": {"approved_at_s": [0.0, *approvals]},
            },
        },
    }


def test_the_figures_count_each_goal_over_the_runs() -> None:
    # Run 1: above every static policy; phase 2 is 0.02 under threshold's; two approvals
    # in phase 2; one adaptation in 60 s, one in 600 s.
    one = _summary(0.90, [0.95, 0.83], [1500.0, 1800.0], [60.0, 600.0], [0.90, 0.85])
    # Run 2: under threshold over the run; one approval at 300 s in phase 1.
    two = _summary(0.84, [0.88, 0.84], [300.0], [None, None], [0.86, 0.84], oracle=0.88)
    figures = goal_figures((d, AdaptiveRun.from_summary(d)) for d in (one, two))
    assert figures.runs == 2
    assert figures.goodput_sum == pytest.approx(1.74)
    assert figures.above_every_static == 1
    assert figures.lowest_phase == pytest.approx(0.83 - 0.85)
    assert figures.phases_below == 1
    assert (figures.changes, figures.phases, figures.multi_change_phases) == (3, 4, 1)
    assert (figures.fast_adaptations, figures.adaptations) == (1, 2)  # 3 x 30 s = 90 s
    # Run 1's events: a rate step at 1200 s (adapted in 60 s), a worker lost at 2400 s (600 s).
    assert (figures.fast_cluster_adaptations, figures.cluster_adaptations) == (0, 1)
    assert figures.oracle_ratio_min == pytest.approx(0.90 / 0.95)  # run 1: 0.947 < 0.955
    assert "above every static 1" in figures.line()


def test_a_replay_is_judged_against_the_committed_static_policies() -> None:
    doc = _summary(0.84, [0.88, 0.80], [300.0], [None, None], [0.86, 0.84])
    replay = {"goodput": 0.91, "phases": [0.90, 0.92], "approved_at_s": [300.0, 1300.0],
              "adaptation_s": [None, 100.0]}
    run = AdaptiveRun.from_replay(replay)
    assert run.approved_at_s == (300.0, 1300.0)  # a replay lists no starting policy
    assert AdaptiveRun.from_summary(doc).approved_at_s == (300.0,)
    figures = goal_figures([(doc, run)])
    assert figures.above_every_static == 1
    assert figures.lowest_phase == pytest.approx(0.90 - 0.86)
    assert figures.multi_change_phases == 0 and figures.changes == 2


def test_a_replay_with_other_phases_is_refused() -> None:
    doc = _summary(0.84, [0.88, 0.80], [], [None], [0.86, 0.84])
    with pytest.raises(ValueError, match="1 phases, the summary 2"):
        goal_figures([(doc, AdaptiveRun(0.9, (0.9,), (), ()))])


def test_adaptations_after_cluster_events_are_counted_apart() -> None:
    doc = _summary(0.90, [0.95, 0.83], [1500.0], [30.0, 45.0], [0.90, 0.85],
                   events=("link_bandwidth", "workload"))
    figures = goal_figures([(doc, AdaptiveRun.from_summary(doc))])
    assert (figures.fast_adaptations, figures.adaptations) == (2, 2)
    assert (figures.fast_cluster_adaptations, figures.cluster_adaptations) == (1, 1)
    assert "(after a worker or link event 1 of 1)" in figures.line()
    doc["events"] = doc["events"][:1]
    with pytest.raises(ValueError, match="1 events, 2 adaptation times"):
        goal_figures([(doc, AdaptiveRun.from_summary(doc))])


def test_a_promotion_rolled_back_counts_as_a_change_in_its_phase() -> None:
    # One approval in phase 2, whose promotion the watch rolled back there: two changes.
    doc = _summary(0.90, [0.95, 0.86], [1500.0], [None, None], [0.90, 0.85])
    doc["policies"]["adaptive"]["controller"]["rolled_back_at_s"] = [1620.0]
    run = AdaptiveRun.from_summary(doc)
    assert run.changed_at_s == (1500.0, 1620.0)
    figures = goal_figures([(doc, run)])
    assert (figures.changes, figures.multi_change_phases) == (2, 1)
    replay = {"goodput": 0.9, "phases": [0.95, 0.86], "approved_at_s": [1500.0],
              "rolled_back_at_s": [1620.0], "adaptation_s": [None, None]}
    assert goal_figures([(doc, AdaptiveRun.from_replay(replay))]).changes == 2


def test_the_once_adapted_figures_come_from_the_summarys_spans_only() -> None:
    doc = _summary(0.90, [0.95, 0.83], [1500.0], [None, None], [0.90, 0.85])
    # Phase 2 from adaptive's approval at 1500 s: adaptive 0.90, threshold 0.86 over it.
    for key, adapted in (("adaptive", [0.95, 0.90]), ("pd", [0.5, 0.5]),
                         ("local", [0.85, 0.75]), ("threshold", [0.90, 0.86])):
        for phase, g in zip(doc["policies"][key]["phases"], adapted, strict=True):
            phase["adapted_goodput"] = g
    run = AdaptiveRun.from_summary(doc)
    assert run.adapted_phases == (0.95, 0.90)
    figures = goal_figures([(doc, run)])
    assert figures.lowest_phase == pytest.approx(0.83 - 0.85)  # over the whole phase
    assert figures.lowest_adapted_phase == pytest.approx(0.90 - 0.86)  # phase 2
    assert figures.adapted_phases_below == 0
    assert "once adapted: lowest phase +0.0400 (0 below -0.01)" in figures.line()
    # A replay's approvals are not the summary's: no once-adapted figures for it.
    replay = {"goodput": 0.9, "phases": [0.95, 0.86], "approved_at_s": [1500.0],
              "adaptation_s": [None, None]}
    assert goal_figures([(doc, AdaptiveRun.from_replay(replay))]).lowest_adapted_phase is None
