"""The router agent's metric building blocks: fixed bins and the lock-free tally."""

from __future__ import annotations

import math
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.policy import bin_index
from controller.policy.bins import (
    CONTEXT_BINS,
    FEATURE_CONTEXT_EDGES,
    FEATURE_IO_RATIO_EDGES,
    IO_RATIO_BINS,
    FeatureBins,
    edge_label,
)
from controller.policy.model import DEFAULT_CONTEXT_EDGES, DEFAULT_IO_RATIO_EDGES
from controller.rollout.agent_metrics import Tally, slo_label


def test_feature_edges_are_the_default_table_edges() -> None:
    assert tuple(map(float, DEFAULT_CONTEXT_EDGES)) == FEATURE_CONTEXT_EDGES
    assert tuple(map(float, DEFAULT_IO_RATIO_EDGES)) == FEATURE_IO_RATIO_EDGES


@pytest.mark.parametrize(
    ("edge", "label"),
    [(1024, "1024"), (1024.0, "1024"), (0.125, "0.125"), (0.1, "0.1"), (1e20, "1e+20")],
)
def test_edge_labels_are_compact(edge: float, label: str) -> None:
    assert edge_label(edge) == label


def test_bin_labels_follow_inclusive_upper_edges() -> None:
    assert CONTEXT_BINS.label(0.0) == "256"
    assert CONTEXT_BINS.label(256.0) == "256"
    assert CONTEXT_BINS.label(256.5) == "512"
    assert CONTEXT_BINS.label(131072.0) == "131072"
    assert CONTEXT_BINS.label(131073.0) == "+Inf"
    assert IO_RATIO_BINS.label(0.2) == "0.25"
    for bad in (-1.0, math.nan, math.inf):
        assert CONTEXT_BINS.label(bad) == "unknown"


@given(st.floats(0.0, 1e6))
def test_bin_labels_agree_with_the_policy_bins_inside_the_edges(value: float) -> None:
    bins = FeatureBins(FEATURE_CONTEXT_EDGES)
    label = bins.label(value)
    if value > FEATURE_CONTEXT_EDGES[-1]:
        assert label == "+Inf"
    else:
        assert label == bins.labels[bin_index(FEATURE_CONTEXT_EDGES, value)]


def test_slo_labels() -> None:
    assert [slo_label(a, b) for a, b in ((True, True), (False, True), (True, False),
                                         (False, False))] == list(
        ("met", "ttft_miss", "tpot_miss", "both_miss"))


def test_tally_counts_every_tick_from_many_threads() -> None:
    tally = Tally()
    assert tally.value() == 0

    def tick_many() -> None:
        for _ in range(20_000):
            tally.tick()

    threads = [threading.Thread(target=tick_many) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert tally.value() == 80_000
