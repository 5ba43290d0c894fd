"""The exposition parser is strict where prometheus_client's is lenient."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from controller.core.exposition import ExpositionError, parse_exposition
from controller.core.window import FailureKind


def parse(text: str, keep: set[str] | None = None):  # type: ignore[no-untyped-def]
    return parse_exposition(text, target="t", taken_at=0.0, keep=keep)


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("foo 1 2 3 4\n", FailureKind.PARSE),  # prometheus_client reads this as foo=1
        ('foo{a="b" 1\n', FailureKind.PARSE),
        ("foo twelve\n", FailureKind.NON_NUMERIC),
        ("foo 1_000\n", FailureKind.NON_NUMERIC),
        ("foo infinity\n", FailureKind.NON_NUMERIC),
        ("foo 1 12.5\n", FailureKind.NON_NUMERIC),  # timestamps are integers
        ('foo{a="1"} 1\nfoo{a="1"} 2\n', FailureKind.DUPLICATE_SERIES),
        ('foo{a="1",a="2"} 1\n', FailureKind.PARSE),
        ('foo{a="1" b="2"} 1\n', FailureKind.PARSE),
        ("foo 1\nbar 2", FailureKind.PARSE),  # no final newline: cut off
        ("<html><body>502 Bad Gateway</body></html>\n", FailureKind.PARSE),
        ("3foo 1\n", FailureKind.PARSE),
    ],
)
def test_bad_text_raises_with_the_failure_kind(text: str, kind: str) -> None:
    with pytest.raises(ExpositionError) as e:
        parse(text)
    assert e.value.kind == kind
    assert str(e.value)


def test_values_labels_and_specials() -> None:
    text = (
        "# HELP x some help\n# TYPE x gauge\n"
        'x{b="2",a="q\\"uote\\\\ \\n"} NaN\n'
        "y +Inf\nz -Inf 1700000000000\n"
        "w{} 3\n"
    )
    snap = parse(text)
    ((labels, value),) = snap.series("x").items()
    assert labels == (("a", 'q"uote\\ \n'), ("b", "2"))
    assert math.isnan(value)
    assert snap.series("y")[()] == math.inf
    assert snap.series("z")[()] == -math.inf
    assert snap.series("w")[()] == 3.0
    assert {"x", "y", "z", "w"} <= snap.families


def test_unused_families_are_skipped_but_their_presence_is_known() -> None:
    text = "# TYPE a_seconds histogram\na_seconds_bucket{le=\"+Inf\"} 2\na_seconds_count 2\n" \
           "# TYPE b gauge\nb 7\nb 8\n"  # a duplicate in a skipped family is not looked at
    snap = parse(text, keep={"a_seconds"})
    assert set(snap.samples) == {"a_seconds_bucket", "a_seconds_count"}
    assert "b" in snap.families


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40), st.floats(allow_nan=False))
def test_round_trip_of_prometheus_client_output(label: str, value: float) -> None:
    registry = CollectorRegistry()
    Gauge("g", "help", ["l"], registry=registry).labels(label).set(value)
    snap = parse(generate_latest(registry).decode())
    assert snap.series("g") == {(("l", label),): value}
