"""``pdctl demo`` as a subprocess: what ``make demo`` runs must work and tell its story.

It runs the live simulated cluster and the real daemon for about two minutes, so it is
marked slow; the bound is the demo's own ``--timeout-s`` plus shutdown."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from controller.cli.demo_cmd import ppd_policy
from controller.demo import (
    DEFAULT_ROUTER,
    DemoRouter,
    DemoState,
    DemoWatcher,
    Event,
    Phase,
    default_scenario,
    summary_lines,
)
from controller.policy import Features, Reason, Route, decide
from controller.sim.scenario import load_scenario
from tests.daemon.fakes import make_rig


def _events(out: str) -> list[tuple[float, str]]:
    return [(float(m[1]), m[2]) for m in re.finditer(r"^ *(\d+\.\d) s  (.+)$", out, re.M)]


@pytest.mark.slow
@pytest.mark.integration
def test_demo_runs_the_closed_loop_to_a_promoted_policy_and_exits_0() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "from controller.cli import main; main()", "demo",
         "--timeout-s", "200"],
        capture_output=True, text=True, timeout=260,
        env={**os.environ, "COLUMNS": "200"},
    )
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:] + out
    # The default path: `pdctl router serve` subprocesses on scenarios/demo-real.toml, whose
    # SLOs the start line names.
    assert DEFAULT_ROUTER is DemoRouter.REAL
    real = load_scenario(default_scenario(DemoRouter.REAL))
    assert (f"SLO TTFT {real.ttft_slo_s:g} s / TPOT {1000 * real.tpot_slo_s:g} ms; "
            "baseline v1") in out, out
    assert "summary:" in out, out
    summary = out[out.index("summary:"):]
    final = re.search(r"^demo: shift at (\d+) s, v(\d+) \((.+?)\) promoted at ([\d.]+) s, every "
                      r"router acked v\2; goodput ([\d.]+)% → ([\d.]+)% → ([\d.]+)%", summary, re.M)
    assert final, summary
    shift_at, version, how, promoted_at = (int(final[1]), int(final[2]), final[3],
                                           float(final[4]))
    # A canary refit (the bake's end re-fitting the canary on its own windows) names the
    # canary it superseded; the trigger in front is that canary's calibration's.
    refit = re.fullmatch(r"(.+) → canary refit of v(\d+)", how)
    origin = int(refit[2]) if refit else version
    how = refit[1] if refit else how
    # Off a terminal the events stream as they happen and the summary does not repeat them.
    assert "  events:" not in summary, summary
    streamed = out[:out.index("summary:")]
    events = _events(streamed)
    texts = [t for _, t in events]
    after_shift = [(at, t) for at, t in events if at >= shift_at]
    # The shift happened and the loop saw it: a drift event (or, on the documented
    # fallback, an operator's forced recalibration) after it, then a calibration whose
    # guardrail approved the final version, a canary and a promotion of that version.
    assert any(t.startswith("shift:") for t in texts), summary
    # The approval came from the recalibration a drift triggered, a scheduled one, or (the
    # documented fallback) an operator's forced recalibration, which the summary then says.
    # A scheduled calibration due right after the shift can get there first: its approvals
    # keep the detectors in their cooldown, so no drift need fire; then the approved table
    # must have been trained on windows from after the shift alone.
    if not any(t.startswith("drift:") for _, t in after_shift):
        assert how == "schedule → guardrail approval", summary
        post_shift_only = rf"candidate v{origin} .*window\(s\), 0 from before the shift"
        assert re.search(post_shift_only, streamed), out
    if how.startswith("forced"):
        assert "NOTE: the guardrail approved nothing" in summary, summary
        assert any(t.startswith("operator request: recalibrate") for _, t in after_shift)
    else:
        assert how in ("drift → guardrail approval", "schedule → guardrail approval"), how
        assert "NOTE:" not in summary, summary
    approval = [t for _, t in after_shift
                if re.match(rf"recalibration \(\w+\): candidate v{version} .*guardrail approved "
                            r"→ approved", t)]
    assert approval, summary
    if refit:
        assert origin < version, summary
        assert any(re.match(rf"recalibration \(canary\): candidate v{version} ", t)
                   for _, t in after_shift), summary
        assert f"canary v{origin} superseded by its canary refit" in streamed, out
    canary = [at for at, t in after_shift if t.startswith(f"canary: v{version} pushed to")]
    promotion = [at for at, t in after_shift
                 if t == f"promotion: v{version} acknowledged by every router"]
    assert canary and promotion and canary[0] <= promotion[0] == promoted_at, summary
    assert re.search(r"\(1 of 2 routers\)", streamed), out  # a canary share, not all
    # Every router acknowledged the final version.
    acked = re.search(r"routers acknowledged: (.+)$", summary, re.M)
    assert acked, summary
    versions = re.findall(r" v(\d+)", acked[1])
    assert len(versions) == 2 and set(versions) == {str(version)}, acked[1]
    assert "recovered: yes" in summary, summary
    # Goodput was measured in every phase (numbers are reported, not asserted on: a live
    # run's outcome is the table in docs/demo.md, not a unit test's threshold).
    for label in ("before the shift", "after the shift", "recovery"):
        assert re.search(rf"{label}.*\d+\.\d%", summary), summary


def test_summary_reports_a_forced_recalibration_honestly() -> None:
    state = DemoState("demo", 45.0, "shift: link_bandwidth ×0.25", ["r0", "r1"])
    state.events = [Event(45.0, "shift", "shift: link_bandwidth ×0.25"),
                    Event(105.0, "operator", "operator request: recalibrate")]
    state.final_version, state.final_promoted_at, state.now = 3, 112.0, 124.0
    state.forced, state.force_requested_at, state.done = True, 105.0, True
    state.final_trigger = "operator"
    state.acked = {"r0": 3, "r1": 3}
    state.phases = [Phase("before the shift", 1, 10, 9), Phase("after", 1, 10, 1),
                    Phase("recovery", 1, 10, 8)]
    text = "\n".join(summary_lines(state))
    assert "forced by an operator request" in text
    assert "NOTE: the guardrail approved nothing" in text
    assert "90.0% → 10.0% → 80.0%" in text
    assert "routers acknowledged: r0 v3, r1 v3" in text


def test_summary_of_a_failed_run_says_so() -> None:
    state = DemoState("demo", 45.0, "shift", ["r0"])
    state.failure = "not finished within 170 s"
    state.phases = [Phase("a"), Phase("b"), Phase("c")]
    text = "\n".join(summary_lines(state))
    assert "demo FAILED: not finished within 170 s" in text
    assert "n/a" in text  # no windows measured: no invented numbers


def test_ppd_policy_is_a_ppd_table() -> None:
    policy = ppd_policy(2)
    assert set(policy.table.routes) == {Route.DECODE_LOCAL, Route.PREFILL_NODE}
    # Score sign follows the route, as the PPD decision rule says.
    for route, score in zip(policy.table.routes, policy.table.scores, strict=True):
        assert (score > 0) == (route is Route.DECODE_LOCAL)
    short = decide(policy, Features(2, 500, 50, 200, 2.0), lambda: 1.0)
    long_ = decide(policy, Features(2, 120000, 50, 200, 2.0), lambda: 1.0)
    heavy_append = decide(policy, Features(2, 500, 5000, 100, 2.0), lambda: 1.0)
    assert (short.route, short.reason) == (Route.DECODE_LOCAL, Reason.TABLE)
    assert long_.route is Route.PREFILL_NODE
    assert heavy_append.route is Route.PREFILL_NODE


async def _until_v1_approved(rig: Any) -> None:
    """The real cycle on its fakes, stepped until it approved its first policy."""
    for _ in range(4):
        if (await rig.step()).approved_version == 1:
            return
    raise AssertionError("v1 was not approved within 4 cycles")


async def test_the_story_follows_a_canary_refit_back_to_the_drift_behind_it(
        tmp_path: Path) -> None:
    # The real cycle on its fakes: v1 learned, a drift's v2 baking on the canary, then the
    # bake's end refits v2 into v3, which supersedes v2 and is promoted everywhere.
    rig = make_rig(tmp_path)
    await _until_v1_approved(rig)
    t0 = rig.clock.now() - 1000.0
    shift_at = rig.clock.now() - t0
    rig.source.goodput = {1: 0.90, 2: 0.96, 3: 0.97}
    rig.learner.approve_refit = rig.learner.fire = True
    assert (await rig.step()).approved_version == 2
    for _ in range(8):
        if ((await rig.step()).canary or "").startswith("promoted"):
            break
    assert rig.store.desired_versions() == dict.fromkeys(rig.agents, 3)
    state = DemoState("demo", shift_at, "shift: scripted", list(rig.agents))
    DemoWatcher(rig.store, state, t0).poll(rig.clock.now())
    state.phases = [Phase("before the shift", 1, 10, 9), Phase("after", 1, 10, 5),
                    Phase("recovery", 1, 10, 9)]
    state.done = True
    text = "\n".join(summary_lines(state))
    assert (state.final_version, state.final_refit_of, state.final_trigger) == (3, 2, "drift")
    assert "(drift → guardrail approval → canary refit of v2) promoted at" in text, text
    assert "canary v2 superseded by its canary refit" in text, text
    assert re.search(r"recalibration \(canary\): candidate v3 .* guardrail approved → approved",
                     text), text


async def test_a_refused_candidate_is_shown_with_its_calibration_not_a_version(
        tmp_path: Path) -> None:
    # The real cycle on its fakes: a drift's candidate refused takes no version, and the
    # timeline names it by its calibration (never "vNone").
    rig = make_rig(tmp_path)
    await _until_v1_approved(rig)
    t0 = rig.clock.now() - 1000.0
    rig.learner.approve, rig.learner.fire = False, True
    await rig.step()
    refused = [c for c in rig.store.calibrations() if not (c.details or {}).get("approved")]
    assert refused and refused[-1].policy_version is None
    state = DemoState("demo", rig.clock.now() - t0, "shift: scripted", list(rig.agents))
    DemoWatcher(rig.store, state, t0).poll(rig.clock.now())
    text = "\n".join(e.text for e in state.events)
    assert "vNone" not in text, text
    assert re.search(rf"candidate of calibration #{refused[-1].id} .* guardrail refused → "
                     r"kept, no version", text), text


async def test_the_recovery_is_credited_to_the_first_version_promoted_after_the_shift(
        tmp_path: Path) -> None:
    # The real cycle on its fakes: after the shift a drift's v2 is promoted; later a second
    # drift's v3 is promoted too. The recovery was v2's: the credit stays with it, and its
    # recovery windows end where v3 first reached a router. (The newest approval took it.)
    rig = make_rig(tmp_path, canary_fraction=0.25, bake_windows=1)
    await _until_v1_approved(rig)
    t0 = rig.clock.now() - 1000.0
    shift_at = rig.clock.now() - t0
    rig.source.goodput = {1: 0.90, 2: 0.96, 3: 0.97, 4: 0.97, 5: 0.97}

    async def drift_to_promotion() -> int:
        rig.learner.fire = True
        version = (await rig.step()).approved_version
        assert version is not None
        for _ in range(8):
            if set(rig.store.desired_versions().values()) == {version} and \
                    {a.snapshot.version for a in rig.agents.values()} == {version}:
                return version
            await rig.step()
        raise AssertionError(f"v{version} was not promoted")

    first = await drift_to_promotion()
    for _ in range(4):  # windows measured under it alone
        await rig.step()
    second = await drift_to_promotion()
    assert first < second
    state = DemoState("demo", shift_at, "shift: scripted", list(rig.agents))
    DemoWatcher(rig.store, state, t0).poll(rig.clock.now())
    assert state.final_version == first, state.events
    assert state.final_trigger == "drift"
    later_push = min(p.at.timestamp() - t0 for p in rig.store.pushes() if p.version > first)
    assert state.final_until == pytest.approx(later_push)
    recovered = state.phases[2]
    assert recovered.windows >= 3
    assert recovered.label == f"after v{first} is promoted (recovery)"
    # Every recovery window ran before a later version reached any router.
    stored = [w.window for w in rig.store.windows()]
    assert recovered.windows == sum(1 for w in stored
                                    if w.start - t0 >= state.final_promoted_at
                                    and w.end - t0 <= later_push)


def test_demo_repeat_reads_drift_credit_and_first_promotion_from_a_run() -> None:
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "demo_repeat.py"
    spec = importlib.util.spec_from_file_location("demo_repeat", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["demo_repeat"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    out = "\n".join([
        "  20.0 s  drift: slo detector fired (statistic 1.03 > threshold 1.00)",
        "  40.0 s  recalibration (schedule): candidate v3 predicted goodput 0.9 vs current "
        "0.8, 1 cell(s) changed, trained on 3 window(s); guardrail approved → approved",
        "  48.0 s  shift: link_bandwidth ×0.25 (scenario event at 48 s)",
        "  49.0 s  promotion: v3 acknowledged by every router",
        "  52.0 s  drift: performance detector fired (statistic 8.00 > threshold 7.50)",
        "  52.0 s  recalibration (drift): candidate v4 predicted goodput 0.9 vs current 0.5, "
        "9 cell(s) changed, trained on 6 window(s), 4 from before the shift; guardrail "
        "approved → approved",
        "  58.0 s  promotion: v4 acknowledged by every router",
        "  70.0 s  recalibration (schedule): candidate v6 predicted goodput 0.9 vs current "
        "0.8, 1 cell(s) changed, trained on 6 window(s), 0 from before the shift; guardrail "
        "approved → approved",
        "  76.0 s  promotion: v6 acknowledged by every router",
        "", "summary:",
        "demo: shift at 48 s, v6 (schedule → guardrail approval) promoted at 76.0 s, every "
        "router acked v6; goodput 99.0% → 50.0% → 98.0% in 85 s",
    ])
    r = mod.parse(out, 0, 88.0)
    assert r.drift_before == ["slo 1.03 at 20.0 s"]
    # v3 was approved before the shift: the first response to it promoted is v4, not v6.
    assert (r.shift_at, r.first_promoted, r.credited, r.demo_s) == (48.0, 4, 6, 85.0)
    assert not r.ok
    clean = mod.parse(out.replace("slo detector fired", "x").replace("v6", "v4"), 0, 88.0)
    assert clean.ok
