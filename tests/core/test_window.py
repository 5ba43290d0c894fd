"""The window: lossless NaN-free JSON, None for missing values, role aggregates."""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import pickle
import random
import struct
from pathlib import Path
from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.core.window import (
    FailureKind,
    Histogram,
    OutcomeColumns,
    RouteOutcome,
    RouteOutcomes,
    Summary,
    TargetFailure,
    Window,
    WindowError,
    WorkerStats,
    Workload,
    aggregate_role,
)
from controller.policy.model import Route
from tests.store.factories import sample_window

DATA = Path(__file__).resolve().parents[1] / "store" / "data"


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_json_round_trip_is_lossless(seed: int, compact: bool) -> None:
    w = sample_window(random.Random(seed), 1_800_000_000.1 + seed)
    text = json.dumps(w.to_dict(compact=compact), allow_nan=False)  # raises on NaN/inf
    back = Window.from_dict(json.loads(text))
    assert back == w
    assert [o.to_row() for o in back.outcomes] == [o.to_row() for o in w.outcomes]


def test_compact_outcomes_keep_awkward_floats_bit_exact() -> None:
    awkward = [0.1 + 0.2, 5e-324, 1.7976931348623157e308, 1 / 3, 0.0, 2.0**53 + 1]
    outcomes = [
        RouteOutcome("r\u00e9", Route.DECODE_LOCAL, 9, 0, x, x, x, x, x, x) for x in awkward
    ]
    w = Window(start=0, end=1, interval_s=1, outcomes=tuple(outcomes))
    back = Window.from_dict(json.loads(json.dumps(w.to_dict(compact=True))))
    assert [o.requests for o in back.outcomes] == awkward
    assert back.outcomes == w.outcomes


def test_a_summary_without_values_round_trips_and_reads_from_an_empty_row() -> None:
    empty = Summary(None)
    w = Window.build(0.0, 30.0, 30.0, workers=[WorkerStats("d0", "decode", ttft_s=empty)])
    stored = json.loads(json.dumps(w.to_dict(compact=True)))
    assert stored["workers"][0]["ttft_s"] == [None]
    assert Window.from_dict(stored) == w
    stored["workers"][0]["ttft_s"] = []  # how the first format-2 writer stored it
    assert Window.from_dict(stored).workers[0].ttft_s == empty


def test_any_mapping_of_prompt_tokens_is_stored() -> None:
    tokens = MappingProxyType({"local_compute": 12.0, "external_kv_transfer": 3.5})
    w = Window.build(0.0, 30.0, 30.0, workers=[
        WorkerStats("d0", "decode", prompt_tokens_by_source=tokens)])
    for compact in (False, True):
        back = Window.from_dict(json.loads(json.dumps(w.to_dict(compact=compact))))
        assert back == w and back.workers[0].prompt_tokens_by_source == dict(tokens)


def test_missing_values_stay_none() -> None:
    w = Window.build(
        start=0.0, end=30.0, interval_s=30.0,
        workers=[WorkerStats(worker="p0", role="prefill")],
    )
    back = Window.from_dict(json.loads(json.dumps(w.to_dict())))
    worker = back.workers[0]
    assert worker.ttft_s is None and worker.running is None
    assert worker.prompt_tokens_by_source is None and worker.request_rate is None
    prefill = back.roles["prefill"]
    assert prefill.workers == 1 and prefill.ttft_s is None and prefill.running is None
    assert back.roles["decode"].workers == 0


def test_infinite_bucket_edges_survive_json() -> None:
    h = Histogram((1.0, 10.0, math.inf), (3.0, 0.0, 2.0))
    w = Window(start=0, end=1, interval_s=1, workload=Workload(context_tokens=h))
    d = json.loads(json.dumps(w.to_dict(), allow_nan=False))
    assert d["workload"]["context_tokens"]["edges"][-1] == "+Inf"
    back = Window.from_dict(d).workload.context_tokens
    assert back == h and back is not None and back.total == 5.0


@pytest.mark.parametrize(
    "make",
    [
        lambda: Summary(mean=math.nan),
        lambda: WorkerStats(worker="d0", role="decode", running=math.nan),
        lambda: WorkerStats(worker="d0", role="decode", prompt_tokens_by_source={"x": math.inf}),
        lambda: WorkerStats(worker="d0", role="router"),  # type: ignore[arg-type]
        lambda: RouteOutcome("r", Route.DECODE_LOCAL, 0, 0, 1, 1, math.nan, 1, 0, 0),
        lambda: RouteOutcome("r", Route.DECODE_LOCAL, 0, 0, -1, 0, 0, 0, 0, 0),
        lambda: Histogram((2.0, 1.0), (0.0, 0.0)),
        lambda: Window(start=10, end=5, interval_s=5),
        lambda: Workload(qps_by_router={"r": math.nan}),
    ],
)
def test_bad_values_are_refused_with_a_window_error(make: object) -> None:
    with pytest.raises(WindowError):
        make()  # type: ignore[operator]


def test_from_dict_rejects_unknown_schema_and_malformed_rows() -> None:
    d = sample_window(random.Random(1), 0.0, n_routers=1, cells=1).to_dict()
    with pytest.raises(WindowError, match="schema_version"):
        Window.from_dict({**d, "schema_version": 99})
    with pytest.raises(WindowError, match="outcome row"):
        Window.from_dict({**d, "outcomes": [["r", "DECODE_LOCAL", 0]]})
    compact = sample_window(random.Random(1), 0.0, n_routers=1, cells=2).to_dict(compact=True)
    with pytest.raises(WindowError, match="format"):
        Window.from_dict({**compact, "format": 3})
    packed = compact["outcomes"]
    truncated = {**packed, "floats": packed["floats"][:-8]}
    with pytest.raises(WindowError, match="packed outcomes"):
        Window.from_dict({**compact, "outcomes": truncated})
    with pytest.raises(WindowError, match="packed outcomes"):
        Window.from_dict({**compact, "outcomes": {**packed, "ints": "not base64!"}})
    with pytest.raises(WindowError, match="router index out of range"):
        Window.from_dict({**compact, "outcomes": {**packed, "routers": []}})
    with pytest.raises(WindowError, match="malformed window"):
        Window.from_dict({**compact, "workers": [{"worker": "w", "role": "decode", "x": 1}]})
    with pytest.raises(WindowError, match="must be finite"):
        Window.from_dict({**compact, "workers": [{"worker": "w", "role": "decode",
                                                   "ttft_s": [1e400]}]})


def _packed(ints: list[int], floats: list[float]) -> dict[str, object]:
    return {"routers": ["r"],
            "ints": base64.b64encode(struct.pack(f"<{len(ints)}i", *ints)).decode(),
            "floats": base64.b64encode(struct.pack(f"<{len(floats)}d", *floats)).decode()}


@pytest.mark.parametrize(
    ("ints", "floats", "message"),
    [
        ([0, 2, 1, 1], [1, 1, math.nan, 1, 0, 0], "finite"),
        ([0, 2, 1, 1], [1, 1, math.inf, 1, 0, 0], "finite"),
        ([0, 2, 1, 1], [1, -1, 0, 1, 0, 0], ">= 0"),
        ([0, 7, 1, 1], [1, 1, 0, 1, 0, 0], "unknown route"),
        ([1, 2, 1, 1], [1, 1, 0, 1, 0, 0], "router index out of range"),
        ([0, 2, 1], [1, 1, 0, 1, 0, 0], "lengths disagree"),
    ],
)
def test_stored_outcome_columns_are_checked_like_objects(
    ints: list[int], floats: list[float], message: str
) -> None:
    with pytest.raises(WindowError, match=message):
        OutcomeColumns.from_json(_packed(ints, floats))


def test_outcomes_read_back_from_columns_equal_the_objects() -> None:
    w = sample_window(random.Random(3), 1_800_000_000.0, n_routers=3, cells=7)
    stored = json.loads(json.dumps(w.to_dict(compact=True), allow_nan=False))
    back = Window.from_dict(stored).outcomes
    assert len(back) == len(w.outcomes) == 3 * 2 * 7
    assert back == w.outcomes and back == tuple(w.outcomes) and tuple(w.outcomes) == back
    assert back[5] == w.outcomes[5] and list(back) == list(w.outcomes)
    assert back.columns.float_column("requests")[4] == w.outcomes[4].requests
    assert hash(back) == hash(tuple(w.outcomes))
    assert pickle.loads(pickle.dumps(back)) == w.outcomes
    changed = list(w.outcomes)
    changed[-1] = dataclasses.replace(changed[-1], met=changed[-1].met + 1)
    assert back != tuple(changed) and back != RouteOutcomes(changed)
    assert not RouteOutcomes() and Window(start=0, end=1, interval_s=1).outcomes == ()
    with pytest.raises(WindowError, match="RouteOutcome"):
        RouteOutcomes([("r", 1)])  # type: ignore[list-item]


def test_a_body_in_the_first_stored_format_still_reads() -> None:
    # Written by the code before format 2 (see the fixture's "about"): plain worker dicts,
    # column-major packed outcomes. The database may hold such rows.
    fixture = json.loads((DATA / "window_format1.json").read_text())
    old = json.loads(fixture["stored_body"])
    assert "packed_outcomes" in old and "format" not in old
    window = Window.from_dict(old)
    assert window == Window.from_dict(fixture["plain"])
    assert len(window.outcomes) == 12 and len(window.workers) == 3
    rewritten = json.loads(json.dumps(window.to_dict(compact=True), allow_nan=False))
    assert rewritten["format"] == 2 and Window.from_dict(rewritten) == window


def test_role_aggregate_weights_means_by_count_and_sums_loads() -> None:
    workers = [
        WorkerStats("d0", "decode", request_rate=2.0, tpot_s=Summary(0.02, count=100),
                    running=3, kv_cache_usage=0.5),
        WorkerStats("d1", "decode", request_rate=None, tpot_s=Summary(0.05, count=300),
                    running=5, kv_cache_usage=None),
        WorkerStats("d2", "decode", tpot_s=Summary(None, count=0)),
        WorkerStats("p0", "prefill", request_rate=9.0, ttft_s=Summary(1.0, count=10)),
    ]
    d = aggregate_role("decode", workers)
    assert d.workers == 3
    assert d.request_rate == 2.0  # the worker without a rate is not counted as 0
    assert d.tpot_s == pytest.approx((0.02 * 100 + 0.05 * 300) / 400)
    assert d.running == 8 and d.kv_cache_usage == 0.5
    assert d.ttft_s is None  # no decode worker reported TTFT
    p = aggregate_role("prefill", workers)
    assert (p.workers, p.request_rate, p.ttft_s) == (1, 9.0, 1.0)


def test_aggregates_that_overflow_are_missing_not_infinite() -> None:
    huge = Summary(1e308, count=1e308)
    workers = [WorkerStats(f"d{i}", "decode", ttft_s=huge, running=1e308) for i in range(2)]
    d = aggregate_role("decode", workers)
    assert d.ttft_s is None and d.running is None
    json.dumps(Window.build(0, 1, 1, workers).to_dict(), allow_nan=False)


def test_outcome_goodput() -> None:
    o = RouteOutcome("r", Route.PREFILL_NODE, 1, 2, requests=8, met=6, ttft_sum=4.0,
                     ttft_count=8, tpot_sum=0.4, tpot_count=8)
    assert o.goodput == 0.75
    assert RouteOutcome("r", Route.PREFILL_NODE, 0, 0, 0, 0, 0, 0, 0, 0).goodput is None


finite = st.floats(allow_nan=False, allow_infinity=False)
counts = st.floats(min_value=0, allow_nan=False, allow_infinity=False)
maybe = st.none() | finite


@settings(max_examples=150, deadline=None)
@given(
    summary=st.builds(Summary, mean=maybe, count=st.none() | counts, p50=maybe, p90=maybe,
                      p99=maybe, interpolated=st.booleans()),
    outcome_values=st.lists(st.tuples(counts, counts, counts, counts, counts, counts),
                            max_size=5),
    router=st.text(max_size=20),
    rate=maybe,
    compact=st.booleans(),
)
def test_round_trip_holds_for_any_finite_values(
    summary: Summary,
    outcome_values: list[tuple[float, ...]],
    router: str,
    rate: float | None,
    compact: bool,
) -> None:
    outcomes = [RouteOutcome(router, Route.PREFILL_NODE, i, i + 1, *v)
                for i, v in enumerate(outcome_values)]
    w = Window.build(
        start=1.5, end=31.5, interval_s=30,
        workers=[WorkerStats("w", "decode", request_rate=rate, ttft_s=summary, tpot_s=summary)],
        outcomes=outcomes,
    )
    text = json.dumps(w.to_dict(compact=compact), allow_nan=False)
    assert Window.from_dict(json.loads(text)) == w


def test_outcome_totals_agree_in_both_forms_without_making_objects() -> None:
    w = sample_window(random.Random(4), 1_800_000_000.0, n_routers=2, cells=5)
    stored = json.loads(json.dumps(w.to_dict(compact=True), allow_nan=False))
    back = Window.from_dict(stored).outcomes
    for name in ("requests", "met", "ttft_sum", "tpot_count"):
        assert back.total(name) == math.fsum(getattr(o, name) for o in w.outcomes) > 0
        assert w.outcomes.total(name) == back.total(name)
    assert back._items is None  # summed from the packed column
    assert RouteOutcomes().total("requests") == 0


def test_failure_kind_round_trips_as_its_word() -> None:
    known = TargetFailure("w:1", FailureKind.NO_BASELINE, "first window")
    doc = json.loads(json.dumps(known.to_dict()))
    assert doc["kind"] == "no_baseline"
    back = TargetFailure.from_dict(doc)
    assert back.kind is FailureKind.NO_BASELINE and f"{back.kind}" == "no_baseline"
    # A word no kind has (a newer writer's) is kept as it is.
    assert TargetFailure.from_dict({**doc, "kind": "brand_new"}).kind == "brand_new"
