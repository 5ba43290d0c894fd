"""``pdctl demo``: the embedded default closed loop.

A live simulated cluster (by default, ``--router real``: the simulated workers behind one
``pdctl router serve`` subprocess per router, :mod:`controller.demo_real`,
``scenarios/demo-real.toml``; ``--router sim``: :class:`controller.sim.live.LiveSim`'s
in-process routers, ``scenarios/demo.toml``: real /metrics endpoints and real gRPC router
agents on loopback) and the real daemon
(:class:`controller.daemon.Daemon`, the composition ``pdctl run`` uses: scrape source,
SQLite store in a temporary directory, APScheduler job, gRPC pushes) with short intervals.
The demo itself only watches: it reads the daemon's store (windows, drift events,
calibrations, policies, pushes, acknowledgements) and tells the story as it happens:

baseline (classic P/D with exploration, v1; the daemon starts after a warm-up of
``WARMUP_S``) → first calibration → canary → promotion → the scenario's shift (every KV link
to a fraction of its bandwidth) → drift → recalibration → guardrail → canary → promotion →
recovery, then a summary. A recalibration right after the
shift trains partly on windows from before it and the guardrail may refuse its candidate;
the demo's config then recalibrates on schedule (every 20 s) on post-shift windows. The
demo ends once goodput after the promotion is back within ``RECOVERY_TOLERANCE`` of before
the shift (measured over ``RECOVERY_WINDOWS`` windows).

If no policy is approved after the shift within ``force_after_s``, the demo records an
operator request (``recalibrate --force``, as ``pdctl recalibrate --force`` would) and says
so in the summary. Every run is bounded by ``timeout_s``; whatever happens, the daemon and
the simulator are stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from controller.clock import Clock, WallClock

SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "demo.toml"
# The real-router path's scenario: demo.toml with SLOs of 1.0 s TTFT / 20 ms TPOT and the KV
# link cut to a fifth (docs/demo.md, "What made runs differ, and the real-router path's
# scenario").
SCENARIO_REAL = SCENARIO.with_name("demo-real.toml")
RECOVERY_WINDOWS = 3  # windows measured after the promotion before the demo ends
# Recovered: goodput after the promotion within this much of the goodput before the shift.
# Until then the daemon keeps going (drift and scheduled recalibrations) and the demo waits.
RECOVERY_TOLERANCE = 0.10
# The real-router path's: after the shift the best table sends later turns decode-local,
# whose prefills on D stall its decodes; through the real routers it measured 78-100% where
# classic P/D had measured 88-99% before the shift (docs/demo.md, "What made runs differ").
REAL_RECOVERY_TOLERANCE = 0.15
DEMO_WHO = "pdctl demo (operator)"
BASELINE_EXPLORATION = 0.2
# The real-router path's baseline explores half as much. Through the real routers (2-core
# machine under load), classic P/D met both SLOs for 94% of requests with 0.2 of the later
# turns decode-local and for 100% with 0.1: the exploration's own prefills on D stall its
# decodes. At 0.2 that gap left room for tables trained on three windows to be approved
# before the shift, some of them decode-local where the shift then hurt little
# (docs/demo.md, "What made runs differ").
REAL_BASELINE_EXPLORATION = 0.1
# The daemon starts once the sessions have filled the cluster, as a daemon meets a serving
# cluster. From an empty cluster the first windows are a ramp: at first only turn 1 (3000
# context tokens), then the later turns of sessions that started together (the request rate
# went 7 -> 14 -> 10 req/s over the first 18 s); tables and drift references from them
# described that ramp, and the steady traffic after it fired the workload and performance
# detectors before the shift (docs/demo.md, "Drift before the shift").
WARMUP_S = 18.0
SHOWN_STATUSES = ("approved", "rolled_back", "superseded")  # policies that reached routers


class DemoRouter(StrEnum):
    """Who routes the demo's traffic."""

    REAL = "real"  # a `pdctl router serve` subprocess per router, traffic over HTTP
    SIM = "sim"  # the scenario's in-simulation routers (their own traffic, in process)


# Real routers by default: the demo shows the loop closed through the router a user runs; 8
# runs of 8 told the story whole on the shared, loaded 2-core machine (docs/demo.md,
# "Repeated runs"). `--router sim` keeps the in-process path.
DEFAULT_ROUTER = DemoRouter.REAL


def default_scenario(router: DemoRouter) -> Path:
    """The scenario ``pdctl demo --router ROUTER`` runs without ``--scenario``."""
    return SCENARIO_REAL if router is DemoRouter.REAL else SCENARIO


# The real-router path's guardrail margin. A drift calibration right after the shift trains
# mostly on windows from before it; through real processes its predictions of the current
# and the candidate table differ by noise, and at the key's default (0.005) such candidates
# were approved for gains of 0.005-0.025 and brought goodput to 0-14% (docs/demo.md, "What
# made runs differ"); the responses that bring goodput back gain 0.05-0.9.
REAL_GUARDRAIL_MARGIN = 0.05
GUARDRAIL_MARGIN = 0.005  # `[controller] guardrail_margin`'s default: the sim path's


def demo_settings(addresses: dict[str, Any], store_url: str, ttft_s: float, tpot_s: float,
                  interval_s: float, guardrail_margin: float = GUARDRAIL_MARGIN) -> Any:
    """The daemon's settings for the demo: the live cluster's addresses and short intervals
    (everything here is an ordinary ``pdctl run`` config key; ``guardrail_margin``: the
    key's default unless given)."""
    from controller.config import load_settings

    def hostport(url: str) -> str:
        return url.split("//", 1)[1].split("/", 1)[0]

    workers = addresses["workers"]
    return load_settings(
        prefill_pool={"nodes": [hostport(w["metrics"]) for w in workers
                                if w["role"] == "prefill"]},
        decode_pool={"nodes": [hostport(w["metrics"]) for w in workers
                               if w["role"] == "decode"]},
        routers={"targets": [r["grpc"] for r in addresses["routers"]],
                 "metrics_targets": [hostport(r["metrics"]) for r in addresses["routers"]]},
        store={"url": store_url},
        metrics={"enable": False},
        slo={"ttft_s": ttft_s, "tpot_s": tpot_s},
        # 8 training windows: with 5, a drift calibration could never train on the windows
        # since the change alone (learning.MIN_REGIME_WINDOWS = 7), and its residual
        # references were too thin to watch a route's latency (ROUTE_REFERENCE_WINDOWS = 6);
        # after the KV link slowed, candidates trained across it were refused three times
        # over 40 s in one run of 10 (106 s in all). With 8: 10 runs of 10 in 70-88 s
        # (docs/demo.md, "Repeated runs").
        controller={
            "interval_s": interval_s, "min_training_windows": 3, "training_windows": 8,
            "min_policy_interval_s": 0, "calibrate_every_s": 20, "bake_windows": 2,
            "bake_min_requests": 10, "max_bake_windows": 8, "promote_margin": 0.05,
            "lease_ttl_s": 10, "shutdown_timeout_s": 5, "guardrail_margin": guardrail_margin,
        },
        drift={"min_requests": 10, "cooldown_s": 2 * interval_s},
        rollout={"push_deadline_s": 2.0, "max_attempts": 2},
    )


@dataclass
class Event:
    at: float  # seconds since the demo's start
    kind: str
    text: str


@dataclass
class Phase:
    label: str
    windows: int = 0
    requests: float = 0.0
    met: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0

    @property
    def goodput(self) -> float | None:
        return self.met / self.requests if self.requests else None

    @property
    def ttft_ms(self) -> float | None:
        return 1000 * self.ttft_sum / self.ttft_count if self.ttft_count else None


@dataclass
class DemoState:
    """What the demo has seen so far (rebuilt from the store at every poll)."""

    scenario: str
    shift_at: float
    shift_text: str
    routers: list[str]
    now: float = 0.0
    warmup_s: float = 0.0  # the daemon starts then
    recovery_tolerance: float = RECOVERY_TOLERANCE
    events: list[Event] = field(default_factory=list)
    windows: list[tuple[float, float, float | None, float]] = field(default_factory=list)
    desired: dict[str, int] = field(default_factory=dict)
    acked: dict[str, int | None] = field(default_factory=dict)
    baseline_version: int = 1
    learned_version: int | None = None  # promoted before the shift
    final_version: int | None = None  # approved after the shift
    final_promoted_at: float | None = None
    # When a version after final_version first reached a router (its recovery is measured
    # until then), None while none has.
    final_until: float | None = None
    # Versions promoted after the shift before final_version that did not bring goodput
    # back: (version, promoted at, goodput under it, windows), in order.
    passed_over: list[tuple[int, float, float | None, int]] = field(default_factory=list)
    final_trigger: str | None = None  # what triggered the calibration behind final_version
    # final_version's origin when it is a canary refit: the canary it superseded, whose own
    # calibration's trigger is final_trigger (a refit's trigger is the bake's end, "canary").
    final_refit_of: int | None = None
    forced: bool = False
    force_requested_at: float | None = None
    phases: list[Phase] = field(default_factory=list)
    done: bool = False
    failure: str | None = None

    @property
    def stage(self) -> str:
        if self.failure:
            return f"failed: {self.failure}"
        if self.done:
            return "done"
        if self.final_promoted_at is not None:
            return "recovery: measuring goodput under the promoted policy"
        if self.final_version is not None:
            return f"canary: v{self.final_version} baking on part of the routers"
        if self.now >= self.shift_at:
            return "shift: waiting for drift detection and recalibration"
        if self.learned_version is not None:
            return f"steady: v{self.learned_version} everywhere, shift at {self.shift_at:.0f} s"
        if self.now < self.warmup_s:
            return (f"warm-up: sessions filling the cluster; the daemon starts at "
                    f"{self.warmup_s:.0f} s")
        return "baseline: classic P/D (v1), collecting windows for the first calibration"


class DemoWatcher:
    """Turns the store's rows into the demo's story; ``poll`` is idempotent."""

    def __init__(self, store: Any, state: DemoState, t0: float) -> None:
        self.store = store
        self.state = state
        self.t0 = t0
        self._seen: set[tuple[str, Any]] = set()
        # version -> its calibration trained on a window that started at or after the shift
        # (a scheduled calibration due at the shift trains on the windows before it alone)
        self._saw_shift: dict[int, bool] = {}

    def _rel(self, dt: Any) -> float:
        return float(dt.timestamp()) - self.t0

    def _add(self, key: tuple[str, Any], at: float, kind: str, text: str) -> None:
        if key not in self._seen:
            self._seen.add(key)
            self.state.events.append(Event(at, kind, text))

    def _add_calibration(self, c: Any, policies: Mapping[int, Any]) -> None:
        """One stored calibration as a timeline event (once): its candidate, prediction,
        training windows (how many from before the shift) and the guardrail's verdict."""
        s, store, d = self.state, self.store, c.details or {}
        changed = d.get("changed_cells")
        n_changed = len(changed) if isinstance(changed, list) else changed
        verdict = "approved" if d.get("approved") else "refused"
        version = c.policy_version
        # A refused candidate takes no version: it is kept with its calibration.
        candidate = f"v{version}" if version is not None else f"of calibration #{c.id}"
        status = (policies[version].status if version in policies
                  else "-" if version is not None else "kept, no version")
        key = ("cal", c.id)
        if key in self._seen:
            return
        trained = [w.window for w in store.windows_by_ids(list(c.training_window_ids))]
        # "from before the shift": started before it (a window across it counts here)
        pre = sum(1 for w in trained if w.start - self.t0 < s.shift_at)
        if version is not None:
            self._saw_shift[version] = pre < len(trained)
        mix = (f"trained on {len(trained)} window(s), {pre} from before the shift"
               if self._rel(c.created_at) >= s.shift_at
               else f"trained on {len(trained)} window(s)")
        self._add(key, self._rel(c.created_at), "calibration",
                  f"recalibration ({d.get('trigger')}): candidate {candidate} predicted "
                  f"goodput {_fmt(c.predicted_goodput_new)} vs current "
                  f"{_fmt(c.predicted_goodput_current)}, {n_changed} cell(s) changed, "
                  f"{mix}; guardrail {verdict} → {status}")

    def poll(self, now: float) -> None:
        s = self.state
        s.now = now - self.t0
        store = self.store
        if s.now >= s.shift_at:
            self._add(("shift", 0), s.shift_at, "shift", s.shift_text)
        stored = store.windows()
        s.windows = []
        for w in stored:
            win = w.window
            n = sum(o.requests for o in win.outcomes)
            met = sum(o.met for o in win.outcomes)
            s.windows.append((win.start - self.t0, win.end - self.t0,
                              met / n if n else None, n))
        for e in store.drift_events():
            self._add(("drift", e.id), self._rel(e.at), "drift",
                      f"drift: {e.kind} detector fired (statistic {e.statistic:.2f} > "
                      f"threshold {e.threshold:.2f})")
        policies = {p.version: p for p in store.policies()}
        triggers: dict[int, str] = {}
        refit_of: dict[int, int] = {}
        for c in store.calibrations():
            d = c.details or {}
            if c.policy_version is not None:
                triggers[c.policy_version] = str(d.get("trigger"))
                if isinstance(d.get("refit_of"), int):
                    refit_of[c.policy_version] = d["refit_of"]
            self._add_calibration(c, policies)
        for r in store.requests():
            self._add(("req", r.id), self._rel(r.created_at), "operator",
                      f"operator request: {r.kind} {r.args} by {r.who} ({r.reason})")
        first_ok: dict[int, dict[str, float]] = {}
        for p in store.pushes():
            if p.result == "ok":
                first_ok.setdefault(p.version, {}).setdefault(p.router_id, self._rel(p.at))
        s.desired = store.desired_versions()
        s.acked = {r.router_id: r.acked_version for r in store.routers()}
        s.learned_version = None
        s.final_version = None
        s.final_promoted_at = None
        s.final_until = None
        promoted_after: list[tuple[float, int]] = []  # (promoted at, version) after the shift
        for version, rec in sorted(policies.items()):
            if version == s.baseline_version or rec.status not in SHOWN_STATUSES:
                continue
            # a response to the shift: approved after it, trained on a window from after it
            after_shift = self._rel(rec.created_at) >= s.shift_at \
                and self._saw_shift.get(version, True)
            pushed = first_ok.get(version, {})
            if pushed:
                first = min(pushed.values())
                canary = sorted(r for r, t in pushed.items() if t == first)
                self._add(("canary", version), first, "canary",
                          f"canary: v{version} pushed to {', '.join(canary)} "
                          f"({len(canary)} of {len(s.routers)} routers)")
            if rec.status == "superseded":
                self._add(("superseded", version), self._rel(rec.updated_at), "superseded",
                          f"canary v{version} {rec.reason}")
                continue
            if rec.status == "rolled_back":
                self._add(("rollback", version), self._rel(rec.updated_at), "rollback",
                          f"rolled back v{version}: {rec.reason}")
                continue
            promoted_at = max(pushed.values()) if len(pushed) == len(s.routers) else None
            if promoted_at is not None:
                self._add(("promoted", version), promoted_at, "promotion",
                          f"promotion: v{version} acknowledged by every router")
            if after_shift and promoted_at is not None:
                promoted_after.append((promoted_at, version))
            elif after_shift and not promoted_after:
                s.final_version = version  # baking: the newest approved since the shift
            elif promoted_at is not None:
                s.learned_version = version
        self._credit(promoted_after, first_ok, stored, policies)
        # A refit is never refitted: one step back reaches the calibration a trigger started.
        s.final_refit_of = refit_of.get(s.final_version) if s.final_version else None
        origin = s.final_refit_of or s.final_version
        s.final_trigger = triggers.get(origin) if origin else None
        s.events.sort(key=lambda e: e.at)
        s.phases = self.phases()

    def _credit(self, promoted_after: list[tuple[float, int]],
                first_ok: dict[int, dict[str, float]], stored: list[Any],
                policies: dict[int, Any]) -> None:
        """The recovery is credited to the FIRST version promoted after the shift and
        measured under it until a later version reaches a router (a canary rolled back
        aside): a later approval (a scheduled recalibration's, say) does not take the credit.
        The credit passes on only when a later version reached a router after the first had
        run ``RECOVERY_WINDOWS`` windows or more without bringing goodput back (or before it
        had run that many): the summary then names the version passed over, with its numbers.
        ``promoted_after``: (promoted at, version), neither rolled back nor superseded."""
        s = self.state
        s.passed_over = []
        spans = [(w.window.start - self.t0, w.window.end - self.t0,
                  sum(o.met for o in w.window.outcomes),
                  sum(o.requests for o in w.window.outcomes)) for w in stored]
        before = _goodput([x for x in spans if x[1] <= s.shift_at])
        for promoted_at, version in sorted(promoted_after):
            later = [t for v, pushed in first_ok.items() if v > version
                     and getattr(policies.get(v), "status", None) != "rolled_back"
                     for t in pushed.values()]
            s.final_promoted_at, s.final_version = promoted_at, version
            s.final_until = min(later) if later else None
            if s.final_until is None:
                return  # measured from its promotion on
            ran = [x for x in spans if x[0] >= promoted_at and x[1] <= s.final_until]
            after = _goodput(ran)
            if len(ran) >= RECOVERY_WINDOWS and before is not None and after is not None \
                    and after >= before - s.recovery_tolerance:
                return
            s.passed_over.append((version, promoted_at, after, len(ran)))

    def _spans(self, stored: list[Any]) -> list[tuple[int, float, float]]:
        """(id, start, end) of each stored window, in seconds since the demo's start."""
        return [(w.id, w.window.start - self.t0, w.window.end - self.t0) for w in stored]

    def phases(self) -> list[Phase]:
        s = self.state
        final = f"v{s.final_version}" if s.final_version is not None else "the new policy"
        before = Phase("before the shift")
        after = Phase(f"after the shift, until {final} is promoted")
        recovered = Phase(f"after {final} is promoted (recovery)")
        for w in self.store.windows():
            win = w.window
            start, end = win.start - self.t0, win.end - self.t0
            if end <= s.shift_at:
                phase = before
            elif start < s.shift_at:
                continue  # straddles the shift
            elif s.final_promoted_at is not None and start >= s.final_promoted_at:
                if s.final_until is not None and end > s.final_until:
                    continue  # a later version runs on some router: not this one's recovery
                phase = recovered
            else:
                phase = after
            phase.windows += 1
            for o in win.outcomes:
                phase.requests += o.requests
                phase.met += o.met
                phase.ttft_sum += o.ttft_sum
                phase.ttft_count += o.ttft_count
        return [before, after, recovered]

    def all_acked(self, version: int) -> bool:
        s = self.state
        return all(s.desired.get(r) == version and s.acked.get(r) == version
                   for r in s.routers)


def _goodput(spans: list[tuple[float, float, float, float]]) -> float | None:
    """Requests meeting both SLOs over all requests of (start, end, met, requests) spans."""
    n = sum(x[3] for x in spans)
    return sum(x[2] for x in spans) / n if n else None


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0f} ms"


async def run_demo(*, scenario_path: Path | None = None, timeout_s: float = 170.0,
                   force_after_s: float = 60.0,
                   on_update: Callable[[DemoState], None] | None = None,
                   clock: Clock | None = None,
                   router: DemoRouter = DEFAULT_ROUTER) -> DemoState:
    """Run the demo to the end (or ``timeout_s``) and return what it saw (the scenario:
    ``default_scenario(router)`` unless given)."""
    from controller.bench.runner import slo_of
    from controller.daemon import Daemon
    from controller.policy import Policy, Route, dumps
    from controller.sim.scenario import load_scenario
    from controller.store import Store

    clock = clock or WallClock()
    scenario = load_scenario(scenario_path or default_scenario(router))
    shift = scenario.events[0]
    shift_text = (f"shift: {shift.kind} ×{getattr(shift, 'factor', '')} "
                  f"(scenario event at {shift.at_s:g} s)")
    # Classic P/D with exploration: a few requests take the other route, so the first
    # calibration has measurements of both routes (DESIGN: exploration is how the
    # controller keeps learning the route it does not take).
    real = router is DemoRouter.REAL  # the real-router path's own values, documented above
    exploration = REAL_BASELINE_EXPLORATION if real else BASELINE_EXPLORATION
    baseline = Policy.uniform(1, Route.PREFILL_NODE, exploration=exploration,
                              slo=slo_of(scenario))
    with tempfile.TemporaryDirectory(prefix="pdctl-demo-") as tmp:
        store_url = f"sqlite:///{Path(tmp) / 'history.db'}"
        sim = demo_cluster(router, scenario, baseline, Path(tmp))
        t0 = clock.now()
        addresses = await sim.start()
        daemon_task: asyncio.Task[int] | None = None
        daemon: Daemon | None = None
        store = Store(store_url, clock)
        try:
            store.upgrade()
            routers = [r["grpc"] for r in addresses["routers"]]
            # The routers start on classic P/D (v1, what the simulator's agents hold): the
            # store knows it as the approved baseline, desired everywhere.
            with store.cycle() as tx:
                tx.add_policy(baseline.version, baseline.checksum, dumps(baseline), "approved",
                              f"baseline: classic P/D (every later turn to a prefill node), "
                              f"exploration {exploration:g}")
                for r in routers:
                    tx.set_desired(r, baseline.version)
            settings = demo_settings(
                addresses, store_url, scenario.ttft_slo_s, scenario.tpot_slo_s,
                scenario.interval_s, REAL_GUARDRAIL_MARGIN if real else GUARDRAIL_MARGIN)
            state = DemoState(scenario.name, shift.at_s, shift_text, routers,
                              warmup_s=min(WARMUP_S, shift.at_s / 2),
                              recovery_tolerance=REAL_RECOVERY_TOLERANCE if real
                              else RECOVERY_TOLERANCE)
            state.events.append(Event(0.0, "start", (
                f"start: live cluster '{scenario.name}' ({len(addresses['workers'])} workers, "
                f"{len(routers)} routers), daemon every {scenario.interval_s:g} s from "
                f"{state.warmup_s:g} s (warm-up: sessions fill the cluster), "
                f"SLO TTFT {scenario.ttft_slo_s:g} s / TPOT {1000 * scenario.tpot_slo_s:g} ms; "
                f"baseline v1 = classic P/D")))
            await _warm_up(clock, t0, state, on_update)
            daemon = Daemon(settings, clock=clock)
            daemon_task = asyncio.create_task(daemon.run())
            watcher = DemoWatcher(store, state, t0)
            deadline = t0 + timeout_s
            while True:
                await clock.sleep(0.5)
                if daemon_task.done():
                    state.failure = (f"the daemon stopped (exit {daemon_task.result()}): "
                                     "interrupted")
                    break
                watcher.poll(clock.now())
                if state.final_version is None and not state.forced \
                        and state.now >= state.shift_at + force_after_s:
                    # Honest fallback: an operator asks for a forced recalibration.
                    with store.cycle() as tx:
                        tx.add_request("recalibrate", {"force": True}, DEMO_WHO,
                                       f"no approval {force_after_s:g} s after the shift")
                    state.forced = True
                    state.force_requested_at = state.now
                if state.final_promoted_at is not None and state.final_version is not None \
                        and state.phases[2].windows >= RECOVERY_WINDOWS and recovered(state):
                    state.done = True
                if on_update is not None:
                    on_update(state)
                if state.done:
                    break
                if clock.now() >= deadline:
                    state.failure = f"not finished within {timeout_s:g} s" + (
                        " (the promoted policy has not brought goodput back)"
                        if state.final_promoted_at is not None else "")
                    break
            if on_update is not None:
                on_update(state)
            return state
        finally:
            if daemon is not None:
                daemon.request_stop()
            if daemon_task is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(daemon_task, 15.0)
            await sim.stop()
            store.close()


def demo_cluster(router: DemoRouter, scenario: Any, baseline: Any, tmp: Path) -> Any:
    """The cluster the demo runs (``start``/``stop``; ``start`` returns the addresses):
    REAL, the simulated workers behind a ``pdctl router serve`` subprocess; SIM, the
    scenario's in-simulation routers."""
    if router is DemoRouter.REAL:
        from controller.demo_real import RealRouterCluster

        return RealRouterCluster(scenario, baseline, tmp)
    from controller.sim.live import LiveSim

    return LiveSim(scenario, baseline)


async def _warm_up(clock: Clock, t0: float, state: DemoState,
                   on_update: Callable[[DemoState], None] | None) -> None:
    """Wait until ``state.warmup_s`` after ``t0``, the screen kept up to date."""
    while clock.now() < t0 + state.warmup_s:
        state.now = clock.now() - t0
        if on_update is not None:
            on_update(state)
        await clock.sleep(min(0.5, max(0.0, t0 + state.warmup_s - clock.now())))


def recovered(state: DemoState) -> bool:
    """Goodput after the final promotion is back within ``state.recovery_tolerance`` of
    before."""
    before, _, after = state.phases
    if before.goodput is None or after.goodput is None:
        return False
    return after.goodput >= before.goodput - state.recovery_tolerance


def summary_lines(state: DemoState, events: bool = True) -> list[str]:
    """The printed summary (the test reads these lines). ``events=False`` leaves out the
    event list, for output that has already streamed every event line by line."""
    lines = ["", "summary:"]
    lines.append(f"  scenario {state.scenario}: {state.shift_text}")
    lines.append(f"  versions: baseline v{state.baseline_version} (classic P/D)"
                 + (f", learned v{state.learned_version} before the shift"
                    if state.learned_version else "")
                 + (f", v{state.final_version} approved after the shift"
                    if state.final_version else ", no version approved after the shift"))
    if events:
        lines.append("  events:")
        lines.extend(f"    {e.at:6.1f} s  {e.text}" for e in state.events)
    lines.append("  goodput (measured by the routers, share of requests meeting both SLOs):")
    for p in state.phases:
        lines.append(f"    {p.label:<44} {_pct(p.goodput):>7}  TTFT mean {_ms(p.ttft_ms):>8}"
                     f"  ({p.windows} windows, {p.requests:.0f} requests)")
    if state.phases and state.phases[2].windows:
        lines.append(f"  recovered: {'yes' if recovered(state) else 'no'} (goodput after the "
                     f"promotion within {100 * state.recovery_tolerance:.0f} points of before the "
                     f"shift)")
    acked = ", ".join(f"{r} v{state.acked.get(r)}" for r in state.routers)
    lines.append(f"  routers acknowledged: {acked}")
    for version, at, goodput, windows in state.passed_over:
        lines.append(f"  v{version}, promoted after the shift at {at:.1f} s, did not bring "
                     f"goodput back: {_pct(goodput)} over {windows} window(s) before the next "
                     "version reached a router")
    if state.forced:
        lines.append(f"  NOTE: the guardrail approved nothing within the wait; the demo asked "
                     f"for an operator recalibration --force at {state.force_requested_at:.0f} s")
    if state.failure:
        lines.append(f"demo FAILED: {state.failure}")
    else:
        final = state.final_version
        how = ("forced by an operator request" if state.final_trigger == "operator"
               else f"{state.final_trigger} → guardrail approval")
        if state.final_refit_of is not None:
            how += f" → canary refit of v{state.final_refit_of}"
        lines.append(f"demo: shift at {state.shift_at:g} s, v{final} ({how}) promoted at "
                     f"{state.final_promoted_at:.1f} s, every router acked v{final}; goodput "
                     f"{_pct(state.phases[0].goodput)} → {_pct(state.phases[1].goodput)} → "
                     f"{_pct(state.phases[2].goodput)} in {state.now:.0f} s")
    return lines


def quiet_daemon_logs() -> None:
    """The story is on the screen; the daemon's own logs only when something breaks."""
    logging.getLogger().setLevel(logging.ERROR)
    for name in ("pdctl", "apscheduler", "httpx", "alembic"):
        logging.getLogger(name).setLevel(logging.ERROR)


__all__ = ["DemoState", "DemoWatcher", "Event", "Phase", "demo_settings", "run_demo",
           "summary_lines"]
