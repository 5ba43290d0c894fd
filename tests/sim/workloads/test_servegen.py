"""ServeGen m-large and deepseek-r1: rate curve, length windows, sessions, slicing."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from controller.data import TRACES_DIR
from controller.sim.workloads import WorkloadConfig, build_workload
from controller.sim.workloads.base import WorkloadError
from controller.sim.workloads.fit import load_shape
from controller.sim.workloads.servegen import (
    DATASETS,
    TRACE_FILE,
    LengthQuantiles,
    ServeGenWorkload,
    load_windows,
    window_percentiles,
)


def aggregate_path() -> Path:
    return TRACES_DIR / TRACE_FILE


def test_quantile_function_passes_through_the_anchors() -> None:
    q = LengthQuantiles(100.0, 900.0, 3000.0)
    assert q.at(0.5) == pytest.approx(100.0)
    assert q.at(0.9) == pytest.approx(900.0)
    assert q.at(0.99) == pytest.approx(3000.0)
    values = [q.at(u / 1000) for u in range(1, 1000)]
    assert values == sorted(values)


@pytest.mark.parametrize("dataset", sorted(DATASETS))
def test_generated_lengths_reproduce_the_window_percentiles(dataset: str) -> None:
    path = TRACES_DIR / DATASETS[dataset]
    window = load_windows(path)[0]
    workload = ServeGenWorkload(path, trace_window_s=(0.0, 3600.0), mean_rate_rps=20.0, shape=None)
    requests = workload.requests(random.Random(2))
    got_in = window_percentiles([r.input_tokens for r in requests])
    got_out = window_percentiles([r.output_tokens for r in requests])
    want_in = (window.input.p50, window.input.p90, window.input.p99)
    want_out = (window.output.p50, window.output.p90, window.output.p99)
    for got, want in ((got_in, want_in), (got_out, want_out)):
        assert got[0] == pytest.approx(want[0], rel=0.05)
        assert got[1] == pytest.approx(want[1], rel=0.05)
        assert got[2] == pytest.approx(want[2], rel=0.12)


def test_arrivals_follow_the_rate_curve_at_the_target_mean() -> None:
    path = aggregate_path()
    windows = load_windows(path)
    # a day compressed 24x into an hour of simulated time, 10 req/s on average
    workload = ServeGenWorkload(
        path, duration_s=3600.0, time_scale=24.0, mean_rate_rps=10.0, shape=None
    )
    requests = workload.requests(random.Random(3))
    assert len(requests) / 3600.0 == pytest.approx(10.0, rel=0.03)
    day = windows[:144]
    mean_rate = sum(w.rate_rps for w in day) / len(day)
    per_window = [0] * 144
    for r in requests:
        per_window[min(143, int(r.arrival_s // 25.0))] += 1  # 600 s trace = 25 s simulated
    # the 24 busiest windows of the day get more requests than the 24 quietest, as in the file
    order = sorted(range(144), key=lambda i: day[i].rate_rps)
    quiet, busy = order[:24], order[-24:]
    want_ratio = sum(day[i].rate_rps for i in busy) / sum(day[i].rate_rps for i in quiet)
    got_ratio = sum(per_window[i] for i in busy) / sum(per_window[i] for i in quiet)
    assert got_ratio == pytest.approx(want_ratio, rel=0.1)
    assert mean_rate > 0


def test_sessions_have_the_fitted_shape_and_conserve_requests() -> None:
    aggregate_path()
    workload = build_workload(WorkloadConfig("servegen", params={"mean_rate_rps": 6.0}))
    sessions = list(workload.sessions(random.Random(4)))
    turns = sum(len(s.turns) for s in sessions)
    assert turns / 3600.0 == pytest.approx(6.0, rel=0.05)
    assert turns / len(sessions) == pytest.approx(load_shape().mean_turns, rel=0.05)


def test_time_slice_selects_trace_time_and_starts_at_zero() -> None:
    aggregate_path()
    cfg = WorkloadConfig(
        "servegen",
        time_slice_s=(86_400.0, 90_000.0),
        params={"mean_rate_rps": 4.0, "sessions": "none"},
    )
    sessions = list(build_workload(cfg).sessions(random.Random(5)))
    assert 0 <= sessions[0].start_s < 5 and 3590 < sessions[-1].start_s < 3600
    assert len(sessions) / 3600 == pytest.approx(4.0, rel=0.05)


def test_the_reasoning_dataset_is_a_day_of_73_clients_read_by_name() -> None:
    """deepseek-r1: 144 windows of 600 s (one day), mean aggregate rate 16.0 req/s and long
    outputs (traces README: output p50 792 over the day, m-large's is 53)."""
    windows = load_windows(TRACES_DIR / DATASETS["deepseek-r1"])
    assert [w.start_s for w in windows] == [600.0 * i for i in range(144)]
    assert sum(w.rate_rps for w in windows) / 144 == pytest.approx(16.0, abs=0.05)
    cfg = WorkloadConfig("servegen", params={"dataset": "deepseek-r1", "mean_rate_rps": 4.0,
                                             "sessions": "none", "time_scale": 24.0})
    turns = [t for s in build_workload(cfg).sessions(random.Random(6)) for t in s.turns]
    assert len(turns) / 3600 == pytest.approx(4.0, rel=0.05)
    median_output = window_percentiles([t.output_tokens for t in turns])[0]
    assert 500 < median_output < 2500
    large = WorkloadConfig("servegen", params={"mean_rate_rps": 4.0, "sessions": "none"})
    large_turns = [t for s in build_workload(large).sessions(random.Random(6)) for t in s.turns]
    assert window_percentiles([t.output_tokens for t in large_turns])[0] < median_output / 2


def test_an_unknown_dataset_is_named_in_the_error() -> None:
    with pytest.raises(WorkloadError, match=r"workload\.params\.dataset: 'm-huge'"):
        build_workload(WorkloadConfig("servegen", params={"dataset": "m-huge"}))
