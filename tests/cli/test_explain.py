"""`pdctl explain` and `pdctl drift` against a store holding a calibration the way the daemon
records it (synthetic windows from a known cluster, tests/core/synth.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from controller.cli import app
from controller.config import load_settings
from controller.loop.learning import CoreLearner
from controller.policy import Features, Policy, Route, decide, dumps, loads
from controller.store import CalibrationRecord
from tests.core.synth import Mix, Truth, stationary, training_windows
from tests.support.cli_store import (
    ROUTER,
    invoke_json,
    open_store,
    record_calibration,
    write_config,
)

runner = CliRunner()


def _config(tmp_path: Path) -> Path:
    return write_config(tmp_path, "[drift]\ncooldown_s = 60")


def _calibrated(config: Path) -> int:
    return record_calibration(config)[0]


def _drift_json(config: Path, last: int) -> dict[str, Any]:
    return invoke_json("drift", "--json", "--last", str(last), "--config", str(config))


# A later turn's features, as explain's flags, for the tests that replace the learned table.
EXPLAIN_ARGS = ["explain", "--turn", "3", "--context", "24576", "--append", "141",
                "--output", "200", "--qps", "2"]
EXPLAIN_FEATURES = Features(3, 24576, 141, 200, 2.0)


@dataclass(frozen=True)
class FirstCalibration:
    """A store with one approved calibration, and the route its table takes for
    :data:`EXPLAIN_FEATURES` (``ours``) and the route it does not (``other``)."""

    config: Path
    version: int
    calibration: CalibrationRecord
    learned: Policy
    ours: Route
    other: Route


def _first_calibration(tmp_path: Path) -> FirstCalibration:
    config = _config(tmp_path)
    version = _calibrated(config)
    store = open_store(config)
    try:
        with store.read() as tx:
            rec, cal = tx.policy(version), tx.calibration_for(version)
    finally:
        store.close()
    assert rec is not None and cal is not None
    learned = loads(rec.body_json)
    ours = decide(learned, EXPLAIN_FEATURES, lambda: 1.0).route
    other = Route.DECODE_LOCAL if ours == Route.PREFILL_NODE else Route.PREFILL_NODE
    return FirstCalibration(config, version, cal, learned, ours, other)


def test_no_calibration_is_a_clear_error(tmp_path: Path) -> None:
    config = _config(tmp_path)
    open_store(config).close()
    for args in (["explain", "--turn", "2", "--context", "1000", "--append", "100",
                  "--output", "100", "--qps", "1"], ["drift"]):
        r = runner.invoke(app, [*args, "--config", str(config)])
        assert r.exit_code == 2, r.output
        assert "no calibration" in r.output


def test_explain_shows_the_stored_policy_decision_with_refitted_predictions(
    tmp_path: Path,
) -> None:
    config = _config(tmp_path)
    version = _calibrated(config)
    store = open_store(config)
    try:
        with store.read() as tx:
            rec = tx.policy(version)
        assert rec is not None
        policy = loads(rec.body_json)
    finally:
        store.close()

    docs = {}
    # Two cells of the synthetic mix (router bins (1, 2) and (7, 3)), so both were measured.
    for context, append in ((384, 70), (24576, 141)):
        r = runner.invoke(app, ["explain", "--turn", "3", "--context", str(context),
                                "--append", str(append), "--output", "200", "--qps", "2",
                                "--json", "--config", str(config)])
        assert r.exit_code == 0, r.output
        doc = json.loads(r.output)
        docs[context] = doc
        expected = decide(policy, Features(3, context, append, 200, 2.0), lambda: 1.0)
        assert doc["policy_version"] == version
        assert doc["decision"] == expected.route.name
        assert expected.cell is not None
        assert tuple(doc["cell"].values()) == expected.cell
        idx = policy.table.axes.cell_index(*expected.cell)
        assert doc["score"] == pytest.approx(policy.table.scores[idx])
        assert doc["weights"] == {"wtft": policy.weights.wtft, "wtpot": policy.weights.wtpot}
        # the score's sign is the decision (DESIGN §2)
        assert (doc["score"] > 0) == (policy.table.routes[idx] == Route.DECODE_LOCAL)
        for route in ("PREFILL_NODE", "DECODE_LOCAL"):
            assert doc["predicted"][route]["ttft_s"] > 0
            assert doc["predicted"][route]["tpot_s"] > 0
        assert doc["samples"]["rarer_route_requests"] > 0  # the mix covers these cells
        # What it compared reproduces the score (the predictions alone contradicted it)
        c, w = doc["compared"], doc["weights"]
        p_, l_ = c["PREFILL_NODE"], c["DECODE_LOCAL"]
        assert doc["score"] == pytest.approx(
            w["wtft"] * (p_["ttft_s"] - l_["ttft_s"]) / p_["ttft_s"]
            - w["wtpot"] * (l_["tpot_s"] - p_["tpot_s"]) / p_["tpot_s"], rel=1e-6, abs=1e-9)
    # A 64x longer context costs the prefill-node route more time to first token.
    assert (docs[24576]["predicted"]["PREFILL_NODE"]["ttft_s"]
            > docs[384]["predicted"]["PREFILL_NODE"]["ttft_s"])

    human = runner.invoke(app, ["explain", "--turn", "3", "--context", "300", "--append",
                                "200", "--output", "200", "--qps", "2", "--config",
                                str(config)])
    assert human.exit_code == 0, human.output
    assert f"policy v{version}" in human.output and "confidence" in human.output
    assert "scored as TTFT" in human.output


def test_explain_a_re_issued_version_with_the_calibration_its_table_came_from(
    tmp_path: Path,
) -> None:
    """A version with no calibration of its own (re-issued above a router that was ahead)
    is explained with the calibration that learned its table, not with a later candidate
    the guardrail refused."""
    from dataclasses import replace

    from controller.policy import LookupTable

    cal = _first_calibration(tmp_path)
    config, first, first_cal, learned = cal.config, cal.version, cal.calibration, cal.learned
    ours, other = cal.ours, cal.other
    store = open_store(config)
    try:
        with store.cycle() as tx:  # a refused candidate routing every cell the other way
            refused = tx.next_version()
            table = LookupTable.uniform(other, axes=learned.table.axes)
            candidate = replace(learned, table=table).with_version(refused)
            tx.add_policy(refused, candidate.checksum, dumps(candidate), "rejected", "no")
            tx.add_calibration(first_cal.training_window_ids, first_cal.heldout_error, 0.5,
                               0.9, refused, {"approved": False})
        with store.cycle() as tx:  # the learned table re-issued above a router ahead
            again = tx.next_version()
            reissued = learned.with_version(again)
            tx.add_policy(again, reissued.checksum, dumps(reissued), "approved",
                          f"v{first} re-issued above a router that was ahead")
            tx.set_desired(ROUTER, again)
    finally:
        store.close()
    args = [*EXPLAIN_ARGS, "--config", str(config)]
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["decision"] == ours.name
    assert doc["policy_version"] == again and doc["calibration_policy_version"] == first
    assert doc["calibration_id"] == first_cal.id
    c, w = doc["compared"], doc["weights"]  # the stored table's score, as it was scored
    p_, l_ = c["PREFILL_NODE"], c["DECODE_LOCAL"]
    assert doc["score"] == pytest.approx(
        w["wtft"] * (p_["ttft_s"] - l_["ttft_s"]) / p_["ttft_s"]
        - w["wtpot"] * (l_["tpot_s"] - p_["tpot_s"]) / p_["tpot_s"], rel=1e-6, abs=1e-9)
    human = runner.invoke(app, args)
    assert f"policy v{again}, learned for v{first}" in human.output, human.output


def test_explain_and_drift_after_an_adoption_use_the_newest_model(tmp_path: Path) -> None:
    """On a first start the daemon adopts the routers' own policy (v1, no calibration) and
    later calibrations may all be refused: explain and drift said "no calibration yet"
    against a running daemon."""

    config = _config(tmp_path)
    windows = training_windows(Truth(), Mix(), 60, seed=1)
    adopted = Policy.uniform(1, Route.PREFILL_NODE)
    store = open_store(config)
    try:
        with store.cycle() as tx:
            ids = [tx.add_window(w) for w in windows]
            tx.add_policy(1, adopted.checksum, dumps(adopted), "approved", "adopted: routers")
            tx.set_desired(ROUTER, 1)
        outcome = CoreLearner(load_settings(config)).calibrate(windows, None, windows[-1].end,
                                                               "test")
        with store.cycle() as tx:  # a candidate the guardrail refused, after the adoption
            refused = outcome.policy.with_version(tx.next_version())
            tx.add_policy(refused.version, refused.checksum, dumps(refused), "rejected", "no")
            tx.add_calibration(ids, outcome.heldout_error, outcome.predicted_goodput_new, 0.9,
                               refused.version, {**outcome.details, "approved": False})
    finally:
        store.close()
    r = runner.invoke(app, ["explain", "--turn", "3", "--context", "24576", "--append", "141",
                            "--output", "200", "--qps", "2", "--json", "--config", str(config)])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["policy_version"] == 1 and doc["decision"] == "PREFILL_NODE"
    assert doc["calibration_policy_version"] == refused.version
    assert runner.invoke(app, ["drift", "--config", str(config)]).exit_code == 0


def test_drift_replays_the_detectors_over_the_windows_stored_since(tmp_path: Path) -> None:
    config = _config(tmp_path)
    _calibrated(config)
    base = training_windows(Truth(), Mix(), 60, seed=1)[-1].end
    calm = stationary(Truth(), Mix(), 2.0, 0.5, 6, seed=7, start=base)
    shifted = stationary(Truth(), Mix().scaled_context(3.0), 2.0, 0.5, 6, seed=8,
                         start=calm[-1].end)
    store = open_store(config)
    try:
        with store.cycle() as tx:
            for w in calm + shifted:
                tx.add_window(w)
    finally:
        store.close()

    doc = _drift_json(config, last=8)
    assert doc["windows_replayed"] == 12
    assert len(doc["history"]) == 8
    assert doc["now"] == doc["history"][-1]
    workload = [h["detectors"]["workload"] for h in doc["history"]]
    # history = the last 2 calm windows, then the 6 shifted ones; the 60 s cooldown after
    # the calibration (30 s windows) is over by then
    assert not any(w["in_cooldown"] for w in workload[:3])
    assert not any(w["fired"] for w in workload[:2])
    assert any(w["fired"] for w in workload[2:5])  # within 3 windows of the shift
    assert all(w["statistic"] > w["threshold"] for w in workload[2:])
    assert set(doc["now"]["detectors"]) == {"workload", "performance", "slo"}

    human = runner.invoke(app, ["drift", "--last", "3", "--config", str(config)])
    assert human.exit_code == 0, human.output
    assert "FIRED" in human.output and "workload" in human.output


def test_drift_replays_from_the_reference_a_refused_calibration_renewed(
        tmp_path: Path) -> None:
    # Like the daemon (controller.loop.policies.reference_calibration): a calibration refused on the
    # traffic since a change alone renews the running policy's reference, so `pdctl drift`
    # measures against the shifted traffic, which no longer fires.
    from controller.core.drift import reference_from_windows

    config = _config(tmp_path)
    version = _calibrated(config)
    base = training_windows(Truth(), Mix(), 60, seed=1)[-1].end
    shifted = stationary(Truth(), Mix().scaled_context(3.0), 2.0, 0.5, 16, seed=8, start=base)
    judged, later = shifted[:10], shifted[10:]
    store = open_store(config)
    try:
        with store.cycle() as tx:
            ids = [tx.add_window(w) for w in judged]
            candidate = loads(tx.policy(version).body_json).with_version(version + 1)  # type: ignore[union-attr]
            tx.add_policy(candidate.version, candidate.checksum, dumps(candidate), "rejected",
                          "rejected: scripted")
            renewal = tx.add_calibration(
                ids, {}, 0.9, 0.9, version + 1,
                {"approved": False, "regime_only": True, "reference_for": version,
                 "drift_reference": reference_from_windows(judged, None).to_dict()},
                at=datetime.fromtimestamp(judged[-1].end, tz=UTC))
            for w in later:
                tx.add_window(w)
    finally:
        store.close()
    doc = _drift_json(config, last=6)
    assert doc["calibration_id"] == renewal and doc["policy_version"] == version
    assert doc["windows_replayed"] == len(later)
    assert not any(h["detectors"]["workload"]["fired"] for h in doc["history"])


def test_drift_of_an_adopted_version_replays_from_its_renewal_not_a_later_dry_run(
        tmp_path: Path) -> None:
    # An adopted version has no calibration of its own: the daemon measures drift against
    # the calibration that renewed its reference (reference_for). A later dry run
    # (`recalibrate --dry-run`) renews nothing; `pdctl drift` used to replay from it and
    # print "policy vNone".
    from controller.core.drift import reference_from_windows

    config = _config(tmp_path)
    windows = training_windows(Truth(), Mix(), 60, seed=1)
    base = windows[-1].end
    shifted = stationary(Truth(), Mix().scaled_context(3.0), 2.0, 0.5, 16, seed=8, start=base)
    judged, later = shifted[:8], shifted[8:]
    outcome = CoreLearner(load_settings(config)).calibrate(windows, None, base, "test")
    store = open_store(config)
    try:
        with store.cycle() as tx:
            ids = [tx.add_window(w) for w in windows]
            adopted = outcome.policy.with_version(1)
            tx.add_policy(1, adopted.checksum, dumps(adopted), "approved", "adopted: routers")
            tx.set_desired(ROUTER, 1)
            judged_ids = [tx.add_window(w) for w in judged]
            refused = outcome.policy.with_version(2)
            tx.add_policy(2, refused.checksum, dumps(refused), "rejected", "no")
            renewal = tx.add_calibration(
                judged_ids, {}, 0.9, 0.9, 2,
                {"approved": False, "reference_for": 1,
                 "drift_reference": reference_from_windows(judged, None).to_dict()},
                at=datetime.fromtimestamp(judged[-1].end, tz=UTC))
            later_ids = [tx.add_window(w) for w in later]
            tx.add_calibration(  # the dry run: trained on every window, no policy
                ids + judged_ids + later_ids[:4], outcome.heldout_error, 0.9, 0.9, None,
                {**outcome.details, "dry_run": True, "approved": False,
                 "drift_reference": reference_from_windows(later[:4], None).to_dict()},
                at=datetime.fromtimestamp(later[3].end, tz=UTC))
    finally:
        store.close()
    doc = _drift_json(config, last=8)
    assert doc["calibration_id"] == renewal and doc["policy_version"] == 1
    assert doc["windows_replayed"] == len(later)
    human = runner.invoke(app, ["drift", "--config", str(config)])
    assert f"calibration #{renewal} (policy v1)" in human.output, human.output


def test_explain_by_calibration_uses_its_refused_candidate_kept_without_a_version(
        tmp_path: Path) -> None:
    """A candidate the guardrail refused takes no version: it is kept with its calibration,
    and `explain --calibration ID` decides with it; the routers' explain is unchanged."""
    from dataclasses import replace

    from controller.policy import LookupTable

    cal = _first_calibration(tmp_path)
    config, first, first_cal, learned = cal.config, cal.version, cal.calibration, cal.learned
    ours, other = cal.ours, cal.other
    store = open_store(config)
    try:
        candidate = replace(learned, table=LookupTable.uniform(other, axes=learned.table.axes))
        with store.cycle() as tx:
            kept = tx.add_calibration(first_cal.training_window_ids, first_cal.heldout_error,
                                      0.5, 0.9, None, {"approved": False, "reason": "no"},
                                      candidate=(dumps(candidate), candidate.checksum))
            assert tx.next_version() == first + 1
    finally:
        store.close()
    args = [*EXPLAIN_ARGS, "--config", str(config)]
    r = runner.invoke(app, [*args, "--json", "--calibration", str(kept)])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["decision"] == other.name and doc["calibration_id"] == kept
    assert doc["rejected_candidate"] is True and doc["policy_version"] is None
    human = runner.invoke(app, [*args, "--calibration", str(kept)])
    assert "its candidate, refused by the guardrail: no version" in human.output, human.output
    current = json.loads(runner.invoke(app, [*args, "--json"]).output)
    assert current["decision"] == ours.name and current["policy_version"] == first
    missing = runner.invoke(app, [*args, "--calibration", "99"])
    assert missing.exit_code == 2 and "no calibration #99" in missing.output
