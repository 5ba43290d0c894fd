"""The routers' fixed feature bins: the labels a router puts on its request metrics.

Every edge and label here is fixed: it does not depend on the policy a router runs, so series
stay comparable across policy versions and the controller can learn the workload distribution
from Prometheus alone. The router agent (``controller.rollout``) writes these labels and the
observer (``controller.observe``) reads them back, so both take them from here, below either.
"""

from __future__ import annotations

from bisect import bisect_left

from controller.policy.model import DEFAULT_CONTEXT_EDGES, DEFAULT_IO_RATIO_EDGES

# The default table's edges, frozen here so that a policy with other axes does not change
# the series a router exports.
FEATURE_CONTEXT_EDGES: tuple[float, ...] = tuple(float(e) for e in DEFAULT_CONTEXT_EDGES)
FEATURE_IO_RATIO_EDGES: tuple[float, ...] = tuple(float(e) for e in DEFAULT_IO_RATIO_EDGES)

UNKNOWN_BIN = "unknown"
OVERFLOW_BIN = "+Inf"
INF = float("inf")


def edge_label(edge: float) -> str:
    """Compact label of a bin's inclusive upper edge: ``1024``, ``0.125``, ``1e+20``."""
    e = float(edge)
    if e.is_integer() and abs(e) < 1e15:
        return str(int(e))
    return repr(e)


class FeatureBins:
    """Maps a value to the label of its fixed bin: the bin's upper edge, ``+Inf`` beyond."""

    def __init__(self, edges: tuple[float, ...]) -> None:
        self.edges = edges
        self.labels: tuple[str, ...] = (*(edge_label(e) for e in edges), OVERFLOW_BIN)

    def label(self, value: float) -> str:
        # Inclusive upper edges, like controller.policy.bin_index; beyond the last: +Inf.
        if not 0.0 <= value < INF:
            return UNKNOWN_BIN
        return self.labels[bisect_left(self.edges, value)]


CONTEXT_BINS = FeatureBins(FEATURE_CONTEXT_EDGES)
IO_RATIO_BINS = FeatureBins(FEATURE_IO_RATIO_EDGES)
