"""The window: one control interval reduced to numbers, the unit everything downstream uses.

Pure values. A source (Prometheus, direct scrape, the simulator's registries) builds a
:class:`Window`; the store keeps it as JSON (:meth:`Window.to_dict` / :meth:`Window.from_dict`,
lossless and NaN-free); drift, fitting and the bench read it back.

Conventions:
- a value the targets did not provide is ``None``, never a fake zero;
- times are seconds, token and byte counts are plain numbers, rates are per second;
- counts are ``float``: PromQL ``increase()`` extrapolates, a direct scrape gives integers;
- a latency :class:`Summary` has the exact mean from ``_sum/_count`` and optional quantiles
  read off histogram buckets; ``interpolated`` says the quantiles are only estimates between
  bucket edges (e.g. vLLM's request-phase buckets start at 0.3 s).
"""

from __future__ import annotations

import base64
import binascii
import math
import operator
import struct
import sys
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import StrEnum
from itertools import chain
from operator import attrgetter
from typing import Any, Literal, cast, overload

from controller.policy.model import Route

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")
SCHEMA_VERSION = 1
COMPACT_FORMAT = 2  # the stored body (Window.to_dict(compact=True)); absent: plain

class FailureKind(StrEnum):
    """Why a target is listed in a window's failures (``TargetFailure.kind``); the value is
    the stored and printed word."""

    UNREACHABLE = "unreachable"  # connection refused, DNS failure, marked down
    TIMEOUT = "timeout"
    HTTP_STATUS = "http_status"  # non-2xx answer
    PARSE = "parse"  # not exposition text (truncated, HTML, garbage)
    DUPLICATE_SERIES = "duplicate_series"
    NON_NUMERIC = "non_numeric"
    INVALID_VALUE = "invalid_value"  # a value no window can hold (non-finite, negative)
    COUNTER_RESET = "counter_reset"  # reported, the window still uses the post-reset increase
    COUNTER_DECREASE = "counter_decrease"  # fell without a restart: no increase
    MISSING_FAMILY = "missing_family"  # a family the window needs is absent
    QUERY = "query"  # a PromQL query failed
    NO_BASELINE = "no_baseline"  # no earlier sample: the window has no increase for it
    STALE = "stale"  # Prometheus' newest sample of the target is too old


def failure_kind(text: str) -> FailureKind | str:
    """The kind a stored word names; a word no kind has is kept as it is."""
    try:
        return FailureKind(text)
    except ValueError:
        return text


class WindowError(ValueError):
    """A window (or its JSON form) is malformed; the message names the field."""


def _check_finite(name: str, value: float | None) -> None:
    if value is not None and not math.isfinite(value):
        raise WindowError(f"{name} must be finite, got {value!r}")


def _all_finite(values: Sequence[float | None]) -> bool:
    """Every value that is not ``None`` is finite. The constructors' hot path (a stored
    window read makes dozens of objects): ``filter(None, ...)`` drops ``None`` (and zeros,
    finite anyway) and one C-level sum meets any NaN or inf; only a sum of huge finite
    values that overflowed needs the exact look at each value."""
    if math.isfinite(sum(filter(None, values))):
        return True
    return all(v is None or math.isfinite(v) for v in values)


@dataclass(frozen=True, slots=True)
class Summary:
    """One latency (or size) distribution over the window."""

    mean: float | None
    count: float | None = None  # observations in the window (from ``_count``)
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    interpolated: bool = False  # quantiles fall between bucket edges (estimates only)

    def __post_init__(self) -> None:
        if not _all_finite((self.mean, self.count, self.p50, self.p90, self.p99)):
            for n in ("mean", "count", "p50", "p90", "p99"):
                _check_finite(f"Summary.{n}", getattr(self, n))

    def to_dict(self) -> dict[str, Any]:
        return {
            "mean": self.mean, "count": self.count, "p50": self.p50, "p90": self.p90,
            "p99": self.p99, "interpolated": self.interpolated,
        }

    def to_row(self) -> list[Any]:
        """``[mean, count, p50, p90, p99, interpolated]`` without trailing ``None``/``False``
        but never empty (the compact stored form; ``Summary(*row)`` reads it back)."""
        row: list[Any] = [self.mean, self.count, self.p50, self.p90, self.p99, self.interpolated]
        while len(row) > 1 and (row[-1] is None or row[-1] is False):
            row.pop()
        return row

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Summary:
        return cls(
            mean=_opt_float(d, "mean"), count=_opt_float(d, "count"), p50=_opt_float(d, "p50"),
            p90=_opt_float(d, "p90"), p99=_opt_float(d, "p99"),
            interpolated=bool(d.get("interpolated", False)),
        )


class Family(StrEnum):
    """A family of engine series the learning reads. A recognised engine whose exposition
    lacks one records it in :attr:`WorkerStats.missing` (the value then is ``None`` because
    the engine does not export it, not because nothing happened in the window)."""

    TTFT = "ttft"
    SUCCESS = "success"  # finished requests (served, aborted, errored)
    INTER_TOKEN = "inter_token"  # noqa: S105 (a family name, not a secret)
    KV_TRANSFER = "kv_transfer"


# WorkerStats fields holding a Summary, in their JSON order.
SUMMARY_FIELDS = (
    "ttft_s", "inter_token_s", "tpot_s", "queue_s", "prefill_s", "kv_transfer_s",
    "kv_transfer_bytes",
)


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """One worker (engine instance) over the window."""

    worker: str  # instance, e.g. ``10.0.0.5:8000``
    role: Role
    engine: str | None = None  # the catalog engine that read it: "vllm", "sglang", ...
    request_rate: float | None = None  # served requests per second (finished normally)
    ttft_s: Summary | None = None
    inter_token_s: Summary | None = None
    tpot_s: Summary | None = None  # per-request time per output token
    queue_s: Summary | None = None
    prefill_s: Summary | None = None
    kv_transfer_s: Summary | None = None
    kv_transfer_bytes: Summary | None = None
    running: float | None = None  # requests running at the end of the window
    waiting: float | None = None
    kv_cache_usage: float | None = None  # 0..1
    prompt_tokens_by_source: Mapping[str, float] | None = None  # local_compute, ...
    generation_tokens: float | None = None
    # Requests that finished without being served, in the window (not in request_rate):
    # aborted (the client or the engine gave up on them) and errored (an engine failure,
    # e.g. vLLM's finished_reason="error" after a KV load failure).
    aborted: float | None = None
    errored: float | None = None
    missing: tuple[Family, ...] = ()  # families the engine does not export (see Family)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise WindowError(f"worker {self.worker!r}: role must be prefill|decode")
        values = (self.request_rate, self.running, self.waiting, self.kv_cache_usage,
                  self.generation_tokens, self.aborted, self.errored)
        if not _all_finite(values):
            for n in ("request_rate", "running", "waiting", "kv_cache_usage",
                      "generation_tokens", "aborted", "errored"):
                _check_finite(f"{self.worker}.{n}", getattr(self, n))
        if self.missing and (type(self.missing) is not tuple
                             or not all(isinstance(f, Family) for f in self.missing)):
            try:
                object.__setattr__(self, "missing", tuple(Family(f) for f in self.missing))
            except ValueError as e:
                raise WindowError(f"worker {self.worker!r}: {e}") from None
        tokens = self.prompt_tokens_by_source
        if tokens and not _all_finite(tuple(tokens.values())):
            for src, v in tokens.items():
                _check_finite(f"{self.worker}.prompt_tokens_by_source[{src}]", v)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "worker": self.worker, "role": self.role, "engine": self.engine,
            "request_rate": self.request_rate,
        }
        for n in SUMMARY_FIELDS:
            s: Summary | None = getattr(self, n)
            d[n] = None if s is None else s.to_dict()
        d.update(
            running=self.running, waiting=self.waiting, kv_cache_usage=self.kv_cache_usage,
            prompt_tokens_by_source=(
                None if self.prompt_tokens_by_source is None
                else dict(self.prompt_tokens_by_source)
            ),
            generation_tokens=self.generation_tokens,
            aborted=self.aborted, errored=self.errored,
            missing=[f.value for f in self.missing],
        )
        return d

    def to_compact(self) -> dict[str, Any]:
        """The stored form: only the fields that have a value, summaries as rows."""
        d: dict[str, Any] = {}
        for n in _WORKER_FIELDS:
            v = getattr(self, n)
            if v is not None:
                d[n] = v.to_row() if n in _SUMMARY_FIELD_SET else v
        if self.prompt_tokens_by_source is not None:  # any Mapping; JSON needs a dict
            d["prompt_tokens_by_source"] = dict(self.prompt_tokens_by_source)
        if self.missing:
            d["missing"] = [f.value for f in self.missing]
        else:
            del d["missing"]
        return d

    @classmethod
    def from_compact(cls, d: Mapping[str, Any]) -> WorkerStats:
        # An empty row is a summary without values (written so before rows kept the mean).
        kwargs: dict[str, Any] = {
            k: (Summary(*v) if v else Summary(None)) if k in _SUMMARY_FIELD_SET else v
            for k, v in d.items()
        }
        return cls(**kwargs)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> WorkerStats:
        summaries = {
            n: None if d.get(n) is None else Summary.from_dict(d[n]) for n in SUMMARY_FIELDS
        }
        pts = d.get("prompt_tokens_by_source")
        return cls(
            worker=str(d["worker"]), role=cast(Role, d["role"]), engine=d.get("engine"),
            request_rate=_opt_float(d, "request_rate"), running=_opt_float(d, "running"),
            waiting=_opt_float(d, "waiting"), kv_cache_usage=_opt_float(d, "kv_cache_usage"),
            prompt_tokens_by_source=(
                None if pts is None else {str(k): float(v) for k, v in pts.items()}
            ),
            generation_tokens=_opt_float(d, "generation_tokens"),
            aborted=_opt_float(d, "aborted"), errored=_opt_float(d, "errored"),
            missing=_families(d.get("missing") or ()),
            **summaries,
        )


def _families(raw: Iterable[str]) -> tuple[Family, ...]:
    try:
        return tuple(Family(f) for f in raw)
    except ValueError as e:
        raise WindowError(f"unknown family: {e}") from None


_SUMMARY_FIELD_SET = frozenset(SUMMARY_FIELDS)
_WORKER_FIELDS = tuple(f.name for f in fields(WorkerStats))


@dataclass(frozen=True, slots=True)
class RoleStats:
    """Aggregate of one role's answering workers (see :func:`aggregate_role`)."""

    role: Role
    workers: int  # workers that answered
    request_rate: float | None = None  # sum over workers
    ttft_s: float | None = None  # count-weighted means
    inter_token_s: float | None = None
    tpot_s: float | None = None
    queue_s: float | None = None
    prefill_s: float | None = None
    kv_transfer_s: float | None = None
    kv_transfer_bytes: float | None = None
    running: float | None = None  # sums
    waiting: float | None = None
    kv_cache_usage: float | None = None  # mean over workers
    generation_tokens: float | None = None  # sum

    def __post_init__(self) -> None:
        if not _all_finite(_ROLE_VALUES(self)):
            for n in _ROLE_FIELDS[2:]:
                _check_finite(f"RoleStats({self.role}).{n}", getattr(self, n))

    def to_dict(self) -> dict[str, Any]:
        return {n: getattr(self, n) for n in _ROLE_FIELDS}

    def to_compact(self) -> dict[str, Any]:
        """The stored form: only the fields that have a value (``RoleStats(**d)`` reads it)."""
        return {n: v for n in _ROLE_FIELDS if (v := getattr(self, n)) is not None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RoleStats:
        values = {n: _opt_float(d, n) for n in _ROLE_FIELDS[2:]}
        return cls(role=cast(Role, d["role"]), workers=int(d["workers"]), **values)


_ROLE_FIELDS = (
    "role", "workers", "request_rate", *SUMMARY_FIELDS, "running", "waiting",
    "kv_cache_usage", "generation_tokens",
)
_ROLE_VALUES = attrgetter(*_ROLE_FIELDS[2:])


def _finite_or_none(x: float) -> float | None:
    # Absurd inputs may overflow; an aggregate that is not a number is missing, not inf.
    return x if math.isfinite(x) else None


def _fsum(values: Sequence[float]) -> float:
    try:
        return math.fsum(values)
    except OverflowError:
        return math.inf


def _sum(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return _finite_or_none(_fsum(present)) if present else None


def _weighted_mean(summaries: Iterable[Summary | None]) -> float | None:
    products, weights = [], []
    for s in summaries:
        if s is None or s.mean is None or not s.count:
            continue
        products.append(s.mean * s.count)
        weights.append(s.count)
    if not weights:
        return None
    total, weight = _fsum(products), _fsum(weights)
    return _finite_or_none(total / weight) if math.isfinite(total + weight) else None


def aggregate_role(role: Role, workers: Sequence[WorkerStats]) -> RoleStats:
    """Sum rates and loads, count-weight the means; ``None`` where no worker had a value."""
    mine = [w for w in workers if w.role == role]
    usages = [w.kv_cache_usage for w in mine if w.kv_cache_usage is not None]
    return RoleStats(
        role=role,
        workers=len(mine),
        request_rate=_sum(w.request_rate for w in mine),
        running=_sum(w.running for w in mine),
        waiting=_sum(w.waiting for w in mine),
        kv_cache_usage=_finite_or_none(_fsum(usages) / len(usages)) if usages else None,
        generation_tokens=_sum(w.generation_tokens for w in mine),
        **{n: _weighted_mean(getattr(w, n) for w in mine) for n in SUMMARY_FIELDS},
    )


@dataclass(frozen=True, slots=True)
class RouteOutcome:
    """What one router saw for one route in one (context bin, io bin) cell."""

    router: str
    route: Route
    ctx_bin: int
    io_bin: int
    requests: float
    met: float  # requests meeting both SLOs
    ttft_sum: float
    ttft_count: float
    tpot_sum: float
    tpot_count: float

    def __post_init__(self) -> None:
        values = (self.requests, self.met, self.ttft_sum, self.ttft_count, self.tpot_sum,
                  self.tpot_count)
        if not _finite_non_negative(values):
            for n in _FLOAT_FIELDS:
                v = getattr(self, n)
                _check_finite(f"{self.router}.{n}", v)
                if v < 0:
                    raise WindowError(f"outcome {self.router}/{self.route.name}: {n} < 0")

    @property
    def goodput(self) -> float | None:
        return self.met / self.requests if self.requests > 0 else None

    # Outcomes are many (routers x routes x cells): stored as compact rows.
    def to_row(self) -> list[Any]:
        return [
            self.router, self.route.name, self.ctx_bin, self.io_bin, self.requests, self.met,
            self.ttft_sum, self.ttft_count, self.tpot_sum, self.tpot_count,
        ]

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> RouteOutcome:
        if len(row) != len(OUTCOME_COLUMNS):
            raise WindowError(f"outcome row needs {len(OUTCOME_COLUMNS)} values, got {len(row)}")
        return cls(
            router=str(row[0]), route=Route[row[1]], ctx_bin=int(row[2]), io_bin=int(row[3]),
            requests=float(row[4]), met=float(row[5]), ttft_sum=float(row[6]),
            ttft_count=float(row[7]), tpot_sum=float(row[8]), tpot_count=float(row[9]),
        )


OUTCOME_COLUMNS = (
    "router", "route", "ctx_bin", "io_bin", "requests", "met", "ttft_sum", "ttft_count",
    "tpot_sum", "tpot_count",
)
_INT_FIELDS = OUTCOME_COLUMNS[:4]  # router (as an index into the names), route, bins
_FLOAT_FIELDS = OUTCOME_COLUMNS[4:]
_ROUTES = {int(r): r for r in Route}


@dataclass(frozen=True, slots=True)
class OutcomeColumns:
    """Route outcomes as two little-endian row-major arrays (the stored form, and what the
    training-set builder reads without making an object per row).

    ``ints``: per outcome ``router index, route wire value, ctx_bin, io_bin`` (int32);
    ``floats``: per outcome ``requests, met, ttft_sum, ttft_count, tpot_sum, tpot_count``
    (float64). Exact: the floats are the bits of the values. Validated on construction.
    """

    routers: tuple[str, ...]
    ints: bytes
    floats: bytes

    def __post_init__(self) -> None:
        n, rest = divmod(len(self.ints), 4 * len(_INT_FIELDS))
        if rest or len(self.floats) != n * 8 * len(_FLOAT_FIELDS):
            raise WindowError("packed outcomes: column lengths disagree")
        if not n:
            return
        ints = self.int_values()
        index = ints[0::4]
        if min(index) < 0 or max(index) >= len(self.routers):
            raise WindowError("packed outcomes: router index out of range")
        if not set(ints[1::4]) <= _ROUTES.keys():
            raise WindowError("packed outcomes: unknown route value")
        if not _finite_non_negative(self.float_values()):
            raise WindowError("packed outcomes: values must be finite and >= 0")

    @property
    def n(self) -> int:
        return len(self.ints) // (4 * len(_INT_FIELDS))

    def int_values(self) -> Sequence[int]:
        return memoryview(self.ints).cast("i") if _LITTLE else _swapped("i", self.ints)

    def float_values(self) -> Sequence[float]:
        return memoryview(self.floats).cast("d") if _LITTLE else _swapped("d", self.floats)

    def float_column(self, name: str) -> Sequence[float]:
        """One of ``requests, met, ttft_sum, ttft_count, tpot_sum, tpot_count``."""
        k = _FLOAT_FIELDS.index(name)
        return self.float_values()[k :: len(_FLOAT_FIELDS)]

    @classmethod
    def pack(cls, outcomes: Sequence[RouteOutcome]) -> OutcomeColumns:
        """From (already validated) objects. C-level loops, and no tuple per outcome kept
        alive: hundreds of live tuples per write would set off the garbage collector."""
        n = len(outcomes)
        names = list(map(_GET_ROUTER, outcomes))
        routers = tuple(dict.fromkeys(names))
        index = {name: i for i, name in enumerate(routers)}
        int_rows = zip(map(index.__getitem__, names), *(map(g, outcomes) for g in _INT_GETTERS),
                       strict=True)
        try:
            ints = struct.pack(f"<{4 * n}i", *chain.from_iterable(int_rows))
        except struct.error as e:  # a bin that does not fit 32 bits
            raise WindowError(f"outcome bins must fit in int32: {e}") from None
        float_rows = zip(*(map(g, outcomes) for g in _FLOAT_GETTERS), strict=True)
        floats = struct.pack(f"<{6 * n}d", *chain.from_iterable(float_rows))
        packed = object.__new__(cls)  # skips __post_init__: the objects were checked
        for name, value in (("routers", routers), ("ints", ints), ("floats", floats)):
            object.__setattr__(packed, name, value)
        return packed

    def unpack(self) -> tuple[RouteOutcome, ...]:
        names, routes = self.routers, _ROUTES
        return tuple(
            RouteOutcome(names[r], routes[route], ctx, io, *values)
            for (r, route, ctx, io), values in zip(
                struct.iter_unpack("<4i", self.ints), struct.iter_unpack("<6d", self.floats),
                strict=True,
            )
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "routers": list(self.routers),
            "ints": base64.b64encode(self.ints).decode("ascii"),
            "floats": base64.b64encode(self.floats).decode("ascii"),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> OutcomeColumns:
        try:
            routers = tuple(map(str, d["routers"]))
            ints = binascii.a2b_base64(d["ints"], strict_mode=True)
            floats = binascii.a2b_base64(d["floats"], strict_mode=True)
        except (ValueError, TypeError) as e:  # bad base64 (binascii.Error is a ValueError)
            raise WindowError(f"malformed packed outcomes: {e}") from None
        return cls(routers, ints, floats)


_GET_ROUTER = attrgetter("router")
_INT_GETTERS = tuple(map(attrgetter, _INT_FIELDS[1:]))
_FLOAT_GETTERS = tuple(map(attrgetter, _FLOAT_FIELDS))
_LITTLE = sys.byteorder == "little"


def _finite_non_negative(values: Sequence[float]) -> bool:
    # Fast: min() and one C-level sum; exact per value only when the sum is not finite
    # (NaN or inf somewhere, or a sum of huge finite values that overflowed).
    if min(values) >= 0 and math.isfinite(sum(values)):
        return True
    return all(v >= 0 and math.isfinite(v) for v in values)


def _swapped(typecode: str, data: bytes) -> array[Any]:
    a = array(typecode, data)
    a.byteswap()
    return a


class RouteOutcomes(Sequence[RouteOutcome]):
    """A window's route outcomes: an immutable sequence of :class:`RouteOutcome`.

    Hundreds per window, tens of thousands per calibration, so two forms are kept, each
    made from the other only when first asked for: the objects (what sources build and most
    code iterates) and :class:`OutcomeColumns` (what the store writes and reads, and what
    :func:`controller.core.features.build_training_set` uses). A window read from the store
    never makes the objects unless someone iterates it. Equal to another ``RouteOutcomes``
    or a tuple with the same outcomes in the same order.
    """

    __slots__ = ("_columns", "_items")

    def __init__(self, outcomes: Iterable[RouteOutcome] = ()) -> None:
        items = tuple(outcomes)
        for o in items:
            if not isinstance(o, RouteOutcome):
                raise WindowError(f"outcomes must be RouteOutcome, got {type(o).__name__}")
        self._items: tuple[RouteOutcome, ...] | None = items
        self._columns: OutcomeColumns | None = None

    @classmethod
    def from_columns(cls, columns: OutcomeColumns) -> RouteOutcomes:
        self = cls.__new__(cls)
        self._items, self._columns = None, columns
        return self

    @property
    def columns(self) -> OutcomeColumns:
        if self._columns is None:
            self._columns = OutcomeColumns.pack(self._objects())
        return self._columns

    def _objects(self) -> tuple[RouteOutcome, ...]:
        if self._items is None:
            self._items = self.columns.unpack()
        return self._items

    def __len__(self) -> int:
        return len(self._items) if self._items is not None else self.columns.n

    def total(self, name: str) -> float:
        """The sum of one of ``requests, met, ttft_sum, ttft_count, tpot_sum, tpot_count``
        over every outcome, from whichever form is at hand (a window read from the store
        sums its packed column without making tens of thousands of objects)."""
        if self._items is not None:
            return math.fsum(map(attrgetter(name), self._items))
        return math.fsum(self.columns.float_column(name))

    @overload
    def __getitem__(self, i: int) -> RouteOutcome: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[RouteOutcome, ...]: ...
    def __getitem__(self, i: int | slice) -> RouteOutcome | tuple[RouteOutcome, ...]:
        return self._objects()[i]

    def __iter__(self) -> Iterator[RouteOutcome]:
        return iter(self._objects())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RouteOutcomes):
            a, b = self._columns, other._columns
            if a is not None and b is not None and a.routers == b.routers:
                return a.ints == b.ints and a.float_values() == b.float_values()
            return self._objects() == other._objects()
        if isinstance(other, tuple):
            return self._objects() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._objects())

    def __repr__(self) -> str:
        return f"RouteOutcomes({self._objects()!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (RouteOutcomes, (self._objects(),))


@dataclass(frozen=True, slots=True)
class Histogram:
    """Observations per bucket: ``counts[i]`` fell in ``(edges[i-1], edges[i]]``.

    Not cumulative. The last edge may be ``inf`` (Prometheus ``+Inf``).
    """

    edges: tuple[float, ...]
    counts: tuple[float, ...]

    def __post_init__(self) -> None:
        edges = self.edges
        if len(edges) != len(self.counts):
            raise WindowError("histogram edges and counts differ in length")
        if not all(map(operator.lt, edges, edges[1:])):
            raise WindowError("histogram edges must be strictly increasing")
        if any(map(math.isnan, edges)):
            raise WindowError("histogram edge is NaN: a missing value must be None")
        if not _all_finite(self.counts):
            for c in self.counts:
                _check_finite("histogram count", c)

    @property
    def total(self) -> float:
        return _fsum(self.counts)

    def to_dict(self) -> dict[str, Any]:
        return {"edges": [_enc_float(e) for e in self.edges], "counts": list(self.counts)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Histogram:
        return cls(edges=_decode_edges(d["edges"]), counts=tuple(map(float, d["counts"])))


# The routers' bucket edges are the same in every window: decode each edge list once.
_EDGES: dict[tuple[Any, ...], tuple[float, ...]] = {}
_EDGES_KEPT = 64


def _decode_edges(raw: Sequence[float | str]) -> tuple[float, ...]:
    key = tuple(raw)
    edges = _EDGES.get(key)
    if edges is None:
        edges = tuple(map(_dec_float, key))
        if len(_EDGES) < _EDGES_KEPT:
            _EDGES[key] = edges
    return edges


@dataclass(frozen=True, slots=True)
class Workload:
    """The request features the routers saw (edges do not depend on the policy)."""

    context_tokens: Histogram | None = None
    io_ratio: Histogram | None = None
    qps_by_router: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not _all_finite(tuple(self.qps_by_router.values())):
            for r, q in self.qps_by_router.items():
                _check_finite(f"qps[{r}]", q)

    def to_dict(self) -> dict[str, Any]:
        return {
            "context_tokens": _hist_dict(self.context_tokens),
            "io_ratio": _hist_dict(self.io_ratio),
            "qps_by_router": dict(self.qps_by_router),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Workload:
        ctx, io = d.get("context_tokens"), d.get("io_ratio")
        return cls(
            context_tokens=None if ctx is None else Histogram.from_dict(ctx),
            io_ratio=None if io is None else Histogram.from_dict(io),
            qps_by_router={str(k): float(v) for k, v in d.get("qps_by_router", {}).items()},
        )


@dataclass(frozen=True, slots=True)
class TargetFailure:
    """A worker or router that did not answer (or answered garbage) in this window."""

    target: str
    kind: FailureKind | str  # a word no FailureKind has is kept as it is
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "kind": self.kind, "message": self.message}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TargetFailure:
        return cls(target=str(d["target"]), kind=failure_kind(str(d["kind"])),
                   message=str(d["message"]))


@dataclass(frozen=True, slots=True)
class Window:
    """One control interval ``[start, end)`` in epoch seconds."""

    start: float
    end: float
    interval_s: float
    workers: tuple[WorkerStats, ...] = ()
    roles: Mapping[str, RoleStats] = field(default_factory=dict)
    # Any sequence of RouteOutcome is accepted and kept as RouteOutcomes.
    outcomes: RouteOutcomes = field(default_factory=RouteOutcomes)
    workload: Workload = field(default_factory=Workload)
    answered: tuple[str, ...] = ()  # targets (workers and routers) that answered
    failures: tuple[TargetFailure, ...] = ()
    source: str = ""  # "prometheus", "scrape", "inprocess", ...

    def __post_init__(self) -> None:
        for n in ("start", "end", "interval_s"):
            _check_finite(f"Window.{n}", getattr(self, n))
        if self.end < self.start:
            raise WindowError(f"window end {self.end} is before its start {self.start}")
        if self.interval_s <= 0:
            raise WindowError("Window.interval_s must be > 0")
        if not isinstance(self.outcomes, RouteOutcomes):
            object.__setattr__(self, "outcomes", RouteOutcomes(self.outcomes))

    @classmethod
    def build(
        cls,
        start: float,
        end: float,
        interval_s: float,
        workers: Sequence[WorkerStats] = (),
        outcomes: Sequence[RouteOutcome] = (),
        workload: Workload | None = None,
        answered: Sequence[str] = (),
        failures: Sequence[TargetFailure] = (),
        source: str = "",
    ) -> Window:
        """A window with its per-role aggregates computed from ``workers``."""
        return cls(
            start=start, end=end, interval_s=interval_s, workers=tuple(workers),
            roles={r: aggregate_role(r, workers) for r in ROLES},
            outcomes=RouteOutcomes(outcomes), workload=workload or Workload(),
            answered=tuple(answered), failures=tuple(failures), source=source,
        )

    def to_dict(self, *, compact: bool = False) -> dict[str, Any]:
        """JSON-safe (no NaN, no inf numbers), lossless: ``from_dict(to_dict(w)) == w``.

        The plain form is for people and scripts. ``compact=True`` is the stored form
        (``"format": 2``): workers and role aggregates carry only the fields that have a
        value, summaries are ``[mean, count, p50, p90, p99, interpolated]`` rows, and the
        route outcomes (hundreds per window) are :class:`OutcomeColumns` as base64, exact
        and several times cheaper to encode and decode than JSON numbers.
        """
        if compact:
            return {
                "schema_version": SCHEMA_VERSION,
                "format": COMPACT_FORMAT,
                "start": self.start,
                "end": self.end,
                "interval_s": self.interval_s,
                "source": self.source,
                "workers": [w.to_compact() for w in self.workers],
                "roles": [r.to_compact() for r in self.roles.values()],
                "outcomes": self.outcomes.columns.to_json(),
                "workload": self.workload.to_dict(),
                "answered": list(self.answered),
                "failures": [f.to_dict() for f in self.failures],
            }
        return {
            "schema_version": SCHEMA_VERSION,
            "start": self.start,
            "end": self.end,
            "interval_s": self.interval_s,
            "source": self.source,
            "workers": [w.to_dict() for w in self.workers],
            "roles": {k: v.to_dict() for k, v in self.roles.items()},
            "outcome_columns": list(OUTCOME_COLUMNS),
            "outcomes": [o.to_row() for o in self.outcomes],
            "workload": self.workload.to_dict(),
            "answered": list(self.answered),
            "failures": [f.to_dict() for f in self.failures],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Window:
        """Reads every form ever written: plain, compact (format 2) and the first stored
        form (plain workers with column-major ``packed_outcomes``)."""
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise WindowError(f"unsupported window schema_version {version!r}")
        fmt = d.get("format")
        try:
            if fmt == COMPACT_FORMAT:
                return cls._from_compact(d)
            if fmt is not None:
                raise WindowError(f"unsupported window format {fmt!r}")
            return cls(
                start=float(d["start"]), end=float(d["end"]), interval_s=float(d["interval_s"]),
                source=str(d.get("source", "")),
                workers=tuple(WorkerStats.from_dict(w) for w in d.get("workers", [])),
                roles={str(k): RoleStats.from_dict(v) for k, v in d.get("roles", {}).items()},
                outcomes=RouteOutcomes(
                    _unpack_outcomes(d["packed_outcomes"]) if "packed_outcomes" in d
                    else (RouteOutcome.from_row(r) for r in d.get("outcomes", []))
                ),
                workload=Workload.from_dict(d.get("workload", {})),
                answered=tuple(str(a) for a in d.get("answered", [])),
                failures=tuple(TargetFailure.from_dict(f) for f in d.get("failures", [])),
            )
        except (KeyError, TypeError, IndexError, OverflowError) as e:
            raise WindowError(f"malformed window: {e!r}") from None

    @classmethod
    def _from_compact(cls, d: Mapping[str, Any]) -> Window:
        # Values come back as the JSON numbers we wrote; each constructor validates them.
        roles = [RoleStats(**r) for r in d["roles"]]
        return cls(
            start=float(d["start"]), end=float(d["end"]), interval_s=float(d["interval_s"]),
            source=str(d["source"]),
            workers=tuple(map(WorkerStats.from_compact, d["workers"])),
            roles={r.role: r for r in roles},
            outcomes=RouteOutcomes.from_columns(OutcomeColumns.from_json(d["outcomes"])),
            workload=Workload.from_dict(d["workload"]),
            answered=tuple(map(str, d["answered"])),
            failures=tuple(map(TargetFailure.from_dict, d["failures"])),
        )

    def workers_of(self, role: Role) -> tuple[WorkerStats, ...]:
        return tuple(w for w in self.workers if w.role == role)


# The first stored form (read only): column-major packed outcomes.
_INTS_PER_OUTCOME = 4  # router index, route wire value, ctx_bin, io_bin
_FLOATS_PER_OUTCOME = 6  # requests, met, ttft_sum, ttft_count, tpot_sum, tpot_count


def _unb64(typecode: str, text: str) -> array[Any]:
    a = array(typecode)
    a.frombytes(base64.b64decode(text, validate=True))
    if sys.byteorder == "big":
        a.byteswap()
    return a


def _unpack_outcomes(packed: Mapping[str, Any]) -> tuple[RouteOutcome, ...]:
    try:
        routers = [str(r) for r in packed["routers"]]
        ints = _unb64("i", packed["ints"])
        floats = _unb64("d", packed["floats"])
    except ValueError as e:  # bad base64 or a byte count that is not a whole array
        raise WindowError(f"malformed packed outcomes: {e}") from None
    n = len(ints) // _INTS_PER_OUTCOME
    if len(ints) != n * _INTS_PER_OUTCOME or len(floats) != n * _FLOATS_PER_OUTCOME:
        raise WindowError("packed outcomes: column lengths disagree")
    ic = [ints[k * n : (k + 1) * n] for k in range(_INTS_PER_OUTCOME)]
    fc = [floats[k * n : (k + 1) * n] for k in range(_FLOATS_PER_OUTCOME)]
    if n and (min(ic[0]) < 0 or max(ic[0]) >= len(routers)):
        raise WindowError("packed outcomes: router index out of range")
    routes = {int(r): r for r in Route}
    try:
        return tuple(
            RouteOutcome(routers[r], routes[route], ctx, io, *values)
            for r, route, ctx, io, *values in zip(*ic, *fc, strict=True)
        )
    except (IndexError, KeyError) as e:
        raise WindowError(f"malformed packed outcomes: bad index {e}") from None


def _hist_dict(h: Histogram | None) -> dict[str, Any] | None:
    return None if h is None else h.to_dict()


def _opt_float(d: Mapping[str, Any], key: str) -> float | None:
    v = d.get(key)
    return None if v is None else float(v)


def _enc_float(x: float) -> float | str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return x


def _dec_float(x: float | str) -> float:
    if isinstance(x, str):
        if x in ("+Inf", "-Inf"):
            return math.inf if x[0] == "+" else -math.inf
        raise WindowError(f"bad number {x!r}")
    return float(x)
