"""Capacity plan from observed windows: the adapter between the store/daemon and
:mod:`controller.core.capacity`.

It gathers the demand and the fitted physics from recent windows and decides nothing itself:

- **QPS**: the routers' request counts (per-route outcomes), else the decode workers'
  finished-request rate (every request ends on a decode worker), else the routers' QPS gauges;
- **prompt tokens and the cached share**: the decode workers' ``prompt_tokens_by_source``
  (``local_compute + local_cache_hit + external_kv_transfer`` is the whole prompt of every
  request); tokens actually computed are the prefill workers' ``local_compute`` plus the decode
  workers' ``local_compute`` minus the last prompt position a decode worker recomputes for each
  P/D request;
- **output tokens**: decode ``generation_tokens`` per finished request;
- **decode-local share**: the routers' per-route request counts;
- **rate profile**: each window's arrival rate over the mean, less the counting noise (see
  :func:`rate_profile`): the p99 is over the busy windows' requests too;
- **physics**: :func:`~controller.core.latency_model.fit_components` on the same windows when
  they carry the component signals, else the defaults (said in the explanation);
- **KV capacity per decode worker**: ``running x resident context / kv_cache_usage``, from
  windows where the cache is at least 5% used (an estimate; an override wins);
- **session KV** (:class:`~controller.core.capacity.SessionCache`): the decode pool's running
  KV (``kv_cache_usage`` summed over the decode workers, window mean) beside its capacity, and
  the share of prompt tokens served from decode-held session KV (the cached tokens less the
  prefill workers' own prefix-cache hits): the plan scales the decode-local and cached shares
  with the session KV a candidate decode count keeps. The working set needs the mean wait
  between a session's turns, which windows do not carry (``PlanOverrides.session_gap_s``,
  from a gateway's log); without it the observed pool is taken to have just held it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Container, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from controller.core.capacity import (
    CapacityDemand,
    CapacityError,
    CapacityPlan,
    ObservedRange,
    SessionCache,
    plan_capacity,
)
from controller.core.latency_model import ComponentParams
from controller.core.window import Role, Window
from controller.policy.model import Route

if TYPE_CHECKING:
    from controller.config import Settings

MIN_KV_USAGE = 0.05  # below this the usage gauge says too little about the pool size


class NoDemand(CapacityError):
    """Neither the windows nor the overrides say what load to plan for."""


@dataclass(frozen=True, slots=True)
class PlanOverrides:
    """What the operator sets by hand (``pdctl plan`` flags); None: from the windows."""

    qps: float | None = None
    rate_profile: tuple[float, ...] | None = None  # (1.0,): plan for a steady rate
    # length of each rate_profile entry (None: the windows' length); a profile finer than the
    # windows (a gateway's arrival log) shows bursts the windows average out
    profile_window_s: float | None = None
    input_tokens: float | None = None
    output_tokens: float | None = None
    cached_fraction: float | None = None
    decode_local_share: float | None = None
    local_append_tokens: float | None = None
    # squared coefficients of variation of the token counts (windows carry only means):
    # computed prompt tokens of prefill-node requests, whole prompts, decode-local appends
    prefill_scv: float | None = None
    input_scv: float | None = None
    append_scv: float | None = None
    prior: ComponentParams | None = None  # physics where the windows cannot tell (a profile)
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    headroom: float | None = None
    kv_capacity_tokens: float | None = None
    max_num_seqs: int | None = None
    params: ComponentParams | None = None
    # mean wait between a session's turns (a request's finish to its session's next arrival):
    # sizes the session KV working set; windows do not carry it (None: see SessionCache)
    session_gap_s: float | None = None
    session_feedback: bool = True  # False: plan on the observed shares at every shape


@dataclass(frozen=True, slots=True)
class ObservedDemand:
    """The load the windows show (None where they do not say)."""

    qps: float | None
    rate_profile: tuple[float, ...]  # each window's arrival rate over the mean
    profile_window_s: float  # mean window length
    input_tokens: float | None
    cached_fraction: float | None
    output_tokens: float | None
    decode_local_share: float | None
    local_append_tokens: float | None
    seconds: float  # time the windows cover
    current: tuple[int, int] | None  # (prefill, decode) workers in the newest window
    observed: ObservedRange | None
    kv_capacity_tokens: float | None
    # share of prompt tokens served from decode-held session KV (decode-local turns' hits)
    decode_cached_fraction: float | None = None
    decode_kv_usage: float | None = None  # sum of the decode workers' kv_cache_usage, mean


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 and math.isfinite(num) else None


def observe_demand(windows: Sequence[Window]) -> ObservedDemand:
    """Demand, shape and per-worker load range of ``windows`` (oldest first)."""
    t = _DemandTally()
    for w in windows:
        t.add(w)
    output = _ratio(t.generated, t.finished)
    prompt = _ratio(t.prompt_total, t.finished) if t.prompt_seen else None
    routed = t.n_local + t.n_pd
    share = _ratio(t.n_local, routed)
    local_append, cached, decode_cached = t.prompt_shares()
    kv_estimates = _kv_capacity_estimates(windows, prompt, output)
    newest = windows[-1] if windows else None
    current = None
    if newest is not None and "prefill" in newest.roles and "decode" in newest.roles:
        current = (newest.roles["prefill"].workers, newest.roles["decode"].workers)
    observed = (ObservedRange(t.max_p_rate, t.max_d_tokens)
                if windows and (t.max_p_rate > 0 or t.max_d_tokens > 0) else None)
    profile = rate_profile(t.window_rates, [w.interval_s for w in windows])
    return ObservedDemand(
        qps=_ratio(t.requests, t.seconds), rate_profile=profile,
        profile_window_s=t.seconds / len(windows) if windows else 30.0, input_tokens=prompt,
        cached_fraction=cached,
        output_tokens=output, decode_local_share=share, local_append_tokens=local_append,
        seconds=t.seconds, current=current, observed=observed,
        kv_capacity_tokens=statistics.median(kv_estimates) if kv_estimates else None,
        decode_cached_fraction=decode_cached,
        decode_kv_usage=statistics.fmean(t.usage_sums) if t.usage_sums else None,
    )


@dataclass(slots=True)
class _DemandTally:
    """Sums over windows, added in window order (the figures do not depend on how the
    code is split: the same float additions happen in the same order)."""

    seconds: float = 0.0
    requests: float = 0.0
    finished: float = 0.0  # decode completions of workers that report generated tokens
    generated: float = 0.0
    prompt_total: float = 0.0
    computed_p: float = 0.0
    computed_d: float = 0.0
    prefill_hits: float = 0.0
    prompt_seen: bool = False  # a decode worker reported prompt tokens by source
    n_local: float = 0.0
    n_pd: float = 0.0
    max_p_rate: float = 0.0  # per prefill worker, requests/s
    max_d_tokens: float = 0.0  # per decode worker, generated tokens/s
    usage_sums: list[float] = field(default_factory=list)
    window_rates: list[float] = field(default_factory=list)

    def add(self, w: Window) -> None:
        iv = w.interval_s
        self.seconds += iv
        win_finished = self._add_decode(w)
        for ws in w.workers_of("prefill"):
            self.computed_p += (ws.prompt_tokens_by_source or {}).get("local_compute", 0.0)
            self.prefill_hits += (ws.prompt_tokens_by_source or {}).get("local_cache_hit", 0.0)
        usages = [ws.kv_cache_usage for ws in w.workers_of("decode")
                  if ws.kv_cache_usage is not None]
        if usages:
            self.usage_sums.append(math.fsum(usages))
        routed_here = 0.0
        for o in w.outcomes:
            routed_here += o.requests
            if o.route == Route.DECODE_LOCAL:
                self.n_local += o.requests
            else:
                self.n_pd += o.requests
        # the routers' counts are exact; their QPS gauge is a sliding rate at the window's end
        if routed_here > 0:
            here = routed_here
        elif win_finished > 0:
            here = win_finished
        else:
            here = math.fsum(w.workload.qps_by_router.values()) * iv
        self.requests += here
        self.window_rates.append(here / iv)
        p, d = w.roles.get("prefill"), w.roles.get("decode")
        if p is not None and p.workers and p.request_rate is not None:
            self.max_p_rate = max(self.max_p_rate, p.request_rate / p.workers)
        if d is not None and d.workers and d.generation_tokens is not None:
            self.max_d_tokens = max(self.max_d_tokens, d.generation_tokens / iv / d.workers)

    def _add_decode(self, w: Window) -> float:
        """Add the decode workers' counts; returns the window's decode completions."""
        win_finished = 0.0
        for ws in w.workers_of("decode"):
            if ws.request_rate is None:
                continue
            f = ws.request_rate * w.interval_s
            win_finished += f
            if ws.generation_tokens is not None:
                self.generated += ws.generation_tokens
                self.finished += f
            src = ws.prompt_tokens_by_source or {}
            self.computed_d += src.get("local_compute", 0.0)
            if "local_cache_hit" in src or "external_kv_transfer" in src:
                self.prompt_seen = True
            self.prompt_total += math.fsum(src.values())
        return win_finished

    def prompt_shares(self) -> tuple[float | None, float | None, float | None]:
        """Decode-local append tokens per request, the cached prompt fraction, and the part
        of it cached outside the prefill workers' own prefix caches (decode-held KV)."""
        routed = self.n_local + self.n_pd
        # decode workers recompute one prompt position of each P/D request
        recompute = self.n_pd * (self.finished / routed) if routed > 0 else 0.0
        local_append = _ratio(max(self.computed_d - recompute, 0.0),
                              self.n_local * (self.finished / routed)) \
            if routed > 0 and self.n_local > 0 else None
        cached = decode_cached = None
        if self.prompt_seen and self.prompt_total > 0:
            cached = min(max(1.0 - (self.computed_p + self.computed_d - recompute)
                             / self.prompt_total, 0.0), 1.0)
            decode_cached = min(max(cached - self.prefill_hits / self.prompt_total, 0.0), cached)
        return local_append, cached, decode_cached


def _kv_capacity_estimates(windows: Sequence[Window], prompt: float | None,
                           output: float | None) -> list[float]:
    """Per decode worker and window: the KV tokens its cache holds when full, from its
    running requests' mean context and its usage (busy enough windows only)."""
    kv_estimates: list[float] = []
    if prompt is not None and output is not None:
        ctx = prompt + output / 2.0
        for w in windows:
            for ws in w.workers_of("decode"):
                if ws.kv_cache_usage and ws.kv_cache_usage >= MIN_KV_USAGE and ws.running:
                    kv_estimates.append(ws.running * ctx / ws.kv_cache_usage)
    return kv_estimates


PLAUSIBLE_FACTOR = 5.0  # a fitted coefficient this far from the prior is not believed


def _plausible(fitted: float, prior: float) -> bool:
    if prior <= 0:
        return True
    return prior / PLAUSIBLE_FACTOR <= fitted <= prior * PLAUSIBLE_FACTOR


@dataclass(frozen=True, slots=True)
class WorkerMeans:
    """Per worker and window: requests finished, their mean tokens and mean prefill time."""

    requests: np.ndarray
    tokens: np.ndarray
    prefill_s: np.ndarray  # NaN where the worker reported no prefill time


def worker_means(windows: Sequence[Window], role: Role) -> WorkerMeans:
    """One row per worker and window that finished requests: prefill workers' computed
    tokens (``local_compute``), decode workers' whole prompts (every source)."""
    rows: list[tuple[float, float, float]] = []
    for w in windows:
        for ws in w.workers_of(role):
            if not ws.request_rate or ws.prompt_tokens_by_source is None:
                continue
            n = ws.request_rate * w.interval_s
            src = ws.prompt_tokens_by_source
            tokens = src.get("local_compute", 0.0) if role == "prefill" else math.fsum(
                src.values())
            s = ws.prefill_s
            mean_s = s.mean if s is not None and s.mean is not None and s.count else math.nan
            rows.append((n, tokens / n, mean_s))
    a = np.asarray(rows, dtype=np.float64).reshape(-1, 3)
    return WorkerMeans(a[:, 0], a[:, 1], a[:, 2])


MIN_SPREAD_ROWS = 8  # worker-windows needed to estimate a token spread or a prefill curve


def token_scv(rows: WorkerMeans) -> float | None:
    """Squared CV of one request's tokens from per-worker window means (method of moments:
    a mean of ``n`` requests varies by ``sigma^2 / n`` around the overall mean, so
    ``sum n (m - mu)^2 / (rows - 1)`` estimates ``sigma^2``). None: too few rows. Bursts of
    similar requests and requests counted in a window other than their tokens' make it an
    overestimate (a pessimistic plan), never an underestimate."""
    n, m = rows.requests, rows.tokens
    if n.size < MIN_SPREAD_ROWS or n.sum() <= 0:
        return None
    mu = float((n * m).sum() / n.sum())
    if mu <= 0:
        return None
    var = float((n * (m - mu) ** 2).sum() / (n.size - 1))
    return var / (mu * mu)


MIN_TOKEN_RANGE = 4.0  # the prefill curve is refitted only over prompts this many times apart


def fit_prefill_curve(rows: WorkerMeans, scv: float | None,
                      ) -> tuple[tuple[float, float, float], int] | None:
    """((base, per token, per token^2), rows fitted) of ``prefill_s = base + a L + a2 L^2``,
    fitted on each prefill worker's own window means (non-negative least squares).

    The latency model fits the curve on the windows' routed mixes, whose cell bins are too
    coarse to see the attention term (it fits to zero, and the long prompts that make a p99
    are priced too cheap). A worker-window that finished a single request is an exact
    ``(L, prefill time)`` pair: with ``MIN_SPREAD_ROWS`` of them, they alone are fitted.
    Otherwise every row is, the mean of ``L^2`` over a row's ``n`` requests taken as ``m^2``
    plus ``sigma^2 (n - 1) / n`` from the pooled spread (rows of many requests say little
    about the curvature). None where the prompts do not vary enough (``MIN_TOKEN_RANGE``) to
    tell a linear from a quadratic cost.
    """
    from scipy.optimize import nnls

    ok = np.isfinite(rows.prefill_s) & (rows.requests > 0) & (rows.tokens > 0)
    single = ok & (rows.requests < 1.5)
    if single.sum() >= MIN_SPREAD_ROWS:
        ok = single
    n, m, y = rows.requests[ok], rows.tokens[ok], rows.prefill_s[ok]
    if n.size < MIN_SPREAD_ROWS or m.max() < MIN_TOKEN_RANGE * m.min():
        return None
    mu = float((n * m).sum() / n.sum())
    var = (scv or 0.0) * mu * mu
    second = m * m + var * np.maximum(n - 1.0, 0.0) / n
    w = np.sqrt(n)
    coef, _ = nnls(np.column_stack([np.ones_like(m), m, second]) * w[:, None], y * w)
    if coef[1] <= 0 and coef[2] <= 0:
        return None
    return (float(coef[0]), float(coef[1]), float(coef[2])), int(n.size)


def rate_profile(rates: Sequence[float], intervals: Sequence[float]) -> tuple[float, ...]:
    """Each window's arrival rate over the mean, with the counting noise taken out.

    A steady Poisson stream of ``n`` requests per window still shows window-to-window
    spread ``1 / sqrt(n)``; planning for that noise would buy workers for nothing. The
    deviations are shrunk by ``sqrt(1 - noise variance / observed variance)`` (method of
    moments), so a steady load plans as steady and a bursty one keeps its bursts.
    """
    if not rates:
        return (1.0,)
    mean = statistics.fmean(rates)
    if mean <= 0:
        return (1.0,)
    factors = [r / mean for r in rates]
    if len(factors) < 2:
        return tuple(factors)
    observed = statistics.pvariance(factors)
    counts = statistics.fmean(r * iv for r, iv in zip(rates, intervals, strict=True))
    noise = 1.0 / counts if counts > 0 else 0.0
    shrink = math.sqrt(max(observed - noise, 0.0) / observed) if observed > 0 else 0.0
    return tuple(1.0 + (f - 1.0) * shrink for f in factors)


def fitted_params(windows: Sequence[Window], prior: ComponentParams | None = None,
                  ) -> tuple[ComponentParams, list[str]]:
    """Component params fitted on ``windows``, with lines saying what was fitted.

    A component is kept from the prior when its fit is implausible: a coefficient zero or
    more than ``PLAUSIBLE_FACTOR`` away from the prior's (windows that never batched much
    cannot see the per-context cost of a decode step; a planner must not extrapolate a flat
    line to the batch sizes it recommends).
    """
    from controller.core.features import build_training_set
    from controller.core.latency_model import fit_components

    base = prior or ComponentParams()
    if not windows:
        return base, ["physics: defaults (no windows to fit on)"]
    try:
        params, report = fit_components(build_training_set(windows), base)
    except (ValueError, FloatingPointError) as e:
        return base, [f"physics: defaults (fit failed: {e})"]
    lines: list[str] = []
    if "prefill" in report:
        params, line = _refit_prefill(windows, params)
        lines += [line] if line else []
    params, kept = _restore_implausible(params, base, report)
    fitted = sorted(report)
    lines.insert(0, f"physics: fitted on {len(windows)} window(s): "
                    f"{', '.join(fitted) or 'nothing'}")
    if kept:
        lines.append(f"physics: prior kept for {'; '.join(kept)} (fit implausible: zero or "
                     f"over {PLAUSIBLE_FACTOR:g}x off the prior)")
    missing = [c for c in COMPONENT_FIELDS if c not in report]
    if missing:
        lines.append(f"physics: prior kept for {', '.join(missing)} (no signal in the windows)")
    return params, lines


# The fields of each fitted component; a component failing the plausibility check is restored
# whole (its fitted intercept absorbed what the implausible slope missed).
COMPONENT_FIELDS: dict[str, tuple[str, ...]] = {
    "prefill": ("prefill_base_s", "prefill_per_token_s", "prefill_per_token2_s"),
    "prefill_queue": ("prefill_queue_scale",),
    "decode_step": ("step_base_s", "step_per_seq_s", "step_per_ctx_token_s",
                    "step_per_prefill_token_s"),
}
# The fields checked per component. step_per_seq_s is not checked: below the weight-read
# floor a decode step does not grow with the batch and a zero fit is right there, so a fitted
# value below the prior's is kept.
CHECKED_FIELDS: dict[str, tuple[str, ...]] = {
    "prefill": ("prefill_per_token_s",),
    "prefill_queue": ("prefill_queue_scale",),
    "decode_step": ("step_base_s", "step_per_ctx_token_s", "step_per_prefill_token_s"),
}


def _refit_prefill(windows: Sequence[Window], params: ComponentParams,
                   ) -> tuple[ComponentParams, str | None]:
    """The prefill curve refitted on per-worker window means, when they allow it."""
    rows = worker_means(windows, "prefill")
    refit = fit_prefill_curve(rows, token_scv(rows))
    if refit is None:
        return params, None
    curve, used = refit
    params = replace(params, prefill_base_s=curve[0], prefill_per_token_s=curve[1],
                     prefill_per_token2_s=curve[2])
    return params, (f"physics: prefill curve refitted on {used} per-worker window means: "
                    f"{curve[0] * 1e3:.1f} ms + {curve[1] * 1e6:.2f} us/token + "
                    f"{curve[2] * 1e9:.3f} ns/token^2")


def _restore_implausible(params: ComponentParams, base: ComponentParams,
                         report: Container[str]) -> tuple[ComponentParams, list[str]]:
    """Fitted components with an implausible checked field go back to ``base``; the list says
    which (and why)."""
    kept: list[str] = []
    for name, fields in COMPONENT_FIELDS.items():
        if name not in report:
            continue
        bad = [f for f in CHECKED_FIELDS[name]
               if not _plausible(getattr(params, f), getattr(base, f))]
        if bad:
            kept.append(f"{name} ({', '.join(bad)})")
            restore = {f: getattr(base, f) for f in fields}
            if name == "decode_step":
                restore["step_per_seq_s"] = min(params.step_per_seq_s, base.step_per_seq_s)
            params = replace(params, **restore)
    return params, kept


def plan_from_windows(windows: Sequence[Window], settings: Settings,
                      overrides: PlanOverrides | None = None) -> CapacityPlan:
    """The capacity plan for the load of ``windows`` (oldest first) and the configured SLOs.

    Raises :class:`NoDemand` when neither the windows nor ``overrides`` give the QPS, prompt
    and output lengths.
    """
    o = overrides or PlanOverrides()
    seen = observe_demand(windows)
    notes = [f"demand: {len(windows)} window(s), {seen.seconds:.0f} s of history"
             if windows else "demand: no history, from the given values only"]
    demand = _demand(windows, o, seen, notes)
    if o.params is not None:
        params, param_notes = o.params, ["physics: given"]
    else:
        params, param_notes = fitted_params(windows, o.prior)
    kv = o.kv_capacity_tokens if o.kv_capacity_tokens is not None else seen.kv_capacity_tokens
    if kv is not None and o.kv_capacity_tokens is None:
        notes.append(f"KV capacity per decode worker: {kv:.0f} tokens (estimated from "
                     "kv_cache_usage)")
    cache = _session_cache(o, seen, demand, kv, notes)
    plan = plan_capacity(
        demand, params,
        slo_ttft_s=o.ttft_slo_s if o.ttft_slo_s is not None else settings.slo.ttft_s,
        slo_tpot_s=o.tpot_slo_s if o.tpot_slo_s is not None else settings.slo.tpot_s,
        headroom=o.headroom if o.headroom is not None else settings.capacity.headroom,
        current=seen.current, observed=seen.observed if o.params is None else None,
        kv_capacity_tokens=kv, max_num_seqs=o.max_num_seqs, session_cache=cache,
    )
    head = tuple(notes + param_notes)
    return replace(
        plan,
        prefill=replace(plan.prefill, explanation=head + plan.prefill.explanation),
        decode=replace(plan.decode, explanation=head + plan.decode.explanation),
    )


def _pick(notes: list[str], name: str, given: float | None, observed: float | None,
          default: float | None) -> float:
    """The given value, else the observed one, else the default (noting which); raises
    :class:`NoDemand` when there is none."""
    if given is not None:
        notes.append(f"{name}: {given:g} (given)")
        return given
    if observed is not None:
        return observed
    if default is not None:
        notes.append(f"{name}: {default:g} (not observed; assumed)")
        return default
    flag = name.replace("_", "-")
    raise NoDemand(f"no {name} to plan for: no window shows it; give it explicitly "
                   f"(pdctl plan --{flag})")


def _demand(windows: Sequence[Window], o: PlanOverrides, seen: ObservedDemand,
            notes: list[str]) -> CapacityDemand:
    """The demand to plan for: each figure given, else observed, else assumed (noted)."""
    qps = _pick(notes, "qps", o.qps, seen.qps, None)
    prompt = _pick(notes, "input_tokens", o.input_tokens, seen.input_tokens, None)
    output = _pick(notes, "output_tokens", o.output_tokens, seen.output_tokens, None)
    share = _pick(notes, "decode_local_share", o.decode_local_share, seen.decode_local_share,
                  0.0)
    cached = _pick(notes, "cached_fraction", o.cached_fraction, seen.cached_fraction, 0.0)
    append = _pick(notes, "local_append_tokens", o.local_append_tokens,
                   seen.local_append_tokens, prompt * (1.0 - cached))
    spreads: dict[str, float] = {}
    derived = {"prefill_scv": token_scv(worker_means(windows, "prefill")),
               "input_scv": token_scv(worker_means(windows, "decode")), "append_scv": None}
    for name, given in (("prefill_scv", o.prefill_scv), ("input_scv", o.input_scv),
                        ("append_scv", o.append_scv)):
        if given is not None:
            spreads[name] = given
            notes.append(f"{name}: {given:g} (given)")
        elif (seen_scv := derived[name]) is not None:
            spreads[name] = seen_scv
            notes.append(f"{name}: {seen_scv:.3g} (from the spread of per-worker window means)")
        else:
            notes.append(f"{name}: 1 (not observed; assumed)")
    if o.rate_profile is not None:
        notes.append(f"rate profile: given, {len(o.rate_profile)} entries of "
                     f"{o.profile_window_s or seen.profile_window_s:g} s")
    return CapacityDemand(qps=qps, input_tokens=prompt, cached_fraction=cached,
                          output_tokens=output, decode_local_share=share,
                          local_append_tokens=append, rate_profile=o.rate_profile
                          if o.rate_profile is not None else seen.rate_profile,
                          profile_window_s=o.profile_window_s or seen.profile_window_s,
                          **spreads)


def _session_cache(o: PlanOverrides, seen: ObservedDemand, demand: CapacityDemand,
                   kv: float | None, notes: list[str]) -> SessionCache | None:
    """The decode pool's session KV feedback, when asked for and the windows allow it."""
    if not o.session_feedback:
        notes.append("session KV feedback: off (the observed shares at every shape)")
        return None
    if kv is None or seen.current is None or seen.decode_cached_fraction is None \
            or seen.decode_kv_usage is None or not seen.current[1]:
        notes.append("session KV feedback: not modelled (the windows lack the decode pool's "
                     "KV size, usage or shape)")
        return None
    if o.session_gap_s is not None and (not math.isfinite(o.session_gap_s)
                                        or o.session_gap_s < 0):
        raise CapacityError(f"session_gap_s: must be a finite number >= 0, got "
                            f"{o.session_gap_s!r}")
    qps, context = demand.qps, demand.input_tokens + demand.output_tokens
    work = None if o.session_gap_s is None else qps * context * o.session_gap_s
    if work is not None:
        notes.append(f"session KV working set: {work:.4g} tokens = {qps:.3g} req/s x "
                     f"{context:.0f} context tokens x {o.session_gap_s:g} s "
                     "between turns (given)")
    return SessionCache(
        observed_decode_workers=seen.current[1], kv_capacity_tokens=kv,
        observed_running_tokens=seen.decode_kv_usage * kv,
        decode_cached_fraction=min(seen.decode_cached_fraction, demand.cached_fraction),
        working_set_tokens=work)
