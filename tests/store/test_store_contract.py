"""The store contract: the same assertions on SQLite and PostgreSQL."""

from __future__ import annotations

import gc
import json
import random
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import TypeVar

import pytest
from sqlalchemy import insert

from controller.clock import VirtualClock
from controller.core.window import Family, Window
from controller.store import Store, StoreError, repository
from controller.store.models import WindowRow
from tests.store.factories import sample_window

T = TypeVar("T")
T0 = datetime(2027, 1, 15, 12, 0, 0, 123456, tzinfo=UTC)
DATA = Path(__file__).resolve().parent / "data"


def _epoch(dt: datetime) -> float:
    return dt.timestamp()


# -- windows ---------------------------------------------------------------------------


def test_window_round_trip_is_exact(store: Store) -> None:
    rng = random.Random(7)
    written = [sample_window(rng, _epoch(T0) + 30 * i + 0.1 + 0.2) for i in range(5)]
    ids = [store.add_window(w) for w in written]
    assert ids == sorted(ids) and len(set(ids)) == 5

    back = store.windows()
    assert [sw.id for sw in back] == ids
    assert [sw.window for sw in back] == written  # every float, None and inf edge exact
    assert back[0].window.workers[0].ttft_s == written[0].workers[0].ttft_s
    # Request outcomes and the families an engine does not export are stored with the body.
    first = back[0].window.workers
    assert [w.aborted for w in first[:3]] == [None, 1.0, None]
    assert first[0].errored == 0.0 and first[0].missing == (Family.KV_TRANSFER, Family.TTFT)
    assert first[1].missing == () and first[5].missing == (Family.KV_TRANSFER, Family.TTFT)
    assert store.windows_by_ids([ids[3], ids[1]]) == [back[1], back[3]]


def test_a_window_row_in_the_first_body_format_still_reads(store: Store) -> None:
    # Rows written before body format 2 (plain worker dicts, column-major packed outcomes),
    # next to one written now; the fixture was made by the code of that time.
    fixture = json.loads((DATA / "window_format1.json").read_text())
    expected = Window.from_dict(fixture["plain"])
    with store.engine.begin() as conn:
        conn.execute(insert(WindowRow).values(
            start_at=datetime.fromtimestamp(expected.start, UTC),
            end_at=datetime.fromtimestamp(expected.end, UTC), interval_s=expected.interval_s,
            source=expected.source, n_workers=len(expected.workers),
            n_failures=len(expected.failures), requests=None, body=fixture["stored_body"],
        ))
    new_id = store.add_window(expected)
    back = store.windows()
    assert [sw.window for sw in back] == [expected, expected]
    assert back[1].id == new_id and store.windows_by_ids([back[0].id])[0].window == expected


@pytest.mark.parametrize("promote_after", [1, 10**9])
def test_reading_windows_leaves_the_garbage_collector_as_it_was(
    store: Store, monkeypatch: pytest.MonkeyPatch, promote_after: int
) -> None:
    # The bulk decode pauses the collector and, for a large read, moves what it made to the
    # oldest generation; the application's own settings (collector off, objects frozen
    # before a fork) must survive it.
    monkeypatch.setattr(repository, "PROMOTE_DECODED_WINDOWS", promote_after)
    store.add_window(sample_window(random.Random(5), _epoch(T0), n_routers=1, cells=2))
    assert gc.isenabled()
    window = store.windows()[0].window
    assert gc.isenabled()
    promoted = any(o is window for o in gc.get_objects(generation=2))
    assert promoted == (promote_after == 1)
    gc.disable()
    try:
        assert len(store.windows()) == 1 and not gc.isenabled()
    finally:
        gc.enable()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0 and len(store.windows()) == 1
        assert gc.get_freeze_count() > frozen // 2  # an unfreeze would have made it 0
    finally:
        gc.unfreeze()


def test_windows_since_and_limit_select_the_newest(store: Store) -> None:
    rng = random.Random(8)
    starts = [_epoch(T0) + 30 * i for i in range(6)]
    ids = [store.add_window(sample_window(rng, s, n_routers=1, cells=3)) for s in starts]

    assert [w.id for w in store.windows(limit=2)] == ids[-2:]  # oldest first, newest two
    since = datetime.fromtimestamp(starts[2], tz=UTC)
    assert [w.id for w in store.windows(since=since)] == ids[2:]
    until = datetime.fromtimestamp(starts[4], tz=UTC)
    assert [w.id for w in store.windows(since=since, until=until)] == ids[2:4]


def test_a_failed_cycle_leaves_nothing(store: Store) -> None:
    rng = random.Random(9)
    kept = store.add_window(sample_window(rng, _epoch(T0)))
    with pytest.raises(RuntimeError, match="fit failed"), store.cycle() as tx:
        tx.add_window(sample_window(rng, _epoch(T0) + 30))
        tx.add_drift_event("workload", 0.4, 0.2, [kept])
        tx.add_policy(tx.next_version(), "ab" * 32, "{}", "candidate", "drift")
        tx.flush()
        raise RuntimeError("fit failed")
    assert [w.id for w in store.windows()] == [kept]
    assert store.drift_events() == [] and store.policies() == []


def test_one_cycle_commits_everything_together(store: Store) -> None:
    rng = random.Random(10)
    with store.cycle() as tx:
        wid = tx.add_window(sample_window(rng, _epoch(T0)))
        tx.add_drift_event("slo", 0.31, 0.1, [wid], {"goodput": 0.69}, at=T0)
        version = tx.next_version()
        tx.add_policy(version, "cd" * 32, '{"v": 1}', "approved", "bootstrap", at=T0)
        tx.add_calibration([wid], {"ttft_mape": 0.08}, 0.93, None, version, at=T0)
        tx.set_desired("r1", version, at=T0)
    with store.read() as tx:
        assert [w.id for w in tx.windows()] == [wid]
        assert tx.drift_events()[0].details == {"goodput": 0.69}
        assert tx.desired_versions() == {"r1": version}
        cal = tx.calibration_for(version)
        assert cal is not None and cal.training_window_ids == (wid,)
        assert cal.heldout_error == {"ttft_mape": 0.08}


def test_a_read_is_one_snapshot_while_another_process_commits(
        store: Store, other_store: Store) -> None:
    """PostgreSQL's default READ COMMITTED gave each statement of a read its own snapshot."""
    store.add_policy(1, "aa" * 32, "{}", "approved", "one", at=T0)
    with store.read() as tx:
        assert [p.version for p in tx.policies()] == [1]
        other_store.add_policy(2, "bb" * 32, "{}", "approved", "two", at=T0)
        assert [p.version for p in tx.policies()] == [1]
        assert tx.next_version() == 2
    assert [p.version for p in store.policies()] == [1, 2]


# -- time ------------------------------------------------------------------------------


def test_timestamps_come_back_timezone_aware_and_exact(store: Store) -> None:
    plus_two = datetime(2027, 3, 1, 14, 30, 5, 654321, tzinfo=timezone(timedelta(hours=2)))
    rec = store.add_policy(1, "ab" * 32, "{}", at=plus_two)
    assert rec.created_at == plus_two
    back = store.policy(1)
    assert back is not None
    assert back.created_at.tzinfo is not None and back.created_at.utcoffset() == timedelta(0)
    assert back.created_at == plus_two  # same instant, microseconds kept
    assert back.created_at.hour == 12


def test_naive_datetimes_are_refused(store: Store) -> None:
    with pytest.raises(Exception, match="naive datetime"):
        store.add_push("r1", 1, "applied", 0.01, at=datetime(2027, 1, 1))
    assert store.pushes() == []


def test_default_times_come_from_the_injected_clock(store: Store, clock: VirtualClock) -> None:
    clock.advance(123.5)
    rid = store.add_request("pause", {}, who="alice", reason="maintenance")
    req = store.request(rid)
    assert req is not None and req.created_at == clock.utcnow()


# -- policies --------------------------------------------------------------------------


def test_policy_lifecycle(store: Store) -> None:
    store.add_policy(1, "aa" * 32, '{"a": 1}', "candidate", "first fit", at=T0)
    with pytest.raises(StoreError, match="already stored"):
        store.add_policy(1, "bb" * 32, "{}", "candidate", "dup")
    with pytest.raises(StoreError, match="unknown policy status"):
        store.add_policy(2, "bb" * 32, "{}", "live", "typo")
    with pytest.raises(StoreError, match="only approved"):
        store.set_desired("r1", 1)

    later = T0 + timedelta(seconds=40)
    approved = store.set_policy_status(1, "approved", "beats current by 0.04", at=later)
    assert (approved.status, approved.reason) == ("approved", "beats current by 0.04")
    assert approved.updated_at == later and approved.created_at == T0
    with pytest.raises(StoreError, match="cannot go from approved to candidate"):
        store.set_policy_status(1, "candidate")
    assert store.set_policy_status(1, "rolled_back", "regressed").status == "rolled_back"
    with pytest.raises(StoreError, match="cannot go from rolled_back to approved"):
        store.set_policy_status(1, "approved")
    with pytest.raises(StoreError, match="no policy version 9"):
        store.set_policy_status(9, "approved")

    store.add_policy(2, "cc" * 32, "{}", "candidate", "second")
    assert store.set_policy_status(2, "rejected", "predicted 0.81 < 0.85").status == "rejected"
    stored = store.policy(1)
    assert stored is not None and stored.body_json == '{"a": 1}'
    assert [p.version for p in store.policies()] == [1, 2]
    assert [p.version for p in store.policies(status="rejected")] == [2]
    assert [p.version for p in store.policies(limit=1)] == [2]


def test_desired_version_per_router_allows_a_canary(store: Store) -> None:
    for v in (1, 2):
        store.add_policy(v, f"{v:02d}" * 32, "{}", "approved", "ok")
    for r in ("r1", "r2", "r3"):
        store.set_desired(r, 1)
    store.set_desired("r2", 2)  # the canary
    assert store.desired_versions() == {"r1": 1, "r2": 2, "r3": 1}
    with pytest.raises(StoreError, match="no policy version 3"):
        store.set_desired("r1", 3)
    store.clear_desired("r3")
    assert store.desired_versions() == {"r1": 1, "r2": 2}


def test_next_version_is_above_every_stored_and_acknowledged_version(store: Store) -> None:
    assert store.next_version() == 1
    store.add_policy(3, "aa" * 32, "{}", "rejected", "imported")
    assert store.next_version() == 4
    store.record_ack("restored-router", 10, "ff" * 32, at=T0)  # ahead of the store
    assert store.next_version() == 11
    store.add_policy(11, "bb" * 32, "{}", "approved", "re-issued above every router")
    store.record_ack("restored-router", 2, "ee" * 32, at=T0)  # it went back: still monotonic
    assert store.next_version() == 12
    seen = [store.next_version()]
    for _ in range(5):
        store.add_policy(seen[-1], "cc" * 32, "{}", "candidate", "")
        seen.append(store.next_version())
    assert seen == sorted(set(seen))


def test_routers_record_acks_and_errors(store: Store) -> None:
    store.record_ack("r1", 4, "aa" * 32, at=T0)
    store.record_router_error("r1", "deadline exceeded", at=T0 + timedelta(seconds=5))
    store.record_router_error("r2", "connection refused", at=T0)
    r1, r2 = store.routers()
    assert (r1.acked_version, r1.acked_checksum, r1.last_seen) == (4, "aa" * 32, T0)
    assert r1.last_error == "deadline exceeded"
    assert (r2.acked_version, r2.last_seen, r2.last_error) == (None, None, "connection refused")
    store.record_ack("r1", 5, "bb" * 32, at=T0 + timedelta(seconds=9))
    assert store.routers()[0].last_error is None and store.routers()[0].acked_version == 5


def test_acks_recorded_in_one_statement_match_single_ones(store: Store) -> None:
    store.record_router_error("r2", "connection refused", at=T0)
    store.record_ack("r3", 1, "11" * 32, at=T0)
    later = T0 + timedelta(seconds=30)
    store.record_acks([("r1", 4, "aa" * 32), ("r2", 4, "aa" * 32), ("r3", 5, "bb" * 32)],
                      at=later)
    store.record_acks([], at=later)  # nothing to say: no statement
    got = {r.router_id: (r.acked_version, r.acked_checksum, r.last_seen, r.last_error)
           for r in store.routers()}
    assert got == {"r1": (4, "aa" * 32, later, None), "r2": (4, "aa" * 32, later, None),
                   "r3": (5, "bb" * 32, later, None)}
    # the error's time stays: it says when the router last failed
    assert next(r for r in store.routers() if r.router_id == "r2").last_error_at == T0


def test_pushes_and_drift_events_are_listed_oldest_first(store: Store) -> None:
    for i in range(4):
        store.add_push(f"r{i}", 7, "applied" if i else "timeout", 0.002 * i or None,
                       None if i else "deadline", at=T0 + timedelta(seconds=i))
        store.add_drift_event("performance", 0.1 * i, 0.25, [i, i + 1],
                              at=T0 + timedelta(seconds=i))
    pushes = store.pushes(limit=3)
    assert [p.router_id for p in pushes] == ["r1", "r2", "r3"]
    assert store.pushes()[0].error == "deadline" and store.pushes()[0].latency_s is None
    events = store.drift_events(since=T0 + timedelta(seconds=2))
    assert [e.window_ids for e in events] == [(2, 3), (3, 4)]


# -- leader lease ----------------------------------------------------------------------


def test_lease_is_exclusive_until_it_expires(store: Store, other_store: Store) -> None:
    a = store.try_acquire_lease("replica-a", ttl_s=10, now=T0)
    assert a is not None and (a.holder, a.term, a.acquired_at) == ("replica-a", 1, T0)
    assert a.expires_at == T0 + timedelta(seconds=10)
    assert other_store.try_acquire_lease("replica-b", 10, now=T0 + timedelta(seconds=9)) is None

    renewed = store.renew_lease("replica-a", 10, now=T0 + timedelta(seconds=9))
    assert renewed is not None and renewed.expires_at == T0 + timedelta(seconds=19)
    assert renewed.term == 1  # same holder, same term
    assert store.try_acquire_lease("replica-a", 10, now=T0 + timedelta(seconds=10)) is not None
    assert other_store.try_acquire_lease("replica-b", 10, now=T0 + timedelta(seconds=15)) is None

    # replica-a stops renewing: after expiry replica-b takes over with a higher term.
    b = other_store.try_acquire_lease("replica-b", 10, now=T0 + timedelta(seconds=20))
    assert b is not None and (b.holder, b.term) == ("replica-b", 2)
    assert store.renew_lease("replica-a", 10, now=T0 + timedelta(seconds=21)) is None
    assert store.release_lease("replica-a", now=T0 + timedelta(seconds=21)) is False

    assert other_store.release_lease("replica-b", now=T0 + timedelta(seconds=22)) is True
    again = store.try_acquire_lease("replica-a", 10, now=T0 + timedelta(seconds=22))
    assert again is not None and again.term == 3


def test_concurrent_lease_attempts_have_one_winner(store: Store, other_store: Store) -> None:
    winners = _race(
        [lambda: store.try_acquire_lease("a", 30, T0), lambda: other_store.try_acquire_lease(
            "b", 30, T0)]
    )
    assert sum(w is not None for w in winners) == 1


# -- operator requests ------------------------------------------------------------------


def test_request_lifecycle(store: Store) -> None:
    rid = store.add_request("rollback", {"to_version": 3}, who="bob", reason="bad p99", at=T0)
    with pytest.raises(StoreError, match="unknown request kind"):
        store.add_request("reboot", {}, who="bob")
    claimed = store.claim_next_request("leader-1", at=T0 + timedelta(seconds=1))
    assert claimed is not None and claimed.id == rid and claimed.args == {"to_version": 3}
    assert (claimed.status, claimed.claimed_by, claimed.who) == ("claimed", "leader-1", "bob")
    assert store.claim_next_request("leader-2") is None
    done = store.finish_request(rid, "rolled back to 3", at=T0 + timedelta(seconds=2))
    assert (done.status, done.outcome, done.finished_at) == (
        "done", "rolled back to 3", T0 + timedelta(seconds=2)
    )
    with pytest.raises(StoreError, match="already done"):
        store.finish_request(rid, "again")
    assert [r.status for r in store.requests()] == ["done"]


def test_a_dead_claimers_request_is_claimable_after_it_goes_stale(store: Store) -> None:
    rid = store.add_request("recalibrate", {}, who="ops", at=T0)
    assert store.claim_next_request("dead-leader", at=T0) is not None
    at = T0 + timedelta(seconds=30)
    assert store.claim_next_request("new-leader", at=at, stale_after_s=60) is None
    again = store.claim_next_request("new-leader", at=at + timedelta(seconds=31), stale_after_s=60)
    assert again is not None and again.id == rid and again.claimed_by == "new-leader"


def test_a_new_leader_reclaims_what_an_earlier_holder_claimed_before_its_term(
        store: Store) -> None:
    """A SIGKILLed leader's claimed request waited request_stale_after_s (5 min) under a
    healthy new leader; claims from the new term on (its own, or anyone's) are kept."""
    old = store.add_request("recalibrate", {}, who="ops", at=T0)
    assert store.claim_next_request("dead-leader", at=T0) is not None
    took_over = T0 + timedelta(seconds=20)
    later = store.add_request("pause", {}, who="ops", at=took_over)
    assert store.claim_next_request("racing", at=took_over + timedelta(seconds=1)) is not None
    at = took_over + timedelta(seconds=2)
    got = store.claim_next_request("new-leader", at=at, stale_after_s=300,
                                   reclaim_before=took_over)
    assert got is not None and got.id == old and got.claimed_by == "new-leader"
    # claimed after the term began (``later``), and our own claims: not taken again
    assert store.claim_next_request("new-leader", at=at, stale_after_s=300,
                                    reclaim_before=took_over) is None
    assert {r.id: r.claimed_by for r in store.requests()}[later] == "racing"


def test_a_claimer_gives_back_only_its_own_unfinished_claims(store: Store) -> None:
    """A cycle whose write failed gives its claims back, pending at once: not another
    holder's claim, and not a request already finished."""
    mine = store.add_request("pause", {}, who="ops", at=T0)
    theirs = store.add_request("recalibrate", {}, who="ops", at=T0)
    done = store.add_request("resume", {}, who="ops", at=T0)
    assert store.claim_next_request("a", at=T0) is not None
    assert store.claim_next_request("b", at=T0) is not None
    assert store.claim_next_request("a", at=T0) is not None
    store.finish_request(done, "resumed")
    assert store.release_requests([mine, theirs, done], "a") == [mine]
    by_id = {r.id: r for r in store.requests()}
    assert (by_id[mine].status, by_id[mine].claimed_by, by_id[mine].claimed_at) == \
        ("pending", None, None)
    assert (by_id[theirs].status, by_id[theirs].claimed_by) == ("claimed", "b")
    assert by_id[done].status == "done"
    again = store.claim_next_request("c", at=T0)
    assert again is not None and again.id == mine and store.release_requests([], "c") == []


def test_two_stores_never_claim_the_same_request(store: Store, other_store: Store) -> None:
    ids = [store.add_request("recalibrate", {"n": i}, who="ops") for i in range(6)]
    claims: dict[str, list[int]] = {"a": [], "b": []}

    def drain(name: str, s: Store) -> None:
        for _ in range(len(ids) + 2):  # bounded: never more attempts than requests + 2
            req = s.claim_next_request(name)
            if req is None:
                return
            claims[name].append(req.id)

    _race([lambda: drain("a", store), lambda: drain("b", other_store)])
    claimed = claims["a"] + claims["b"]
    assert sorted(claimed) == ids  # every request claimed exactly once
    assert {r.claimed_by for r in store.requests()} <= {"a", "b"}
    assert all(r.status == "claimed" for r in store.requests())


# -- retention -------------------------------------------------------------------------


def test_retention_compacts_windows_only(store: Store) -> None:
    rng = random.Random(11)
    day = 86_400.0
    ids = [
        store.add_window(sample_window(rng, _epoch(T0) + i * day, n_routers=1, cells=2))
        for i in range(6)
    ]
    # windows 1-2 trained the approved policy, window 3 a rejected one.
    store.add_policy(1, "aa" * 32, "{}", "approved", "ok", at=T0)
    store.add_policy(2, "bb" * 32, "{}", "rejected", "worse", at=T0)
    store.add_calibration(ids[1:3], {"mape": 0.1}, 0.9, 0.8, policy_version=1, at=T0)
    store.add_calibration([ids[3]], {"mape": 0.3}, 0.7, 0.8, policy_version=2, at=T0)
    # window 0 trained a refused candidate that renewed v1's drift reference: what a
    # restart restores and `pdctl explain` refits for v1 (compaction deleted it)
    store.add_policy(3, "cc" * 32, "{}", "rejected", "kept v1", at=T0)
    store.add_calibration([ids[0]], {"mape": 0.2}, 0.8, 0.8, policy_version=3,
                          details={"reference_for": 1}, at=T0)
    store.add_drift_event("workload", 0.5, 0.2, ids[:2], at=T0)
    store.add_push("r1", 1, "applied", 0.01, at=T0)
    store.add_request("pause", {}, who="ops", at=T0)
    store.set_desired("r1", 1, at=T0)

    cutoff = T0 + timedelta(days=4, seconds=1)  # windows 0-3 ended before it
    deleted = store.compact_windows(older_than=cutoff)
    assert deleted == 1
    assert [w.id for w in store.windows()] == [ids[0], ids[1], ids[2], ids[4], ids[5]]
    assert [p.version for p in store.policies()] == [1, 2, 3]
    assert len(store.calibrations()) == 3 and len(store.drift_events()) == 1
    assert len(store.pushes()) == 1 and len(store.requests()) == 1
    assert store.desired_versions() == {"r1": 1}
    assert store.compact_windows(older_than=cutoff) == 0


# -- capacity recommendations ----------------------------------------------------------


def _plan_body(prefill: int, decode: int) -> dict[str, object]:
    """A body shaped like ``CapacityPlan.to_dict()``, with awkward floats."""
    return {
        "prefill": {"workers": prefill, "utilisation": 0.1 + 0.2, "binding": "p99 TTFT",
                    "explanation": ["demand 12.5 req/s", "ä unicode line"]},
        "decode": {"workers": decode, "utilisation": 2 / 3, "binding": "p99 TPOT"},
        "demand": {"qps": 12.5, "input_tokens": 1e-9}, "headroom": 0.2,
    }


def test_recommendation_round_trip(store: Store) -> None:
    body = _plan_body(3, 7)
    rid = store.add_recommendation(
        window_ids=[12, 10, 11], workers=(3, 7), current=(2, None),
        binding=("p99 TTFT", "KV cache"), utilisation=(0.1 + 0.2, 2 / 3), body=body, at=T0,
    )
    (rec,) = store.recommendations()
    assert rec.id == rid and rec.created_at == T0
    assert rec.window_ids == (12, 10, 11)
    assert (rec.first_window_id, rec.last_window_id) == (10, 12)
    assert (rec.prefill_workers, rec.decode_workers) == (3, 7)
    assert (rec.workers("prefill"), rec.workers("decode")) == (3, 7)
    assert (rec.current_prefill, rec.current_decode) == (2, None)
    assert (rec.prefill_binding, rec.decode_binding) == ("p99 TTFT", "KV cache")
    assert rec.prefill_utilisation == 0.1 + 0.2 and rec.decode_utilisation == 2 / 3
    assert rec.body == body  # JSON text keeps every float exactly
    assert rec.applied_at is None
    with pytest.raises(ValueError, match="unknown role"):
        rec.workers("router")


def test_recommendations_since_limit_and_applied(store: Store, clock: VirtualClock) -> None:
    ids = [
        store.add_recommendation(
            window_ids=[i], workers=(1 + i, 2 + i), current=(1, 2), binding=("a", "b"),
            utilisation=(0.5, 0.5), body=_plan_body(1 + i, 2 + i),
            at=T0 + timedelta(minutes=5 * i),
        )
        for i in range(4)
    ]
    assert [r.id for r in store.recommendations(limit=2)] == ids[-2:]  # oldest first
    assert [r.id for r in store.recommendations(since=T0 + timedelta(minutes=10))] == ids[2:]

    clock.advance(60)
    first = store.mark_recommendation_applied(ids[1])
    assert first.applied_at == clock.utcnow()
    clock.advance(60)
    again = store.mark_recommendation_applied(ids[1])
    assert again.applied_at == first.applied_at  # the first time it was reached counts
    assert [r.applied_at is not None for r in store.recommendations()] == [
        False, True, False, False]
    with pytest.raises(StoreError, match="no recommendation 999"):
        store.mark_recommendation_applied(999)


def test_bad_recommendations_are_refused_and_nothing_is_half_written(store: Store) -> None:
    with pytest.raises(StoreError, match=">= 1"):
        store.add_recommendation(window_ids=[], workers=(0, 2), current=(None, None),
                                 binding=("a", "b"), utilisation=(0.0, 0.0), body={})
    with pytest.raises(StoreError, match="utilisation must be finite"):
        store.add_recommendation(window_ids=[], workers=(1, 1), current=(None, None),
                                 binding=("a", "b"), utilisation=(float("inf"), 0.0), body={})
    with pytest.raises(StoreError, match="not storable JSON"), store.cycle() as tx:
        tx.add_window(sample_window(random.Random(3), _epoch(T0)))
        tx.add_recommendation(window_ids=[], workers=(1, 1), current=(None, None),
                              binding=("a", "b"), utilisation=(0.5, 0.5),
                              body={"demand": {"qps": float("nan")}})
        tx.flush()
    assert store.recommendations() == [] and store.windows() == []


def test_retention_lets_superseded_policies_windows_age_out(store: Store) -> None:
    """Every approved version stays 'approved' (a rollback target): keeping all their
    training windows kept every window once approvals came about hourly. Kept now: the
    newest approved version's, a desired version's, and what a desired re-issue re-issues."""
    rng = random.Random(14)
    ids = [store.add_window(sample_window(rng, _epoch(T0) + 60 * i, n_routers=1, cells=2))
           for i in range(7)]
    for version, trained in ((1, ids[0:2]), (2, ids[2:4]), (4, ids[4:6])):
        store.add_policy(version, f"{version:02d}" * 32, "{}", "approved", "ok", at=T0)
        store.add_calibration(trained, {"mape": 0.1}, 0.9, 0.8, policy_version=version, at=T0)
    store.add_policy(3, "03" * 32, "{}", "approved", "re-issue of v2", at=T0, reissue_of=2)
    store.set_desired("r1", 3, at=T0)  # a router still on the re-issue of v2

    assert store.compact_windows(older_than=T0 + timedelta(days=1)) == 2
    assert [w.id for w in store.windows()] == ids[2:]  # v2's (via v3), v4's, the newest


def test_retention_keeps_what_explains_a_version_with_no_calibration(store: Store) -> None:
    """A desired version made with no calibration of its own (exploration turned off, a
    fallback) is explained by a calibration stored before it: v1's windows were deleted
    once v2 was the newest approved, and `pdctl explain` found none of them."""
    rng = random.Random(16)
    ids = [store.add_window(sample_window(rng, _epoch(T0) + 60 * i, n_routers=1, cells=2))
           for i in range(5)]
    store.add_policy(1, "01" * 32, "{}", "approved", "ok", at=T0)
    store.add_calibration(ids[0:2], {"mape": 0.1}, 0.9, 0.8, policy_version=1, at=T0)
    later = T0 + timedelta(hours=1)
    store.add_policy(2, "02" * 32, "{}", "approved", "v1 without exploration", at=later)
    store.set_desired("r1", 2, at=later)
    # A calibration after v2 (a refused candidate) is not what explains v2.
    store.add_policy(3, "03" * 32, "{}", "rejected", "worse", at=later + timedelta(hours=1))
    store.add_calibration(ids[2:3], {"mape": 0.1}, 0.9, 0.8, policy_version=3,
                          at=later + timedelta(hours=1))

    assert store.compact_windows(older_than=T0 + timedelta(days=1)) == 2
    assert [w.id for w in store.windows()] == [ids[0], ids[1], ids[4]]


def test_retention_keeps_the_newest_windows_a_fit_may_be_training_on(store: Store) -> None:
    """`pdctl db compact --older-than-days 0` while a calibration is being fitted: the
    windows it trains on (the newest ones) are there when it is stored."""
    rng = random.Random(15)
    ids = [store.add_window(sample_window(rng, _epoch(T0) + 60 * i, n_routers=1, cells=2))
           for i in range(6)]
    assert store.compact_windows(older_than=T0 + timedelta(days=1), keep_newest=4) == 2
    assert [w.id for w in store.windows()] == ids[2:]
    assert store.compact_windows(older_than=T0 + timedelta(days=1), keep_newest=10) == 0


def test_retention_keeps_recommendations(store: Store) -> None:
    rng = random.Random(12)
    wid = store.add_window(sample_window(rng, _epoch(T0), n_routers=1, cells=2))
    store.add_window(sample_window(rng, _epoch(T0) + 60, n_routers=1, cells=2))
    store.add_recommendation(window_ids=[wid], workers=(1, 2), current=(1, 2),
                             binding=("a", "b"), utilisation=(0.4, 0.6), body={}, at=T0)
    assert store.compact_windows(older_than=T0 + timedelta(days=1)) == 1
    (rec,) = store.recommendations()
    assert rec.window_ids == (wid,)  # the record of what it was computed from stays


def test_retention_never_hands_a_deleted_window_id_to_a_new_window(store: Store) -> None:
    """Everything older than now deleted (`db compact --older-than-days 0`): SQLite numbers
    a row one above the largest id left, so the newest window is kept; else the next
    window took the id a calibration or drift event still names."""
    rng = random.Random(13)
    ids = [store.add_window(sample_window(rng, _epoch(T0) + 60 * i, n_routers=1, cells=2))
           for i in range(4)]
    store.add_drift_event("workload", 0.5, 0.2, ids[-2:], at=T0)
    assert store.compact_windows(older_than=T0 + timedelta(days=1)) == 3
    assert [w.id for w in store.windows()] == [ids[-1]]
    new = store.add_window(sample_window(rng, _epoch(T0) + 600, n_routers=1, cells=2))
    assert new > max(ids)
    assert store.drift_events()[0].window_ids == tuple(ids[-2:])


def _race(calls: list[Callable[[], T]]) -> list[T | None]:
    """Run the calls at once on threads (bounded by a join timeout); return their results."""
    barrier = threading.Barrier(len(calls))
    results: list[T | None] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        barrier.wait(timeout=10)
        try:
            results[i] = calls[i]()
        except BaseException as e:  # reported below, on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a racing call hung"
    if errors:
        raise errors[0]
    return results
