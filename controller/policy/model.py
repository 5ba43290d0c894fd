"""The routing policy: the one contract between the controller and every router.

Pure values only. A :class:`Policy` is immutable; a new decision means a new policy with a
higher version. Cells are flattened in C order: context bin (slowest), io-ratio bin, qps bin
(fastest), so ``index = (i_ctx * n_io + i_io) * n_qps + i_qps``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime

MAX_EDGES_PER_AXIS = 64
MAX_EXPLORATION = 0.2
AXIS_NAMES = ("context_tokens", "io_ratio", "qps")

# Default axes: 10 x 10 x 10, inclusive upper edges. The last bin also takes every larger value.
DEFAULT_CONTEXT_EDGES: tuple[float, ...] = (
    256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072,
)
DEFAULT_IO_RATIO_EDGES: tuple[float, ...] = (
    0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64,
)
DEFAULT_QPS_EDGES: tuple[float, ...] = (0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256)


class Route(enum.IntEnum):
    """Where a turn's append-prefill runs. Values are the wire values (proto and checksum)."""

    PREFILL_NODE = 1  # x=0: classic P/D, prefill worker + KV transfer
    DECODE_LOCAL = 2  # x=1: PPD, the session's decode worker computes the new tokens

    @property
    def other(self) -> Route:
        return Route.DECODE_LOCAL if self is Route.PREFILL_NODE else Route.PREFILL_NODE

    @classmethod
    def parse(cls, value: str) -> Route:
        """Accept the canonical names and the seed config's words (``prefill``/``decode``)."""
        v = value.strip().upper()
        aliases = {"PREFILL": "PREFILL_NODE", "DECODE": "DECODE_LOCAL", "LOCAL": "DECODE_LOCAL"}
        v = aliases.get(v, v)
        try:
            return cls[v]
        except KeyError:
            raise ValueError(
                f"unknown route {value!r}: expected PREFILL_NODE (or prefill) or "
                "DECODE_LOCAL (or decode, local)"
            ) from None


@dataclass(frozen=True, slots=True)
class Axes:
    """Inclusive, strictly increasing bin upper edges per axis."""

    context_tokens: tuple[float, ...] = DEFAULT_CONTEXT_EDGES
    io_ratio: tuple[float, ...] = DEFAULT_IO_RATIO_EDGES
    qps: tuple[float, ...] = DEFAULT_QPS_EDGES

    @property
    def shape(self) -> tuple[int, int, int]:
        return (len(self.context_tokens), len(self.io_ratio), len(self.qps))

    @property
    def n_cells(self) -> int:
        a, b, c = self.shape
        return a * b * c

    def by_name(self) -> dict[str, tuple[float, ...]]:
        return {n: getattr(self, n) for n in AXIS_NAMES}

    def cell_index(self, i_ctx: int, i_io: int, i_qps: int) -> int:
        _, n_io, n_qps = self.shape
        return (i_ctx * n_io + i_io) * n_qps + i_qps

    def cell_coords(self, index: int) -> tuple[int, int, int]:
        _, n_io, n_qps = self.shape
        i_ctx, rest = divmod(index, n_io * n_qps)
        i_io, i_qps = divmod(rest, n_qps)
        return (i_ctx, i_io, i_qps)


@dataclass(frozen=True, slots=True)
class LookupTable:
    """Per-cell route, score and exploration fraction over :class:`Axes`."""

    axes: Axes
    routes: tuple[Route, ...]
    scores: tuple[float, ...]
    exploration: tuple[float, ...]

    @classmethod
    def uniform(
        cls,
        route: Route,
        axes: Axes | None = None,
        score: float = 0.0,
        exploration: float = 0.0,
    ) -> LookupTable:
        axes = axes or Axes()
        n = axes.n_cells
        return cls(axes, (route,) * n, (score,) * n, (exploration,) * n)

    def route_at(self, i_ctx: int, i_io: int, i_qps: int) -> Route:
        return self.routes[self.axes.cell_index(i_ctx, i_io, i_qps)]


@dataclass(frozen=True, slots=True)
class Weights:
    """The PPD paper's knobs; only their ratio matters for the decision."""

    wtft: float = 1.0
    wtpot: float = 1.0


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float = 2.0
    tpot_s: float = 0.1

    def met(self, ttft_s: float, tpot_s: float | None) -> tuple[bool, bool]:
        """(TTFT met, TPOT met). A request with one output token has no TPOT and meets it."""
        ttft_ok = math.isfinite(ttft_s) and ttft_s <= self.ttft_s
        tpot_ok = tpot_s is None or (math.isfinite(tpot_s) and tpot_s <= self.tpot_s)
        return ttft_ok, tpot_ok


@dataclass(frozen=True, slots=True)
class Overrides:
    """Rules applied before the table.

    ``first_turn_route``: turn 1 has no cached context, so by default it goes to a prefill
    node. ``bypass_append_tokens``: an append strictly shorter than this runs decode-local
    (0 disables the bypass). ``first_turn_busy_waiting``: turn 1 runs decode-local instead of
    on a prefill node while every prefill worker has at least this many requests waiting
    (the router's ``prefill_waiting`` feature; 0 disables it). A burst of new conversations
    then spills onto the decode pool instead of queueing behind the prefill workers, like
    the busyness clause of NVIDIA Dynamo's conditional disaggregation.
    ``later_turn_busy_waiting``: the same clause for a later turn whose cell routes it to a
    prefill node (an explored request keeps its draw; 0 disables it), while turn 1 goes to a
    prefill node: a policy running turn 1 decode-local has put every new prompt on the decode
    pool already. The table prices the load of a QPS bin, not the queue a burst inside it
    builds; the router sees that queue.
    """

    first_turn_route: Route = Route.PREFILL_NODE
    bypass_append_tokens: int = 0
    first_turn_busy_waiting: int = 0
    later_turn_busy_waiting: int = 0


@dataclass(frozen=True, slots=True)
class Provenance:
    """Why this policy exists. Not part of the checksum."""

    created_at: datetime | None = None
    reason: str = ""
    created_by: str = ""
    trained_from: datetime | None = None
    trained_to: datetime | None = None


@dataclass(frozen=True, slots=True)
class Policy:
    version: int
    table: LookupTable
    weights: Weights = field(default_factory=Weights)
    slo: Slo = field(default_factory=Slo)
    overrides: Overrides = field(default_factory=Overrides)
    default_route: Route = Route.PREFILL_NODE
    provenance: Provenance = field(default_factory=Provenance)

    @property
    def checksum(self) -> str:
        from controller.policy.checksum import policy_checksum

        return policy_checksum(self)

    def with_version(self, version: int) -> Policy:
        return replace(self, version=version)

    @classmethod
    def uniform(
        cls,
        version: int,
        route: Route,
        axes: Axes | None = None,
        exploration: float = 0.0,
        **kwargs: object,
    ) -> Policy:
        """A policy that sends every later turn the same way (``pd`` / ``local`` baselines)."""
        table = LookupTable.uniform(route, axes, exploration=exploration)
        return cls(version=version, table=table, **kwargs)  # type: ignore[arg-type]


def edges_tuple(values: Sequence[float]) -> tuple[float, ...]:
    return tuple(float(v) for v in values)
