"""Calibration: windows → latency model → table (fixed point) → weights → candidate policy.

The table is built **under the load the candidate itself creates** (the gap the PPD paper's
offline table leaves open): candidate routes → implied load on prefill workers, KV links and
decode workers (from the workload mix per cell and the QPS of each table row) → predicted TTFT
and TPOT for both routes of every cell → scores → routes, repeated until no cell changes or a
bounded number of rounds (a cycle ends at its best-goodput member). Every round is recorded.

Score (DESIGN §2, the paper's form):
``score = wtft·(TTFT_P − TTFT_L)/TTFT_P − wtpot·(TPOT_L − TPOT_P)/TPOT_P``, decode-local iff
``score > 0``. The predicted values include the delay a request of the cell imposes on the
others sharing the resource (its marginal load: prefill-pool queueing for the prefill node,
decode-step stretch for decode-local); otherwise every cell would count only its own share of
the interference it causes and the table would push the decode pool into saturation.

Pure: windows, config values and ``now`` in; a :class:`CalibrationResult` out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import numpy as np
from numpy.typing import NDArray

from controller.core.exploration import ExplorationConfig, exploration_fractions
from controller.core.features import (
    FORCED_MIN_REQUESTS,
    N_CTX_BINS,
    N_IO_BINS,
    N_ROUTER_CELLS,
    ROUTER_CTX_REP,
    ROUTER_IO_REP,
    FloatArray,
    IntArray,
    TrainingSet,
    build_training_set,
    context_representatives,
    first_turn_share,
    forced_shares,
    ratio_representatives,
)
from controller.core.guardrail import GuardrailVerdict, check
from controller.core.latency_model import (
    ErrorStats,
    LatencyModel,
    Predictions,
    Scenario,
    fit_latency_model,
    heldout_error,
)
from controller.core.weights import DEFAULT_RATIOS, WeightChoice, choose_weights
from controller.core.window import Window
from controller.policy.decide import Features, decide
from controller.policy.model import (
    Axes,
    LookupTable,
    Overrides,
    Policy,
    Provenance,
    Route,
    Slo,
    Weights,
)

DAMPING = 0.5


@dataclass(frozen=True, slots=True)
class CalibrationConfig:
    axes: Axes = field(default_factory=Axes)
    slo: Slo = field(default_factory=Slo)
    pinned_weights: Weights | None = None  # operator-pinned wtft/wtpot: no tuning
    weight_ratios: tuple[float, ...] = DEFAULT_RATIOS
    max_rounds: int = 12
    exploration: ExplorationConfig = field(default_factory=ExplorationConfig)
    guardrail_margin: float = 0.005
    # Below this predicted goodput of the current policy (overloaded) the guardrail also
    # needs a gain above the model's held-out goodput error (guardrail.py).
    guardrail_overload_goodput: float = 0.5
    exploration_budget: float = 0.005  # predicted goodput exploration may cost (above floor)
    # Requests per second a cell may send the predicted-worse way, floor included: the model
    # needs samples, not a share, and a busy cell pays the most for each explored request,
    # more than the model predicts (benchmarks/core_sim_exploration_cost.py measures it).
    # 0.2/s is 120 samples per cell in 10 minutes.
    exploration_max_rate: float = 0.2
    holdout_fraction: float = 0.2  # later windows held out to measure the model's error
    recent_windows: int = 20  # windows that define "the current mix" for predicted goodput
    overrides: Overrides = field(default_factory=Overrides)
    default_route: Route = Route.PREFILL_NODE
    residual_model: bool = True
    # The KV link changed then (a performance drift on its transfers): the link is fitted on
    # the transfers since, the windows before keep their own (latency_model.fit_link_change).
    link_changed_at: float | None = None
    # Also build a table with turn 1 decode-local (the override's other route) and keep it
    # when its predicted goodput beats turn 1 on a prefill node by ``guardrail_margin``.
    tune_first_turn: bool = True
    refit_on_all: bool = True  # after measuring held-out error, refit on every window
    seed: int = 0
    # An operator's pin (``[ppd] append_prefill_route`` / ``enabled``): every later turn on
    # this route, turn 1 on ``overrides.first_turn_route`` untuned, no exploration. The model
    # is still fitted and the policy's goodput still predicted (drift, explain, guardrail).
    pinned_route: Route | None = None


@dataclass(frozen=True, slots=True)
class RoundRecord:
    round: int
    changed_cells: int
    decode_local_share: float  # traffic-weighted, over the current mix
    predicted_goodput: float


@dataclass(frozen=True, slots=True)
class TableGrid:
    """The table's cells as a prediction problem: ``S`` QPS rows × ``K`` (ctx, io) cells."""

    axes: Axes
    context: FloatArray  # [K]
    ratio: FloatArray  # [K]
    mix: FloatArray  # [K] share of requests (sums to 1; zeros where never seen)
    output_tokens: float
    qps: FloatArray  # [S] per-router QPS representative of each row
    n_routers: float
    n_prefill: float
    n_decode: float
    qps_weight: FloatArray  # [S] share of recent windows per QPS row
    # Shares of each cell's traffic the table does not decide (overrides: turn 1 always to a
    # prefill node, the short-append bypass always decode-local), see ``forced_shares``.
    forced_p: FloatArray | None = None  # [K]
    forced_l: FloatArray | None = None  # [K]
    # Where predicted goodput is evaluated: the recent windows' own per-router QPS and the
    # table row each falls in (the rows' representative QPS is up to a factor 1.4 off the
    # load actually seen, and latency is convex in load).
    eval_qps: FloatArray | None = None  # [E]
    eval_row: IntArray | None = None  # [E]
    # Turn 1's share of each cell (the override routes it, not the table), and the route
    # the override gives it in this grid.
    first_turn: FloatArray | None = None  # [K]
    first_turn_route: Route = Route.PREFILL_NODE

    def with_first_turn(self, route: Route) -> TableGrid:
        """The same grid with turn 1 on ``route``."""
        if route is self.first_turn_route or self.first_turn is None \
                or self.forced_p is None or self.forced_l is None:
            return replace(self, first_turn_route=route)
        if route is Route.DECODE_LOCAL:
            moved = np.minimum(self.first_turn, self.forced_p)
            return replace(self, forced_p=self.forced_p - moved,
                           forced_l=self.forced_l + moved, first_turn_route=route)
        moved = np.minimum(self.first_turn, self.forced_l)
        return replace(self, forced_p=self.forced_p + moved,
                       forced_l=self.forced_l - moved, first_turn_route=route)

    def evaluation(self) -> tuple[TableGrid, IntArray]:
        """This grid at the evaluation loads, and the table row of each of its rows."""
        if self.eval_qps is None or self.eval_row is None or self.eval_qps.size == 0:
            return self, np.arange(self.qps.shape[0])
        # Each load weighs by its requests: goodput is a share of requests, and the busy
        # windows of a bursty trace hold most of them.
        weight = self.eval_qps / self.eval_qps.sum() if self.eval_qps.sum() > 0 else \
            np.full(self.eval_qps.shape[0], 1.0 / self.eval_qps.shape[0])
        return replace(self, qps=self.eval_qps, qps_weight=weight,
                       eval_qps=None, eval_row=None), self.eval_row

    def scenario(self, local: FloatArray) -> Scenario:
        """``local[s, k]`` = share of cell k's table-decided traffic sent decode-local."""
        if self.forced_p is not None and self.forced_l is not None:
            free = 1.0 - self.forced_p - self.forced_l
            local = self.forced_l[None, :] + free[None, :] * local
        rate = (self.qps * self.n_routers)[:, None] * self.mix[None, :]
        s = self.qps.shape[0]
        context = np.broadcast_to(self.context, (s, self.context.shape[0]))
        append = np.broadcast_to(self.ratio * self.output_tokens, context.shape)
        return Scenario(
            np.ascontiguousarray(context), np.ascontiguousarray(append),
            rate * (1.0 - local), rate * local, np.full(s, self.output_tokens),
            np.full(s, max(self.n_prefill, 1.0)), np.full(s, max(self.n_decode, 1.0)),
        )


@dataclass(frozen=True, slots=True)
class FixedPoint:
    routes: Any  # bool [S, K]: True = decode-local
    scores: FloatArray
    predictions: Predictions
    rounds: tuple[RoundRecord, ...]
    converged: bool
    predicted_goodput: float
    stable_rows: Any  # bool [S]: QPS rows that reached a fixed point
    terms: ScoreTerms  # what ``scores`` compared


@dataclass(slots=True)
class CalibrationResult:
    """Everything the store records about one calibration."""

    policy: Policy  # the candidate (version = current + 1)
    verdict: GuardrailVerdict
    weights: WeightChoice
    rounds: tuple[RoundRecord, ...]
    converged: bool
    predicted_goodput_candidate: float
    predicted_goodput_current: float | None
    heldout: dict[str, dict[str, ErrorStats]]
    training_window_range: tuple[float, float]
    n_training_windows: int
    n_heldout_windows: int
    changed_cells: int | None  # vs the current policy (None: no current or other axes)
    model: LatencyModel
    grid: TableGrid
    predictions: Predictions  # under the candidate's load, [qps row, (ctx, io) cell, route]
    details: dict[str, Any] = field(default_factory=dict)
    score_terms: ScoreTerms | None = None  # what the table's scores compared

    @property
    def approved(self) -> bool:
        return self.verdict.approved

    def heldout_mape(self) -> dict[str, dict[str, float | None]]:
        return {r: {t: e.mape for t, e in v.items()} for r, v in self.heldout.items()}

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe summary for the store's ``details`` column and ``--json`` output."""
        return {
            "candidate_version": self.policy.version,
            "approved": self.approved,
            "verdict": self.verdict.to_dict(),
            "predicted_goodput": {"current": self.predicted_goodput_current,
                                  "candidate": self.predicted_goodput_candidate},
            "changed_cells": self.changed_cells,
            "heldout": {r: {t: {"mape": e.mape, "r2": e.r2, "rows": e.rows}
                            for t, e in v.items()} for r, v in self.heldout.items()},
            "heldout_mape": self.heldout_mape(),
            "weights": self.weights.to_dict(),
            "rounds": [
                {"round": r.round, "changed_cells": r.changed_cells,
                 "decode_local_share": r.decode_local_share,
                 "predicted_goodput": r.predicted_goodput} for r in self.rounds
            ],
            "converged": self.converged,
            "training_window_range": list(self.training_window_range),
            "n_training_windows": self.n_training_windows,
            "n_heldout_windows": self.n_heldout_windows,
            "model": self.model.report,
            **self.details,
        }


class CalibrationError(ValueError):
    """The windows cannot support a calibration (the message says why)."""


# ---------------------------------------------------------------------------------------------
# Grid, scores, goodput


def _bin(edges: Sequence[float], values: FloatArray) -> IntArray:
    idx = np.searchsorted(np.asarray(edges, dtype=np.float64), values, side="left")
    out: IntArray = np.minimum(idx, len(edges) - 1).astype(np.int64)
    return out


def table_grid(ts: TrainingSet, axes: Axes, recent_windows: int,
               first_turn_route: Route = Route.PREFILL_NODE) -> TableGrid:
    """The current mix (last ``recent_windows`` windows) laid on the table's cells, with
    turn 1 on ``first_turn_route`` (the route of the policy the windows were observed
    under)."""
    if ts.n_windows == 0:
        raise CalibrationError("no windows")
    recent = np.arange(max(ts.n_windows - recent_windows, 0), ts.n_windows)
    n_ctx, n_io, n_qps = axes.shape
    t_ctx = _bin(axes.context_tokens, ROUTER_CTX_REP)  # router ctx bin -> table ctx bin
    t_io = _bin(axes.io_ratio, ROUTER_IO_REP)
    router_to_table = (t_ctx[:, None] * n_io + t_io[None, :]).reshape(-1)  # [K_router]
    mass_router = ts.rate[recent].sum(axis=(0, 2))
    if mass_router.sum() <= 0:
        mass_router = ts.rate.sum(axis=(0, 2))
    if mass_router.sum() <= 0:
        raise CalibrationError("the windows hold no routed requests")
    k = n_ctx * n_io
    mix = np.bincount(router_to_table, weights=mass_router, minlength=k)
    ctx_r = np.repeat(ROUTER_CTX_REP, N_IO_BINS)
    io_r = np.tile(ROUTER_IO_REP, N_CTX_BINS)
    ctx_sum = np.bincount(router_to_table, weights=mass_router * ctx_r, minlength=k)
    io_sum = np.bincount(router_to_table, weights=mass_router * np.log(io_r), minlength=k)
    axis_ctx = np.repeat(context_representatives(axes.context_tokens)[:n_ctx], n_io)
    axis_io = np.tile(ratio_representatives(axes.io_ratio)[:n_io], n_ctx)
    seen = mix > 0
    context = np.where(seen, ctx_sum / np.where(seen, mix, 1.0), axis_ctx)
    ratio = np.where(seen, np.exp(io_sum / np.where(seen, mix, 1.0)), axis_io)
    router_qps = ts.cluster_qps[recent] / np.maximum(ts.n_routers[recent], 1.0)
    qps_rows = _bin(axes.qps, router_qps)
    qps_weight = np.bincount(qps_rows, weights=router_qps, minlength=n_qps).astype(np.float64)
    if qps_weight.sum() <= 0:
        qps_weight = np.bincount(qps_rows, minlength=n_qps).astype(np.float64)
    qps_weight /= qps_weight.sum()
    only_p, only_l = forced_shares(ts, first_turn_route)
    first = np.zeros(N_ROUTER_CELLS)
    first[:N_IO_BINS] = first_turn_share(ts, first_turn_route)
    safe = np.where(seen, mix, 1.0)
    forced_p = np.bincount(router_to_table, weights=mass_router * only_p, minlength=k) / safe
    forced_l = np.bincount(router_to_table, weights=mass_router * only_l, minlength=k) / safe
    first_turn = np.bincount(router_to_table, weights=mass_router * first, minlength=k) / safe
    return TableGrid(
        axes=axes, context=context, ratio=ratio, mix=mix / mix.sum(),
        output_tokens=float(np.median(ts.output_tokens[recent])),
        qps=ratio_representatives(axes.qps)[:n_qps],
        n_routers=float(np.median(np.maximum(ts.n_routers[recent], 1.0))),
        n_prefill=float(np.median(ts.n_prefill[recent])),
        n_decode=float(np.median(ts.n_decode[recent])),
        qps_weight=qps_weight, forced_p=np.where(seen, forced_p, 0.0),
        forced_l=np.where(seen, forced_l, 0.0),
        eval_qps=router_qps.astype(np.float64), eval_row=qps_rows,
        first_turn=np.where(seen, first_turn, 0.0), first_turn_route=first_turn_route,
    )




@dataclass(frozen=True, slots=True)
class ScoreTerms:
    """What a cell's score compares, [qps row, (ctx, io) cell]: each route's predicted TTFT
    and TPOT with the marginal cost it puts on the other requests added, so that ``pdctl
    explain`` shows what the score compares (the predictions alone can contradict the score
    under load)."""

    ttft_p: FloatArray
    ttft_l: FloatArray
    tpot_p: FloatArray
    tpot_l: FloatArray


def score_terms(pred: Predictions, sc: Scenario) -> ScoreTerms:
    ph = pred.physics
    ttft_p, ttft_l = pred.ttft[:, :, 0], pred.ttft[:, :, 1]
    tpot_p, tpot_l = pred.tpot[:, :, 0], pred.tpot[:, :, 1]
    rate_p = sc.rate_p.sum(axis=1)
    rate_l = sc.rate_l.sum(axis=1)
    rate_all = rate_p + rate_l
    # Prefill-node: queueing this request adds to the other prefill-node requests.
    harm_p = ph.prefill_harm
    # Decode-local: its append tokens stretch every decode step on the worker.
    d_step = (ph.step_per_local_tps / sc.n_decode)[:, None] * sc.append
    harm_l_tpot = rate_all[:, None] * d_step
    harm_l_ttft = rate_l[:, None] * d_step * 1.5
    return ScoreTerms(ttft_p + harm_p, ttft_l + harm_l_ttft, tpot_p, tpot_l + harm_l_tpot)


def scores(pred: Predictions, sc: Scenario, weights: Weights) -> FloatArray:
    """The paper's score per cell, with marginal (social) costs added to both routes."""
    return score_from(score_terms(pred, sc), weights)


def score_from(t: ScoreTerms, weights: Weights) -> FloatArray:
    out: FloatArray = (weights.wtft * (t.ttft_p - t.ttft_l) / t.ttft_p
                       - weights.wtpot * (t.tpot_l - t.tpot_p) / t.tpot_p)
    return out


def goodput_rows(pred: Predictions, sc: Scenario, slo: Slo, model: LatencyModel
                 ) -> FloatArray:
    """Predicted goodput of each scenario row (fraction of its requests meeting both SLOs)."""
    g = model.met_probability(pred, sc, slo.ttft_s, slo.tpot_s)
    met = (sc.rate_p * g[:, :, 0] + sc.rate_l * g[:, :, 1]).sum(axis=1)
    total = (sc.rate_p + sc.rate_l).sum(axis=1)
    out: FloatArray = np.where(total > 0, met / np.where(total > 0, total, 1.0), 1.0)
    return out


def goodput_error(model: LatencyModel, ts: TrainingSet, slo: Slo) -> float | None:
    """Requests-weighted mean |predicted - observed| goodput of ``ts``'s windows, each
    predicted under its own load and routing (None: no window with requests)."""
    if ts.n_windows == 0:
        return None
    sc, _ = model.scenario_of(ts)
    predicted = goodput_rows(model.predict(sc), sc, slo, model)
    requests = ts.cluster_qps * ts.interval_s
    ok = np.isfinite(ts.goodput) & (requests > 0)
    if not ok.any():
        return None
    return float(np.average(np.abs(predicted[ok] - ts.goodput[ok]), weights=requests[ok]))


def local_share(routes: Any, exploration: FloatArray | float) -> FloatArray:
    """Share of a cell's requests that run decode-local, exploration included."""
    x = np.asarray(routes, dtype=np.float64)
    e = np.asarray(exploration, dtype=np.float64)
    out: FloatArray = x * (1.0 - e) + (1.0 - x) * e
    return out


def predicted_goodput(model: LatencyModel, grid: TableGrid, routes: Any,
                      exploration: FloatArray | float, slo: Slo) -> tuple[float, Predictions]:
    """Goodput of a routing (``routes[s, k]`` True = local) for the current mix at the
    recent windows' loads, and the predictions at the table rows' representative QPS."""
    sc = grid.scenario(local_share(routes, exploration))
    pred = model.predict(sc)
    return evaluated_goodput(model, grid, routes, exploration, slo), pred


def evaluated_goodput(model: LatencyModel, grid: TableGrid, routes: Any,
                      exploration: FloatArray | float, slo: Slo) -> float:
    """Predicted goodput of a routing at the recent windows' own loads (see ``evaluation``)."""
    ev, rows_of = grid.evaluation()
    share = np.broadcast_to(local_share(routes, exploration),
                            (grid.qps.shape[0], grid.context.shape[0]))[rows_of]
    sc = ev.scenario(share)
    pred = model.predict(sc)
    return float(np.dot(goodput_rows(pred, sc, slo, model), ev.qps_weight))


def fixed_point(
    model: LatencyModel,
    grid: TableGrid,
    weights: Weights,
    slo: Slo,
    initial: Any,
    exploration: FloatArray | float = 0.0,
    max_rounds: int = 12,
) -> FixedPoint:
    """Routes → implied load → predictions → scores → routes, until stable or bounded.

    QPS rows do not share load, so each row converges on its own; a row still moving after
    ``max_rounds`` (or caught in a cycle) keeps the visited routes with its best predicted
    goodput.
    """
    routes = np.asarray(initial, dtype=bool).copy()
    visited: list[tuple[Any, FloatArray]] = []  # (routes, goodput per row)
    records: list[RoundRecord] = []
    stable = np.zeros(routes.shape[0], dtype=bool)
    for rnd in range(1, max_rounds + 1):
        sc = grid.scenario(local_share(routes, exploration))
        pred = model.predict(sc)
        rows = goodput_rows(pred, sc, slo, model)
        new = scores(pred, sc, weights) > 0.0
        row_changes = (new != routes).sum(axis=1)
        share = float(np.dot(grid.qps_weight, (routes * grid.mix[None, :]).sum(axis=1)))
        records.append(RoundRecord(rnd, int(row_changes.sum()), share,
                                   float(np.dot(rows, grid.qps_weight))))
        visited.append((routes, rows))
        stable = row_changes == 0
        if stable.all():
            break
        cycle = any(np.array_equal(new, prev) for prev, _ in visited)
        if cycle:
            break
        routes = _damped(routes, new, scores(pred, sc, weights), rnd)
    final = visited[-1][0].copy()
    if not stable.all():
        row_goodput = np.stack([g for _, g in visited])  # [rounds, S]
        best = row_goodput.argmax(axis=0)
        for s in np.flatnonzero(~stable):
            final[s] = visited[best[s]][0][s]
    sc = grid.scenario(local_share(final, exploration))
    pred = model.predict(sc)
    g = evaluated_goodput(model, grid, final, exploration, slo)
    terms = score_terms(pred, sc)
    return FixedPoint(final, score_from(terms, weights), pred, tuple(records),
                      bool(stable.all()), g, stable, terms)


def pinned_point(model: LatencyModel, grid: TableGrid, weights: Weights, slo: Slo,
                 route: Route) -> FixedPoint:
    """Every cell on ``route`` (an operator's pin): its predictions and scores, no search."""
    routes = np.full((grid.qps.shape[0], grid.context.shape[0]), route is Route.DECODE_LOCAL)
    sc = grid.scenario(local_share(routes, 0.0))
    pred = model.predict(sc)
    g = evaluated_goodput(model, grid, routes, 0.0, slo)
    terms = score_terms(pred, sc)
    return FixedPoint(routes, score_from(terms, weights), pred, (), True, g,
                      np.ones(routes.shape[0], dtype=bool), terms)


def _damped(routes: Any, new: Any, sc_scores: FloatArray, rnd: int) -> Any:
    """Flip, per QPS row, only the most decided half (then quarter, ...) of changing cells.

    The first round takes every change; later rounds take fewer, strongest |score| first, so
    the loop settles instead of swinging the whole pool between two overloaded states.
    """
    changed = new != routes
    if rnd == 1:
        return new
    n_changed = changed.sum(axis=1)
    allowed = np.ceil(n_changed * DAMPING ** (rnd - 1)).astype(np.int64)
    key = np.where(changed, np.abs(sc_scores), -1.0)
    order = np.argsort(-key, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(order.shape[1])[None, :].repeat(order.shape[0], 0),
                      axis=1)
    flip = changed & (rank < allowed[:, None])
    return np.where(flip, new, routes)


# ---------------------------------------------------------------------------------------------
# Current policy, exploration inputs


def policy_routes_on(policy: Policy, grid: TableGrid) -> tuple[Any, FloatArray]:
    """The routes and exploration a policy (any axes) applies to ``grid``'s cells."""
    axes = policy.table.axes
    ctx_bins = _bin(axes.context_tokens, grid.context)
    io_bins = _bin(axes.io_ratio, grid.ratio)
    qps_bins = _bin(axes.qps, grid.qps)
    _, p_io, p_qps = axes.shape
    idx = (ctx_bins[None, :] * p_io + io_bins[None, :]) * p_qps + qps_bins[:, None]
    routes = np.array(policy.table.routes, dtype=np.int64)[idx] == int(Route.DECODE_LOCAL)
    expl = np.array(policy.table.exploration, dtype=np.float64)[idx]
    return routes, expl


def cell_uncertainty(ts: TrainingSet, model: LatencyModel, axes: Axes
                      ) -> tuple[FloatArray, FloatArray, NDArray[np.bool_]]:
    """Per table cell (flattened, policy order): rarer-route samples, residual spread, seen."""
    _, n_io, n_qps = axes.shape
    t_ctx = _bin(axes.context_tokens, ROUTER_CTX_REP)
    t_io = _bin(axes.io_ratio, ROUTER_IO_REP)
    router_to_table = (t_ctx[:, None] * n_io + t_io[None, :]).reshape(-1)
    router_qps = ts.cluster_qps / np.maximum(ts.n_routers, 1.0)
    w_qps = _bin(axes.qps, router_qps)
    cell = router_to_table[ts.row_cell] * n_qps + w_qps[ts.row_window]
    n = axes.n_cells
    req_p = np.bincount(cell, weights=np.where(ts.row_route == 0, ts.row_requests, 0.0),
                        minlength=n)
    req_l = np.bincount(cell, weights=np.where(ts.row_route == 1, ts.row_requests, 0.0),
                        minlength=n)
    ttft_pred, _ = model.predict_rows(ts)
    ok = np.isfinite(ts.row_ttft) & (ts.row_ttft > 0) & (ts.row_ttft_count > 0)
    resid = np.where(ok, np.log(np.where(ok, ts.row_ttft, 1.0) / ttft_pred), 0.0)
    w = np.where(ok, ts.row_ttft_count, 0.0)
    sw = np.bincount(cell, weights=w, minlength=n)
    m1 = np.bincount(cell, weights=w * resid, minlength=n) / np.where(sw > 0, sw, 1.0)
    m2 = np.bincount(cell, weights=w * resid**2, minlength=n) / np.where(sw > 0, sw, 1.0)
    spread = np.where(sw > 0, np.sqrt(np.maximum(m2 - m1**2, 0.0)), np.nan)
    return np.minimum(req_p, req_l), spread, (req_p + req_l) > 0


def _rate_capped_share(grid: TableGrid, max_rate: float) -> FloatArray:
    """Per cell (policy order), the exploration share that sends ``max_rate`` requests per
    second of the traffic the table decides (overrides excluded) the other way."""
    free = np.ones_like(grid.mix)
    if grid.forced_p is not None and grid.forced_l is not None:
        free = np.clip(1.0 - grid.forced_p - grid.forced_l, 0.0, 1.0)
    rate = (grid.qps * grid.n_routers)[:, None] * (grid.mix * free)[None, :]  # [S, K]
    cap = np.where(rate > 0, max_rate / np.where(rate > 0, rate, 1.0), np.inf)
    out: FloatArray = cap.T.reshape(-1)
    return out


def _price_exploration(
    model: LatencyModel, grid: TableGrid, routes: Any, explore: FloatArray,
    seen: NDArray[np.bool_], floor: float, budget: float, slo: Slo,
) -> tuple[FloatArray, float]:
    """Shrink exploration above the floor until its predicted goodput cost is within budget.

    Exploring sends requests the predicted-worse way, and decode-local exploration also
    stretches every decode step; on a pool near its SLO that costs real goodput. The part
    above the floor is scaled by the largest factor in [0, 1] (bisection) whose predicted
    loss against no exploration at all is at most ``budget``; the floor always stays.
    """
    k, n_qps = grid.context.shape[0], grid.qps.shape[0]
    base = np.where(seen, np.minimum(explore, floor), 0.0)

    def loss(scale: float) -> float:
        e = base + scale * (explore - base)
        with_e, _ = predicted_goodput(model, grid, routes, e.reshape(k, n_qps).T, slo)
        return none - with_e

    none, _ = predicted_goodput(model, grid, routes, 0.0, slo)
    if loss(1.0) <= budget:
        return explore, 1.0
    lo, hi = 0.0, 1.0
    for _ in range(8):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if loss(mid) <= budget else (lo, mid)
    out: FloatArray = base + lo * (explore - base)
    return out, lo


ROUTE_WORDS = {Route.PREFILL_NODE: "prefill-node", Route.DECODE_LOCAL: "decode-local"}


def measured_requests(ts: TrainingSet, route: Route) -> float:
    """Requests the training windows saw take ``route`` (every cell, every window)."""
    col = 1 if route is Route.DECODE_LOCAL else 0
    return float(ts.rate[:, :, col].sum() * float(np.median(ts.interval_s)))


def explain_refusal(verdict: GuardrailVerdict, ts: TrainingSet) -> GuardrailVerdict:
    """A refused verdict whose windows measured (almost) no request on one route says so in
    words: its predictions for that route are extrapolations, which is why the predicted
    goodput can be 0 (a model that never saw a decode-local turn predicts its latency from
    nothing). The numbers stay; an approved verdict is returned unchanged."""
    if verdict.approved:
        return verdict
    thin = [(route, measured_requests(ts, route)) for route in ROUTE_WORDS]
    thin = [(route, n) for route, n in thin if n < FORCED_MIN_REQUESTS]
    if not thin:
        return verdict
    words = ", ".join(f"{n:.0f} {ROUTE_WORDS[route]} request(s)" for route, n in thin)
    unseen = any(n < 1.0 for _, n in thin)
    why = (f"; the training windows saw {words} (fewer than {FORCED_MIN_REQUESTS:.0f}): "
           + ("predictions for a route nothing took are extrapolations, not measurements"
              if unseen else "predictions for that route rest on few measurements")
           + " (exploration measures it: [controller] adopted_exploration > 0, or "
           "pdctl calibrate-active)")
    return replace(verdict, reason=verdict.reason + why)


def _first_turn_measured(ts: TrainingSet, route: Route) -> bool:
    """Whether the windows show requests without cached context (context bin 0) taking
    ``route``: without them, turn 1 on that route would be an extrapolation."""
    col = 1 if route is Route.DECODE_LOCAL else 0
    volume = ts.rate[:, :N_IO_BINS, col].sum() * float(np.median(ts.interval_s))
    return bool(volume >= FORCED_MIN_REQUESTS)


def _to_datetime(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, tz=UTC)


# ---------------------------------------------------------------------------------------------
# The calibration


def calibrate(
    windows: Sequence[Window],
    now: float,
    current: Policy | None = None,
    config: CalibrationConfig | None = None,
    heldout_windows: Sequence[Window] | None = None,
    reason: str = "",
    training: TrainingSet | None = None,
) -> CalibrationResult:
    """Fit, build and judge a candidate policy from ``windows`` (oldest first).

    Held-out error comes from ``heldout_windows`` when given, else from the last
    ``holdout_fraction`` of ``windows`` (a model fitted on the earlier ones predicts them).
    """
    cfg = config or CalibrationConfig()
    ts = training if training is not None else build_training_set(windows)
    if ts.n_windows < 2 or ts.n_rows == 0:
        raise CalibrationError(
            f"need at least 2 windows with routed requests, got {ts.n_windows} windows "
            f"and {ts.n_rows} outcome rows"
        )
    slo = cfg.slo
    fit = _fit_with_holdout(ts, cfg, heldout_windows)
    model = fit.model
    live_first = current.overrides.first_turn_route if current is not None \
        else cfg.overrides.first_turn_route
    observed = table_grid(ts, cfg.axes, cfg.recent_windows, live_first)
    n_qps, k = observed.qps.shape[0], observed.context.shape[0]
    cur_routes, cur_expl, initial = _current_on(current, observed)
    pick = _choose_routes(model, ts, observed, initial, live_first, cfg)
    grid, fp = pick.grid, pick.point
    ex = _exploration(model, ts, grid, fp, cfg)
    explore_grid = ex.explore.reshape(k, n_qps).T

    g_candidate, pred = predicted_goodput(model, grid, fp.routes, explore_grid, slo)
    g_current = None
    if current is not None:
        g_current, _ = predicted_goodput(model, observed, cur_routes, cur_expl, slo)
    verdict = check(g_candidate, g_current, cfg.guardrail_margin, heldout_error=fit.goodput_error,
                    overload_below=cfg.guardrail_overload_goodput)
    verdict = explain_refusal(verdict, ts)
    policy = _candidate_policy(ts, now, current, cfg, reason, pick, ex)
    changed = None
    if current is not None and current.table.axes == cfg.axes:
        changed = sum(a != b for a, b in zip(current.table.routes, policy.table.routes,
                                             strict=True))
    share = float(np.dot(grid.qps_weight, (fp.routes * grid.mix[None, :]).sum(axis=1)))
    return CalibrationResult(
        policy=policy, verdict=verdict, weights=pick.choice, rounds=fp.rounds,
        converged=fp.converged, predicted_goodput_candidate=g_candidate,
        predicted_goodput_current=g_current, heldout=fit.heldout,
        training_window_range=(float(ts.start.min()), float(ts.end.max())),
        n_training_windows=ts.n_windows, n_heldout_windows=fit.n_heldout,
        changed_cells=changed, model=model, grid=grid, predictions=pred, score_terms=fp.terms,
        details=_details(share, pick, ex, cfg, fit),
    )


def _current_on(current: Policy | None, observed: TableGrid) -> tuple[Any, FloatArray, Any]:
    """The live policy's routes and exploration on the observed grid (None and zeros without
    one), and where the fixed point starts: the live routes, else all prefill-node."""
    n_qps, k = observed.qps.shape[0], observed.context.shape[0]
    if current is not None:
        cur_routes, cur_expl = policy_routes_on(current, observed)
        return cur_routes, cur_expl, cur_routes
    return None, np.zeros((n_qps, k)), np.zeros((n_qps, k), dtype=bool)


def _details(share: float, pick: _RoutePick, ex: _Exploration, cfg: CalibrationConfig,
             fit: _HeldoutFit) -> dict[str, Any]:
    pin = cfg.pinned_route
    return {"decode_local_share": share,
            "stable_qps_rows": [int(i) for i in np.flatnonzero(pick.point.stable_rows)],
            "exploration_mean": float(ex.explore[ex.seen].mean()) if ex.seen.any() else 0.0,
            "exploration_scale": ex.scale,
            "first_turn_route": pick.first_route.name,
            "pinned_route": pin.name if pin is not None else None,
            "first_turn_goodput": pick.first_turn_goodput,
            "heldout_goodput_error": fit.goodput_error}


@dataclass(frozen=True, slots=True)
class _HeldoutFit:
    model: LatencyModel  # the model the policy is built on
    heldout: dict[str, dict[str, ErrorStats]]  # its error on windows it was not fitted on
    goodput_error: float | None
    n_heldout: int


def _fit(ts: TrainingSet, cfg: CalibrationConfig) -> LatencyModel:
    return fit_latency_model(ts, cfg.slo.ttft_s, cfg.slo.tpot_s, seed=cfg.seed,
                             residual=cfg.residual_model, link_changed_at=cfg.link_changed_at)


def _fit_with_holdout(ts: TrainingSet, cfg: CalibrationConfig,
                      heldout_windows: Sequence[Window] | None) -> _HeldoutFit:
    """Judge a fit on windows it did not see: ``heldout_windows`` when given, else the last
    ``holdout_fraction`` of ``ts`` (then, with ``refit_on_all``, the model is refitted on all
    of ``ts``)."""
    if heldout_windows is not None:
        hold = build_training_set(heldout_windows)
        model = _fit(ts, cfg)
        return _HeldoutFit(model, heldout_error(model, hold),
                           goodput_error(model, hold, cfg.slo), hold.n_windows)
    n_hold = max(int(ts.n_windows * cfg.holdout_fraction), 1)
    cut = ts.n_windows - n_hold
    late = ts.subset(np.arange(cut, ts.n_windows))
    model = _fit(ts.subset(np.arange(cut)), cfg)
    heldout, g_error = heldout_error(model, late), goodput_error(model, late, cfg.slo)
    if cfg.refit_on_all:
        model = _fit(ts, cfg)
    return _HeldoutFit(model, heldout, g_error, n_hold)


@dataclass(frozen=True, slots=True)
class _RoutePick:
    first_route: Route  # the turn-1 override the table was built under
    grid: TableGrid
    choice: WeightChoice
    point: FixedPoint
    first_turn_goodput: dict[str, float]  # route name -> predicted goodput under it


def _search(model: LatencyModel, grid: TableGrid, initial: Any,
            cfg: CalibrationConfig) -> tuple[WeightChoice, FixedPoint]:
    """The weight ratio whose fixed point predicts the best goodput, and that point."""
    results: dict[float, FixedPoint] = {}

    def goodput_of_ratio(ratio: float) -> float:
        w = Weights(wtft=ratio, wtpot=1.0) if math.isfinite(ratio) else Weights(1.0, 0.0)
        fp = fixed_point(model, grid, w, cfg.slo, initial, 0.0, cfg.max_rounds)
        results[ratio] = fp
        return fp.predicted_goodput

    choice = choose_weights(goodput_of_ratio, cfg.weight_ratios, cfg.pinned_weights)
    return choice, results[choice.ratio]


def _choose_routes(model: LatencyModel, ts: TrainingSet, observed: TableGrid, initial: Any,
                   live_first: Route, cfg: CalibrationConfig) -> _RoutePick:
    """Routes and weights under the configured turn-1 override, or one pinned route; with
    ``tune_first_turn``, the other override too when it was measured, kept only if it wins
    by the guardrail's margin (no margin for the override the data was seen under)."""
    first_route = cfg.overrides.first_turn_route
    grid = observed.with_first_turn(first_route)
    pin = cfg.pinned_route
    if pin is not None:
        # The routes do not depend on the weights: one point, under the pinned weights.
        weights = cfg.pinned_weights or Weights()
        fp = pinned_point(model, grid, weights, cfg.slo, pin)
        choice = choose_weights(lambda _: fp.predicted_goodput, cfg.weight_ratios, weights)
    else:
        choice, fp = _search(model, grid, initial, cfg)
    first_turn_goodput: dict[str, float] = {first_route.name: fp.predicted_goodput}
    other = Route.DECODE_LOCAL if first_route is Route.PREFILL_NODE else Route.PREFILL_NODE
    if pin is None and cfg.tune_first_turn and _first_turn_measured(ts, other):
        alt_grid = observed.with_first_turn(other)
        alt_choice, alt_fp = _search(model, alt_grid, initial, cfg)
        first_turn_goodput[other.name] = alt_fp.predicted_goodput
        need = 0.0 if other is live_first else cfg.guardrail_margin
        keep = 0.0 if first_route is live_first else cfg.guardrail_margin
        if alt_fp.predicted_goodput - need > fp.predicted_goodput - keep:
            first_route, grid, choice, fp = other, alt_grid, alt_choice, alt_fp
    return _RoutePick(first_route, grid, choice, fp, first_turn_goodput)


@dataclass(frozen=True, slots=True)
class _Exploration:
    explore: FloatArray  # per cell, policy order (ctx, io, qps)
    scale: float  # what the exploration budget scaled the fractions by
    seen: NDArray[np.bool_]  # cells with measurements
    scores: FloatArray  # the fixed point's scores, policy order


def _exploration(model: LatencyModel, ts: TrainingSet, grid: TableGrid, fp: FixedPoint,
                 cfg: CalibrationConfig) -> _Exploration:
    """Exploration per cell (policy order: ctx, io, qps; the grid is [qps, ctx*io]): from the
    cells' uncertainty, capped by rate, priced against the budget; none under a pin."""
    samples, spread, seen = cell_uncertainty(ts, model, cfg.axes)
    score_flat = fp.scores.T.reshape(-1)  # [(ctx*io), qps] -> policy order
    explore = exploration_fractions(samples, spread, score_flat, seen, cfg.exploration)
    explore = np.minimum(explore, _rate_capped_share(grid, cfg.exploration_max_rate))
    explore, explore_scale = _price_exploration(
        model, grid, fp.routes, explore, seen, cfg.exploration.floor, cfg.exploration_budget,
        cfg.slo)
    if cfg.pinned_route is not None:
        explore, explore_scale = np.zeros_like(explore), 0.0
    return _Exploration(explore, explore_scale, seen, score_flat)


def _candidate_policy(ts: TrainingSet, now: float, current: Policy | None,
                      cfg: CalibrationConfig, reason: str, pick: _RoutePick,
                      ex: _Exploration) -> Policy:
    """The candidate: the next version after ``current`` (1 without one)."""
    routes_flat = pick.point.routes.T.reshape(-1)
    table = LookupTable(
        axes=cfg.axes,
        routes=tuple(Route.DECODE_LOCAL if r else Route.PREFILL_NODE for r in routes_flat),
        scores=tuple(float(np.clip(s, -1e6, 1e6)) for s in ex.scores),
        exploration=tuple(float(e) for e in ex.explore),
    )
    return Policy(
        version=(current.version + 1) if current is not None else 1,
        table=table,
        weights=pick.choice.weights,
        slo=cfg.slo,
        overrides=replace(cfg.overrides, first_turn_route=pick.first_route),
        default_route=cfg.default_route,
        provenance=Provenance(
            created_at=_to_datetime(now), reason=reason, created_by="pd-controller calibrate",
            trained_from=_to_datetime(float(ts.start.min())),
            trained_to=_to_datetime(float(ts.end.max())),
        ),
    )


def with_version(result: CalibrationResult, version: int) -> CalibrationResult:
    """The same result with the candidate renumbered (the store assigns versions)."""
    return replace(result, policy=result.policy.with_version(version))


def explain(result: CalibrationResult, features: Features,
            rarer_route_requests: FloatArray | None = None) -> dict[str, Any]:
    """What ``pdctl explain`` shows: predictions per route for the features' cell (under the
    load the policy creates), the score, the weights, the decision and its confidence.

    ``rarer_route_requests`` (per cell, policy order; from :func:`cell_uncertainty`): a
    cell where one route was never measured is an extrapolation for that route, whatever
    its score."""
    policy = result.policy
    decision = decide(policy, features, lambda: 1.0)  # never explores: the table's choice
    out: dict[str, Any] = {
        "decision": decision.route.name, "reason": decision.reason.value,
        "weights": {"wtft": policy.weights.wtft, "wtpot": policy.weights.wtpot},
    }
    if decision.cell is None:
        return out
    i_ctx, i_io, i_qps = decision.cell
    axes = policy.table.axes
    idx = axes.cell_index(i_ctx, i_io, i_qps)
    k = i_ctx * axes.shape[1] + i_io
    pred = result.predictions
    score = policy.table.scores[idx]
    out.update(
        cell={"context_bin": i_ctx, "io_bin": i_io, "qps_bin": i_qps},
        predicted={
            "PREFILL_NODE": {"ttft_s": float(pred.ttft[i_qps, k, 0]),
                             "tpot_s": float(pred.tpot[i_qps, k, 0])},
            "DECODE_LOCAL": {"ttft_s": float(pred.ttft[i_qps, k, 1]),
                             "tpot_s": float(pred.tpot[i_qps, k, 1])},
        },
        score=score,
        exploration=policy.table.exploration[idx],
        # |score| is the relative margin of the decision; a cell the routers never saw, or
        # saw on one route only, is an extrapolation of the model.
        confidence="extrapolated" if result.grid.mix[k] == 0 or (
            rarer_route_requests is not None and rarer_route_requests[idx] <= 0) else (
            "high" if abs(score) >= 0.2 else "medium" if abs(score) >= 0.05 else "low"),
    )
    t = result.score_terms
    if t is not None:
        # What the score compares: the predictions under the table's own load, plus the
        # marginal cost each route puts on the other requests (score = wtft (TTFT_p -
        # TTFT_l) / TTFT_p - wtpot (TPOT_l - TPOT_p) / TPOT_p over these).
        out["compared"] = {
            "PREFILL_NODE": {"ttft_s": float(t.ttft_p[i_qps, k]),
                             "tpot_s": float(t.tpot_p[i_qps, k])},
            "DECODE_LOCAL": {"ttft_s": float(t.ttft_l[i_qps, k]),
                             "tpot_s": float(t.tpot_l[i_qps, k])},
        }
    return out
