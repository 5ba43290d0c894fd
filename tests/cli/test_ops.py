"""`pdctl status` and the operator requests, against a store a virtual-time cycle works on."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from controller.cli import app
from tests.daemon.fakes import Rig, make_rig
from tests.support.cli_store import upgraded_store

runner = CliRunner()


def _url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'history.db'}"


def _invoke_with_a_cycle(rig: Rig, args: list[str]) -> Result:
    """Run ``pdctl ARGS`` while the daemon's next cycle runs half a second later in another
    thread (what a --wait command waits for)."""

    def daemon_cycle_later() -> None:
        time.sleep(0.5)
        asyncio.run(rig.step())

    worker = threading.Thread(target=daemon_cycle_later)
    worker.start()
    try:
        return runner.invoke(app, args)
    finally:
        worker.join(30)


async def _bootstrap(rig: Rig) -> None:
    for _ in range(4):
        if (await rig.step()).approved_version == 1:
            return
    raise AssertionError("no bootstrap policy")


async def test_status_shows_leader_versions_routers_calibration_and_operator_state(
    tmp_path: Path
) -> None:
    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    result = runner.invoke(app, ["pause", "--url", _url(tmp_path), "--who", "ops@box",
                                 "--reason", "maintenance", "--json"])
    assert result.exit_code == 0, result.output
    req = json.loads(result.output)
    assert (req["kind"], req["who"], req["reason"], req["status"]) == \
        ("pause", "ops@box", "maintenance", "pending")
    await rig.step()

    result = runner.invoke(app, ["status", "--url", _url(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["fleet_version"] == 1 and doc["canary"] is None
    assert [(r["router"], r["desired"], r["acked"], r["health"]) for r in doc["routers"]] == \
        [(r, 1, 1, "ok") for r in sorted(rig.agents)]
    assert doc["last_calibration"]["policy_version"] == 1
    assert doc["last_calibration"]["approved"] is True
    assert doc["operator"]["paused"] is True and doc["operator"]["pending_requests"] == []
    assert doc["leader"] is None  # the rig runs without a lease

    text = runner.invoke(app, ["status", "--url", _url(tmp_path)])
    assert text.exit_code == 0 and "PAUSED" in text.output and "v1" in text.output


async def test_wait_returns_the_daemon_outcome_or_times_out(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    timed_out = runner.invoke(app, ["pin", "1", "--url", _url(tmp_path), "--wait",
                                    "--timeout", "0.3"])
    assert timed_out.exit_code == 4, timed_out.output
    assert "request #" in timed_out.stderr and "still pending" in timed_out.stderr
    await rig.step()  # the daemon picks up the pin

    refused = _invoke_with_a_cycle(rig, ["pin", "99", "--url", _url(tmp_path), "--wait",
                                         "--timeout", "30", "--json"])
    assert refused.exit_code == 1, refused.output
    doc = json.loads(refused.output)
    assert doc["status"] == "failed" and "no such version" in doc["outcome"]


async def test_a_negative_timeout_is_refused_before_a_request_is_written(
        tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    result = runner.invoke(app, ["pause", "--url", _url(tmp_path), "--wait", "--timeout", "-5"])
    assert result.exit_code == 2 and "--timeout" in result.output
    listed = runner.invoke(app, ["history", "requests", "--url", _url(tmp_path), "--json"])
    assert listed.exit_code == 0 and json.loads(listed.output) == []


def test_request_commands_document_their_exit_codes() -> None:
    for command in ("pause", "resume", "pin", "unpin", "fallback", "rollback", "exploration",
                    "recalibrate"):
        out = runner.invoke(app, [command, "--help"], terminal_width=200).output
        assert "4 --wait timed out" in out, (command, out)


def test_bad_input_and_missing_schema(tmp_path: Path) -> None:
    assert runner.invoke(app, ["fallback", "decode", "--url", _url(tmp_path)]).exit_code == 2
    assert runner.invoke(app, ["exploration", "maybe", "--url", _url(tmp_path)]).exit_code == 2
    for command in ("pin", "rollback"):  # beyond 2**63-1 no policy can have the version
        result = runner.invoke(app, [command, str(2**64), "--url", _url(tmp_path)])
        assert result.exit_code == 2 and "9223372036854775807" in result.output, result.output
    result = runner.invoke(app, ["pause", "--url", _url(tmp_path)])
    assert result.exit_code == 3 and "pdctl db upgrade" in result.output


def test_a_request_names_the_uid_s_account_when_user_is_unset(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `kubectl exec` shell or a cron job has no $USER: the request still names someone."""
    import pwd
    import socket

    from controller.store import Store

    url = _url(tmp_path)
    Store(url).upgrade()
    monkeypatch.delenv("USER", raising=False)
    monkeypatch.delenv("LOGNAME", raising=False)
    assert runner.invoke(app, ["pause", "--url", url, "--reason", "r"]).exit_code == 0
    (request,) = Store(url).requests()
    assert request.who == f"{pwd.getpwuid(os.getuid()).pw_name}@{socket.gethostname()}"
    monkeypatch.setenv("USER", "alice")
    assert runner.invoke(app, ["resume", "--url", url, "--reason", "r"]).exit_code == 0
    assert [r.who for r in Store(url).requests()][-1] == f"alice@{socket.gethostname()}"


def test_run_requires_a_config_file(tmp_path: Path) -> None:
    result = runner.invoke(app, ["run"])
    assert result.exit_code == 2 and "--config" in result.output
    missing = runner.invoke(app, ["run", "--config", str(tmp_path / "nope.toml")])
    assert missing.exit_code == 2


async def test_status_shows_a_promotion_under_watch_until_its_watch_ends(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from controller.cli.ops_cmd import _print_status, status_doc

    rig = make_rig(tmp_path)
    await _bootstrap(rig)
    rig.source.goodput = {1: 0.90, 2: 0.97}
    rig.learner.fire = True
    for _ in range(6):
        if "promoted" in ((await rig.step()).canary or ""):
            break
    watch_s = rig.config.watch_s
    assert watch_s == (rig.config.judge.watch_windows + 1) * rig.config.interval_s
    doc = status_doc(rig.store, None, watch_s)
    assert doc["fleet_version"] == 2 and doc["watch"] is not None
    assert doc["watch"]["version"] == 2
    assert (doc["watch"]["until"] - doc["watch"]["promoted_at"]).total_seconds() == watch_s
    _print_status(doc)
    assert "watch    v2 promoted at" in capsys.readouterr().out
    assert status_doc(rig.store, None, None)["watch"] is None  # the watch turned off
    for _ in range(rig.config.judge.watch_windows + 2):
        await rig.step()
    assert status_doc(rig.store, None, watch_s)["watch"] is None


async def test_status_says_when_the_leader_last_observed_and_flags_it_stale(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through an outage of Prometheus or the workers every cycle is skipped and nothing in
    the store changes: the status screen looked healthy. It now says when the newest window
    ended and flags it past stalled_after_s."""
    from controller.cli.ops_cmd import _print_status, status_doc

    rig = make_rig(tmp_path)
    assert status_doc(rig.store, None)["observed"]["last_window_end"] is None
    await _bootstrap(rig)
    fresh = status_doc(rig.store, None, stalled_after_s=120.0)["observed"]
    assert fresh["age_s"] == 0.0 and fresh["stale"] is False
    rig.clock.advance(121)  # no cycle observed meanwhile
    doc = status_doc(rig.store, None, stalled_after_s=120.0)
    assert doc["observed"]["age_s"] == 121.0 and doc["observed"]["stale"] is True
    _print_status(doc)
    out = capsys.readouterr().out
    assert "observed last window ended at" in out and "(121 s ago)  STALE" in out
    assert status_doc(rig.store, None)["observed"]["stale"] is None  # no limit given


def test_status_names_a_forced_policy_a_killed_calibrate_active_left_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from controller.cli.ops_cmd import _print_status, status_doc
    from controller.loop.calibration_runner import PHASE_REASON
    from controller.policy import Policy, Route, dumps

    store = upgraded_store(f"sqlite:///{tmp_path / 'h.db'}")
    try:
        for version, reason in ((1, "adopted: every router runs v1"),
                                (2, PHASE_REASON[Route.DECODE_LOCAL])):
            policy = Policy.uniform(version, Route.DECODE_LOCAL)
            with store.cycle() as tx:
                tx.add_policy(version, policy.checksum, dumps(policy), "approved", reason)
                tx.set_desired("r1", version)
            doc = status_doc(store, None, None)
            assert doc["fleet_version"] == version
            assert doc["fleet_forced"] is (version == 2)
            _print_status(doc)
            assert ("forced   v2 is a forced `pdctl calibrate-active` policy"
                    in capsys.readouterr().out) is (version == 2)
    finally:
        store.close()


def test_status_lists_the_configured_routers_before_the_store_knows_them(
    tmp_path: Path,
) -> None:
    db = tmp_path / "h.db"
    config = tmp_path / "pd.toml"
    config.write_text(f'[store]\nurl = "sqlite:///{db}"\n'
                      '[routers]\ntargets = ["10.0.0.1:50151", "10.0.0.2:50151"]\n')
    assert runner.invoke(app, ["db", "upgrade", "-c", str(config)]).exit_code == 0
    result = runner.invoke(app, ["status", "--json", "-c", str(config)])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["routers"]
    assert [(r["router"], r["health"]) for r in rows] == [
        ("10.0.0.1:50151", "no policy yet"), ("10.0.0.2:50151", "no policy yet")]


def test_status_reads_the_rollout_of_the_configured_routers_and_a_held_candidate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A router taken out of [routers] targets keeps its rows: read with it, the fleet's
    version looked like a canary on the router left (the cycle reads the configured ones).
    A recalibration held by an operator is a stored candidate, not "approved"."""
    from controller.cli.ops_cmd import _print_status, status_doc
    from controller.policy import Policy, Route, dumps

    store = upgraded_store(f"sqlite:///{tmp_path / 'h.db'}")
    try:
        with store.cycle() as tx:
            for version, status in ((1, "approved"), (2, "approved"), (3, "candidate")):
                policy = Policy.uniform(version, Route.DECODE_LOCAL)
                tx.add_policy(version, policy.checksum, dumps(policy), status, "test")
            tx.set_desired("r1", 1)
            tx.set_desired("r2", 1)
            tx.set_desired("r1", 2)  # r2 left the targets; r1 alone runs v2
            tx.add_calibration([], {}, 0.9, 0.8, 3,
                               {"approved": True, "trigger": "operator", "reason": "paused"})
        everyone = status_doc(store, None, None)
        assert everyone["canary"] is not None  # the stale row's reading
        doc = status_doc(store, None, None, configured=["r1"])
        assert doc["fleet_version"] == 2 and doc["canary"] is None
        assert [(r["router"], r["health"]) for r in doc["routers"]] == [
            ("r1", "behind"), ("r2", "not in [routers] targets")]
        assert doc["last_calibration"]["policy_status"] == "candidate"
        _print_status(doc)
        out = capsys.readouterr().out
        assert "held as a candidate v3" in out and "approved v3" not in out
    finally:
        store.close()


async def test_a_dry_run_says_what_it_would_do_and_never_done_approved(tmp_path: Path) -> None:
    """`recalibrate --dry-run --wait` printed "done — approved: …" for a calibration that
    approved nothing and stored no policy."""
    rig = make_rig(tmp_path)
    await _bootstrap(rig)

    def run(approve: bool) -> str:
        rig.learner.approve = approve
        result = _invoke_with_a_cycle(rig, ["recalibrate", "--dry-run", "--wait", "--timeout",
                                            "30", "--url", _url(tmp_path)])
        assert result.exit_code == 0, result.output
        return result.output

    before = rig.store.next_version()
    would = run(approve=True)
    assert "dry run: would approve; nothing stored (guardrail: approved: scripted)" in would
    assert "done" not in would and "— approved" not in would, would
    refused = run(approve=False)
    assert "dry run: would reject; nothing stored (guardrail: rejected: scripted)" in refused
    assert rig.store.next_version() == before  # neither stored a policy
    # The request's stored outcome says so too (`pdctl history requests`).
    outcomes = [r.outcome for r in rig.store.requests() if r.kind == "recalibrate"]
    assert [o.split(";")[0] for o in outcomes if o] == ["dry run: would approve",
                                                        "dry run: would reject"]


def test_a_dry_run_outcome_an_older_daemon_recorded_still_reads_as_a_dry_run() -> None:
    from types import SimpleNamespace

    from controller.cli.ops_cmd import request_line

    old = SimpleNamespace(id=3, kind="recalibrate", args={"dry_run": True, "force": False},
                          who="ops@box", status="done",
                          outcome="approved: predicted goodput 0.94 vs current 0.91")
    line = request_line(old)
    assert line.endswith("dry run: would approve; nothing stored (guardrail: approved: "
                         "predicted goodput 0.94 vs current 0.91)"), line
    assert "done" not in line
    rejected = request_line(SimpleNamespace(**{**old.__dict__, "outcome": "rejected: x"}))
    assert "dry run: would reject" in rejected
    # A request that is not a dry run reads as before.
    real = request_line(SimpleNamespace(**{**old.__dict__, "args": {"dry_run": False}}))
    assert real.endswith(": done — approved: predicted goodput 0.94 vs current 0.91")


def test_status_names_a_refused_candidate_kept_with_its_calibration(tmp_path: Path) -> None:
    from controller.store import Store

    with Store(_url(tmp_path)) as store:
        store.upgrade()
        store.add_calibration([], {}, 0.8, 0.9, None, {"approved": False, "reason": "worse",
                                                       "trigger": "drift"},
                              candidate=("{}", "ab" * 32))
    doc = json.loads(runner.invoke(app, ["status", "--url", _url(tmp_path), "--json"]).output)
    cal = doc["last_calibration"]
    assert (cal["policy_version"], cal["policy_status"], cal["not_stored"]) == \
        (None, "rejected", None)
    text = runner.invoke(app, ["status", "--url", _url(tmp_path)])
    assert text.exit_code == 0, text.output
    assert "not approved (its candidate kept, no version" in text.output
