"""Policy <-> protobuf: lossless round trips and every malformed field refused with its path."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from controller._proto.pdcontrol.v1 import policy_pb2 as pb
from controller.policy import (
    Axes,
    Decision,
    Features,
    LookupTable,
    Policy,
    PolicyValidationError,
    Provenance,
    Reason,
    Route,
)
from controller.rollout.codec import (
    MAX_MESSAGE_BYTES,
    decision_from_proto,
    decision_to_proto,
    features_from_proto,
    features_to_proto,
    policy_from_proto,
    policy_to_proto,
)
from tests.policy.strategies import any_float, policies


def _paths(excinfo: pytest.ExceptionInfo[PolicyValidationError]) -> set[str]:
    return {p.path for p in excinfo.value.problems}


def _small_policy(version: int = 3) -> Policy:
    axes = Axes((1024.0, 8192.0), (0.5, 4.0), (2.0, 16.0))
    n = axes.n_cells
    table = LookupTable(
        axes,
        tuple(Route.DECODE_LOCAL if i % 3 else Route.PREFILL_NODE for i in range(n)),
        tuple(float(i) - 3.5 for i in range(n)),
        tuple(0.01 * (i % 5) for i in range(n)),
    )
    return Policy(
        version=version,
        table=table,
        provenance=Provenance(
            created_at=datetime(2026, 11, 30, 5, 0, 0, 123456, tzinfo=UTC), reason="test"
        ),
    )


@settings(max_examples=150, deadline=None)
@given(policy=policies())
def test_policy_round_trips_through_the_wire_losslessly(policy: Policy) -> None:
    wire = policy_to_proto(policy).SerializeToString()
    back = policy_from_proto(pb.Policy.FromString(wire))
    assert back == policy
    assert back.checksum == policy.checksum
    # Field by field too, so a broken __eq__ could not hide a loss.
    assert back.table.routes == policy.table.routes
    assert back.table.scores == policy.table.scores
    assert back.table.exploration == policy.table.exploration
    assert back.provenance == policy.provenance


@settings(max_examples=60, deadline=None)
@given(policy=policies())
def test_message_round_trips_through_the_policy(policy: Policy) -> None:
    msg = policy_to_proto(policy)
    assert policy_to_proto(policy_from_proto(msg)) == msg


def test_aware_timestamps_keep_their_instant() -> None:
    plus2 = timezone(timedelta(hours=2))
    p = replace(
        _small_policy(),
        provenance=Provenance(
            created_at=datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=plus2),
            trained_from=datetime(1999, 12, 31, 23, 59, 59, tzinfo=UTC),
        ),
    )
    back = policy_from_proto(policy_to_proto(p))
    assert back.provenance.created_at == p.provenance.created_at
    assert back.provenance.created_at is not None
    assert back.provenance.created_at.utcoffset() == timedelta(0)
    assert back.provenance.trained_to is None


def test_naive_timestamp_is_refused_with_its_path() -> None:
    p = replace(_small_policy(), provenance=Provenance(trained_to=datetime(2026, 1, 1)))
    with pytest.raises(PolicyValidationError) as e:
        policy_to_proto(p)
    assert _paths(e) == {"provenance.trained_to"}


def test_route_numbers_match_the_policy_contract() -> None:
    assert Route.PREFILL_NODE.value == pb.ROUTE_PREFILL_NODE
    assert Route.DECODE_LOCAL.value == pb.ROUTE_DECODE_LOCAL
    assert pb.ROUTE_UNSPECIFIED == 0


@pytest.mark.parametrize("bad", [0, 7])
def test_unspecified_or_unknown_route_is_refused_with_its_path(bad: int) -> None:
    msg = policy_to_proto(_small_policy())
    msg.routes[5] = bad  # type: ignore[call-overload]
    msg.default_route = bad  # type: ignore[assignment]
    msg.overrides.first_turn_route = bad  # type: ignore[assignment]
    with pytest.raises(PolicyValidationError) as e:
        policy_from_proto(msg)
    assert _paths(e) == {"routes[5]", "default_route", "overrides.first_turn_route"}
    text = str(e.value)
    assert ("ROUTE_UNSPECIFIED" in text) if bad == 0 else ("unknown route value 7" in text)


def test_checksum_must_match_the_content() -> None:
    policy = _small_policy()
    msg = policy_to_proto(policy, checksum="0" * 64)
    with pytest.raises(PolicyValidationError) as e:
        policy_from_proto(msg)
    assert _paths(e) == {"checksum"}
    # A tampered cell with the original checksum is caught the same way.
    msg = policy_to_proto(policy)
    msg.scores[0] += 1.0
    with pytest.raises(PolicyValidationError) as e:
        policy_from_proto(msg)
    assert _paths(e) == {"checksum"}


def test_missing_checksum_and_sub_messages_are_named() -> None:
    msg = policy_to_proto(_small_policy())
    msg.checksum = ""
    with pytest.raises(PolicyValidationError) as e:
        policy_from_proto(msg)
    assert _paths(e) == {"checksum"}

    empty = pb.Policy(version=1)
    with pytest.raises(PolicyValidationError) as e:
        policy_from_proto(empty)
    paths = _paths(e)
    assert {"axes", "weights", "slo", "overrides", "default_route"} <= paths
    assert {"axes.context_tokens", "axes.io_ratio", "axes.qps"} <= paths


def test_every_semantic_problem_is_listed_at_once() -> None:
    msg = policy_to_proto(_small_policy())
    msg.version = -4
    msg.axes.qps[:] = [16.0, 2.0]
    msg.scores[2] = float("nan")
    msg.exploration[1] = 0.5
    del msg.routes[-1]
    msg.weights.wtft = float("inf")
    msg.slo.tpot_s = 0.0
    with pytest.raises(PolicyValidationError) as e:
        policy_from_proto(msg)
    assert {
        "version", "axes.qps[1]", "scores[2]", "exploration[1]", "routes", "weights.wtft",
        "slo.tpot_s",
    } <= _paths(e)


def test_out_of_range_timestamp_is_a_problem_not_a_crash() -> None:
    msg = policy_to_proto(_small_policy())
    msg.provenance.created_at.seconds = 2**62
    with pytest.raises(PolicyValidationError) as e:
        policy_from_proto(msg)
    assert "provenance" in _paths(e)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=400))
def test_hostile_bytes_never_crash_the_decoder(data: bytes) -> None:
    try:
        msg = pb.Policy.FromString(data)
    except DecodeError:
        return
    try:
        policy = policy_from_proto(msg)
    except PolicyValidationError as e:
        assert e.problems
    else:  # astronomically unlikely, but then it must be a real, valid policy
        assert policy.checksum == msg.checksum


def test_largest_table_fits_the_message_limit() -> None:
    edges = tuple(float(2**i) for i in range(64))
    policy = Policy.uniform(9, Route.DECODE_LOCAL, axes=Axes(edges, edges, edges))
    wire = policy_to_proto(policy).SerializeToString()
    assert 4_000_000 < len(wire) < MAX_MESSAGE_BYTES
    assert policy_from_proto(pb.Policy.FromString(wire)) == policy


@settings(max_examples=100, deadline=None)
@given(
    turn=st.integers(-(2**40), 2**40),
    ctx=any_float,
    app=any_float,
    out=any_float,
    qps=any_float,
)
def test_features_round_trip(turn: int, ctx: float, app: float, out: float, qps: float) -> None:
    f = Features(turn, float(ctx), float(app), float(out), float(qps))
    back = features_from_proto(features_to_proto(f))
    for name in ("turn", "context_tokens", "append_tokens", "expected_output_tokens", "qps"):
        a, b = getattr(back, name), getattr(f, name)
        assert a == b or (a != a and b != b)  # NaN stays NaN


@pytest.mark.parametrize(
    "decision",
    [
        Decision(Route.DECODE_LOCAL, (3, 0, 9), Reason.TABLE),
        Decision(Route.PREFILL_NODE, (0, 1, 2), Reason.EXPLORE, explored=True),
        Decision(Route.PREFILL_NODE, None, Reason.FIRST_TURN),
        Decision(Route.DECODE_LOCAL, None, Reason.BYPASS),
        Decision(Route.PREFILL_NODE, None, Reason.NO_POLICY),
    ],
)
def test_decision_round_trip(decision: Decision) -> None:
    assert decision_from_proto(decision_to_proto(decision)) == decision


def test_bad_decision_is_refused_with_paths() -> None:
    msg = decision_to_proto(Decision(Route.DECODE_LOCAL, None, Reason.TABLE))
    msg.route = 0  # type: ignore[assignment]
    msg.reason = "vibes"
    with pytest.raises(PolicyValidationError) as e:
        decision_from_proto(msg)
    assert _paths(e) == {"decision.route", "decision.reason"}
