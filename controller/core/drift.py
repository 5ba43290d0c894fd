"""Drift detection: three detectors as pure state machines, plus scaling events.

Each detector has a statistic, a threshold, a minimum sample size, hysteresis (consecutive
windows over the threshold before it fires) and a cooldown after it fires or after a
recalibration. ``step(state, ...) -> (state, verdict)``; nothing here reads a clock (``now``
is an argument) or keeps hidden state.

- **workload**: population stability index (PSI) of ``context_tokens`` and ``io_ratio``
  (router histograms, fixed bins) against the calibration set, with a threshold that is the
  larger of an effect-size floor (0.2, the usual "significant shift") and a multiple of PSI's
  expected value under no change (``(bins - 1) (1/n + 1/N)``, so small windows do not
  false-alarm); ``|log(qps / calibration median)|`` (requests counted over the window)
  against the larger of ``log 1.2`` and four standard deviations: the calibration windows'
  robust one, at least the window's own Poisson spread (``qps_sampling_sd``); and a
  two-sided CUSUM of that log ratio, which accumulates a moderate step (QPS
  x1.3 at ~120 requests a window is under three standard deviations, below any single-window
  threshold that keeps false alarms away). The CUSUM standardises by a window's expected
  spread: Poisson ``1 / expected count`` plus the calibration windows' variance beyond
  Poisson (sessions and bursts overdisperse counts); its allowance also covers the
  reference median's own error. The statistic is the largest ratio statistic / threshold
  over the features (fires at 1).
- **performance**: two-sided CUSUM (tabular Page–Hinkley) on standardised residuals
  ``log(observed / predicted)`` of per-route mean TTFT and TPOT, one accumulator per route and
  target; standardised by the calibration set's own residual mean and spread, clipped per
  window so that one bad window cannot fire it alone (its hysteresis is that clip: the
  default needs two windows of a large shift).
- **slo**: window goodput outside the calibration band ``mean ± max(4 sd, floor)``, its sd
  at least the window's own binomial spread (``goodput_sampling_sd``).

A change in the number of prefill or decode workers is not drift: :func:`scaling_event`
reports it as a known cause that triggers a recalibration directly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from controller.core.features import build_training_set
from controller.core.latency_model import LatencyModel, log_ratio
from controller.core.window import Histogram, Window

KINDS = ("workload", "performance", "slo")
HISTORY = 32  # statistics kept per detector for `pdctl drift`
KV_RESIDUAL = "KV.transfer"  # the KV link's own residual (the others are per route)
# Windows a reference needs before a residual's spread is taken from them (fewer: the key is
# left out and the performance detector does not watch it until a later reference has them).
# A route's latency residual carries queueing noise and an in-sample fit, and a standard
# deviation from n windows is below half the true one with probability P(chi2(n-1) <
# (n-1)/4): 22 % from 3 windows, 6 % from 6. Half the spread doubles each window's z, and a
# stationary stream then climbs the CUSUM to its threshold within a few windows, a false
# alarm. Six windows keep that risk near 6 %. The KV link's transfer time is bytes over
# bandwidth, with little noise: 3 windows, so a slower link is still seen right after a first
# calibration.
ROUTE_REFERENCE_WINDOWS = 6
KV_REFERENCE_WINDOWS = 3
RESIDUAL_KEYS = ("PREFILL_NODE.ttft", "PREFILL_NODE.tpot", "DECODE_LOCAL.ttft",
                 "DECODE_LOCAL.tpot", KV_RESIDUAL)


@dataclass(frozen=True, slots=True)
class DetectorConfig:
    threshold: float
    min_samples: float
    hysteresis: int = 2
    cooldown_s: float = 900.0


@dataclass(frozen=True, slots=True)
class DriftConfig:
    workload: DetectorConfig = field(
        default_factory=lambda: DetectorConfig(threshold=1.0, min_samples=50.0))
    performance: DetectorConfig = field(
        # CUSUM accumulates evidence itself; the per-window clip of z (below) is what keeps a
        # single bad window from firing, so it needs no extra consecutive-window hysteresis.
        default_factory=lambda: DetectorConfig(threshold=7.5, min_samples=20.0, hysteresis=1))
    slo: DetectorConfig = field(
        default_factory=lambda: DetectorConfig(threshold=1.0, min_samples=50.0))
    psi_floor: float = 0.2
    psi_null_multiple: float = 4.0
    qps_floor: float = math.log(1.2)
    qps_sd_multiple: float = 4.0
    # QPS CUSUM, in standard deviations of one window's log rate. The allowance is also at
    # least half of qps_floor (log units): with large windows a tiny, real but harmless rate
    # change would otherwise accumulate. Under no change a two-sided CUSUM with k = 1, h = 5
    # runs ~5e4 windows between false alarms (Siegmund's approximation), ~2 weeks of 30 s
    # windows; one window moves it by at most max_step_share of its threshold, so one odd
    # window cannot fire it alone.
    qps_cusum_allowance: float = 1.0
    qps_cusum_threshold: float = 5.0
    qps_cusum_max_step_share: float = 0.8
    # The KV link's residual needs fewer transfers a window than a route's latency needs
    # requests: a transfer's time is bytes over bandwidth, not a heavy-tailed queueing delay.
    # A window with fewer transfers than the reference windows averaged has its spread
    # widened by sqrt(reference count / count), the spread of a mean, so a small floor
    # keeps sparse windows in play without overweighting them (measured in CHANGELOG.md,
    # "The KV link's own minimum sample").
    kv_min_samples: float = 5.0
    cusum_allowance: float = 1.0  # k, in standard deviations
    z_clip: float = 5.0  # one window moves a CUSUM by at most z_clip - k
    residual_sd_floor: float = 0.04
    # The calibration set's residual spread is measured in-sample (the model was fitted on
    # those windows); later windows scatter more.
    residual_sd_inflation: float = 1.3
    goodput_floor: float = 0.05
    goodput_sd_multiple: float = 4.0


@dataclass(frozen=True, slots=True)
class DriftReference:
    """What the calibration set looked like."""

    context_counts: tuple[float, ...]
    io_counts: tuple[float, ...]
    qps_log_median: float
    qps_log_sd: float
    # Variance of the calibration windows' log rate beyond Poisson (>= 0), and how many
    # windows the median came from (its error widens the CUSUM's allowance).
    qps_log_excess_var: float
    qps_windows: int
    goodput_mean: float | None
    goodput_sd: float
    residual_mean: Mapping[str, float]
    residual_sd: Mapping[str, float]
    window_range: tuple[float, float]
    # Mean samples a window behind each residual (its spread is that of a mean of so many).
    # May be empty (references stored without it): the spread is then used as measured.
    residual_count: Mapping[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "context_counts": list(self.context_counts), "io_counts": list(self.io_counts),
            "qps_log_median": self.qps_log_median, "qps_log_sd": self.qps_log_sd,
            "qps_log_excess_var": self.qps_log_excess_var, "qps_windows": self.qps_windows,
            "goodput_mean": self.goodput_mean, "goodput_sd": self.goodput_sd,
            "residual_mean": dict(self.residual_mean), "residual_sd": dict(self.residual_sd),
            "window_range": list(self.window_range),
            "residual_count": dict(self.residual_count),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DriftReference:
        return cls(
            context_counts=tuple(float(x) for x in d["context_counts"]),
            io_counts=tuple(float(x) for x in d["io_counts"]),
            qps_log_median=float(d["qps_log_median"]), qps_log_sd=float(d["qps_log_sd"]),
            # References stored before the QPS CUSUM: take the whole robust spread as excess
            # (a less sensitive CUSUM, never a noisier one).
            qps_log_excess_var=float(d.get("qps_log_excess_var",
                                           float(d["qps_log_sd"]) ** 2)),
            qps_windows=int(d.get("qps_windows", 1)),
            goodput_mean=None if d.get("goodput_mean") is None else float(d["goodput_mean"]),
            goodput_sd=float(d["goodput_sd"]),
            residual_mean={str(k): float(v) for k, v in d["residual_mean"].items()},
            residual_sd={str(k): float(v) for k, v in d["residual_sd"].items()},
            window_range=(float(d["window_range"][0]), float(d["window_range"][1])),
            residual_count={str(k): float(v)
                            for k, v in d.get("residual_count", {}).items()},
        )


@dataclass(frozen=True, slots=True)
class DetectorState:
    consecutive: int = 0
    cooldown_until: float = -math.inf
    last_fired_at: float | None = None
    cusum: Mapping[str, tuple[float, float]] = field(default_factory=dict)  # key -> (up, down)
    history: tuple[tuple[float, float], ...] = ()  # (window end, statistic)


@dataclass(frozen=True, slots=True)
class DriftState:
    workload: DetectorState = field(default_factory=DetectorState)
    performance: DetectorState = field(default_factory=DetectorState)
    slo: DetectorState = field(default_factory=DetectorState)

    def of(self, kind: str) -> DetectorState:
        state: DetectorState = getattr(self, kind)
        return state


@dataclass(frozen=True, slots=True)
class DriftVerdict:
    kind: str
    fired: bool
    statistic: float  # NaN when the window had too few samples
    threshold: float
    samples: float
    consecutive: int
    in_cooldown: bool
    reason: str
    details: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "fired": self.fired,
            "statistic": None if math.isnan(self.statistic) else self.statistic,
            "threshold": self.threshold, "samples": self.samples,
            "consecutive": self.consecutive, "in_cooldown": self.in_cooldown,
            "reason": self.reason, "details": dict(self.details),
        }


# ---------------------------------------------------------------------------------------------
# Statistics


def _counts(h: Histogram | None) -> np.ndarray[Any, np.dtype[np.float64]]:
    if h is None:
        return np.zeros(0)
    return np.asarray(h.counts, dtype=np.float64)


def psi(
    reference: Sequence[float] | np.ndarray[Any, np.dtype[np.float64]],
    current: Sequence[float] | np.ndarray[Any, np.dtype[np.float64]],
) -> tuple[float, float]:
    """(PSI, its expected value under no change) over aligned bins; +0.5 count smoothing."""
    ref = np.asarray(reference, dtype=np.float64)
    cur = np.asarray(current, dtype=np.float64)
    if ref.shape != cur.shape or ref.sum() <= 0 or cur.sum() <= 0:
        return math.nan, math.nan
    used = (ref + cur) > 0
    r = (ref[used] + 0.5) / (ref[used].sum() + 0.5 * used.sum())
    c = (cur[used] + 0.5) / (cur[used].sum() + 0.5 * used.sum())
    value = float(np.sum((c - r) * np.log(c / r)))
    null = (used.sum() - 1) * (1.0 / cur.sum() + 1.0 / ref.sum())
    return value, float(null)


def window_qps(window: Window) -> float:
    """Requests per second over the window: the routers' request counts when there are any
    (a count over the whole window is far steadier than the routers' sliding-window gauges,
    which swing by ±10 % at a constant rate in the simulator), else the gauges."""
    total = window.outcomes.total("requests")
    if total > 0:
        return total / window.interval_s
    return math.fsum(window.workload.qps_by_router.values())


def window_goodput(window: Window) -> tuple[float | None, float]:
    req = window.outcomes.total("requests")
    met = window.outcomes.total("met")
    return (met / req if req > 0 else None), req


def performance_residuals(
    model: LatencyModel, windows: Sequence[Window]
) -> list[dict[str, tuple[float, float]]]:
    """Per window and key: (count-weighted mean log(observed/predicted), count). Keys:
    ``ROUTE.ttft`` / ``ROUTE.tpot`` per route, and ``KV.transfer`` for the KV link."""
    ts = build_training_set(windows)
    out: list[dict[str, tuple[float, float]]] = [{} for _ in windows]

    def add(key: str, window: Any, obs: Any, pred: Any, count: Any) -> None:
        logr, w = log_ratio(obs, pred, count)
        sw = np.bincount(window, weights=w, minlength=len(windows))
        sr = np.bincount(window, weights=w * logr, minlength=len(windows))
        for i in np.flatnonzero(sw > 0):
            out[i][key] = (float(sr[i] / sw[i]), float(sw[i]))

    ttft, tpot = model.predict_rows(ts) if ts.n_rows else (np.empty(0), np.empty(0))
    for name, pred, obs, cnt in (("ttft", ttft, ts.row_ttft, ts.row_ttft_count),
                                 ("tpot", tpot, ts.row_tpot, ts.row_tpot_count)):
        for col, route in ((0, "PREFILL_NODE"), (1, "DECODE_LOCAL")):
            sel = ts.row_route == col
            add(f"{route}.{name}", ts.row_window[sel], obs[sel], pred[sel], cnt[sel])
    # The KV link on its own: a transfer's time is physics (bytes over bandwidth), far less
    # noisy than a TTFT that carries queueing, so a slower link shows within a window or two.
    kv = ts.kv_transfer
    if kv.window.size:
        add(KV_RESIDUAL, kv.window, kv.value, model.transfer_s(ts), kv.weight)
    return out


def reference_from_windows(
    windows: Sequence[Window], model: LatencyModel | None = None
) -> DriftReference:
    """The calibration set's distributions, goodput band and residual scale."""
    if not windows:
        raise ValueError("a drift reference needs at least one window")
    n_ctx = max((len(w.workload.context_tokens.counts) for w in windows
                 if w.workload.context_tokens is not None), default=0)
    n_io = max((len(w.workload.io_ratio.counts) for w in windows
                if w.workload.io_ratio is not None), default=0)
    ctx = np.zeros(n_ctx)
    io = np.zeros(n_io)
    for w in windows:
        c, i = _counts(w.workload.context_tokens), _counts(w.workload.io_ratio)
        if c.shape == ctx.shape:
            ctx += c
        if i.shape == io.shape:
            io += i
    rates = np.maximum([window_qps(w) for w in windows], 1e-9)
    logq = np.log(rates)
    med = float(np.median(logq))
    mad = float(np.median(np.abs(logq - med))) * 1.4826
    # Var(log count) of a Poisson count is ~1/count; what the windows scatter beyond that is
    # the workload's own overdispersion.
    poisson_var = float(np.mean(1.0 / np.maximum(rates * [w.interval_s for w in windows],
                                                 1.0)))
    excess = (max(float(np.var(logq, ddof=1)) - poisson_var, 0.0) if len(windows) > 1
              else mad**2)
    goods = [g for g, n in (window_goodput(w) for w in windows) if g is not None and n > 0]
    res_mean: dict[str, float] = {}
    res_sd: dict[str, float] = {}
    res_count: dict[str, float] = {}
    if model is not None:
        per = performance_residuals(model, windows)
        for key in RESIDUAL_KEYS:
            vals = np.array([p[key][0] for p in per if key in p])
            if vals.size >= (KV_REFERENCE_WINDOWS if key == KV_RESIDUAL
                             else ROUTE_REFERENCE_WINDOWS):
                res_mean[key] = float(np.mean(vals))
                res_sd[key] = float(np.std(vals, ddof=1))
                res_count[key] = float(np.mean([p[key][1] for p in per if key in p]))
    return DriftReference(
        context_counts=tuple(float(x) for x in ctx), io_counts=tuple(float(x) for x in io),
        qps_log_median=med, qps_log_sd=mad, qps_log_excess_var=excess,
        qps_windows=len(windows),
        goodput_mean=float(np.mean(goods)) if goods else None,
        goodput_sd=float(np.std(goods, ddof=1)) if len(goods) > 1 else 0.0,
        residual_mean=res_mean, residual_sd=res_sd,
        window_range=(min(w.start for w in windows), max(w.end for w in windows)),
        residual_count=res_count,
    )


# ---------------------------------------------------------------------------------------------
# The state machine shared by the three detectors


def _advance(
    kind: str, cfg: DetectorConfig, state: DetectorState, now: float, statistic: float,
    threshold: float, samples: float, details: Mapping[str, Any],
    cusum: Mapping[str, tuple[float, float]] | None = None,
) -> tuple[DetectorState, DriftVerdict]:
    cusum = state.cusum if cusum is None else cusum
    in_cooldown = now < state.cooldown_until
    if samples < cfg.min_samples or math.isnan(statistic):
        new = replace(state, cusum=cusum)
        return new, DriftVerdict(kind, False, math.nan, threshold, samples, state.consecutive,
                                 in_cooldown, f"too few samples ({samples:g} < "
                                 f"{cfg.min_samples:g})", details)
    history = (*state.history, (now, statistic))[-HISTORY:]
    over = statistic > threshold
    consecutive = state.consecutive + 1 if over else 0
    if over and consecutive >= cfg.hysteresis and not in_cooldown:
        fired = DetectorState(consecutive=0, cooldown_until=now + cfg.cooldown_s,
                              last_fired_at=now, cusum={}, history=history)
        return fired, DriftVerdict(
            kind, True, statistic, threshold, samples, consecutive, False,
            f"{kind} drift: {statistic:.3g} > {threshold:.3g} for {consecutive} windows",
            details)
    reason = ("over threshold, in cooldown" if over and in_cooldown
              else f"over threshold {consecutive}/{cfg.hysteresis}" if over
              else "within threshold")
    new = replace(state, consecutive=consecutive, cusum=cusum, history=history)
    return new, DriftVerdict(kind, False, statistic, threshold, samples, consecutive,
                             in_cooldown, reason, details)


def step_workload(
    state: DetectorState, ref: DriftReference, window: Window, now: float,
    cfg: DriftConfig | None = None,
) -> tuple[DetectorState, DriftVerdict]:
    c = cfg or DriftConfig()
    details: dict[str, Any] = {}
    ratios: list[float] = []
    samples = 0.0
    for name, ref_counts, hist in (
        ("context_tokens", ref.context_counts, window.workload.context_tokens),
        ("io_ratio", ref.io_counts, window.workload.io_ratio),
    ):
        cur = _counts(hist)
        samples = max(samples, float(cur.sum()))
        value, null = psi(ref_counts, cur)
        if math.isnan(value):
            continue
        thr = max(c.psi_floor, c.psi_null_multiple * null)
        details[name] = {"psi": value, "threshold": thr}
        ratios.append(value / thr)
    q = window_qps(window)
    cusum = state.cusum
    if q > 0:
        log_ratio = math.log(q) - ref.qps_log_median
        thr = max(c.qps_floor, c.qps_sd_multiple * max(ref.qps_log_sd,
                                                       qps_sampling_sd(ref, window)))
        details["qps"] = {"log_ratio": abs(log_ratio), "threshold": thr, "qps": q,
                          "reference_qps": math.exp(ref.qps_log_median)}
        ratios.append(abs(log_ratio) / thr)
        if samples >= c.workload.min_samples:  # a thin window adds no evidence
            up, down, sd = _qps_cusum(cusum.get("qps", (0.0, 0.0)), ref, window, log_ratio, c)
            cusum = {**cusum, "qps": (up, down)}
            details["qps"] |= {"cusum_up": up, "cusum_down": down, "sd": sd,
                               "cusum_threshold": c.qps_cusum_threshold}
            ratios.append(max(up, down) / c.qps_cusum_threshold)
    stat = max(ratios) if ratios else math.nan
    return _advance("workload", c.workload, state, now, stat, c.workload.threshold, samples,
                    details, cusum)


def qps_sampling_sd(ref: DriftReference, window: Window) -> float:
    """The spread of a window's log request count from sampling alone: ``1 / sqrt(count)``
    of a Poisson count, at the reference's median rate over this window's length. The
    per-window QPS test never puts its threshold below ``qps_sd_multiple`` of it: the
    reference's robust spread, from a handful of windows, can be far below it (five equal
    counts give 0), and a window of ~30 requests would then cross the ``log 1.2`` floor on
    sampling noise alone (its Poisson spread is 0.18 = log 1.2), firing the workload detector
    on short windows before anything changed. A reference from many windows already
    scatters at least this much (its windows are samples too), so there it changes nothing."""
    expected = math.exp(ref.qps_log_median) * window.interval_s
    return 1.0 / math.sqrt(max(expected, 1.0))


# Var(median of n) ~ (pi/2) Var(x) / n for normal samples.
_MEDIAN_VAR_FACTOR = math.pi / 2.0


def _qps_cusum(
    prev: tuple[float, float], ref: DriftReference, window: Window, log_ratio: float,
    c: DriftConfig,
) -> tuple[float, float, float]:
    """One step of the two-sided CUSUM on a window's log rate ratio: (up, down, its sd)."""
    expected = math.exp(ref.qps_log_median) * window.interval_s
    sd = math.sqrt(ref.qps_log_excess_var + 1.0 / max(expected, 1.0))
    z = log_ratio / sd
    # The reference median's own error is the same offset in every window, which a CUSUM
    # would accumulate (from 10 windows it is 0.4 sd, and a 0.6 sd offset makes k = 1, h = 5
    # fire within 2 h about every other time): the allowance covers one standard error of it.
    k = max(c.qps_cusum_allowance + math.sqrt(_MEDIAN_VAR_FACTOR / max(ref.qps_windows, 1)),
            c.qps_floor / (2.0 * sd))
    cap = c.qps_cusum_max_step_share * c.qps_cusum_threshold
    up = max(0.0, prev[0] + min(z - k, cap))
    down = max(0.0, prev[1] + min(-z - k, cap))
    return up, down, sd


def step_performance(
    state: DetectorState, ref: DriftReference, residuals: Mapping[str, tuple[float, float]],
    now: float, cfg: DriftConfig | None = None,
) -> tuple[DetectorState, DriftVerdict]:
    """``residuals``: see :func:`performance_residuals` (one window's entry)."""
    c = cfg or DriftConfig()
    cusum = dict(state.cusum)
    details: dict[str, Any] = {}
    samples = 0.0
    stat = math.nan
    nominal = c.performance.min_samples
    floor = nominal
    lead = ""
    for key, (value, count) in residuals.items():
        link = key == KV_RESIDUAL
        need = c.kv_min_samples if link else nominal
        if key not in ref.residual_mean or count < need:
            continue
        samples = max(samples, count)
        floor = min(floor, need)
        sd = max(ref.residual_sd.get(key, 0.0) * c.residual_sd_inflation, c.residual_sd_floor)
        if link:  # a mean of fewer transfers scatters more
            sd *= math.sqrt(max(1.0, ref.residual_count.get(key, nominal) / count))
        z = min(max((value - ref.residual_mean[key]) / sd, -c.z_clip), c.z_clip)
        up, down = cusum.get(key, (0.0, 0.0))
        up = max(0.0, up + z - c.cusum_allowance)
        down = max(0.0, down - z - c.cusum_allowance)
        cusum[key] = (up, down)
        details[key] = {"z": z, "cusum_up": up, "cusum_down": down}
        if math.isnan(stat) or max(up, down) > stat:
            stat, lead = max(up, down), key
    # The KV link is measured directly (bytes over bandwidth, not a fit of queueing delays):
    # the cooldown a recalibration starts, which keeps a fresh model's misfit from firing,
    # does not hold its residual back, so a link slowdown soon after an approval is seen at
    # once; the cooldown after the detector's own firing does (CHANGELOG.md, "The KV link
    # and a recalibration's cooldown").
    fired_long_ago = (state.last_fired_at is None
                      or now >= state.last_fired_at + c.performance.cooldown_s)
    if lead == KV_RESIDUAL and stat > c.performance.threshold and fired_long_ago:
        state = replace(state, cooldown_until=-math.inf)
    # Every residual used met its own minimum: the detector advances on any of them.
    new, verdict = _advance("performance", replace(c.performance, min_samples=floor), state,
                            now, stat, c.performance.threshold, samples, details, cusum)
    if stat > c.performance.threshold:  # which residual: the KV link, or a route's latency
        verdict = replace(verdict, reason=f"{verdict.reason} (led by {lead})")
    return new, verdict


def goodput_sampling_sd(p: float, n: float) -> float:
    """The spread of a window's goodput from sampling alone: binomial, ``sqrt(p (1 - p) / n)``
    at the reference's goodput ``p`` over the window's ``n`` requests. The SLO band is never
    narrower than ``goodput_sd_multiple`` of it, for the same reason as the QPS test's floor
    (``qps_sampling_sd``): a reference of a few windows can agree by chance (all at 1.0: a
    spread of 0), and a 30-request window at 98 % goodput moves by 0.026 from sampling alone,
    so two windows with a few misses each would cross the 0.05 floor with nothing changed.
    With hundreds of requests a window it is below the floor and changes
    nothing."""
    q = min(max(p, 0.0), 1.0)
    return math.sqrt(q * (1.0 - q) / n) if n > 0 else 0.0


def step_slo(
    state: DetectorState, ref: DriftReference, window: Window, now: float,
    cfg: DriftConfig | None = None,
) -> tuple[DetectorState, DriftVerdict]:
    c = cfg or DriftConfig()
    g, n = window_goodput(window)
    if g is None or ref.goodput_mean is None:
        return _advance("slo", c.slo, state, now, math.nan, c.slo.threshold, n, {})
    band = max(c.goodput_sd_multiple * max(ref.goodput_sd,
                                           goodput_sampling_sd(ref.goodput_mean, n)),
               c.goodput_floor)
    stat = abs(g - ref.goodput_mean) / band
    details = {"goodput": g, "reference": ref.goodput_mean, "band": band}
    return _advance("slo", c.slo, state, now, stat, c.slo.threshold, n, details)


def assess(
    state: DriftState, ref: DriftReference, window: Window, now: float,
    residuals: Mapping[str, tuple[float, float]] | None = None,
    cfg: DriftConfig | None = None,
) -> tuple[DriftState, tuple[DriftVerdict, ...]]:
    """All three detectors on one window (performance only when residuals are given)."""
    w_state, w = step_workload(state.workload, ref, window, now, cfg)
    s_state, s = step_slo(state.slo, ref, window, now, cfg)
    verdicts = [w]
    p_state = state.performance
    if residuals is not None:
        p_state, p = step_performance(state.performance, ref, residuals, now, cfg)
        verdicts.append(p)
    verdicts.append(s)
    return DriftState(w_state, p_state, s_state), tuple(verdicts)


def feature_statistics(kind: str, details: Mapping[str, Any]) -> dict[str, float]:
    """Per feature, a verdict's share in its detector's units (what its statistic is the
    maximum of): the workload detector's context / io-ratio PSI and QPS as ratios to their
    thresholds, the performance detector's CUSUM per residual (``KV.transfer``,
    ``PREFILL_NODE.ttft``, ...). Empty for the SLO detector (one statistic)."""
    out: dict[str, float] = {}
    for feature, d in details.items():
        if not isinstance(d, Mapping):
            continue
        if kind == "performance" and "cusum_up" in d:
            out[feature] = max(float(d["cusum_up"]), float(d["cusum_down"]))
        elif kind == "workload" and "threshold" in d:
            value = d["psi"] if "psi" in d else d.get("log_ratio", math.nan)
            ratio = float(value) / float(d["threshold"])
            if "cusum_threshold" in d:
                ratio = max(ratio, max(float(d["cusum_up"]), float(d["cusum_down"]))
                            / float(d["cusum_threshold"]))
            out[feature] = ratio
    return out


def drift_onset(state: DetectorState, threshold: float) -> float | None:
    """When the run of windows that made a detector fire began: the end of the newest window
    in its history whose statistic was within ``threshold`` (None: the history holds none).

    A calibration after a shift should learn from the windows after it only; the windows
    before describe the old regime (a model trained on them predicts the old load, and its
    candidate is refused).
    """
    history = state.history
    for end, stat in reversed(history[:-1]):
        if not math.isnan(stat) and stat <= threshold:
            return end
    return None


def after_recalibration(state: DriftState, now: float, cfg: DriftConfig | None = None
                        ) -> DriftState:
    """Fresh accumulators and a cooldown for every detector (a new calibration set)."""
    c = cfg or DriftConfig()

    def fresh(s: DetectorState, dc: DetectorConfig) -> DetectorState:
        return DetectorState(cooldown_until=now + dc.cooldown_s, last_fired_at=s.last_fired_at,
                             history=s.history)

    return DriftState(fresh(state.workload, c.workload),
                      fresh(state.performance, c.performance), fresh(state.slo, c.slo))


# ---------------------------------------------------------------------------------------------
# Scaling


@dataclass(frozen=True, slots=True)
class ScalingEvent:
    role: str
    before: int
    after: int
    added: tuple[str, ...]
    removed: tuple[str, ...]

    @property
    def reason(self) -> str:
        return f"{self.role} workers {self.before} -> {self.after}"


def scaling_event(prev: Window, window: Window) -> tuple[ScalingEvent, ...]:
    """Changes in the number of prefill or decode workers between two windows.

    A worker that vanished but is listed among this window's failed targets is a failed
    scrape, not a scale-down.
    """
    failed = {f.target for f in window.failures}
    events = []
    for role in ("prefill", "decode"):
        before = {w.worker for w in prev.workers if w.role == role}
        after = {w.worker for w in window.workers if w.role == role}
        removed = tuple(sorted(before - after - failed))
        added = tuple(sorted(after - before))
        n_after = len(after | (before & failed))
        if n_after != len(before):
            events.append(ScalingEvent(role, len(before), n_after, added, removed))
    return tuple(events)


@dataclass(frozen=True, slots=True)
class ScalingState:
    """Answering workers per role as last confirmed, and a pending change being confirmed."""

    known: Mapping[str, int] = field(default_factory=dict)
    pending: Mapping[str, tuple[int, int]] = field(default_factory=dict)  # role -> (count, seen)


def worker_counts(window: Window) -> dict[str, int]:
    """Answering workers per role in ``window`` (what :func:`step_scaling` counts)."""
    return {role: sum(1 for w in window.workers if w.role == role)
            for role in ("prefill", "decode")}


def step_scaling(
    state: ScalingState, window: Window, persist: int = 2
) -> tuple[ScalingState, tuple[ScalingEvent, ...]]:
    """Debounced scaling detection on the number of *answering* workers per role.

    A worker that stops answering for ``persist`` consecutive windows is capacity lost, the
    same as one scaled away (a simulator or a scrape cannot tell the two apart, and the
    routing trade-off changes either way); a single failed scrape is not. The first window
    only records the counts.
    """
    known = dict(state.known)
    pending = dict(state.pending)
    events = []
    for role, n in worker_counts(window).items():
        if role not in known:
            known[role] = n
            continue
        if n == known[role]:
            pending.pop(role, None)
            continue
        count, seen = pending.get(role, (n, 0))
        seen = seen + 1 if count == n else 1
        if seen >= persist:
            events.append(ScalingEvent(role, known[role], n, (), ()))
            known[role] = n
            pending.pop(role, None)
        else:
            pending[role] = (n, seen)
    return ScalingState(known, pending), tuple(events)
