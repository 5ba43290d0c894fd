"""The checksum's canonical encoding, checked against an independent encoder and the
published test vector."""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import replace
from pathlib import Path

from hypothesis import given, settings

from controller.policy import Policy, Provenance, Route, Slo, canonical_bytes, policy_from_dict
from tests.policy.strategies import policies

VECTOR = Path(__file__).parents[2] / "controller" / "policy" / "test_vector.json"


def test_published_vector_matches_an_independent_encoding() -> None:
    data = json.loads(VECTOR.read_text())
    policy = policy_from_dict(data["policy"])
    # Written out field by field from the documented layout, not through the library.
    expected = b"".join(
        [
            b"PDPOL\x00\x01\x00",
            struct.pack("<I", 1), struct.pack("<d", 2048.0),
            struct.pack("<I", 2), struct.pack("<dd", 1.0, 8.0),
            struct.pack("<I", 1), struct.pack("<d", 4.0),
            struct.pack("<Bdd", 2, 0.25, 0.1),
            struct.pack("<Bdd", 1, 0.0, 0.0),
            struct.pack("<dd", 1.5, 1.0),
            struct.pack("<BQ", 1, 64),
            struct.pack("<B", 1),
        ]
    )
    assert canonical_bytes(policy) == expected
    assert data["canonical_bytes_hex"] == expected.hex()
    assert data["checksum"] == hashlib.sha256(expected).hexdigest() == policy.checksum


@settings(max_examples=100, deadline=None)
@given(policy=policies())
def test_checksum_ignores_version_slo_and_provenance(policy: Policy) -> None:
    other = replace(policy, version=policy.version + 1, slo=Slo(9.0, 0.9), provenance=Provenance())
    assert other.checksum == policy.checksum


@settings(max_examples=100, deadline=None)
@given(policy=policies())
def test_checksum_covers_every_decision_field(policy: Policy) -> None:
    t = policy.table
    flipped = tuple(r.other if i == 0 else r for i, r in enumerate(t.routes))
    variants = [
        replace(policy, table=replace(t, routes=flipped)),
        replace(policy, table=replace(t, scores=(t.scores[0] + 1.0, *t.scores[1:]))),
        replace(
            policy,
            table=replace(
                t, exploration=((0.2 if t.exploration[0] < 0.1 else 0.0), *t.exploration[1:])
            ),
        ),
        replace(policy, weights=replace(policy.weights, wtft=policy.weights.wtft + 1)),
        replace(policy, default_route=policy.default_route.other),
        replace(
            policy,
            overrides=replace(
                policy.overrides, bypass_append_tokens=policy.overrides.bypass_append_tokens + 1
            ),
        ),
        replace(
            policy,
            overrides=replace(
                policy.overrides, first_turn_route=policy.overrides.first_turn_route.other
            ),
        ),
        replace(
            policy,
            table=replace(
                t, axes=replace(t.axes, qps=(*t.axes.qps[:-1], t.axes.qps[-1] + 1.0))
            ),
        ),
        replace(
            policy,
            overrides=replace(
                policy.overrides,
                first_turn_busy_waiting=(policy.overrides.first_turn_busy_waiting + 1) % 2**32,
            ),
        ),
        replace(
            policy,
            overrides=replace(
                policy.overrides,
                later_turn_busy_waiting=(policy.overrides.later_turn_busy_waiting + 1) % 2**32,
            ),
        ),
    ]
    for v in variants:
        assert v.checksum != policy.checksum


def test_route_wire_values_are_stable() -> None:
    assert (int(Route.PREFILL_NODE), int(Route.DECODE_LOCAL)) == (1, 2)


def test_the_busy_override_extends_the_encoding_only_when_on() -> None:
    """Policies without it keep the bytes (and checksums) they had before it existed."""
    off = Policy.uniform(3, Route.PREFILL_NODE)
    on = replace(off, overrides=replace(off.overrides, first_turn_busy_waiting=2))
    assert canonical_bytes(on) == canonical_bytes(off) + struct.pack("<I", 2)


def test_the_later_turn_override_writes_both_busy_fields_so_lengths_tell_them_apart() -> None:
    off = Policy.uniform(3, Route.PREFILL_NODE)
    later = replace(off, overrides=replace(off.overrides, later_turn_busy_waiting=2))
    first = replace(off, overrides=replace(off.overrides, first_turn_busy_waiting=2))
    both = replace(later, overrides=replace(later.overrides, first_turn_busy_waiting=5))
    assert canonical_bytes(later) == canonical_bytes(off) + struct.pack("<II", 0, 2)
    assert canonical_bytes(both) == canonical_bytes(off) + struct.pack("<II", 5, 2)
    assert len({later.checksum, first.checksum, both.checksum, off.checksum}) == 4
