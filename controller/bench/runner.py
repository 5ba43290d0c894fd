"""``pdctl bench run``: every policy on the same seeded scenario, then the oracle.

Order of the runs (each a full virtual-time replay of the scenario, same seed):

1. ``pd`` and ``local`` (forced all-prefill-node / all-decode-local) with windows recorded
   every control interval through :class:`InProcessSource`; they are both baselines and the
   oracle's forced calibration runs.
2. ``ppd-static``, the PPD paper's method: the learning issue's active calibration
   (:func:`controller.core.active.plan_active_calibration`: the paper's context classes x
   io-ratio classes x QPS points, two-turn conversations) replayed under forced
   all-prefill-node and all-decode-local on the scenario's cluster as its first phase
   starts (no events), windows recorded alike; a table calibrated by the learning core on
   those windows, weights pinned at (1, 1), never changed. ``ppd-static+overrides``: the
   same table with the controller's configured router-side overrides (the busy overrides
   adaptive starts with), never changed: the strongest static table a user could deploy,
   so that "learning beats a static table" is measured against it.
3. ``threshold``: the Dynamo-style rule (:mod:`controller.bench.baselines`).
4. ``adaptive``: the daemon's cycle (:mod:`controller.bench.adaptive`) from ``ppd-static``
   with the controller's configured overrides.
5. Oracle candidates ``table-a:b``: per phase, a table calibrated on that phase's windows of
   the forced runs with wtft:wtpot = a:b and the controller's configured overrides (turn 1's
   busy override), pushed to the routers at the phase's start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from controller.bench.adaptive import adaptive_start
from controller.bench.baselines import ThresholdConfig, install_threshold, static_policy
from controller.bench.oracle import (
    ORACLE_RATIOS,
    OraclePick,
    calibrated_result,
    calibrated_table,
    pick_per_phase,
    ratio_key,
    windows_in,
)
from controller.core.window import Window
from controller.loop.learning import calibration_config
from controller.policy import Policy, Route, Slo, Weights
from controller.sim.run import RunResult, run_scenario
from controller.sim.scenario import (
    MAX_DURATION_S,
    Event,
    Scenario,
    check_intervals,
    load_scenario,
)


class BenchPolicy(StrEnum):
    """The evaluation's built-in policies (their values are the report's keys)."""

    PD = "pd"
    LOCAL = "local"
    PPD_STATIC = "ppd-static"
    PPD_STATIC_OVERRIDES = "ppd-static+overrides"
    THRESHOLD = "threshold"
    ADAPTIVE = "adaptive"
    ORACLE = "oracle"


POLICIES: tuple[BenchPolicy, ...] = tuple(BenchPolicy)
# What a user could deploy and never change: adaptive is compared with the best of these.
STATIC: tuple[BenchPolicy, ...] = (BenchPolicy.PD, BenchPolicy.LOCAL, BenchPolicy.PPD_STATIC,
                                   BenchPolicy.PPD_STATIC_OVERRIDES, BenchPolicy.THRESHOLD)

Progress = Callable[[str, float, float], None]  # (label, virtual now, virtual total)


@dataclass
class PolicyRun:
    """One policy's replay and what the bench knows about its tables."""

    result: RunResult
    tables: list[tuple[float, Policy]] = field(default_factory=list)  # (from s, table)
    policy_changes: int = 0
    adaptation_s: list[float | None] = field(default_factory=list)
    # Per event: seconds to the loop's first drift event or scaling calibration (adaptive).
    detection_s: list[float | None] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    adaptive: Any = None  # AdaptiveOutcome for "adaptive"


@dataclass
class BenchRun:
    scenario: Scenario
    runs: dict[str, PolicyRun]  # the requested policies (oracle excluded)
    candidates: dict[str, RunResult]  # everything the oracle chose from
    oracle: list[OraclePick] | None
    notes: list[str] = field(default_factory=list)


def scale_scenario(scenario: Scenario, factor: float, min_interval_s: float = 10.0
                   ) -> Scenario:
    """A shortened scenario: duration and event times x ``factor``; the control interval
    x ``factor`` too, but not below ``min_interval_s`` (windows need requests)."""
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"--duration-scale must be a number > 0, got {factor}")
    if factor == 1.0:
        return scenario
    duration = scenario.duration_s * factor
    if duration > MAX_DURATION_S:
        raise ValueError(f"--duration-scale {factor:g} makes the run {duration:.3g} s; at most "
                         f"{MAX_DURATION_S:.0f} s (30 days)")
    interval = max(min_interval_s, scenario.interval_s * factor)
    check_intervals(duration, interval)
    events = tuple(replace(e, at_s=e.at_s * factor) for e in scenario.events)
    return replace(scenario, duration_s=duration, events=events, interval_s=interval)


def slo_of(scenario: Scenario) -> Slo:
    return Slo(ttft_s=scenario.ttft_slo_s, tpot_s=scenario.tpot_slo_s)


def numbered_scenarios(directory: Path, which: Sequence[str] = (), seed: int | None = None
                       ) -> list[tuple[Path, Scenario]]:
    """The scenario files ``N-*.toml`` of ``directory`` (the built-in ones are
    ``scenarios/bench``) whose number ``N`` is in ``which`` (all when empty), loaded, in file
    order; with ``seed``, replayed with that seed instead of their own."""
    out = []
    for path in sorted(directory.glob("[0-9]*-*.toml")):
        if which and path.name.split("-")[0] not in which:
            continue
        scenario = load_scenario(path)
        out.append((path, scenario if seed is None else replace(scenario, seed=seed)))
    return out


class WindowRecorder:
    """A controller hook that only observes: one window per control interval."""

    def __init__(self) -> None:
        self.windows: list[Window] = []
        self._source: Any = None
        self._last = 0.0
        self._loop = asyncio.new_event_loop()

    def setup(self, cluster: Any) -> None:
        from controller.observe.inprocess import InProcessSource, sim_cluster_provider

        self._source = InProcessSource.following(sim_cluster_provider(cluster), cluster.clock)
        self._loop.run_until_complete(self._source.window(0.0, 0.0))  # baseline snapshot

    def __call__(self, now: float, cluster: Any) -> None:
        self.windows.append(self._loop.run_until_complete(self._source.window(self._last, now)))
        self._last = now

    def close(self) -> None:
        self._loop.close()


def times_to_first(events: Sequence[Event], times: Sequence[float]) -> list[float | None]:
    """Per event: seconds from it to the first of ``times`` after it (None: none up to the
    next event, or ever). Approval times give ``adaptation_s``; drift events and scaling
    calibrations give ``detection_s``.

    Strictly after: the cycle at the event's own time reads the window that ends there,
    which holds nothing of the event (an approval then answers an earlier change)."""
    starts = sorted({e.at_s for e in events})
    out: list[float | None] = []
    for ev in sorted(events, key=lambda e: e.at_s):
        nxt = next((t for t in starts if t > ev.at_s), float("inf"))
        first = next((a for a in sorted(times) if ev.at_s < a <= nxt), None)
        out.append(None if first is None else first - ev.at_s)
    return out


def _phase_switcher(tables: Sequence[tuple[float, Policy]]) -> Callable[[Any], None]:
    """``setup`` hook: push each table to every router at its start time."""

    def setup(cluster: Any) -> None:
        for start, table in tables:
            if start <= 0:
                continue

            def push(policy: Policy = table) -> None:
                for router in cluster.routers:
                    router.agent.apply(policy)

            cluster.loop.at(start, push)

    return setup


def quiet_logs() -> None:
    """The simulated routers warn that a static policy is 'stale' after 15 virtual minutes
    and the cycle logs every pass: noise on a bench's terminal. Called by the commands, not by
    run_bench(): a library call must not change the process's logging."""
    logging.getLogger("controller.rollout.agent").setLevel(logging.ERROR)
    logging.getLogger("pdctl.cycle").setLevel(logging.WARNING)


def run_bench(
    scenario: Scenario,
    policies: Sequence[str] = POLICIES,
    *,
    threshold: ThresholdConfig | None = None,
    settings: Any = None,
    progress: Progress | None = None,
    workdir: Path | None = None,
    extra: dict[str, Policy] | None = None,
    time_scale: float = 1.0,
) -> BenchRun:
    """Replay ``scenario`` under ``policies`` (names of :data:`POLICIES`) and policy files
    (``extra``: key -> policy). The active calibration behind ``ppd-static`` runs whenever
    a table is needed, and the forced runs behind the oracle run even when ``pd``/``local``
    are not asked for (they are then left out of the report).
    ``time_scale``: the factor ``scenario`` was shortened by (:func:`scale_scenario`); without
    ``settings``, the adaptive controller's time constants are shortened by it too."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policy {', '.join(unknown)}; expected {', '.join(POLICIES)}")
    slo = slo_of(scenario)
    wanted = set(policies)
    need_tables = bool(wanted & {BenchPolicy.PPD_STATIC, BenchPolicy.PPD_STATIC_OVERRIDES,
                                 BenchPolicy.ADAPTIVE, BenchPolicy.ORACLE})
    need_windows = BenchPolicy.ORACLE in wanted  # the oracle's tables learn from the forced runs
    notes: list[str] = []

    def replay(key: str, policy: Any, *, controller: Any = None,
               setup: Callable[[Any], None] | None = None) -> RunResult:
        return _replay(scenario, policy, key, progress, controller=controller, setup=setup)

    runs: dict[str, PolicyRun] = {}
    windows: dict[str, list[Window]] = {}
    key: str
    for key, route in ((BenchPolicy.PD, Route.PREFILL_NODE),
                       (BenchPolicy.LOCAL, Route.DECODE_LOCAL)):
        if key not in wanted and not need_windows:
            continue
        if need_windows:
            res, windows[key] = _recorded(scenario, static_policy(route, slo), key, progress)
        else:
            res = replay(key, static_policy(route, slo))
        runs[key] = PolicyRun(res, tables=[(0.0, static_policy(route, slo))],
                              adaptation_s=[None] * len(scenario.events))

    static_start: StaticStart | None = None
    if settings is None:
        settings = adaptive_settings(scenario, time_scale)
    if need_tables:
        static_start = ppd_static_start(scenario, progress, settings.drift.reference_windows)
        with_overrides = adaptive_start(static_start.policy, settings)
        for key, table in ((BenchPolicy.PPD_STATIC, static_start.policy),
                           (BenchPolicy.PPD_STATIC_OVERRIDES, with_overrides)):
            if key in wanted or BenchPolicy.ORACLE in wanted:
                runs[key] = PolicyRun(replay(key, table), tables=[(0.0, table)],
                                      adaptation_s=[None] * len(scenario.events))
    if BenchPolicy.THRESHOLD in wanted or BenchPolicy.ORACLE in wanted:
        cfg = threshold or ThresholdConfig()
        runs[BenchPolicy.THRESHOLD] = PolicyRun(
            replay(BenchPolicy.THRESHOLD, static_policy(Route.PREFILL_NODE, slo),
                   setup=install_threshold(cfg)),
            adaptation_s=[None] * len(scenario.events))
    for name, pol in (extra or {}).items():
        runs[name] = PolicyRun(replay(name, pol), tables=[(0.0, pol)],
                               adaptation_s=[None] * len(scenario.events))
    if BenchPolicy.ADAPTIVE in wanted:
        assert static_start is not None
        runs[BenchPolicy.ADAPTIVE] = _run_adaptive(
            scenario, adaptive_start(static_start.policy, settings), settings, replay, workdir,
            static_start.drift_reference)

    candidates: dict[str, RunResult] = {k: runs[k].result for k in STATIC if k in runs}
    oracle: list[OraclePick] | None = None
    if BenchPolicy.ORACLE in wanted:
        _oracle_candidates(scenario, windows, settings, replay, runs, candidates, notes)
        oracle = pick_per_phase(candidates)
    # Keep only what was asked for (plus oracle candidates, needed for the oracle's report).
    report_runs = {k: v for k, v in runs.items()
                   if k in wanted or k in (extra or {}) or k.startswith("table-")}
    if BenchPolicy.ORACLE not in wanted:
        report_runs = {k: v for k, v in report_runs.items() if not k.startswith("table-")}
    return BenchRun(scenario, report_runs, candidates, oracle, notes)


def _oracle_candidates(scenario: Scenario, windows: dict[str, list[Window]], settings: Any,
                       replay: Callable[..., RunResult], runs: dict[str, PolicyRun],
                       candidates: dict[str, RunResult], notes: list[str]) -> None:
    """One run per oracle weight ratio, each phase under a table calibrated on that phase's
    windows of the forced runs (added to ``candidates`` and ``runs``)."""
    slo = slo_of(scenario)
    # The controller's own overrides: the oracle bounds what its tables could do.
    oracle_overrides = calibration_config(settings).overrides
    for wtft, wtpot in ORACLE_RATIOS:
        key = ratio_key(wtft, wtpot)
        tables: list[tuple[float, Policy]] = []
        for i, (start, end) in enumerate(scenario.phase_bounds()):
            mine = [w for k in (BenchPolicy.PD, BenchPolicy.LOCAL)
                    for w in windows_in(windows[k], start, end)]
            try:
                tables.append((start, calibrated_table(
                    mine, slo, Weights(wtft, wtpot), i + 1,
                    f"oracle candidate: phase {i} windows, wtft:wtpot {wtft:g}:{wtpot:g}",
                    overrides=oracle_overrides)))
            except ValueError as e:  # CalibrationError: too few windows in the phase
                notes.append(f"{key}: phase {i} has no table ({e}); previous kept")
        if not tables:
            continue
        if tables[0][0] > 0:
            tables[0] = (0.0, tables[0][1])
        res = replay(key, tables[0][1], setup=_phase_switcher(tables))
        candidates[key] = res
        runs.setdefault(key, PolicyRun(res, tables=tables, policy_changes=len(tables) - 1,
                                       adaptation_s=[None] * len(scenario.events)))


PPD_STATIC_REASON = ("ppd-static: the active calibration's grid under forced "
                     "all-prefill-node and all-decode-local, weights 1:1")


def active_calibration_windows(scenario: Scenario, progress: Progress | None = None
                               ) -> list[Window]:
    """The windows of an active calibration (the default plan, the scenario's SLOs) run on
    the scenario's cluster as its first phase starts: each forced phase of the plan replayed
    with its grid as the only traffic and no events, one window per control interval.

    Each phase runs on a fresh cluster from time 0, so the two phases' windows overlap in
    time, and the calibration's held-out windows (the newest) come from the end of both.
    Run one after the other, as the live runner does, the table's scores differ slightly;
    adaptive started from either scored the same to 0.0001 over the 30 committed runs."""
    from controller.core.active import plan_active_calibration
    from controller.policy import Axes
    from controller.sim.workloads.active import ActivePlanWorkload

    plan = plan_active_calibration(Axes(), slo_of(scenario), 1)
    windows: list[Window] = []
    for phase in plan.phases:
        grid = ActivePlanWorkload(phase.points, scenario.cluster.routers)
        run = replace(scenario, events=(), duration_s=grid.end_s + scenario.interval_s)
        key = "active-" + ("pd" if phase.route is Route.PREFILL_NODE else "local")
        windows += _recorded(run, phase.policy, key, progress, grid)[1]
    return windows


def _replay(scenario: Scenario, policy: Any, key: str, progress: Progress | None, *,
            controller: Any = None, setup: Callable[[Any], None] | None = None,
            workload: Any = None) -> RunResult:
    """One virtual-time replay of ``scenario``, its progress reported as ``key``."""
    def tick(t: float) -> None:
        if progress is not None:
            progress(key, t, scenario.duration_s)

    return run_scenario(scenario, policy, policy_key=key, controller=controller, setup=setup,
                        workload=workload, progress=tick if progress is not None else None)


def _recorded(scenario: Scenario, policy: Any, key: str, progress: Progress | None,
              workload: Any = None) -> tuple[RunResult, list[Window]]:
    """:func:`_replay` with one window recorded per control interval."""
    recorder = WindowRecorder()
    try:
        result = _replay(scenario, policy, key, progress, controller=recorder,
                         setup=recorder.setup, workload=workload)
    finally:
        recorder.close()
    return result, recorder.windows


@dataclass(frozen=True)
class StaticStart:
    """The ``ppd-static`` table and what ``pdctl calibrate-active`` stores with it: the drift
    reference of its calibration (its newest windows), which the adaptive loop starts from."""

    policy: Policy
    drift_reference: dict[str, Any]


def ppd_static_start(scenario: Scenario, progress: Progress | None = None,
                     reference_windows: int = 10) -> StaticStart:
    """The ``ppd-static`` baseline: the PPD paper's table, calibrated once on an active
    calibration (:func:`active_calibration_windows`) with the weights at (1, 1) and turn 1
    kept on a prefill node; with its calibration's drift reference over the newest
    ``reference_windows`` (``[drift] reference_windows``), as the learner builds one."""
    from controller.core.drift import reference_from_windows

    policy, result, used = calibrated_result(
        active_calibration_windows(scenario, progress), slo_of(scenario), Weights(1.0, 1.0),
        1, PPD_STATIC_REASON, tune_first_turn=False)
    reference = reference_from_windows(used[-reference_windows:], result.model)
    return StaticStart(policy, reference.to_dict())


def adaptive_settings(scenario: Scenario, time_scale: float = 1.0,
                      overrides: Mapping[str, Mapping[str, Any]] | None = None) -> Any:
    """pdctl's defaults with the scenario's SLOs and control interval; in a scenario
    shortened by ``time_scale`` the approval rate limit, the drift cooldown and the
    scheduled recalibration period shrink with it (a 6-minute CI run would otherwise allow
    one change at most). ``overrides`` (section -> key -> value, as
    :func:`parse_setting_overrides` gives) go on top; a bad one raises ConfigError."""
    from controller.config import load_settings

    sections: dict[str, dict[str, Any]] = {
        "slo": {"ttft_s": scenario.ttft_slo_s, "tpot_s": scenario.tpot_slo_s},
        "controller": {"interval_s": scenario.interval_s},
    }
    base = load_settings(None, **sections)
    if time_scale == 1.0 and not overrides:
        return base
    if time_scale != 1.0:
        c, d = base.controller, base.drift
        every = c.calibrate_every_s * time_scale if c.calibrate_every_s is not None else None
        sections["controller"] |= {"min_policy_interval_s": c.min_policy_interval_s * time_scale,
                                   "calibrate_every_s": every}
        sections["drift"] = {"cooldown_s": d.cooldown_s * time_scale}
    for section, values in (overrides or {}).items():
        sections[section] = {**sections.get(section, {}), **values}
    return load_settings(None, **sections)


def parse_setting_overrides(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``SECTION.KEY=VALUE`` items to section -> key -> value; VALUE is read as JSON when it
    parses (numbers, booleans, null), else kept as a string. ValueError names a bad item."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        section, dot, key = name.partition(".")
        if not sep or not dot or not section or not key:
            raise ValueError(f"{item!r}: expected SECTION.KEY=VALUE")
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out.setdefault(section, {})[key] = value
    return out


def _run_adaptive(scenario: Scenario, initial: Policy, settings: Any,
                  replay: Callable[..., RunResult], workdir: Path | None,
                  drift_reference: Mapping[str, Any] | None = None) -> PolicyRun:
    from controller.bench.adaptive import AdaptiveController

    owned = None
    if workdir is None:
        owned = tempfile.TemporaryDirectory(prefix="pdctl-bench-")
        workdir = Path(owned.name)
    try:
        hook = AdaptiveController(initial, settings, workdir / f"{scenario.name}-adaptive.db",
                                  drift_reference)
        res = replay(BenchPolicy.ADAPTIVE, initial, controller=hook, setup=hook.setup)
        outcome = hook.finish()
    finally:
        if owned is not None:
            owned.cleanup()
    approvals = [t for t, _ in outcome.approvals[1:]]
    timeline = sorted([*outcome.approvals, *outcome.rollbacks], key=lambda item: item[0])
    return PolicyRun(
        res, tables=[(max(0.0, t), p) for t, p in timeline],
        policy_changes=len(approvals) + len(outcome.rollbacks),
        adaptation_s=times_to_first(scenario.events, approvals),
        detection_s=times_to_first(scenario.events, outcome.reactions),
        notes=[f"cycle failed: {r}" for r in outcome.failed_cycles[:5]],
        adaptive=outcome,
    )
