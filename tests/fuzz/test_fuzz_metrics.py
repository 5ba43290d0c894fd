"""Hostile metrics: random text and mutated valid expositions through the parser and the
whole window computation (parse, histogram checks, diff against the previous scrape,
assembly). Expected: the parser returns a snapshot or raises ExpositionError; a window is
always built; a target whose answer is unusable is a per-target failure, the other targets
are untouched, and no value in the window is NaN or infinite."""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from controller.clock import VirtualClock
from controller.core.exposition import ExpositionError, parse_exposition
from controller.core.window import FailureKind
from controller.observe.snapshot import FetchError, SnapshotSource
from controller.observe.source import Target
from tests.observe.cluster import Cluster

FUZZ = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)


class TextSource(SnapshotSource):
    """Answers each target with the next text we hand it (our own seam, no HTTP)."""

    name = "fuzz"

    def __init__(self, targets: Sequence[Target], clock: VirtualClock) -> None:
        super().__init__(targets, clock)
        self.texts: list[str | FetchError] = []

    async def fetch_all(self, targets: Sequence[Target]) -> list[str | FetchError]:
        return list(self.texts)


def _cluster_texts() -> tuple[list[Target], list[str], list[str]]:
    cluster = Cluster.build(prefill=1, decode=1, routers=1)
    regs = cluster.registries()
    cluster.traffic(random.Random(1), requests_per_worker=10)
    first = [generate_latest(regs[t.name]).decode() for t in cluster.targets]
    cluster.traffic(random.Random(2), requests_per_worker=30)
    second = [generate_latest(regs[t.name]).decode() for t in cluster.targets]
    return cluster.targets, first, second


TARGETS, FIRST, SECOND = _cluster_texts()


def _floats(value: Any) -> list[float]:
    if isinstance(value, float):
        return [value]
    if isinstance(value, dict):
        return [f for v in value.values() for f in _floats(v)]
    if isinstance(value, list | tuple):
        return [f for v in value for f in _floats(v)]
    return []


@FUZZ
@given(st.text(max_size=3000))
def test_random_text_parses_or_fails_with_a_kind(text: str) -> None:
    try:
        snap = parse_exposition(text, target="t", taken_at=1.0)
    except ExpositionError as e:
        assert e.kind and str(e)
        return
    assert snap.target == "t"


SPECIAL_VALUES = ["NaN", "+Inf", "-Inf", "-1", "1e308", "0", "garbage", "", "0x10", "1_000"]


@st.composite
def mutated_exposition(draw: st.DrawFn, base: str) -> str:
    lines = base.splitlines()
    for _ in range(draw(st.integers(1, 6))):
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["value", "drop", "dup", "garble", "html", "cut", "label"]))
        line = lines[i]
        if op == "value" and not line.startswith("#") and " " in line:
            lines[i] = line.rsplit(" ", 1)[0] + " " + draw(st.sampled_from(SPECIAL_VALUES))
        elif op == "drop":
            del lines[i]
        elif op == "dup":
            lines.insert(i, line)
        elif op == "garble":
            lines[i] = draw(st.text(max_size=60)).replace("\n", " ")
        elif op == "html":
            lines.insert(0, "<html><body>502 Bad Gateway</body></html>")
        elif op == "cut":
            lines[i] = line[: draw(st.integers(0, len(line)))]
        elif op == "label" and "{" in line:
            lines[i] = line.replace('="', '="x', 1)
    text = "\n".join(lines)
    return text if draw(st.booleans()) else text + "\n"


@FUZZ
@given(st.data())
async def test_a_mutated_target_fails_alone_and_the_window_holds_no_fake_numbers(
    data: st.DataObject,
) -> None:
    victim = data.draw(st.integers(0, len(TARGETS) - 1))
    hostile = data.draw(mutated_exposition(SECOND[victim]))
    clock = VirtualClock(1_800_000_000.0)
    source = TextSource(TARGETS, clock)
    source.texts = list(FIRST)
    await source.window(clock.now() - 30, clock.now())
    clock.advance(30)
    source.texts = [hostile if i == victim else t for i, t in enumerate(SECOND)]
    window = await source.window(clock.now() - 30, clock.now())

    failed = {f.target for f in window.failures}
    assert failed <= {TARGETS[victim].name}  # the others are never dragged down
    body = window.to_dict()
    assert all(math.isfinite(v) for v in _floats(body))  # no NaN or inf passed off as data
    json.dumps(body, allow_nan=False)  # storable as strict JSON
    if hostile == SECOND[victim]:
        assert not failed


async def test_html_and_truncated_answers_name_the_target() -> None:
    clock = VirtualClock(1_800_000_000.0)
    source = TextSource(TARGETS, clock)
    source.texts = list(FIRST)
    await source.window(clock.now() - 30, clock.now())
    clock.advance(30)
    source.texts = ["<!doctype html><p>login</p>\n", SECOND[1][:-40], SECOND[2]]
    window = await source.window(clock.now() - 30, clock.now())
    kinds = {f.target: f.kind for f in window.failures}
    assert kinds == {TARGETS[0].name: FailureKind.PARSE, TARGETS[1].name: FailureKind.PARSE}


@pytest.mark.parametrize("value", ["+Inf", "Inf"])
async def test_a_counter_no_window_can_hold_fails_its_target_alone(value: str) -> None:
    """A router whose request counter reads +Inf (seen from the fuzzer): that target fails
    with ``invalid_value``; the others' window is built as without it."""
    victim = next(i for i, t in enumerate(SECOND) if "pdrouter_requests_total{" in t)
    hostile = re.sub(r"(pdrouter_requests_total\{[^}]*\}) \S+", rf"\1 {value}",
                     SECOND[victim], count=1)
    clock = VirtualClock(1_800_000_000.0)
    source = TextSource(TARGETS, clock)
    source.texts = list(FIRST)
    await source.window(clock.now() - 30, clock.now())
    clock.advance(30)
    source.texts = [hostile if i == victim else t for i, t in enumerate(SECOND)]
    window = await source.window(clock.now() - 30, clock.now())
    assert {(f.target, f.kind) for f in window.failures} >= {(TARGETS[victim].name,
                                                               FailureKind.INVALID_VALUE)}
    assert TARGETS[victim].name not in window.answered
    assert {f.target for f in window.failures} == {TARGETS[victim].name}
    json.dumps(window.to_dict(), allow_nan=False)
