"""The active cold-start calibration against the live simulated cluster (`pdctl sim serve` as
a real process): forced policies pushed over gRPC, synthetic conversations through its
OpenAI-compatible endpoints, windows scraped from its /metrics, the first table recorded.
Bounded: a small plan (about 6 s of load per phase), 1 s windows, every wait capped."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from controller.cli import app
from controller.clock import WallClock
from controller.core.rollout import FALLBACK_PREFILL
from controller.loop.calibration_runner import (
    FALLBACK_REASON,
    FORCED_PREFIX,
    PHASE_REASON,
    ActiveCalibrationError,
    ActiveCalibrationRunner,
    RunnerLimits,
)
from controller.loop.leader import LeaseLeadership
from controller.policy import Policy, Route, dumps, loads
from controller.store import Store
from tests.conftest import require
from tests.support.processes import hostport, sim_serve

# The scenario's own traffic is off (--no-traffic): the only load is the calibration's. The
# routers start with no policy (--policy none, as new routers) unless a test marks
# `@pytest.mark.parametrize("live_sim", ["local"], indirect=True)`: then all-decode-local, the
# policy an empty store adopts.
SCENARIO = """
name = "active-calibration"
seed = 5
duration_s = 600

[cluster]
prefill_workers = 1
decode_workers = 2
profile = "llama-3.1-8b-h100"
kv_link_gbps = 100
routers = 2
prefill_prefix_cache = true
transfer_missing_only = true

[workload]
source = "synthetic"

[workload.params]
qps = 0.1
turns = 2
turn1_input = 512
turn1_output = 32
append_input = 64
append_output = 32
think_s = 1.0

[slo]
ttft_s = 0.5
tpot_s = 0.05
"""


@pytest.fixture
def live_sim(tmp_path: Path, request: pytest.FixtureRequest
             ) -> Iterator[dict[str, Any] | None]:
    """The live cluster's addresses; None when it cannot start (the tests then fail in CI
    through ``require``, and skip locally)."""
    scenario = tmp_path / "scenario.toml"
    scenario.write_text(SCENARIO)
    policy = getattr(request, "param", "none")
    with ExitStack() as stack:
        try:
            addresses, _ = stack.enter_context(
                sim_serve(scenario, "--no-traffic", "--policy", policy))
        except (OSError, RuntimeError):
            addresses = None
        yield addresses


def _config(tmp_path: Path, sim: dict[str, Any]) -> Path:
    prefill = [hostport(w["metrics"]) for w in sim["workers"] if w["role"] == "prefill"]
    decode = [hostport(w["metrics"]) for w in sim["workers"] if w["role"] == "decode"]
    path = tmp_path / "pd-controller.toml"
    path.write_text(f"""
[prefill_pool]
nodes = {json.dumps(prefill)}
[decode_pool]
nodes = {json.dumps(decode)}
[routers]
targets = {json.dumps([r["grpc"] for r in sim["routers"]])}
metrics_targets = {json.dumps([hostport(r["metrics"]) for r in sim["routers"]])}
[store]
url = "sqlite:///{tmp_path / 'history.db'}"
[slo]
ttft_s = 0.5
tpot_s = 0.05
[rollout]
push_deadline_s = 2.0
max_attempts = 3
""")
    return path


@dataclass(frozen=True)
class Recorded:
    """What a run left in the store (read once, the store then closed)."""

    policies: dict[int, Any]
    desired: dict[str, int]
    acked: dict[str, int | None]
    calibrations: list[Any]
    pushes: list[Any]
    lease: Any

    @property
    def forced(self) -> list[Any]:
        return [p for p in self.policies.values() if p.reason.startswith(FORCED_PREFIX)]


def _recorded(store: Store) -> Recorded:
    try:
        with store.read() as tx:
            return Recorded({p.version: p for p in tx.policies()}, tx.desired_versions(),
                            {r.router_id: r.acked_version for r in tx.routers()},
                            tx.calibrations(), tx.pushes(), tx.lease())
    finally:
        store.close()


def _calibrate_active(tmp_path: Path, live_sim: dict[str, Any]
                      ) -> tuple[dict[str, Any], list[str]]:
    """`pdctl calibrate-active` with a small plan (about 6 s of load per phase) on a new
    migrated store; its report and the routers."""
    config = _config(tmp_path, live_sim)
    store = Store(f"sqlite:///{tmp_path / 'history.db'}")
    store.upgrade()
    store.close()
    result = CliRunner().invoke(app, [
        "calibrate-active", "--config", str(config),
        *(a for r in live_sim["routers"] for a in ("--openai", r["openai"])),
        "--contexts", "256,4096", "--turns", "32:32,512:32", "--qps", "4",
        "--sessions", "3", "--min-sessions", "1", "--max-requests", "200",
        "--max-duration", "40", "--window", "1.0", "--concurrency", "8", "--json",
    ])
    assert result.exit_code == 0, result.output
    report: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return report, [r["grpc"] for r in live_sim["routers"]]


def test_active_calibration_builds_the_first_table_on_the_live_sim(
    tmp_path: Path, live_sim: dict[str, Any] | None
) -> None:
    require("pdctl sim serve (the live simulated cluster)", live_sim is not None)
    assert live_sim is not None
    report, routers = _calibrate_active(tmp_path, live_sim)

    store = Store(f"sqlite:///{tmp_path / 'history.db'}")
    with store.read() as tx:
        phase_windows = [tx.windows_by_ids(ph["window_ids"]) for ph in report["phases"]]
    rec = _recorded(store)
    policies, pushes, calibrations = rec.policies, rec.pushes, rec.calibrations
    desired, acked = rec.desired, rec.acked

    # Both forced policies: stored with their reason, acknowledged by every router, and
    # superseded once the run is over (no rollback goes back to one).
    assert [ph["name"] for ph in report["phases"]] == ["all-prefill-node", "all-decode-local"]
    for ph, route, reason in zip(report["phases"], (Route.PREFILL_NODE, Route.DECODE_LOCAL),
                                 ("active calibration: forced prefill",
                                  "active calibration: forced decode-local"), strict=True):
        rec = policies[ph["version"]]
        assert rec.reason.startswith(reason) and rec.status == "superseded"
        assert set(loads(rec.body_json).table.routes) == {route}
        assert ph["acked"] == dict.fromkeys(routers, ph["version"])
        assert {p.router_id for p in pushes if p.version == ph["version"]
                and p.result == "ok"} == set(routers)
        assert ph["requests_ok"] > 0 and ph["requests_failed"] == 0
        assert ph["usable_window_ids"]

    # Windows were stored under each policy, and the routers really routed by it: later
    # turns only to a prefill node in the first phase, decode-local ones in the second.
    def later_turn_requests(windows: list[Any], route: Route) -> float:
        return sum(o.requests for s in windows for o in s.window.outcomes if o.route == route)

    prefill_phase, local_phase = phase_windows
    assert len(prefill_phase) == len(report["phases"][0]["window_ids"]) >= 2
    assert later_turn_requests(prefill_phase, Route.DECODE_LOCAL) == 0
    assert later_turn_requests(prefill_phase, Route.PREFILL_NODE) > 0
    assert later_turn_requests(local_phase, Route.DECODE_LOCAL) > 0

    # The first table: calibrated from those windows, recorded, approved (no current
    # policy), desired everywhere and acknowledged.
    version = report["policy_version"]
    assert report["approved"] is True, (report["reason"], report["predicted_goodput"])
    assert policies[version].status == "approved"
    assert version > report["phases"][1]["version"]
    [cal] = calibrations
    assert cal.id == report["calibration_id"] and cal.policy_version == version
    used = {i for ph in report["phases"] for i in ph["usable_window_ids"]}
    assert set(cal.training_window_ids) == used
    assert cal.details["trigger"] == "active" and "drift_reference" in cal.details
    assert desired == dict.fromkeys(routers, version)
    assert acked == dict.fromkeys(routers, version)
    assert report["final_acked"] == dict.fromkeys(routers, version)


@asynccontextmanager
async def _runner(tmp_path: Path, live_sim: dict[str, Any], *, qps: float, sessions: int,
                  limits: RunnerLimits, before: Policy | None = None, lead: bool = False,
                  extra_router: str | None = None, endpoint: str | None = None,
                  ) -> AsyncIterator[tuple[ActiveCalibrationRunner, Store, list[str]]]:
    """A runner with a one-cell plan against the live sim, its migrated store (``before``
    desired on every router first, when given) and the routers; closed on exit. ``lead``:
    the runner holds the leader lease as `pdctl calibrate-active` does; ``extra_router``
    and ``endpoint`` put a router or an OpenAI endpoint beside (instead of) the sim's."""
    from controller.clock import WallClock
    from controller.config import load_settings
    from controller.core.active import plan_active_calibration
    from controller.loop.learning import CoreLearner
    from controller.observe.factory import source_from_settings
    from controller.policy import Axes, Slo
    from controller.rollout.client import GrpcRouterTransport
    from controller.rollout.reconciler import Reconciler

    settings = load_settings(_config(tmp_path, live_sim))
    routers = [r["grpc"] for r in live_sim["routers"]] + ([extra_router] if extra_router
                                                          else [])
    clock = WallClock()
    store = Store(settings.store.url)
    store.upgrade()
    if before is not None:
        with store.cycle() as tx:
            tx.add_policy(before.version, before.checksum, dumps(before), "approved", "before")
            for r in routers:
                tx.set_desired(r, before.version)
    plan = plan_active_calibration(Axes(), Slo(0.5, 0.05), 1, contexts=(256,),
                                   turns=((32, 32),), qps_points=(qps,),
                                   sessions_per_point=sessions)
    assert plan.requests == 4 * sessions  # two phases of two-turn conversations
    source = await source_from_settings(settings, clock=clock)
    transport = GrpcRouterTransport()
    try:
        yield ActiveCalibrationRunner(
            plan=plan, store=store,
            reconciler=Reconciler.from_config(transport, clock, settings.rollout),
            routers=routers, endpoints=[endpoint or live_sim["routers"][0]["openai"]],
            source=source,
            learner=CoreLearner(settings), clock=clock, limits=limits,
            leadership=LeaseLeadership(store, clock, "calibrate-active", 3.0) if lead
            else None), store, routers
    finally:
        await transport.close()
        await source.aclose()


async def test_out_of_bounds_the_run_stops_and_the_routers_return_to_their_policy(
    tmp_path: Path, live_sim: dict[str, Any] | None
) -> None:
    """The runner's own request budget (below what the plan asks) stops the first phase; the
    second never starts, nothing is calibrated and every router is rolled back to the
    policy it ran before."""
    require("pdctl sim serve (the live simulated cluster)", live_sim is not None)
    assert live_sim is not None
    previous = Policy.uniform(1, Route.DECODE_LOCAL)
    limits = RunnerLimits(max_requests=10, max_duration_s=30, window_s=1.0)
    async with _runner(tmp_path, live_sim, qps=8.0, sessions=8, limits=limits,
                       before=previous) as (runner, store, _):
        with pytest.raises(ActiveCalibrationError, match="bounds") as failed:
            await runner.run()
    rec = _recorded(store)
    forced, desired, acked = rec.forced, rec.desired, rec.acked
    calibrations, pushes, policies = rec.calibrations, rec.pushes, rec.policies
    report = failed.value.report
    assert report is not None and len(report.phases) == 1
    assert report.phases[0].requests_sent == 10  # the budget, not the plan's 32
    assert report.phases[0].stopped == "request budget spent"
    assert report.phases[0].window_ids
    assert [loads(p.body_json).table.routes[0] for p in forced] == [Route.PREFILL_NODE]
    assert {p.version for p in pushes if p.result == "ok"} >= {forced[0].version}
    assert calibrations == []
    back = max(desired.values())
    assert set(desired.values()) == {back} and set(acked.values()) == {back}
    # the policy they ran before (re-issued if the simulator's own v1 differed)
    assert loads(policies[back].body_json).table == previous.table


def test_recalibrate_active_runs_here_only(tmp_path: Path) -> None:
    """`recalibrate --active` is the same run: it needs --local, a config and an endpoint."""
    for args in (["--active"], ["--active", "--local"],
                 ["--active", "--local", "--config", str(tmp_path / "x.toml")]):
        r = CliRunner().invoke(app, ["recalibrate", *args])
        assert r.exit_code == 2, r.output
        assert "--openai" in r.output


@pytest.mark.parametrize("live_sim", ["local"], indirect=True)
def test_on_an_empty_store_the_routers_policy_is_adopted_and_judged_against(
    tmp_path: Path, live_sim: dict[str, Any] | None
) -> None:
    """Routers that already run a policy the store does not know: it is recorded (as the
    daemon's first start does), the first table is judged against it by the guardrail,
    and the routers end on the outcome: the table if approved, else their own policy."""
    require("pdctl sim serve (the live simulated cluster)", live_sim is not None)
    assert live_sim is not None
    report, routers = _calibrate_active(tmp_path, live_sim)

    rec = _recorded(Store(f"sqlite:///{tmp_path / 'history.db'}"))
    policies, desired, acked = rec.policies, rec.desired, rec.acked
    [cal] = rec.calibrations
    adopted = [p for p in policies.values() if p.reason.startswith("adopted: every router")]
    assert len(adopted) == 1 and adopted[0].status == "approved"
    assert set(loads(adopted[0].body_json).table.routes) == {Route.DECODE_LOCAL}
    assert report["phases"][0]["version"] > adopted[0].version  # adopted before forcing
    assert cal.predicted_goodput_current is not None  # judged against the adopted policy
    assert report["predicted_goodput"]["current"] == pytest.approx(
        cal.predicted_goodput_current)
    # What `pdctl rollback` and a promotion watch may return to: never a forced policy.
    approved = {v for v, p in policies.items() if p.status == "approved"}
    assert approved == {adopted[0].version} | (
        {report["policy_version"]} if report["approved"] else set())
    end = report["policy_version"] if report["approved"] else adopted[0].version
    assert report["final_version"] == end
    assert desired == dict.fromkeys(routers, end) and acked == dict.fromkeys(routers, end)


@pytest.mark.parametrize("live_sim", ["local"], indirect=True)
async def test_routers_replaced_on_a_store_with_history_go_back_to_their_own_policy(
    tmp_path: Path, live_sim: dict[str, Any] | None
) -> None:
    """The store's history belongs to routers that are gone (a redeploy under new
    addresses): what the new ones run is adopted, under the next version since its number
    is taken, and a failed run sends them back to it, not to classic P/D."""
    require("pdctl sim serve (the live simulated cluster)", live_sim is not None)
    assert live_sim is not None
    limits = RunnerLimits(max_requests=200, max_duration_s=30, window_s=1.0,
                          request_timeout_s=2.0)
    old = Policy.uniform(1, Route.PREFILL_NODE)
    async with _runner(tmp_path, live_sim, qps=8.0, sessions=4, limits=limits,
                       endpoint="http://127.0.0.1:9/v1") as (runner, store, routers):
        with store.cycle() as tx:
            tx.add_policy(1, old.checksum, dumps(old), "approved", "before the redeploy")
            tx.set_desired("10.0.0.9:50051", 1)
        with pytest.raises(ActiveCalibrationError, match="were answered"):
            await runner.run()
    rec = _recorded(store)
    [adopted] = [p for p in rec.policies.values() if p.reason.startswith("adopted: ")]
    assert adopted.version == 2 and adopted.status == "approved"
    assert "calibrate-active found no configured router with a desired version" \
        in adopted.reason
    assert set(loads(adopted.body_json).table.routes) == {Route.DECODE_LOCAL}
    assert not [p for p in rec.policies.values() if p.reason == FALLBACK_REASON]
    assert {rec.desired[r] for r in routers} == {2}
    assert {rec.acked[r] for r in routers} == {2}


async def test_an_interrupted_run_leaves_routers_that_ran_no_policy_on_classic_pd(
    tmp_path: Path, live_sim: dict[str, Any] | None
) -> None:
    """Ctrl-C in the all-decode-local phase (the task cancelled): the routers ran no policy
    before, so they are sent the forced all-prefill-node table as a new version, recorded
    as the fallback, and no forced policy is desired or running any more."""
    require("pdctl sim serve (the live simulated cluster)", live_sim is not None)
    assert live_sim is not None
    limits = RunnerLimits(max_requests=200, max_duration_s=60, window_s=1.0)
    async with _runner(tmp_path, live_sim, qps=2.0, sessions=8, limits=limits, lead=True
                       ) as (runner, store, routers):
        daemon = LeaseLeadership(store, WallClock(), "daemon", 3.0)

        def forcing_local() -> bool:
            with store.read() as tx:
                return any(p.reason == PHASE_REASON[Route.DECODE_LOCAL]
                           for p in tx.policies())

        run = asyncio.create_task(runner.run())
        for _ in range(300):  # at most 30 s: the first phase is about 8 s of load
            if forcing_local() or run.done():
                break
            await asyncio.sleep(0.1)
        assert forcing_local() and not run.done()
        await asyncio.sleep(1.0)  # into the decode-local load
        # The run holds the lease (renewed past its 3 s lifetime): a daemon started now
        # follows instead of approving over the forced policies.
        assert not await daemon.ensure()
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        assert await daemon.ensure()  # released at the end
        await daemon.release()
    rec = _recorded(store)
    policies, desired, acked, calibrations = rec.policies, rec.desired, rec.acked, \
        rec.calibrations
    forced = rec.forced
    assert len(forced) == 2 and {p.status for p in forced} == {"superseded"}
    [fallback] = [p for p in policies.values() if p.reason == FALLBACK_REASON]
    assert fallback.version == max(policies)  # after both forced ones
    assert set(loads(fallback.body_json).table.routes) == {Route.PREFILL_NODE}
    assert desired == dict.fromkeys(routers, fallback.version)
    assert acked == dict.fromkeys(routers, fallback.version)
    assert calibrations == []


async def test_a_running_daemon_refuses_the_run_before_anything_is_pushed(
    tmp_path: Path, live_sim: dict[str, Any] | None
) -> None:
    require("pdctl sim serve (the live simulated cluster)", live_sim is not None)
    assert live_sim is not None
    limits = RunnerLimits(max_requests=200, max_duration_s=60, window_s=1.0)
    async with _runner(tmp_path, live_sim, qps=2.0, sessions=8, limits=limits, lead=True
                       ) as (runner, store, _):
        daemon = LeaseLeadership(store, WallClock(), "daemon-on-host-1", 15.0)
        assert await daemon.ensure()
        with pytest.raises(ActiveCalibrationError, match="daemon-on-host-1 holds the leader"):
            await runner.run()
        with store.read() as tx:
            assert tx.policies() == [] and tx.pushes() == []
            lease = tx.lease()
        assert lease is not None and lease.holder == "daemon-on-host-1"  # still its
        await daemon.release()
    store.close()


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
def test_sigterm_ends_the_real_process_with_the_routers_sent_back(
    tmp_path: Path, live_sim: dict[str, Any] | None, signame: str
) -> None:
    """`pdctl calibrate-active` as a real process, terminated (systemd, kubectl, `timeout`;
    SIGHUP: its terminal closed) during the all-decode-local phase: exit 143, the lease
    released, and the routers, which ran no policy, are on classic P/D, not on the forced
    policy."""
    require("pdctl sim serve (the live simulated cluster)", live_sim is not None)
    assert live_sim is not None
    import signal
    import subprocess
    import time

    from tests.support.processes import PDCTL, REPO

    config = _config(tmp_path, live_sim)
    url = f"sqlite:///{tmp_path / 'history.db'}"
    store = Store(url)
    store.upgrade()
    proc = subprocess.Popen(
        [*PDCTL, "calibrate-active", "--config", str(config),
         "--openai", live_sim["routers"][0]["openai"], "--contexts", "256", "--turns",
         "32:32", "--qps", "2", "--sessions", "8", "--window", "1.0", "--json"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 40  # the first phase is about 8 s of load
        while time.monotonic() < deadline and proc.poll() is None:
            with store.read() as tx:
                if any(p.reason == PHASE_REASON[Route.DECODE_LOCAL] for p in tx.policies()):
                    break
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before its decode-local phase"
        time.sleep(1.0)
        proc.send_signal(getattr(signal, signame))
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert proc.returncode == 143, err
    rec = _recorded(store)
    policies, desired, acked, lease = rec.policies, rec.desired, rec.acked, rec.lease
    [fallback] = [p for p in policies.values() if p.reason == FALLBACK_REASON]
    routers = [r["grpc"] for r in live_sim["routers"]]
    assert desired == dict.fromkeys(routers, fallback.version)
    assert acked == dict.fromkeys(routers, fallback.version)
    assert lease is None or lease.holder is None  # released
    assert f"terminated; routers sent back to v{fallback.version} (acknowledged by 2 of 2)" \
        in err
    report = json.loads(out.strip().splitlines()[-1])  # --json: what was done until then
    assert report["error"] == "terminated"
    assert [ph["name"] for ph in report["phases"]] == ["all-prefill-node", "all-decode-local"]
    assert report["final_version"] == fallback.version


async def test_what_would_fail_mid_run_refuses_it_first_or_stops_it_at_once(
    tmp_path: Path, live_sim: dict[str, Any] | None
) -> None:
    """An operator's pin, a router that does not answer: refused before anything is pushed.
    Requests nobody answers: the first phase fails (its windows would not be the grid) and
    the routers go back."""
    require("pdctl sim serve (the live simulated cluster)", live_sim is not None)
    assert live_sim is not None
    before = Policy.uniform(1, Route.DECODE_LOCAL)
    limits = RunnerLimits(max_requests=200, max_duration_s=30, window_s=1.0,
                          request_timeout_s=2.0)
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("pinned", {}, "an operator holds the rollout: pinned to v1"),
        ("pin waiting", {}, r"operator requests wait for the daemon: #\d+ pin v1, "
                            r"#\d+ fallback; start the daemon"),
        ("unreachable", {"extra_router": "127.0.0.1:9"},
         "not every router answered, nothing was pushed: 127.0.0.1:9"),
        ("unanswered", {"endpoint": "http://127.0.0.1:9/v1"},
         r"all-prefill-node: only 0 of \d+ requests were answered"),
    ]
    for name, options, message in cases:
        (tmp_path / name).mkdir()
        async with _runner(tmp_path / name, live_sim, qps=8.0, sessions=4, limits=limits,
                           before=before, **options) as (runner, store, routers):
            if name == "pinned":
                with store.cycle() as tx:
                    rid = tx.add_request("pause", {"what": "pin", "version": 1}, "ops")
                    tx.finish_request(rid, "pinned v1 on every router")
            if name == "pin waiting":  # filed while the daemon was stopped
                with store.cycle() as tx:
                    tx.add_request("pause", {"what": "pin", "version": 1}, "ops")
                    tx.add_request("rollback", {"to": FALLBACK_PREFILL}, "ops")
                    tx.add_request("recalibrate", {}, "ops")  # no hold: not listed
            started: list[bool] = []
            runner.on_start = functools.partial(started.append, True)
            with pytest.raises(ActiveCalibrationError, match=message):
                await runner.run()
            assert started == ([True] if name == "unanswered" else []), name
        rec = _recorded(store)
        forced, desired, acked = rec.forced, rec.desired, rec.acked
        assert desired == dict.fromkeys(routers, 1), name
        if name == "unanswered":  # forced, then sent back
            assert len(forced) == 1 and forced[0].status == "superseded"
            assert acked == dict.fromkeys(routers, 1)
        else:
            assert forced == [], name
