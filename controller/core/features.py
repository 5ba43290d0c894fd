"""Windows → training data: per-window load, the route mix per cell, per-route outcomes.

Pure and vectorised: a calibration reads thousands of windows, so everything lands in numpy
arrays (struct of arrays) in one pass over the Python objects.

Router cells use the routers' fixed feature bins (the default table's edges, plus one
overflow bin); each bin stands for a representative value so that the latency model can work
in tokens, whatever axes the policy being built has.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from controller.core.window import Histogram, Window, WorkerStats
from controller.policy.bins import FEATURE_CONTEXT_EDGES, FEATURE_IO_RATIO_EDGES
from controller.policy.model import Route

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]

# Router bins: the routers' fixed feature bins (controller.policy.bins), index len(edges) =
# beyond the last.
ROUTER_CONTEXT_EDGES: tuple[float, ...] = FEATURE_CONTEXT_EDGES
ROUTER_IO_EDGES: tuple[float, ...] = FEATURE_IO_RATIO_EDGES
N_CTX_BINS = len(ROUTER_CONTEXT_EDGES) + 1
N_IO_BINS = len(ROUTER_IO_EDGES) + 1
N_ROUTER_CELLS = N_CTX_BINS * N_IO_BINS
ROUTES: tuple[Route, Route] = (Route.PREFILL_NODE, Route.DECODE_LOCAL)  # column 0, column 1

DEFAULT_OUTPUT_TOKENS = 256.0  # used only when no decode worker reports generated tokens


def context_representatives(edges: Sequence[float]) -> FloatArray:
    """Representative context per bin (and one overflow bin): arithmetic bin midpoints."""
    e = [float(x) for x in edges]
    lows = [0.0, *e[:-1]]
    reps = [(lo + hi) / 2.0 for lo, hi in zip(lows, e, strict=True)]
    return np.array([*reps, e[-1] * 1.5], dtype=np.float64)


def ratio_representatives(edges: Sequence[float]) -> FloatArray:
    """Representative io ratio per bin (and one overflow bin): geometric bin midpoints."""
    e = [float(x) for x in edges]
    reps = [e[0] / math.sqrt(2.0)]
    reps += [math.sqrt(lo * hi) for lo, hi in itertools.pairwise(e)]
    return np.array([*reps, e[-1] * 2.0], dtype=np.float64)


ROUTER_CTX_REP = context_representatives(ROUTER_CONTEXT_EDGES)
ROUTER_IO_REP = ratio_representatives(ROUTER_IO_EDGES)


_ACTIVE: dict[int, tuple[FloatArray, IntArray]] = {}


def router_cell(ctx_bin: int, io_bin: int) -> int:
    return min(max(ctx_bin, 0), N_CTX_BINS - 1) * N_IO_BINS + min(max(io_bin, 0), N_IO_BINS - 1)


@dataclass(frozen=True, slots=True)
class WorkerRows:
    """Per-worker component signals, one row per (window, worker) that reported them."""

    window: IntArray
    value: FloatArray  # the measured time (s)
    x: FloatArray  # regressors, one row per sample (columns depend on the component)
    weight: FloatArray  # observations behind the mean


@dataclass(frozen=True, slots=True)
class TrainingSet:
    """Everything a calibration learns from, for ``W`` windows.

    ``rate[w, k, r]``: requests per second of router cell ``k`` on route column ``r``
    (0 = prefill node, 1 = decode-local) summed over routers. Outcome rows aggregate routers.
    """

    start: FloatArray  # [W]
    end: FloatArray
    interval_s: FloatArray
    n_prefill: FloatArray
    n_decode: FloatArray
    cluster_qps: FloatArray  # arrivals per second over all routers
    n_routers: FloatArray
    output_tokens: FloatArray  # mean generated tokens per request
    goodput: FloatArray  # met / requests over the window (NaN when no requests)
    rate: FloatArray  # [W, K, 2]
    # outcome rows (window, cell, route)
    row_window: IntArray
    row_cell: IntArray
    row_route: IntArray
    row_requests: FloatArray
    row_met: FloatArray
    row_ttft: FloatArray  # mean, NaN when no sample
    row_ttft_count: FloatArray
    row_tpot: FloatArray
    row_tpot_count: FloatArray
    # component signals
    prefill: WorkerRows  # x = [prompt tokens computed per request]
    prefill_queue: WorkerRows  # x = [utilisation rho, mean prefill time]
    kv_transfer: WorkerRows  # x = [bytes per transfer, link busy fraction]
    decode_step: WorkerRows  # x = [running, running * ctx_mean, local prefill tok/s]
    kv_bytes_per_token: float | None

    @property
    def active_cells(self) -> IntArray:
        """Router cells that carry traffic in some window (computed once)."""
        cached = _ACTIVE.get(id(self.rate))
        if cached is None or cached[0] is not self.rate:
            cached = (self.rate, np.flatnonzero(self.rate.sum(axis=(0, 2)) > 0))
            _ACTIVE.clear()  # one training set at a time is the common case
            _ACTIVE[id(self.rate)] = cached
        return cached[1]

    @property
    def n_windows(self) -> int:
        return int(self.start.shape[0])

    @property
    def n_rows(self) -> int:
        return int(self.row_window.shape[0])

    def subset(self, windows: IntArray) -> TrainingSet:
        """The same data restricted to some windows (renumbered 0..len-1), for held-out splits."""
        order = np.asarray(windows, dtype=np.int64)
        remap = np.full(self.n_windows, -1, dtype=np.int64)
        remap[order] = np.arange(order.shape[0])

        def rows(r: WorkerRows) -> WorkerRows:
            keep = remap[r.window] >= 0
            return WorkerRows(remap[r.window[keep]], r.value[keep], r.x[keep], r.weight[keep])

        keep = remap[self.row_window] >= 0
        return TrainingSet(
            start=self.start[order], end=self.end[order], interval_s=self.interval_s[order],
            n_prefill=self.n_prefill[order], n_decode=self.n_decode[order],
            cluster_qps=self.cluster_qps[order], n_routers=self.n_routers[order],
            output_tokens=self.output_tokens[order], goodput=self.goodput[order],
            rate=self.rate[order],
            row_window=remap[self.row_window[keep]], row_cell=self.row_cell[keep],
            row_route=self.row_route[keep], row_requests=self.row_requests[keep],
            row_met=self.row_met[keep], row_ttft=self.row_ttft[keep],
            row_ttft_count=self.row_ttft_count[keep], row_tpot=self.row_tpot[keep],
            row_tpot_count=self.row_tpot_count[keep],
            prefill=rows(self.prefill), prefill_queue=rows(self.prefill_queue),
            kv_transfer=rows(self.kv_transfer), decode_step=rows(self.decode_step),
            kv_bytes_per_token=self.kv_bytes_per_token,
        )


def _finished(w: WorkerStats, interval_s: float) -> float | None:
    if w.request_rate is not None:
        return w.request_rate * interval_s
    return None


def _local_compute(w: WorkerStats) -> float | None:
    src = w.prompt_tokens_by_source
    if not src:
        return None
    return src.get("local_compute")


def histogram_mean(h: Histogram | None, representatives: FloatArray | None = None) -> float | None:
    """Mean of a bucketed distribution, each bucket at its midpoint (last bucket: 1.5x edge)."""
    if h is None or h.total <= 0:
        return None
    edges = np.array([e if math.isfinite(e) else np.nan for e in h.edges], dtype=np.float64)
    finite = edges[np.isfinite(edges)]
    if representatives is not None and representatives.shape[0] == edges.shape[0]:
        reps = representatives
    else:
        lows = np.concatenate(([0.0], np.nan_to_num(edges[:-1], nan=0.0)))
        reps = np.where(np.isfinite(edges), (lows + np.nan_to_num(edges)) / 2.0,
                        (finite[-1] * 1.5) if finite.size else 0.0)
    counts = np.array(h.counts, dtype=np.float64)
    return float(np.dot(reps, counts) / counts.sum())


def build_training_set(windows: Sequence[Window]) -> TrainingSet:
    """One pass over ``windows`` (any order; kept as given)."""
    n = len(windows)
    cols = _WindowColumns(n)
    for i, win in enumerate(windows):
        cols.add(i, win)
    out_tokens = np.where(np.isfinite(cols.out_tokens), cols.out_tokens,
                          np.nanmedian(cols.out_tokens) if np.isfinite(cols.out_tokens).any()
                          else DEFAULT_OUTPUT_TOKENS)
    o = spread_bin_totals(outcome_matrix(b"".join(cols.outcome_ints),
                                         b"".join(cols.outcome_floats), cols.outcomes_per_window))
    ow = o[:, 0].astype(np.int64)
    cells = (np.clip(o[:, 1], 0, N_CTX_BINS - 1) * N_IO_BINS
             + np.clip(o[:, 2], 0, N_IO_BINS - 1)).astype(np.int64)
    route_col = o[:, 3].astype(np.int64)
    rate = np.zeros((n, N_ROUTER_CELLS, 2))
    np.add.at(rate, (ow, cells, route_col), o[:, 4] / cols.interval[ow])
    req_w = np.bincount(ow, weights=o[:, 4], minlength=n)
    met_w = np.bincount(ow, weights=o[:, 5], minlength=n)
    goodput = np.where(req_w > 0, met_w / np.where(req_w > 0, req_w, 1.0), np.nan)
    ctx_mean = decode_context_mean(rate, out_tokens)
    rw, rc, rr, a = _outcome_rows(o, ow, cells, route_col)
    with np.errstate(invalid="ignore", divide="ignore"):
        ttft = np.where(a[:, 3] > 0, a[:, 2] / np.where(a[:, 3] > 0, a[:, 3], 1.0), np.nan)
        tpot = np.where(a[:, 5] > 0, a[:, 4] / np.where(a[:, 5] > 0, a[:, 5], 1.0), np.nan)
    return TrainingSet(
        start=cols.start, end=cols.end, interval_s=cols.interval, n_prefill=cols.n_p,
        n_decode=cols.n_d, cluster_qps=cols.qps, n_routers=cols.n_routers,
        output_tokens=out_tokens, goodput=goodput, rate=rate,
        row_window=rw.astype(np.int64), row_cell=rc.astype(np.int64),
        row_route=rr.astype(np.int64), row_requests=a[:, 0], row_met=a[:, 1],
        row_ttft=ttft, row_ttft_count=a[:, 3], row_tpot=tpot, row_tpot_count=a[:, 5],
        prefill=_worker_rows(cols.pf_rows, 1), prefill_queue=_worker_rows(cols.pq_rows, 2),
        kv_transfer=_worker_rows(cols.kv_rows, 2),
        decode_step=_decode_step_rows(cols.dec_rows, ctx_mean),
        kv_bytes_per_token=(float(np.median(cols.bytes_per_token)) if cols.bytes_per_token
                            else None),
    )


class _WindowColumns:
    """Per-window columns and per-worker component rows, filled one window at a time."""

    def __init__(self, n: int) -> None:
        self.start = np.empty(n)
        self.end = np.empty(n)
        self.interval = np.empty(n)
        self.n_p = np.zeros(n)
        self.n_d = np.zeros(n)
        self.qps = np.zeros(n)
        self.n_routers = np.zeros(n)
        self.out_tokens = np.full(n, np.nan)
        # outcome rows (one per router x route x cell), aggregated over routers later; taken
        # from the windows' packed columns, never one Python object per row
        self.outcome_ints: list[bytes] = []
        self.outcome_floats: list[bytes] = []
        self.outcomes_per_window = np.zeros(n, dtype=np.int64)
        self.pf_rows: list[tuple[int, float, float, float]] = []  # (w, prefill_s, tokens, n)
        self.pq_rows: list[tuple[int, float, float, float, float]] = []  # (w, queue_s, rho, s, n)
        self.kv_rows: list[tuple[int, float, float, float, float]] = []  # (w, t, bytes, busy, n)
        self.dec_rows: list[tuple[int, float, float, float, float]] = []  # (w, itl, run, tps, n)
        self.bytes_per_token: list[float] = []

    def add(self, i: int, win: Window) -> None:
        iv = win.interval_s
        self.start[i], self.end[i], self.interval[i] = win.start, win.end, iv
        prefill_workers = [w for w in win.workers if w.role == "prefill"]
        decode_workers = [w for w in win.workers if w.role == "decode"]
        roles = win.roles
        self.n_p[i] = roles["prefill"].workers if "prefill" in roles else len(prefill_workers)
        self.n_d[i] = roles["decode"].workers if "decode" in roles else len(decode_workers)
        packed = win.outcomes.columns
        self.outcome_ints.append(packed.ints)
        self.outcome_floats.append(packed.floats)
        self.outcomes_per_window[i] = packed.n
        routers = win.workload.qps_by_router
        if routers:
            self.qps[i] = math.fsum(routers.values())
            self.n_routers[i] = len(routers)
        else:
            self.qps[i] = math.fsum(packed.float_column("requests")) / iv
            self.n_routers[i] = 1.0
        gen = finished = 0.0
        for w in decode_workers:
            f = _finished(w, iv)
            if w.generation_tokens is not None and f:
                gen += w.generation_tokens
                finished += f
        if finished > 0:
            self.out_tokens[i] = gen / finished
        p_tokens = self._add_prefill(i, iv, prefill_workers)
        self._add_transfers(i, iv, win.workers, p_tokens)
        self._add_decode(i, iv, decode_workers)

    def _add_prefill(self, i: int, iv: float, workers: Sequence[WorkerStats]) -> list[float]:
        """Prefill time and queueing rows; returns the per-worker computed tokens/request."""
        p_tokens: list[float] = []
        for w in workers:
            f = _finished(w, iv)
            local = _local_compute(w)
            s = w.prefill_s
            if s is not None and s.mean is not None and s.count and local is not None and f:
                tokens = local / f
                p_tokens.append(tokens)
                self.pf_rows.append((i, s.mean, tokens, s.count))
            q = w.queue_s
            if q is not None and q.mean is not None and q.count and s is not None and s.mean:
                rho = (w.request_rate or 0.0) * s.mean
                self.pq_rows.append((i, q.mean, rho, s.mean, q.count))
        return p_tokens

    def _add_transfers(self, i: int, iv: float, workers: Sequence[WorkerStats],
                       p_tokens: list[float]) -> None:
        for w in workers:
            t, b = w.kv_transfer_s, w.kv_transfer_bytes
            if t is not None and t.mean is not None and t.count and b is not None and b.mean:
                busy = t.count * t.mean / iv
                self.kv_rows.append((i, t.mean, b.mean, busy, t.count))
                if p_tokens:
                    self.bytes_per_token.append(
                        b.mean / max(sum(p_tokens) / len(p_tokens), 1.0))

    def _add_decode(self, i: int, iv: float, workers: Sequence[WorkerStats]) -> None:
        for w in workers:
            itl = w.inter_token_s
            if itl is None or itl.mean is None or not itl.count or w.running is None:
                continue
            local = _local_compute(w)
            pf_tps = (local or 0.0) / iv
            self.dec_rows.append((i, itl.mean, w.running, pf_tps, itl.count))


def _outcome_rows(o: FloatArray, ow: IntArray, cells: IntArray, route_col: IntArray
                  ) -> tuple[IntArray, IntArray, IntArray, FloatArray]:
    """Outcome rows summed over routers: window, cell and route of each row, and its six
    sums (requests, met, TTFT sum and count, TPOT sum and count)."""
    key = (ow * N_ROUTER_CELLS + cells) * 2 + route_col
    uniq, inverse = np.unique(key, return_inverse=True)
    a: FloatArray = np.column_stack([
        np.bincount(inverse, weights=o[:, j], minlength=uniq.shape[0]).astype(np.float64)
        for j in range(4, 10)
    ]).reshape(-1, 6)
    return uniq // (2 * N_ROUTER_CELLS), (uniq // 2) % N_ROUTER_CELLS, uniq % 2, a


def _worker_rows(rows: Sequence[tuple[float, ...]], x_of: int) -> WorkerRows:
    m = np.array(rows, dtype=np.float64).reshape(-1, x_of + 3)
    return WorkerRows(m[:, 0].astype(np.int64), m[:, 1], m[:, 2:2 + x_of], m[:, -1])


def _decode_step_rows(dec_rows: Sequence[tuple[float, ...]], ctx_mean: FloatArray
                      ) -> WorkerRows:
    """Decode step regressors: running, running * mean context, local prefill tokens/s."""
    dec = _worker_rows(dec_rows, 2)
    if not dec.window.size:
        return WorkerRows(dec.window, dec.value, np.zeros((0, 3)), dec.weight)
    running = dec.x[:, 0]
    return WorkerRows(dec.window, dec.value,
                      np.column_stack([running, running * ctx_mean[dec.window], dec.x[:, 1]]),
                      dec.weight)


def outcome_matrix(ints: bytes, floats: bytes, per_window: IntArray) -> FloatArray:
    """Rows ``[w, ctx, io, local, requests, met, ttft_sum, ttft_n, tpot_sum, tpot_n]`` from
    the windows' :class:`~controller.core.window.OutcomeColumns`, concatenated in order
    (``per_window[w]`` rows each)."""
    int_rows = np.frombuffer(ints, dtype="<i4").reshape(-1, 4)  # router, route, ctx, io
    o = np.empty((int_rows.shape[0], 10), dtype=np.float64)
    o[:, 0] = np.repeat(np.arange(per_window.shape[0]), per_window)
    o[:, 1:3] = int_rows[:, 2:4]
    o[:, 3] = int_rows[:, 1] == int(Route.DECODE_LOCAL)
    o[:, 4:] = np.frombuffer(floats, dtype="<f8").reshape(-1, 6)
    return o


ALL_BINS = -1  # an outcome row summing over every io bin (see controller.observe)


def spread_bin_totals(o: FloatArray) -> FloatArray:
    """Outcome rows ``[w, ctx, io, local, requests, met, ttft_sum, ttft_n, tpot_sum, tpot_n]``
    with latency sums only per (route, context bin) spread over that bin's io cells.

    Routers export request counts per (route, context bin, io bin) but latency histograms per
    (route, context bin): a window then holds latency rows with ``io_bin = ALL_BINS`` and zero
    requests. Each such row's sums and counts are shared among the io cells of the same
    window, route and context bin in proportion to their requests (each cell is given the
    bin's mean). Rows with an unknown or missing context bin, and latency rows without any
    request row to land on, are dropped.
    """
    o = o[(o[:, 1] >= 0) & ((o[:, 2] >= 0) | (o[:, 2] == ALL_BINS))]
    totals = o[:, 2] == ALL_BINS
    if not totals.any():
        return o
    rows: FloatArray = o[~totals].copy()
    agg = o[totals]
    key_rows = (rows[:, 0] * N_CTX_BINS + rows[:, 1]) * 2 + rows[:, 3]
    key_agg = (agg[:, 0] * N_CTX_BINS + agg[:, 1]) * 2 + agg[:, 3]
    keys, inverse = np.unique(np.concatenate([key_rows, key_agg]), return_inverse=True)
    inv_rows, inv_agg = inverse[:rows.shape[0]], inverse[rows.shape[0]:]
    requests = np.bincount(inv_rows, weights=rows[:, 4], minlength=keys.shape[0])
    share = rows[:, 4] / np.where(requests[inv_rows] > 0, requests[inv_rows], 1.0)
    for j in range(6, 10):
        group = np.bincount(inv_agg, weights=agg[:, j], minlength=keys.shape[0])
        rows[:, j] += group[inv_rows] * share
    return rows


def cell_tokens(output_tokens: FloatArray) -> tuple[FloatArray, FloatArray]:
    """Representative (context, append) tokens per router cell, per window: ``[W, K]``."""
    ctx = np.repeat(ROUTER_CTX_REP, N_IO_BINS)  # [K]
    ratio = np.tile(ROUTER_IO_REP, N_CTX_BINS)  # [K]
    out = np.asarray(output_tokens, dtype=np.float64)
    context = np.broadcast_to(ctx, (out.shape[0], ctx.shape[0]))
    append = ratio[None, :] * out[:, None]
    return np.ascontiguousarray(context), append


def decode_context_mean(rate: FloatArray, output_tokens: FloatArray) -> FloatArray:
    """Mean KV context of a running decode, per window: prompt + half the output."""
    context, append = cell_tokens(output_tokens)
    total = rate.sum(axis=2)  # [W, K]
    mass = total.sum(axis=1)
    prompt = (total * (context + append)).sum(axis=1) / np.where(mass > 0, mass, 1.0)
    fallback = float(np.median(prompt[mass > 0])) if (mass > 0).any() else 1024.0
    prompt = np.where(mass > 0, prompt, fallback)
    result: FloatArray = prompt + output_tokens / 2.0
    return result


FORCED_MIN_REQUESTS = 50.0


def forced_shares(ts: TrainingSet, first_turn_route: Route = Route.PREFILL_NODE
                  ) -> tuple[FloatArray, FloatArray]:
    """Per router cell: 1.0 where overrides, not the table, decide its route.

    A cell with traffic that never went decode-local while the routers did send other cells
    decode-local in the same windows is decided by an override (turn 1 always goes to a
    prefill node; its context is 0, so it fills the smallest context bin); likewise for a
    cell that never went to a prefill node (the short-append bypass). When no cell ever took
    a route, the routing was simply uniform (a forced policy without exploration): nothing is
    marked.
    """
    per_p = ts.rate[:, :, 0].sum(axis=0)
    per_l = ts.rate[:, :, 1].sum(axis=0)
    volume = (per_p + per_l) * float(np.median(ts.interval_s)) if ts.n_windows else per_p
    any_l, any_p = per_l.sum() > 0, per_p.sum() > 0
    only_p = (volume >= FORCED_MIN_REQUESTS) & (per_l == 0) & any_l
    only_l = (volume >= FORCED_MIN_REQUESTS) & (per_p == 0) & any_p
    forced_p = only_p.astype(np.float64)
    forced_l = only_l.astype(np.float64)
    first_turn = first_turn_share(ts, first_turn_route)
    forced = forced_l if first_turn_route is Route.DECODE_LOCAL else forced_p
    forced[:N_IO_BINS] = np.maximum(forced[:N_IO_BINS], first_turn)
    return forced_p, forced_l


def first_turn_share(ts: TrainingSet, route: Route = Route.PREFILL_NODE) -> FloatArray:
    """Per io bin of the smallest context bin: the share of its traffic the turn-1 override
    keeps on ``route`` (0 where the windows cannot tell).

    Turn 1 has no cached context, so it lands in context bin 0 together with the later turns
    whose decode worker no longer holds their prefix; routers count both alike. Only the
    later turns follow the table: treating the whole cell as movable would make a
    decode-local choice there look as if it took every first turn off the prefill pool, and
    overstate a decode-local table's goodput. Estimate: the prefill-node
    share of the cell's traffic, pooled over the windows in which the cell did go
    decode-local. Exact when the table sent the cell decode-local in those windows; where
    only exploration did, it overstates the share (the cell then looks less movable than it
    is, which errs towards keeping the load where it was). Windows are not selected by their
    own share: with a few requests per cell and window that would pick the noise.
    """
    col = 1 if route is Route.DECODE_LOCAL else 0
    own = ts.rate[:, :N_IO_BINS, col]
    other = ts.rate[:, :N_IO_BINS, 1 - col]
    seen = other > 0
    own_sum = np.where(seen, own, 0.0).sum(axis=0)
    total = own_sum + other.sum(axis=0)
    enough = total * float(np.median(ts.interval_s)) >= FORCED_MIN_REQUESTS
    out: FloatArray = np.where(enough, own_sum / np.where(total > 0, total, 1.0), 0.0)
    return out
