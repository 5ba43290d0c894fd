"""Hostile policy files: random JSON trees, mutated valid files and random text through
``loads`` and the validator. Expected: a valid Policy or PolicyValidationError listing
problems with their paths; never another exception; what loads is always valid."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.policy import Policy, PolicyValidationError, Route, dumps, loads, validate_policy
from controller.policy.jsonfile import policy_from_dict, policy_to_dict

FUZZ = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
VALID = policy_to_dict(Policy.uniform(3, Route.DECODE_LOCAL))

scalars = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
)
json_trees = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner,
                                                                max_size=6),
    max_leaves=40,
)


def outcome(load: Callable[[], Policy]) -> Policy | None:
    try:
        policy = load()
    except PolicyValidationError as e:
        assert e.problems and all(isinstance(p.path, str) for p in e.problems)
        return None
    assert validate_policy(policy) == []
    return policy


@FUZZ
@given(json_trees)
def test_random_json_trees_are_refused_cleanly(tree: Any) -> None:
    assert outcome(lambda: policy_from_dict(tree)) is None
    assert outcome(lambda: loads(json.dumps(tree))) is None


def _paths(d: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = [prefix]
    if isinstance(d, dict):
        for k, v in d.items():
            out.extend(_paths(v, (*prefix, k)))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            out.extend(_paths(v, (*prefix, i)))
    return out


@st.composite
def mutated_files(draw: st.DrawFn) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(json.dumps(VALID))
    paths = _paths(doc)[1:]
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(paths))
        parent = doc
        try:
            for key in path[:-1]:
                parent = parent[key]
            action = draw(st.sampled_from(["replace", "delete", "wrap"]))
            if action == "replace":
                parent[path[-1]] = draw(json_trees)
            elif action == "delete":
                del parent[path[-1]]
            else:
                parent[path[-1]] = [parent[path[-1]]]
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed the spot
    return doc


@FUZZ
@given(mutated_files())
def test_mutated_policy_files_load_whole_or_are_refused(doc: dict[str, Any]) -> None:
    policy = outcome(lambda: policy_from_dict(doc))
    if policy is not None:  # a mutation that kept it valid: it round-trips exactly
        assert loads(dumps(policy)) == policy


@FUZZ
@given(st.text(max_size=2000) | st.binary(max_size=2000))
def test_random_text_is_refused_cleanly(text: str | bytes) -> None:
    assert outcome(lambda: loads(text)) is None


def test_deeply_nested_and_special_constants_are_refused() -> None:
    for text in ("[" * 100_000 + "]" * 100_000, '{"version": NaN}', '{"version": Infinity}',
                 '{"version": 1e999}', "\ufeff{}", '{"a":' * 50_000 + "1" + "}" * 50_000):
        assert outcome(lambda t=text: loads(t)) is None  # type: ignore[misc]
