"""Latency model: TTFT and TPOT per cell and route under a given load.

Three layers, from physics to data:

1. **Components** with known shape, fitted on worker signals (scikit-learn, non-negative
   coefficients where the physics demands it):
   - prefill time per request, linear (+ quadratic attention) in computed prompt tokens;
   - prefill queueing, an M/G/1-per-worker (Pollaczek–Khinchine) wait
     ``lambda E[S^2] / (2 (1 - rho))`` with the utilisation the load implies, times a fitted
     scale;
   - KV transfer time, ``setup + bytes / bandwidth`` plus a contention term in link busy time;
   - decode step time, ``base + per_seq * B + per_ctx_token * B * ctx + per_prefill_token *
     prefill tokens in the step`` (latency-model.md §1 and §7). With Little's law
     (``B = decode rate * output tokens * step / n_decode``) the step time has the closed form
     ``T = base / (1 - k - per_prefill_token * local_prefill_tokens_per_s)``.
2. **Route calibration**: per route and target, a non-negative linear map from the physics
   prediction to the observed per-cell means (absorbs what the components cannot see, such
   as the extra step a transferred request waits on the decode side).
3. **Residual correction**: a ridge regression of the log ratio observed / predicted on
   cell effects and load (see :class:`Residual`), kept only when there is enough data and it
   lowers the error on the last part of the training windows. It is linear so that its
   evaluation stays cheap: it is paid in every round of the fixed point and for every weight
   ratio, inside the 5 s calibration budget (a tree ensemble costs ~20 ms per prediction of a
   1,000-cell table, too much for that budget).

Everything is vectorised over ``S`` scenarios (windows, or QPS points) and ``K`` cells.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from controller.core.features import (
    N_CTX_BINS,
    N_IO_BINS,
    ROUTER_CONTEXT_EDGES,
    ROUTER_IO_EDGES,
    FloatArray,
    TrainingSet,
    WorkerRows,
    cell_tokens,
    forced_shares,
)

TARGETS = ("ttft", "tpot")
MAX_UTILISATION = 0.95  # queueing terms saturate here instead of going to infinity
MIN_STEP_HEADROOM = 0.04  # decode step denominator floor (the pool is saturated below it)
RESIDUAL_MIN_ROWS = 40
RESIDUAL_MAX_ROWS = 20_000
RESIDUAL_RIDGE_ALPHA = 5.0  # in units of one mean-weight row
RESIDUAL_CLIP = 1.0  # |log ratio| the residual model may apply


@dataclass(frozen=True, slots=True)
class ComponentParams:
    """Physics coefficients (seconds, tokens, bytes). Defaults: Llama-3.1-8B on H100."""

    prefill_base_s: float = 0.008
    prefill_per_token_s: float = 21e-6
    prefill_per_token2_s: float = 1.3e-9
    prefill_queue_scale: float = 1.0
    xfer_setup_s: float = 0.002
    xfer_per_byte_s: float = 1.0 / 20e9  # 20 GB/s
    xfer_contention_scale: float = 1.0
    kv_bytes_per_token: float = 131_072.0
    step_base_s: float = 0.0075
    step_per_seq_s: float = 0.00002
    step_per_ctx_token_s: float = 48.5e-9
    step_per_prefill_token_s: float = 21e-6
    chunk_budget_tokens: float = 2048.0

    def to_dict(self) -> dict[str, float]:
        return {k: float(getattr(self, k)) for k in self.__slots__}

    def transfer_s(self, nbytes: FloatArray, busy: FloatArray) -> FloatArray:
        """One KV transfer's time: ``nbytes`` over a link ``busy`` of the time (as fitted)."""
        b = np.minimum(busy, 0.95)
        out: FloatArray = self.xfer_setup_s + self.xfer_per_byte_s * nbytes * (
            1.0 + self.xfer_contention_scale * b / (1.0 - b))
        return out


@dataclass(frozen=True, slots=True)
class Scenario:
    """A load to predict under: ``[S, K]`` per-cell tokens and rates, ``[S]`` cluster shape."""

    context: FloatArray
    append: FloatArray
    rate_p: FloatArray  # requests/s routed to a prefill node
    rate_l: FloatArray  # requests/s routed decode-local
    output_tokens: FloatArray
    n_prefill: FloatArray
    n_decode: FloatArray
    # [S] multiplier of every KV transfer's time (None: 1). Windows from before a known change
    # of the link are explained with the link as it was (see LinkChange).
    xfer_scale: FloatArray | None = None

    @classmethod
    def from_training(cls, ts: TrainingSet) -> Scenario:
        return training_scenario(ts)[0]


@dataclass(frozen=True, slots=True)
class LinkChange:
    """The KV link changed at ``at`` (epoch s): windows that began before it moved KV at
    ``before_scale`` times the fitted (current) transfer time. A calibration right after a
    link drift fits the link on the transfers since the change and keeps every window for
    the rest of the model, instead of averaging two links into one."""

    at: float
    before_scale: float

    def window_scale(self, ts: TrainingSet) -> FloatArray:
        out: FloatArray = np.where(ts.start < self.at - 1e-6, self.before_scale, 1.0)
        return out


def training_scenario(ts: TrainingSet, link: LinkChange | None = None
                      ) -> tuple[Scenario, NDArray[np.int64]]:
    """The windows' loads as a scenario over the router cells that carry traffic, and the
    column of each router cell in it (-1 for cells never seen)."""
    context, append = cell_tokens(ts.output_tokens)
    active = ts.active_cells
    if active.size == 0:
        active = np.arange(ts.rate.shape[1])
    column = np.full(ts.rate.shape[1], -1, dtype=np.int64)
    column[active] = np.arange(active.size)
    sc = Scenario(
        np.ascontiguousarray(context[:, active]), np.ascontiguousarray(append[:, active]),
        np.ascontiguousarray(ts.rate[:, active, 0]), np.ascontiguousarray(ts.rate[:, active, 1]),
        ts.output_tokens, np.maximum(ts.n_prefill, 1.0), np.maximum(ts.n_decode, 1.0),
        None if link is None else link.window_scale(ts),
    )
    return sc, column


@dataclass(frozen=True, slots=True)
class Physics:
    """Intermediate physics terms; ``[S]`` per scenario, ``[S, K]`` per cell."""

    rho_prefill: FloatArray
    wait_prefill: FloatArray
    mean_prefill_s: FloatArray
    link_busy: FloatArray
    step_s: FloatArray
    step_headroom: FloatArray  # 1 - decode utilisation; <= MIN_STEP_HEADROOM is saturated
    step_per_local_tps: FloatArray  # dT / d(local prefill tokens/s per decode worker)
    prefill_harm: FloatArray  # [S, K] added wait of all prefill-node requests per req/s of k
    prefill_second_moment: FloatArray  # E[S^2] of the prefill pool's mix
    prefill_s: FloatArray  # [S, K]
    ttft_p: FloatArray  # [S, K]
    ttft_l: FloatArray  # [S, K]
    attention: FloatArray  # [S, K] append * context (local prefill attention work)


def physics(p: ComponentParams, sc: Scenario) -> Physics:
    """Evaluate the component models under the load of ``sc``."""
    prompt = sc.context + sc.append
    prefill_s = (p.prefill_base_s + p.prefill_per_token_s * prompt
                 + p.prefill_per_token2_s * prompt**2)
    rate_p_total = sc.rate_p.sum(axis=1)
    all_rate = sc.rate_p + sc.rate_l
    mass = all_rate.sum(axis=1)
    # Mean service time of the prefill pool's mix; with no prefill traffic, of the whole mix.
    weights = np.where(rate_p_total[:, None] > 0, sc.rate_p, all_rate)
    wsum = weights.sum(axis=1)
    mean_s = np.where(wsum > 0, (weights * prefill_s).sum(axis=1) / np.where(wsum > 0, wsum, 1),
                      prefill_s.mean(axis=1))
    second = np.where(wsum > 0, (weights * prefill_s**2).sum(axis=1) / np.where(wsum > 0, wsum, 1),
                      (prefill_s**2).mean(axis=1))
    lam = rate_p_total / sc.n_prefill  # per prefill worker
    rho = lam * mean_s
    rho_c = np.minimum(rho, MAX_UTILISATION)
    # M/G/1 per worker (Pollaczek-Khinchine): W = lambda E[S^2] / (2 (1 - rho)).
    wait = p.prefill_queue_scale * lam * second / (2.0 * (1.0 - rho_c))
    # What one more request/s of cell k adds to the wait of all prefill-node requests.
    prefill_harm = (p.prefill_queue_scale * rate_p_total[:, None] / sc.n_prefill[:, None]) * (
        prefill_s**2 / (2.0 * (1.0 - rho_c[:, None]))
        + (lam * second)[:, None] * prefill_s / (2.0 * (1.0 - rho_c[:, None]) ** 2))

    xfer = p.xfer_setup_s + p.xfer_per_byte_s * p.kv_bytes_per_token * prompt
    if sc.xfer_scale is not None:
        xfer = xfer * sc.xfer_scale[:, None]
    busy = (sc.rate_p * xfer).sum(axis=1) / sc.n_decode
    busy_c = np.minimum(busy, 0.95)
    xfer_loaded = xfer * (1.0 + p.xfer_contention_scale * (busy_c / (1.0 - busy_c)))[:, None]

    out = sc.output_tokens
    prompt_mean = np.where(mass > 0, (all_rate * prompt).sum(axis=1) / np.where(mass > 0, mass, 1),
                           prompt.mean(axis=1))
    ctx_mean = prompt_mean + out / 2.0
    k = (p.step_per_seq_s + p.step_per_ctx_token_s * ctx_mean) * mass * out / sc.n_decode
    local_tps = ((sc.rate_l * sc.append).sum(axis=1) + rate_p_total) / sc.n_decode
    headroom = 1.0 - k - p.step_per_prefill_token_s * local_tps
    den = np.maximum(headroom, MIN_STEP_HEADROOM)
    step = p.step_base_s / den
    # Beyond saturation the pool falls behind: penalise linearly so the fixed point sees it.
    step = step * (1.0 + np.maximum(MIN_STEP_HEADROOM - headroom, 0.0) * 10.0)
    step_per_local = p.step_per_prefill_token_s * step / den

    chunks = np.maximum(np.ceil(sc.append / p.chunk_budget_tokens), 1.0)
    ttft_p = (wait[:, None] + prefill_s + xfer_loaded + 1.5 * step[:, None])
    ttft_l = (step[:, None] * (0.5 + chunks) + p.step_per_prefill_token_s * sc.append)
    return Physics(
        rho_prefill=rho, wait_prefill=wait, mean_prefill_s=mean_s, link_busy=busy,
        step_s=step, step_headroom=headroom, step_per_local_tps=step_per_local,
        prefill_harm=prefill_harm, prefill_second_moment=second, prefill_s=prefill_s,
        ttft_p=ttft_p, ttft_l=ttft_l,
        attention=sc.append * sc.context,
    )


# ---------------------------------------------------------------------------------------------
# Component fits


def prompt_moments(ts: TrainingSet) -> tuple[FloatArray, FloatArray]:
    """E[L] and E[L^2] of the prompt computed on prefill nodes, per window (NaN: no mix)."""
    context, append = cell_tokens(ts.output_tokens)
    prompt = context + append
    r = ts.rate[:, :, 0]
    mass = r.sum(axis=1)
    safe = np.where(mass > 0, mass, 1.0)
    m1 = np.where(mass > 0, (r * prompt).sum(axis=1) / safe, np.nan)
    m2 = np.where(mass > 0, (r * prompt**2).sum(axis=1) / safe, np.nan)
    return m1, m2


def _service_second_moment(p: ComponentParams, ts: TrainingSet) -> FloatArray:
    context, append = cell_tokens(ts.output_tokens)
    prompt = context + append
    s = p.prefill_base_s + p.prefill_per_token_s * prompt + p.prefill_per_token2_s * prompt**2
    r = ts.rate[:, :, 0]
    mass = r.sum(axis=1)
    out: FloatArray = np.where(mass > 0, (r * s**2).sum(axis=1) / np.where(mass > 0, mass, 1.0),
                               np.nan)
    return out


def _subsample(rows: NDArray[np.int64], limit: int = RESIDUAL_MAX_ROWS) -> NDArray[np.int64]:
    """At most ``limit`` rows, a fixed pseudo-random choice (fits stay deterministic)."""
    if rows.shape[0] <= limit:
        return rows
    picked = np.random.default_rng(0).choice(rows, limit, replace=False)
    out: NDArray[np.int64] = np.sort(picked)
    return out


def _positive_fit(x: FloatArray, y: FloatArray, w: FloatArray) -> tuple[float, FloatArray] | None:
    """Non-negative least squares with a free intercept; None when the data cannot say."""
    from sklearn.linear_model import LinearRegression

    ok = np.isfinite(y) & np.isfinite(x).all(axis=1) & (w > 0)
    if ok.sum() < max(5, x.shape[1] + 2) or np.ptp(x[ok], axis=0).max() <= 0:
        return None
    rows = _subsample(np.flatnonzero(ok))
    reg = LinearRegression(positive=True).fit(x[rows], y[rows], sample_weight=w[rows])
    return float(reg.intercept_), np.asarray(reg.coef_, dtype=np.float64)


def fit_components(
    ts: TrainingSet, prior: ComponentParams | None = None
) -> tuple[ComponentParams, dict[str, Any]]:
    """Fit each component where its signals exist; keep the prior's values elsewhere."""
    p = prior or ComponentParams()
    report: dict[str, Any] = {}

    pf = ts.prefill
    if pf.window.size:
        # Moments of the computed prompt over the window's prefill-node mix (a mean of a
        # quadratic is not the quadratic of the mean); the measured mean where no mix.
        m1, m2 = prompt_moments(ts)
        tokens = pf.x[:, 0]
        first = np.where(np.isfinite(m1[pf.window]), m1[pf.window], tokens)
        second = np.where(np.isfinite(m2[pf.window]), m2[pf.window], tokens**2)
        fit = _positive_fit(np.column_stack([first, second]), pf.value, pf.weight)
        if fit is not None:
            b0, coef = fit
            p = replace(p, prefill_base_s=max(b0, 0.0), prefill_per_token_s=float(coef[0]),
                        prefill_per_token2_s=float(coef[1]))
            report["prefill"] = {"rows": int(pf.window.size), "base_s": p.prefill_base_s,
                                 "per_token_s": p.prefill_per_token_s}
    pq = ts.prefill_queue
    if pq.window.size:
        rho = np.minimum(pq.x[:, 0], MAX_UTILISATION)
        m1, m2 = prompt_moments(ts)
        mean_s = pq.x[:, 1]
        # E[S^2] under the fitted prefill curve, from the window's prefill-node mix.
        s2 = _service_second_moment(p, ts)[pq.window]
        s2 = np.where(np.isfinite(s2), s2, mean_s**2)
        lam = rho / np.maximum(mean_s, 1e-9)
        feature = lam * s2 / (2.0 * (1.0 - rho))
        fit = _positive_fit(feature[:, None], pq.value, pq.weight)
        if fit is not None:
            p = replace(p, prefill_queue_scale=float(fit[1][0]))
            report["prefill_queue"] = {"rows": int(pq.window.size), "scale": p.prefill_queue_scale}
    kv = ts.kv_transfer
    if kv.window.size:
        p = _fit_link(p, kv, np.ones(kv.window.size, dtype=bool))
        report["kv_transfer"] = {"rows": int(kv.window.size), "setup_s": p.xfer_setup_s,
                                 "bandwidth_Bps": 1.0 / p.xfer_per_byte_s}
    if ts.kv_bytes_per_token:
        p = replace(p, kv_bytes_per_token=ts.kv_bytes_per_token)
    ds = ts.decode_step
    if ds.window.size:
        # T = base + a*B + b*B*ctx + c*(prefill tokens per step = tokens/s * T)
        x = np.column_stack([ds.x[:, 0], ds.x[:, 1], ds.x[:, 2] * ds.value])
        fit = _positive_fit(x, ds.value, ds.weight)
        if fit is not None and fit[0] > 0:
            base, coef = fit
            p = replace(p, step_base_s=base, step_per_seq_s=float(coef[0]),
                        step_per_ctx_token_s=float(coef[1]),
                        step_per_prefill_token_s=float(coef[2]))
            report["decode_step"] = {"rows": int(ds.window.size), "base_s": base,
                                     "per_seq_s": p.step_per_seq_s,
                                     "per_ctx_token_s": p.step_per_ctx_token_s,
                                     "per_prefill_token_s": p.step_per_prefill_token_s}
    return p, report


def _fit_link(p: ComponentParams, kv: WorkerRows, rows: NDArray[np.bool_]) -> ComponentParams:
    """The KV link's setup, per-byte time and contention from ``rows`` (``p``'s elsewhere)."""
    busy = np.minimum(kv.x[rows, 1], 0.95)
    x = np.column_stack([kv.x[rows, 0], kv.x[rows, 0] * busy / (1.0 - busy)])
    fit = _positive_fit(x, kv.value[rows], kv.weight[rows])
    if fit is None or fit[1][0] <= 0:
        return p
    setup, coef = fit
    return replace(p, xfer_setup_s=max(setup, 0.0), xfer_per_byte_s=float(coef[0]),
                   xfer_contention_scale=float(coef[1] / coef[0]))


def log_ratio(value: FloatArray, pred: FloatArray, weight: FloatArray
              ) -> tuple[FloatArray, FloatArray]:
    """``log(value / pred)`` per row and its weight, both 0 where a row is unusable (not
    finite, not positive, or weightless)."""
    ok = np.isfinite(value) & (value > 0) & (pred > 0) & (weight > 0)
    logr: FloatArray = np.where(
        ok, np.log(np.where(ok, value, 1.0) / np.where(ok, pred, 1.0)), 0.0)
    w: FloatArray = np.where(ok, weight, 0.0)
    return logr, w


def _scale_to(pred: FloatArray, value: FloatArray, weight: FloatArray) -> float | None:
    """Least-squares ``s`` in ``value ~ s * pred`` (None: no usable row)."""
    ok = np.isfinite(value) & (value > 0) & (pred > 0) & (weight > 0)
    den = float(np.sum(weight[ok] * pred[ok] ** 2))
    return float(np.sum(weight[ok] * value[ok] * pred[ok]) / den) if den > 0 else None


# Windows before the detector's onset searched for the link's change point.
LINK_CHANGE_SEARCH_WINDOWS = 10
# A split is a change only if its F statistic (the one-link error it removes over the
# two-link error per degree of freedom) reaches this. Measured on synthetic streams of 20
# windows: 0.1-5.2 with no change (the best of 10 candidate splits), ~200 for bandwidth / 1.3
# after 4 windows, 1,700+ for bandwidth / 4 after one.
LINK_CHANGE_MIN_F = 25.0


def _link_split(p: ComponentParams, kv: WorkerRows, after: NDArray[np.bool_]
                ) -> tuple[ComponentParams, float, float] | None:
    """The link fitted before the split, the scale of the transfers after it, and the
    weighted squared log error of that two-link description (None: nothing to scale)."""
    before = _fit_link(p, kv, ~after)
    pred = before.transfer_s(kv.x[:, 0], kv.x[:, 1])
    scale = _scale_to(pred[after], kv.value[after], kv.weight[after])
    if scale is None:
        return None
    sse, _ = _squared_log_error(kv, np.where(after, pred * scale, pred))
    return before, scale, sse


def _squared_log_error(kv: WorkerRows, pred: FloatArray) -> tuple[float, int]:
    """Weighted squared log error of ``pred`` against the transfers, and the rows it used."""
    err, w = log_ratio(kv.value, pred, kv.weight)
    return float(np.sum(w * err**2)), int(np.count_nonzero(w))


def fit_link_change(
    ts: TrainingSet, p: ComponentParams, at: float
) -> tuple[ComponentParams, LinkChange | None]:
    """The link as it is since its change, and how the windows before the change saw it.

    The change is the window start, at most ``LINK_CHANGE_SEARCH_WINDOWS`` before ``at``
    (the detector's onset: its last window within threshold can already be after the
    change), that best splits the transfers into one link before and a scaled one after.
    A split counts only when it explains the transfers clearly better than one link
    (``LINK_CHANGE_MIN_F``); otherwise ``p`` is returned with no change.
    The link's shape (setup, contention) is fitted on the transfers before and scaled to
    those since: a minute of transfers pins one scale, not a fresh fit (a few windows of
    transfers cannot pin setup, per-byte cost and contention apart, and one fit over both
    links would explain a slower link as contention). Every window keeps explaining the rest
    of the model.
    """
    kv = ts.kv_transfer
    starts = ts.start[(ts.start <= at + 1e-6) & (ts.start > ts.start[0])]
    best: tuple[float, ComponentParams, float, float] | None = None
    for start in starts[-LINK_CHANGE_SEARCH_WINDOWS:]:
        after = ts.start[kv.window] >= start - 1e-6
        if not after.any() or after.all():
            continue
        split = _link_split(p, kv, after)
        if split is not None and (best is None or split[2] < best[3]):
            best = (float(start), *split)
    if best is None:
        return p, None
    change, before, scale, two_links = best
    # The F test keeps a split only when it is significant: without it every fit finds a
    # "change" (a held-out fit on windows that end before the change splits at noise, with
    # a scale near 1).
    one_link, rows = _squared_log_error(kv, p.transfer_s(kv.x[:, 0], kv.x[:, 1]))
    # Rows in the error, less setup, per byte, contention, scale and the change point.
    dof = max(rows - 5, 1)
    if two_links <= 0 or (one_link - two_links) * dof < LINK_CHANGE_MIN_F * two_links:
        return p, None
    now = replace(before, xfer_setup_s=before.xfer_setup_s * scale,
                  xfer_per_byte_s=before.xfer_per_byte_s * scale)
    return now, LinkChange(change, 1.0 / scale)


# ---------------------------------------------------------------------------------------------
# The full model


@dataclass(frozen=True, slots=True)
class RouteMap:
    """``y = intercept + coefs . features`` (non-negative coefs), per target and route.

    Features (see :func:`map_features`): TTFT on the prefill node = service part (prefill +
    transfer + decode steps), prefill-pool wait, prompt tokens, prompt tokens squared (the
    component fit sees only window means, which blur a per-request curve); TTFT decode-local =
    the physics estimate, the attention work (append x context) and the append tokens; TPOT =
    the decode step time.
    """

    intercept: float = 0.0
    coefs: tuple[float, ...] = (1.0,)

    def apply(self, features: list[FloatArray]) -> FloatArray:
        y: FloatArray = np.full(features[0].shape, self.intercept)
        for c, f in zip(self.coefs, features, strict=False):
            if c:
                y = y + c * f
        return y


def map_features(target: str, col: int, ph: Physics, sc: Scenario) -> list[FloatArray]:
    """The route map's regressors, each ``[S, K]``."""
    shape = sc.context.shape
    if target == "tpot":
        return [np.broadcast_to(ph.step_s[:, None], shape)]
    if col == 0:
        wait = np.broadcast_to(ph.wait_prefill[:, None], shape)
        prompt = (sc.context + sc.append) / 1000.0
        return [ph.ttft_p - wait, wait, prompt, prompt**2]
    return [ph.ttft_l, ph.attention, sc.append / 1000.0]


@dataclass(frozen=True, slots=True)
class Predictions:
    """``ttft[s, k, r]`` and ``tpot[s, k, r]`` in seconds, ``r`` 0 = prefill node, 1 = local."""

    ttft: FloatArray
    tpot: FloatArray
    physics: Physics


@dataclass(frozen=True, slots=True)
class Residual:
    """Log-ratio correction per route: cell effects (context bin, io bin) + load slopes.

    ``log(observed / base) = b[r] + c[r, ctx_bin] + d[r, io_bin] + e[r] . load`` with
    ``load = (prefill utilisation, decode headroom, link busy)``. A ridge fit (shrunk towards
    no correction where data is thin); evaluation is a few array lookups, cheap enough for
    every round of the fixed point.
    """

    intercept: FloatArray  # [2]
    ctx: FloatArray  # [2, N_CTX_BINS]
    io: FloatArray  # [2, N_IO_BINS]
    load: FloatArray  # [2, 3]

    def apply(self, sc: Scenario, ph: Physics) -> FloatArray:
        """``adj[s, k, r]`` (log ratio), clipped."""
        c_bin, i_bin = _router_bins(sc)
        cell = self.ctx.T[c_bin] + self.io.T[i_bin]  # [S, K, 2]
        load = _load_features(ph)  # [S, 3]
        adj = cell + (load @ self.load.T)[:, None, :] + self.intercept[None, None, :]
        out: FloatArray = np.clip(adj, -RESIDUAL_CLIP, RESIDUAL_CLIP)
        return out


def _router_bins(sc: Scenario) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    ratio = sc.append / np.maximum(sc.output_tokens, 1.0)[:, None]
    c_bin = np.searchsorted(np.asarray(ROUTER_CONTEXT_EDGES), sc.context, side="left")
    i_bin = np.searchsorted(np.asarray(ROUTER_IO_EDGES), ratio, side="left")
    return c_bin.astype(np.int64), i_bin.astype(np.int64)


def _load_features(ph: Physics) -> FloatArray:
    return np.column_stack([np.minimum(ph.rho_prefill, 2.0), ph.step_headroom,
                            np.minimum(ph.link_busy, 2.0)])


@dataclass(slots=True)
class LatencyModel:
    params: ComponentParams = field(default_factory=ComponentParams)
    # maps[target][route column]
    maps: dict[str, tuple[RouteMap, RouteMap]] = field(
        default_factory=lambda: {
            "ttft": (RouteMap(0.0, (1.0, 1.0, 0.0, 0.0)), RouteMap(0.0, (1.0, 0.0, 0.0))),
            "tpot": (RouteMap(), RouteMap()),
        }
    )
    residual: dict[str, Residual] = field(default_factory=dict)
    sigma: dict[str, float] = field(default_factory=lambda: {"ttft": 0.5, "tpot": 0.25})
    # Probit shift of P(both SLOs met) per [route, context bin, io bin] (see
    # :func:`_fit_goodput_shift`); None: the log-normal spread alone.
    goodput_shift: FloatArray | None = None
    link_change: LinkChange | None = None
    report: dict[str, Any] = field(default_factory=dict)

    def scenario_of(self, ts: TrainingSet) -> tuple[Scenario, NDArray[np.int64]]:
        """:func:`training_scenario` of windows this model explains (its link change applied)."""
        return training_scenario(ts, self.link_change)

    def transfer_s(self, ts: TrainingSet) -> FloatArray:
        """Predicted time of each of ``ts``'s KV transfer rows."""
        kv = ts.kv_transfer
        out = self.params.transfer_s(kv.x[:, 0], kv.x[:, 1])
        if self.link_change is not None:
            out = out * self.link_change.window_scale(ts)[kv.window]
        return out

    def met_probability(self, pred: Predictions, sc: Scenario, slo_ttft: float,
                        slo_tpot: float) -> FloatArray:
        """``p[s, k, r]``: probability that a request of cell k on route r meets both SLOs."""
        p = (prob_below(pred.ttft, slo_ttft, self.sigma["ttft"])
             * prob_below(pred.tpot, slo_tpot, self.sigma["tpot"]))
        if self.goodput_shift is None:
            return p
        from scipy.special import ndtr, ndtri

        c_bin, i_bin = _router_bins(sc)
        shift = np.stack([self.goodput_shift[r][c_bin, i_bin] for r in (0, 1)], axis=2)
        out: FloatArray = ndtr(ndtri(np.clip(p, 1e-6, 1.0 - 1e-6)) + shift)
        return out

    def base(self, sc: Scenario) -> tuple[FloatArray, FloatArray, Physics]:
        ph = physics(self.params, sc)
        ttft = np.stack([self.maps["ttft"][c].apply(map_features("ttft", c, ph, sc))
                         for c in (0, 1)], axis=2)
        tpot = np.stack([self.maps["tpot"][c].apply(map_features("tpot", c, ph, sc))
                         for c in (0, 1)], axis=2)
        floor = 1e-4
        return np.maximum(ttft, floor), np.maximum(tpot, floor), ph

    def predict(self, sc: Scenario) -> Predictions:
        ttft, tpot, ph = self.base(sc)
        for name, arr in (("ttft", ttft), ("tpot", tpot)):
            res = self.residual.get(name)
            if res is not None:
                arr *= np.exp(res.apply(sc, ph))
        return Predictions(ttft, tpot, ph)

    def predict_rows(self, ts: TrainingSet) -> tuple[FloatArray, FloatArray]:
        """Predicted mean TTFT and TPOT for every outcome row of ``ts``."""
        sc, column = self.scenario_of(ts)
        pred = self.predict(sc)
        idx = (ts.row_window, column[ts.row_cell], ts.row_route)
        return pred.ttft[idx], pred.tpot[idx]


def _fit_route_maps(
    ts: TrainingSet, ph: Physics, sc: Scenario, column: NDArray[np.int64]
) -> dict[str, tuple[RouteMap, RouteMap]]:
    w, c, r = ts.row_window, column[ts.row_cell], ts.row_route
    maps: dict[str, tuple[RouteMap, RouteMap]] = {}
    for target in TARGETS:
        per_route: list[RouteMap] = []
        y_all = ts.row_ttft if target == "ttft" else ts.row_tpot
        cnt_all = ts.row_ttft_count if target == "ttft" else ts.row_tpot_count
        for col in (0, 1):
            sel = r == col
            feats = map_features(target, col, ph, sc)
            x = np.column_stack([f[w[sel], c[sel]] for f in feats])
            y, cnt = y_all[sel], cnt_all[sel]
            # Relative error matters (MAPE, SLO ratios): weight rows by count / scale^2, with
            # the scale the cell's mean over all windows rather than the row's own value,
            # because 1/y^2 favours the windows that happen to be fast and biases every
            # mean low.
            scale = _group_mean(c[sel], y, cnt)
            fit = _positive_fit(x, y, cnt / np.maximum(scale, 1e-6) ** 2)
            if fit is None or (not (fit[1] > 0).any() and fit[0] <= 0):
                per_route.append(RouteMap(0.0, (1.0,) + (0.0,) * (len(feats) - 1)))
            else:
                b0, coef = fit
                per_route.append(RouteMap(b0, tuple(float(v) for v in coef)))
        maps[target] = (per_route[0], per_route[1])
    return maps


def _group_mean(group: NDArray[np.int64], y: FloatArray, w: FloatArray) -> FloatArray:
    """Per row: the ``w``-weighted mean of ``y`` over the rows of its group (NaN-safe)."""
    ok = np.isfinite(y) & (w > 0)
    yw = np.where(ok, y * w, 0.0)
    ww = np.where(ok, w, 0.0)
    size = int(group.max()) + 1 if group.size else 0
    sums = np.bincount(group, weights=yw, minlength=size)
    wts = np.bincount(group, weights=ww, minlength=size)
    mean = np.where(wts > 0, sums / np.where(wts > 0, wts, 1.0), np.nan)
    out: FloatArray = np.nan_to_num(mean[group], nan=1.0)
    return out


def _design(ts: TrainingSet, ph: Physics) -> FloatArray:
    """Rows x (2 routes x (1 + ctx bins + io bins + 3 load)) one-hot/linear design."""
    w, c, r = ts.row_window, ts.row_cell, ts.row_route
    per = 1 + N_CTX_BINS + N_IO_BINS + 3
    x = np.zeros((w.shape[0], 2 * per))
    rows = np.arange(w.shape[0])
    off = r * per
    x[rows, off] = 1.0
    x[rows, off + 1 + c // N_IO_BINS] = 1.0
    x[rows, off + 1 + N_CTX_BINS + c % N_IO_BINS] = 1.0
    load = _load_features(ph)[w]
    for j in range(3):
        x[rows, off + 1 + N_CTX_BINS + N_IO_BINS + j] = load[:, j]
    return x


def _residual_from_coef(coef: FloatArray) -> Residual:
    per = 1 + N_CTX_BINS + N_IO_BINS + 3
    blocks = coef.reshape(2, per)
    return Residual(
        intercept=blocks[:, 0].copy(), ctx=blocks[:, 1:1 + N_CTX_BINS].copy(),
        io=blocks[:, 1 + N_CTX_BINS:1 + N_CTX_BINS + N_IO_BINS].copy(),
        load=blocks[:, 1 + N_CTX_BINS + N_IO_BINS:].copy(),
    )


def _fit_residual(model: LatencyModel, ts: TrainingSet) -> dict[str, Residual]:
    """Ridge on log(observed / base prediction); kept only if later windows agree."""
    from sklearn.linear_model import Ridge

    sc, column = model.scenario_of(ts)
    ttft, tpot, ph = model.base(sc)
    idx = (ts.row_window, column[ts.row_cell], ts.row_route)
    x_all = _design(ts, ph)
    chosen: dict[str, Residual] = {}
    for name, pred, obs, cnt in (("ttft", ttft, ts.row_ttft, ts.row_ttft_count),
                                 ("tpot", tpot, ts.row_tpot, ts.row_tpot_count)):
        p = pred[idx]
        ok = np.isfinite(obs) & (obs > 0) & (cnt > 0)
        rows = np.flatnonzero(ok)
        if rows.size < RESIDUAL_MIN_ROWS:
            continue
        # Later windows validate: the correction must generalise forward in time.
        order = rows[np.argsort(ts.row_window[rows], kind="stable")]
        cut = int(order.size * 0.8)
        train, valid = _subsample(order[:cut]), order[cut:]
        target = np.log(obs / p)
        # Weights: counts, capped so a few huge cells do not own the fit.
        weight = np.minimum(cnt, np.quantile(cnt[rows], 0.9))
        reg = Ridge(alpha=RESIDUAL_RIDGE_ALPHA * float(weight[train].mean()), fit_intercept=False)
        reg.fit(x_all[train], target[train], sample_weight=weight[train])
        adj = np.clip(x_all[valid] @ reg.coef_, -RESIDUAL_CLIP, RESIDUAL_CLIP)
        before = _weighted_ape(p[valid], obs[valid], cnt[valid])
        after = _weighted_ape(p[valid] * np.exp(adj), obs[valid], cnt[valid])
        if after < before * 0.98:
            rows = _subsample(rows)
            reg.fit(x_all[rows], target[rows], sample_weight=weight[rows])
            chosen[name] = _residual_from_coef(np.asarray(reg.coef_, dtype=np.float64))
    return chosen


def _weighted_ape(pred: FloatArray, obs: FloatArray, w: FloatArray) -> float:
    return float(np.sum(w * np.abs(pred - obs) / obs) / max(np.sum(w), 1e-12))


def _fit_sigma(model: LatencyModel, ts: TrainingSet, slo_ttft: float, slo_tpot: float
               ) -> dict[str, float]:
    """Log-normal spread per target that best reproduces the per-row goodput observed."""
    # Cells an override decides (turn 1) cost the same under every table: leave them out,
    # the spread must describe the cells the table chooses for.
    only_p, only_l = forced_shares(ts)
    ok = (ts.row_requests > 0) & (only_p[ts.row_cell] < 1) & (only_l[ts.row_cell] < 1)
    rows = np.flatnonzero(ok)
    if rows.size < 20:
        return dict(model.sigma)
    rows = _subsample(rows, RESIDUAL_MAX_ROWS // 2)
    ttft, tpot = model.predict_rows(ts)
    ttft, tpot = ttft[rows], tpot[rows]
    observed = ts.row_met[rows] / ts.row_requests[rows]
    weight = ts.row_requests[rows]
    grid = (0.1, 0.2, 0.35, 0.5, 0.7, 1.0)
    best = (math.inf, 0.5, 0.25)
    p2s = [prob_below(tpot, slo_tpot, s2) for s2 in grid]
    for s1 in grid:
        p1 = prob_below(ttft, slo_ttft, s1)
        for s2, p2 in zip(grid, p2s, strict=True):
            err = float(np.sum(weight * (p1 * p2 - observed) ** 2))
            if err < best[0]:
                best = (err, s1, s2)
    return {"ttft": best[1], "tpot": best[2]}


GOODPUT_SHIFT_PRIOR_REQUESTS = 50.0  # requests at which a group's own shift gets half weight
GOODPUT_SHIFT_CLIP = 3.0  # probit units


def _fit_goodput_shift(model: LatencyModel, ts: TrainingSet, slo_ttft: float,
                       slo_tpot: float) -> FloatArray | None:
    """Probit shifts ``[route, context bin, io bin]`` that make the predicted share of
    requests meeting both SLOs match the observed share, shrunk towards coarser groups.

    One log-normal spread around a predicted *mean* does not describe the tails: with a
    heavy-tailed prompt mix (Mooncake) the prefill node's TTFT tail under queueing and the
    long decode-local appends miss the SLO far more often than the mean says, so a mean-only
    model overstates goodput for every table. Routers count requests and SLO hits per
    (route, context bin, io bin), so the correction is learned per route and cell: first per
    route, then per context bin, then per io bin, each level shrunk towards the one above
    by ``n / (n + 50)`` requests. Load sensitivity still comes from the physics (the shift
    is added to the model's probit, which moves with the load).
    """
    from scipy.special import ndtr, ndtri

    rows = np.flatnonzero(ts.row_requests > 0)
    if rows.size < 20:
        return None
    rows = _subsample(rows)  # bounded cost: 30 bisection steps per group
    ttft, tpot = model.predict_rows(ts)
    base = (prob_below(ttft[rows], slo_ttft, model.sigma["ttft"])
            * prob_below(tpot[rows], slo_tpot, model.sigma["tpot"]))
    z = ndtri(np.clip(base, 1e-6, 1.0 - 1e-6))
    n_all = ts.row_requests[rows]
    met_all = np.minimum(ts.row_met[rows], n_all)
    ctx, io = ts.row_cell[rows] // N_IO_BINS, ts.row_cell[rows] % N_IO_BINS
    route = ts.row_route[rows]
    ok = np.ones(rows.size, dtype=bool)
    shift = np.zeros((2, N_CTX_BINS, N_IO_BINS))

    def solve(sel: NDArray[np.bool_], prior: float) -> float:
        n = float(n_all[sel].sum())
        if n <= 0:
            return prior
        target = float(met_all[sel].sum())
        lo, hi = -GOODPUT_SHIFT_CLIP, GOODPUT_SHIFT_CLIP
        for _ in range(30):  # predicted met is increasing in the shift
            mid = (lo + hi) / 2.0
            if float(np.sum(n_all[sel] * ndtr(z[sel] + mid))) < target:
                lo = mid
            else:
                hi = mid
        w = n / (n + GOODPUT_SHIFT_PRIOR_REQUESTS)
        return w * (lo + hi) / 2.0 + (1.0 - w) * prior

    for r in (0, 1):
        in_route = ok & (route == r)
        b_r = solve(in_route, 0.0)
        shift[r] = b_r
        for c in np.unique(ctx[in_route]):
            in_ctx = in_route & (ctx == c)
            b_c = solve(in_ctx, b_r)
            shift[r, c] = b_c
            for i in np.unique(io[in_ctx]):
                shift[r, c, i] = solve(in_ctx & (io == i), b_c)
    return shift


def prob_below(mean: FloatArray, limit: float, sigma: float) -> FloatArray:
    """P(X <= limit) for a log-normal X with the given mean and log-space sigma."""
    from scipy.special import ndtr

    mu = np.log(np.maximum(mean, 1e-9)) - sigma**2 / 2.0
    out: FloatArray = ndtr((math.log(limit) - mu) / sigma)
    return out


def fit_latency_model(
    ts: TrainingSet,
    slo_ttft: float,
    slo_tpot: float,
    prior: ComponentParams | None = None,
    seed: int = 0,
    residual: bool = True,
    link_changed_at: float | None = None,
) -> LatencyModel:
    """Fit components, route maps, the residual regressor and the goodput spread.

    ``link_changed_at``: the KV link changed then (a performance drift on it); see
    :func:`fit_link_change`."""
    from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

    # The fits are small and many: one BLAS thread is faster than threads fighting over a few
    # shared cores (an X^T X of 20k x 50 takes a few ms alone, tens of ms contended).
    with threadpool_limits(1):
        return _fit_latency_model(ts, slo_ttft, slo_tpot, prior, residual, link_changed_at)


def _fit_latency_model(
    ts: TrainingSet, slo_ttft: float, slo_tpot: float, prior: ComponentParams | None,
    residual: bool, link_changed_at: float | None,
) -> LatencyModel:
    params, report = fit_components(ts, prior)
    link = None
    if link_changed_at is not None:
        params, link = fit_link_change(ts, params, link_changed_at)
        if link is not None:
            report["kv_transfer"] = {"changed_at": link.at, "before_scale": link.before_scale,
                                     "setup_s": params.xfer_setup_s,
                                     "bandwidth_Bps": 1.0 / params.xfer_per_byte_s}
    model = LatencyModel(params=params, link_change=link, report={"components": report})
    sc, column = model.scenario_of(ts)
    model.maps = _fit_route_maps(ts, physics(params, sc), sc, column)
    if residual:
        model.residual = _fit_residual(model, ts)
    model.sigma = _fit_sigma(model, ts, slo_ttft, slo_tpot)
    model.goodput_shift = _fit_goodput_shift(model, ts, slo_ttft, slo_tpot)
    model.report["route_maps"] = {
        t: [{"intercept": m.intercept, "coefs": list(m.coefs)}
            for m in model.maps[t]] for t in TARGETS
    }
    model.report["residual"] = sorted(model.residual)
    model.report["sigma"] = dict(model.sigma)
    return model


@dataclass(frozen=True, slots=True)
class ErrorStats:
    mape: float | None
    r2: float | None
    rows: int


def heldout_error(model: LatencyModel, ts: TrainingSet) -> dict[str, dict[str, ErrorStats]]:
    """Count-weighted MAPE and R² of per-cell mean TTFT/TPOT, per route and target."""
    ttft, tpot = model.predict_rows(ts)
    out: dict[str, dict[str, ErrorStats]] = {}
    for col, route in ((0, "PREFILL_NODE"), (1, "DECODE_LOCAL")):
        out[route] = {}
        for name, pred, obs, cnt in (("ttft", ttft, ts.row_ttft, ts.row_ttft_count),
                                     ("tpot", tpot, ts.row_tpot, ts.row_tpot_count)):
            sel = (ts.row_route == col) & np.isfinite(obs) & (obs > 0) & (cnt > 0)
            if not sel.any():
                out[route][name] = ErrorStats(None, None, 0)
                continue
            p, o, w = pred[sel], obs[sel], cnt[sel]
            mape = _weighted_ape(p, o, w)
            mean = np.sum(w * o) / np.sum(w)
            ss_tot = float(np.sum(w * (o - mean) ** 2))
            r2 = 1.0 - float(np.sum(w * (o - p) ** 2)) / ss_tot if ss_tot > 0 else None
            out[route][name] = ErrorStats(mape, r2, int(sel.sum()))
    return out
