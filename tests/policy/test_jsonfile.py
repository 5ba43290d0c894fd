"""JSON file round trips and validation errors that name the field."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given, settings

from controller.policy import (
    Overrides,
    Policy,
    PolicyValidationError,
    Route,
    dumps,
    loads,
    policy_from_dict,
    policy_to_dict,
)
from tests.policy.strategies import policies


@settings(max_examples=150, deadline=None)
@given(policy=policies())
def test_round_trip_is_lossless(policy: Policy) -> None:
    again = loads(dumps(policy))
    assert again == policy
    assert again.checksum == policy.checksum


def _valid() -> dict[str, Any]:
    return policy_to_dict(Policy.uniform(4, Route.DECODE_LOCAL, exploration=0.05))


def _problems(d: Any) -> dict[str, str]:
    with pytest.raises(PolicyValidationError) as e:
        policy_from_dict(d)
    return {p.path: p.message for p in e.value.problems}


@pytest.mark.parametrize(
    ("mutate", "path"),
    [
        (lambda d: d.update(version=0), "version"),
        (lambda d: d.update(version="7"), "version"),
        (lambda d: d.update(schema_version=2), "schema_version"),
        (lambda d: d.update(schema_version=True), "schema_version"),
        (lambda d: d.update(schema_version=1.0), "schema_version"),
        (lambda d: d["axes"]["io_ratio"].__setitem__(3, 0.1), "axes.io_ratio[3]"),
        (lambda d: d["axes"]["qps"].__setitem__(0, -1), "axes.qps[0]"),
        (lambda d: d["axes"].__setitem__("context_tokens", []), "axes.context_tokens"),
        (lambda d: d["axes"].__setitem__("qps", list(range(1, 66))), "axes.qps"),
        (lambda d: d["axes"].pop("qps"), "axes.qps"),
        (lambda d: d["routes"].__setitem__(17, "SIDEWAYS"), "routes[17]"),
        (lambda d: d["routes"].pop(), "routes"),
        (lambda d: d["scores"].__setitem__(5, "high"), "scores[5]"),
        (lambda d: d["exploration"].__setitem__(9, 0.5), "exploration[9]"),
        (lambda d: d["weights"].__setitem__("wtft", -1), "weights.wtft"),
        (lambda d: d["slo"].__setitem__("tpot_s", 0), "slo.tpot_s"),
        (lambda d: d["slo"].pop("ttft_s"), "slo.ttft_s"),
        (lambda d: d["overrides"].__setitem__("bypass_append_tokens", 1.5),
         "overrides.bypass_append_tokens"),
        (lambda d: d["overrides"].__setitem__("first_turn_route", 3),
         "overrides.first_turn_route"),
        (lambda d: d["overrides"].__setitem__("first_turn_busy_waiting", -1),
         "overrides.first_turn_busy_waiting"),
        (lambda d: d["overrides"].__setitem__("first_turn_busy_waiting", True),
         "overrides.first_turn_busy_waiting"),
        (lambda d: d["overrides"].__setitem__("later_turn_busy_waiting", -1),
         "overrides.later_turn_busy_waiting"),
        (lambda d: d["overrides"].__setitem__("later_turn_busy_waiting", 2**32),
         "overrides.later_turn_busy_waiting"),
        (lambda d: d.update(default_route="nowhere"), "default_route"),
        (lambda d: d.update(extra_field=1), "extra_field"),
        (lambda d: d["weights"].__setitem__("wtfft", 1), "weights.wtfft"),
        (lambda d: d["provenance"].__setitem__("created_at", "yesterday"),
         "provenance.created_at"),
        (lambda d: d["provenance"].__setitem__("created_at", "2026-01-01T00:00:00"),
         "provenance.created_at"),
        (lambda d: d.update(checksum="0" * 64), "checksum"),
    ],
)
def test_each_malformed_field_is_named(mutate: Any, path: str) -> None:
    d = _valid()
    mutate(d)
    assert path in _problems(d)


def test_every_problem_is_reported_at_once() -> None:
    d = _valid()
    d["version"] = -3
    d["routes"][0] = "X"
    d["slo"]["ttft_s"] = "fast"
    assert {"version", "routes[0]", "slo.ttft_s"} <= set(_problems(d))


def test_not_an_object_and_not_json() -> None:
    assert "$" in _problems([1, 2])
    with pytest.raises(PolicyValidationError, match="not valid JSON"):
        loads("{broken")
    with pytest.raises(PolicyValidationError, match="NaN is not allowed"):
        loads('{"version": NaN}')
    # json keeps the last of two equal keys: this applied as v99
    good = json.loads(dumps(Policy.uniform(2, Route.DECODE_LOCAL)))
    doubled = json.dumps(good)[:-1] + ', "version": 99}'
    with pytest.raises(PolicyValidationError, match="duplicate key 'version'"):
        loads(doubled)


def test_a_refused_field_is_one_problem_not_two() -> None:
    """``"version": 5.0`` also said "must be between 1 and ..., got 0"."""
    for bad in (5.0, True):
        d = json.loads(dumps(Policy.uniform(2, Route.DECODE_LOCAL)))
        d["version"] = bad
        d.pop("checksum", None)
        with pytest.raises(PolicyValidationError) as e:
            loads(json.dumps(d))
        assert [p.path for p in e.value.problems] == ["version"], e.value.problems


def test_checksum_optional_on_import_and_verified_when_present() -> None:
    d = _valid()
    d.pop("checksum")
    assert policy_from_dict(d).version == 4
    d2 = _valid()
    d2["scores"][0] = 0.5  # edited by hand without updating the checksum
    assert "checksum" in _problems(d2)


def _refuse(constant: str) -> float:
    raise ValueError(constant)


def test_output_is_strict_json() -> None:
    text = dumps(Policy.uniform(1, Route.PREFILL_NODE))
    assert json.loads(text, parse_constant=_refuse)["version"] == 1


def test_the_busy_override_is_written_only_when_on() -> None:
    """Routers of earlier releases refuse unknown keys: a file without the override must
    stay readable by them."""
    off = Policy.uniform(2, Route.PREFILL_NODE)
    assert "first_turn_busy_waiting" not in policy_to_dict(off)["overrides"]
    on = dataclasses.replace(off, overrides=Overrides(first_turn_busy_waiting=3))
    d = policy_to_dict(on)
    assert d["overrides"]["first_turn_busy_waiting"] == 3
    assert "later_turn_busy_waiting" not in d["overrides"]
    assert policy_from_dict(d) == on
    later = dataclasses.replace(off, overrides=Overrides(later_turn_busy_waiting=4))
    d = policy_to_dict(later)
    assert d["overrides"]["later_turn_busy_waiting"] == 4
    assert "first_turn_busy_waiting" not in d["overrides"]
    assert policy_from_dict(d) == later
