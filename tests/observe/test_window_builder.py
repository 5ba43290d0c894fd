"""Quantiles from bucket increases, engine detection, router cells."""

from __future__ import annotations

import math

import pytest

from controller.core.catalog import SGLANG, VLLM, detect_engine
from controller.core.exposition import parse_exposition
from controller.core.window import FailureKind
from controller.observe.window_builder import (
    ALL_BINS,
    UNKNOWN_BIN,
    bin_index,
    diff_snapshots,
    quantiles,
    worker_stats,
)


def test_quantile_is_linear_inside_its_bucket() -> None:
    # 10 observations: 4 in (0, 1], 4 in (1, 1.5], 2 in (1.5, +Inf)
    cum = [(1.0, 4.0), (1.5, 8.0), (math.inf, 10.0)]
    (p50, p90), flagged = quantiles(cum, (0.5, 0.7))
    assert p50 == pytest.approx(1.0 + 0.5 * (5 - 4) / 4)
    assert p90 == pytest.approx(1.0 + 0.5 * (7 - 4) / 4)
    assert flagged is False  # (1, 1.5] resolves it


@pytest.mark.parametrize(
    ("cum", "q", "expected"),
    [
        ([(0.01, 10.0), (0.025, 10.0), (math.inf, 10.0)], 0.5, 0.005),  # below vLLM's ITL floor
        ([(0.3, 1.0), (0.5, 1.0), (math.inf, 10.0)], 0.9, 0.5),  # in +Inf: clamped
        ([(0.3, 0.0), (0.5, 0.0), (0.8, 0.0), (1.0, 1.0), (2.5, 2.0), (math.inf, 2.0)], 0.9,
         1.0 + 1.5 * (1.8 - 1.0)),  # bucket (1, 2.5] is 2.5x wide
        ([(0.0, 0.0), (0.001, 10.0), (math.inf, 10.0)], 0.5, 0.0005),  # SGLang's (0, 1 ms]
    ],
)
def test_unresolved_quantiles_are_flagged(cum, q, expected) -> None:  # type: ignore[no-untyped-def]
    (value,), flagged = quantiles(cum, (q,))
    assert value == pytest.approx(expected)
    assert flagged is True


def test_no_observations_no_quantiles() -> None:
    assert quantiles([(1.0, 0.0), (math.inf, 0.0)], (0.5,)) == ([None], False)
    assert quantiles([], (0.5,)) == ([None], False)
    # Every observation in the only bucket, +Inf: nothing known (it was 0.0).
    assert quantiles([(math.inf, 5.0)], (0.5, 0.9)) == ([None, None], True)


VLLM_LEGACY_TEXT = """\
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{le="0.01",model_name="m"} 0
vllm:time_per_output_token_seconds_bucket{le="0.025",model_name="m"} 4
vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="m"} 4
vllm:time_per_output_token_seconds_count{model_name="m"} 4
vllm:time_per_output_token_seconds_sum{model_name="m"} 0.08
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="m"} 500
"""

SGLANG_TEXT = """\
# TYPE sglang:token_usage gauge
sglang:token_usage{dp_rank="0",engine_type="prefill",tp_rank="0"} 0.5
sglang:token_usage{dp_rank="1",engine_type="prefill",tp_rank="4"} 0.7
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",engine_type="prefill",tp_rank="0"} 2
sglang:num_running_reqs{dp_rank="1",engine_type="prefill",tp_rank="4"} 3
# TYPE sglang:kv_transfer_latency_ms histogram
sglang:kv_transfer_latency_ms_bucket{le="10.0"} 1
sglang:kv_transfer_latency_ms_bucket{le="+Inf"} 2
sglang:kv_transfer_latency_ms_count 2
sglang:kv_transfer_latency_ms_sum 30
# TYPE sglang:per_stage_req_latency_seconds histogram
sglang:per_stage_req_latency_seconds_bucket{le="+Inf",stage="prefill_forward"} 2
sglang:per_stage_req_latency_seconds_count{stage="prefill_forward"} 2
sglang:per_stage_req_latency_seconds_sum{stage="prefill_forward"} 0.5
sglang:per_stage_req_latency_seconds_bucket{le="+Inf",stage="decode_waiting"} 5
sglang:per_stage_req_latency_seconds_count{stage="decode_waiting"} 5
sglang:per_stage_req_latency_seconds_sum{stage="decode_waiting"} 100
"""


def _zeroed(text: str) -> str:
    # the same families, every sample 0: the baseline before the window
    out = []
    for line in text.splitlines():
        out.append(line if line.startswith("#") else line.rsplit(" ", 1)[0] + " 0")
    return "\n".join(out) + "\n"


@pytest.mark.parametrize(("text", "spec"), [(VLLM_LEGACY_TEXT, VLLM), (SGLANG_TEXT, SGLANG)])
def test_engine_is_detected_from_its_families(text: str, spec) -> None:  # type: ignore[no-untyped-def]
    snap = parse_exposition(text, target="w", taken_at=1.0)
    assert detect_engine(snap.families) is spec


def test_old_vllm_names_map_to_the_same_keys() -> None:
    prev = parse_exposition(_zeroed(VLLM_LEGACY_TEXT), target="w", taken_at=0.0)
    cur = parse_exposition(VLLM_LEGACY_TEXT, target="w", taken_at=30.0)
    stats, _notes = worker_stats(diff_snapshots(prev, cur), "decode", 30.0)
    assert stats is not None and stats.engine == "vllm"
    # time_per_output_token_seconds measured inter-token latency: it is NOT per-request TPOT
    assert stats.inter_token_s is not None and stats.inter_token_s.mean == pytest.approx(0.02)
    assert stats.tpot_s is None
    assert stats.kv_cache_usage == 0.25 and stats.running == 3
    assert stats.prompt_tokens_by_source == {"total": 500.0}


def test_sglang_units_labels_and_aggregation() -> None:
    prev = parse_exposition(_zeroed(SGLANG_TEXT), target="w", taken_at=0.0)
    cur = parse_exposition(SGLANG_TEXT, target="w", taken_at=30.0)
    stats, _ = worker_stats(diff_snapshots(prev, cur), "prefill", 30.0)
    assert stats is not None and stats.engine == "sglang"
    assert stats.kv_transfer_s is not None and stats.kv_transfer_s.mean == pytest.approx(0.015)
    assert stats.prefill_s is not None and stats.prefill_s.count == 2  # only prefill_forward
    assert stats.prefill_s.mean == pytest.approx(0.25)
    assert stats.running == 5  # summed over DP ranks (schedulers of their own)
    assert stats.kv_cache_usage == pytest.approx(0.6)  # averaged over them


def test_vllm_spec_names_come_from_the_reference() -> None:
    assert VLLM.histograms["tpot_s"].family == "vllm:request_time_per_output_token_seconds"
    assert VLLM.histograms["inter_token_s"].family == "vllm:inter_token_latency_seconds"
    assert VLLM.gauges["kv_cache_usage"].family == "vllm:kv_cache_usage_perc"


def test_unknown_exposition_is_a_missing_family_failure() -> None:
    cur = parse_exposition("# TYPE up gauge\nup 1\n", target="w", taken_at=0.0)
    stats, notes = worker_stats(diff_snapshots(None, cur), "decode", 30.0)
    assert stats is None and [n.kind for n in notes] == [FailureKind.MISSING_FAMILY]


def test_bin_labels() -> None:
    labels = ["256", "1024", "+Inf"]
    assert bin_index("1024", labels) == 1
    assert bin_index("+Inf", labels) == 2
    assert bin_index("unknown", labels) == UNKNOWN_BIN
    assert bin_index(None, labels) == ALL_BINS


def _snapshot(text: str, at: float):  # type: ignore[no-untyped-def]
    from controller.observe.snapshot import snapshot_from_text

    return snapshot_from_text(text, "w:1", at)


def test_sglang_priority_classes_are_parts_of_their_total() -> None:
    """With priority scheduling SGLang reports each class beside the total (priority=""):
    summed with it, running, waiting, rates and token counts all came out doubled."""
    def text(running: float, requests: float) -> str:
        lines = ["# TYPE sglang:num_running_reqs gauge",
                 "# TYPE sglang:num_requests_total counter"]
        for priority, share in (("", 1.0), ("0", 0.6), ("1", 0.4)):
            labels = f'model_name="m",priority="{priority}",tp_rank="0"'
            lines.insert(1, f"sglang:num_running_reqs{{{labels}}} {running * share}")
            lines.append(f"sglang:num_requests_total{{{labels}}} {requests * share}")
        return "\n".join(lines) + "\n"

    delta = diff_snapshots(_snapshot(text(10, 100), 0), _snapshot(text(10, 400), 30))
    stats, _ = worker_stats(delta, "decode", 30.0)
    assert stats is not None
    assert stats.running == pytest.approx(10.0) and stats.request_rate == pytest.approx(10.0)


def test_a_family_missing_from_the_baseline_is_not_counted_over_its_lifetime() -> None:
    """An answer cut after a whole family passed validation (it lacked the counter family);
    the next window counted that counter's lifetime as its increase (670 requests/s for 2)."""
    def text(n: int, with_counter: bool = True) -> str:
        out = '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0"} 0.5\n'
        if with_counter:
            out += ("# TYPE vllm:request_success_total counter\n"
                    f'vllm:request_success_total{{engine="0",finished_reason="stop"}} {n}\n')
        return out

    cut = _snapshot(text(10_030, with_counter=False), 30)
    stats, notes = worker_stats(diff_snapshots(cut, _snapshot(text(10_060), 60)), "decode", 30.0)
    assert stats is not None and stats.request_rate is None
    assert [n.kind for n in notes] == [FailureKind.NO_BASELINE]
    assert "vllm:request_success_total" in notes[0].message
    # A family announced in the baseline with no series yet (no request so far): counted
    # from zero, as a new series is.
    empty = _snapshot(text(0).replace('vllm:request_success_total{engine="0",'
                                      'finished_reason="stop"} 0\n', ""), 0)
    stats, notes = worker_stats(diff_snapshots(empty, _snapshot(text(60), 30)), "decode", 30.0)
    assert stats is not None and stats.request_rate == pytest.approx(2.0) and notes == []


def test_a_router_target_without_router_metrics_is_a_failure() -> None:
    """A "router" target exposing no pdrouter_* family (a worker's port, a wrong one) was
    answered with zero outcomes: the window silently lacked that router's traffic."""
    from controller.observe.snapshot import snapshot_from_text
    from controller.observe.window_builder import TargetResult, assemble_window
    from controller.policy.bins import CONTEXT_BINS, IO_RATIO_BINS

    text = '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.5\n'
    delta = diff_snapshots(snapshot_from_text(text, "r:1", 0), snapshot_from_text(text, "r:1", 30))
    window = assemble_window(0, 30, [TargetResult("r:1", "router", delta=delta)], source="t",
                             ctx_labels=CONTEXT_BINS.labels, io_labels=IO_RATIO_BINS.labels)
    assert [(f.target, f.kind) for f in window.failures] == [("r:1", FailureKind.MISSING_FAMILY)]


def test_a_histogram_whose_sum_is_nan_has_no_mean_rather_than_zero() -> None:
    def text(count: int, total: str) -> str:
        return ("# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.5\n"
                "# TYPE vllm:time_to_first_token_seconds histogram\n"
                f'vllm:time_to_first_token_seconds_bucket{{le="0.1"}} {count}\n'
                f'vllm:time_to_first_token_seconds_bucket{{le="+Inf"}} {count}\n'
                f"vllm:time_to_first_token_seconds_count {count}\n"
                f"vllm:time_to_first_token_seconds_sum {total}\n")

    delta = diff_snapshots(_snapshot(text(10, "0.5"), 0), _snapshot(text(20, "NaN"), 30))
    stats, _ = worker_stats(delta, "decode", 30.0)
    assert stats is not None and stats.ttft_s is not None
    assert stats.ttft_s.count == 10 and stats.ttft_s.mean is None
    delta = diff_snapshots(_snapshot(text(10, "0.5"), 0), _snapshot(text(20, "1.5"), 30))
    stats, _ = worker_stats(delta, "decode", 30.0)
    assert stats is not None and stats.ttft_s is not None
    assert stats.ttft_s.mean == pytest.approx(0.1)


def test_a_counter_that_is_nan_has_no_rate_rather_than_zero() -> None:
    def text(value: str) -> str:
        return ('# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.5\n'
                '# TYPE vllm:request_success_total counter\n'
                f'vllm:request_success_total{{finished_reason="stop"}} {value}\n')

    stats, _ = worker_stats(diff_snapshots(_snapshot(text("NaN"), 0), _snapshot(text("NaN"), 30)),
                            "decode", 30.0)
    assert stats is not None and stats.request_rate is None
    stats, _ = worker_stats(diff_snapshots(_snapshot(text("5"), 0), _snapshot(text("5"), 30)),
                            "decode", 30.0)
    assert stats is not None and stats.request_rate == 0.0  # idle: zero, not missing


def test_a_counter_reset_is_decided_per_process() -> None:
    """One data-parallel engine restarting alone made the whole family count from zero: the
    engines that did not restart counted their lifetime totals as one window's increase."""
    def text(requests: dict[str, int], ttft: dict[str, tuple[int, float]]) -> str:
        lines = ['# TYPE vllm:kv_cache_usage_perc gauge',
                 '# TYPE vllm:request_success_total counter',
                 '# TYPE vllm:time_to_first_token_seconds histogram']
        for engine, n in requests.items():
            lines.append(f'vllm:kv_cache_usage_perc{{engine="{engine}"}} 0.5')
            lines.append(f'vllm:request_success_total{{engine="{engine}",'
                         f'finished_reason="stop"}} {n}')
            count, total = ttft[engine]
            for le in ("0.1", "+Inf"):
                lines.append(f'vllm:time_to_first_token_seconds_bucket{{engine="{engine}",'
                             f'le="{le}"}} {count}')
            lines.append(f'vllm:time_to_first_token_seconds_count{{engine="{engine}"}} {count}')
            lines.append(f'vllm:time_to_first_token_seconds_sum{{engine="{engine}"}} {total}')
        return "\n".join(lines) + "\n"

    before = _snapshot(text({"0": 9_000, "1": 9_000}, {"0": (9_000, 450.0),
                                                       "1": (9_000, 450.0)}), 0)
    # Engine 0 served 60 requests at 0.05 s; engine 1 restarted and served 30 at 0.08 s.
    after = _snapshot(text({"0": 9_060, "1": 30}, {"0": (9_060, 453.0),
                                                   "1": (30, 2.4)}), 30)
    stats, notes = worker_stats(diff_snapshots(before, after), "decode", 30.0)
    assert stats is not None and stats.request_rate == pytest.approx(90 / 30)
    assert stats.ttft_s is not None and stats.ttft_s.count == 90
    assert stats.ttft_s.mean == pytest.approx((3.0 + 2.4) / 90)
    assert [n.kind for n in notes] == [FailureKind.COUNTER_RESET]
    assert 'engine="1"' in notes[0].message and 'engine="0"' not in notes[0].message
    # A target with one process (no rank labels): the whole family counts from the reset.
    one = _snapshot(text({"0": 9_000}, {"0": (9_000, 450.0)}).replace('engine="0",', "")
                    .replace('{engine="0"}', ""), 0)
    restarted = _snapshot(text({"0": 12}, {"0": (12, 1.2)}).replace('engine="0",', "")
                          .replace('{engine="0"}', ""), 30)
    stats, notes = worker_stats(diff_snapshots(one, restarted), "decode", 30.0)
    assert stats is not None and stats.request_rate == pytest.approx(12 / 30)
    assert stats.ttft_s is not None and stats.ttft_s.mean == pytest.approx(0.1)
    assert [n.kind for n in notes] == [FailureKind.COUNTER_RESET] and "{" not in notes[0].message
    assert "request_success" in notes[0].message and "first_token" in notes[0].message
