"""SLO-aware P:D capacity planning: how many prefill and decode workers a load needs.

Pure: values in, a :class:`CapacityPlan` out. The physics are the fitted
:class:`~controller.core.latency_model.ComponentParams` the latency model uses; this module only
turns them around (load -> latency becomes SLO -> largest load per worker).

**Prefill.** Requests the policy sends to a prefill node compute their uncached prompt
tokens (``L``) on top of ``C`` cached ones; one request's service time is
``base + a L + a2 (L^2 + 2 L C)`` (the quadratic term is causal attention, which also reads the
cached prefix). Each prefill worker is an M/G/1 queue (the same Pollaczek-Khinchine wait the
latency model uses, times its fitted ``prefill_queue_scale``), with gamma-distributed service
of squared coefficient of variation ``prefill_scv``. The p99 of TTFT needs the *tail* of the
wait, not its mean: the standard M/G/1 approximation ``P(W > t) = rho exp(-rho t / E[W])``
convolved with the service distribution gives p99(wait + service); KV transfer and the first
decode step are added on top. The largest arrival rate per worker whose p99 TTFT stays within
the SLO (and whose utilisation stays below ``MAX_PREFILL_UTILISATION``) is its capacity.

**Decode.** A decode step takes ``T = base + u B + c P_step`` (``u`` = per-sequence plus
per-context-token cost at the mean resident context, ``c`` per prefill token computed in the
step, ``P_step`` = tokens of decode-local appends and P/D last-position recomputes that land in
the step). With Little's law (``B = x T`` at ``x`` generated tokens/s per worker) the step time
has the closed form ``T = base / (1 - u x - c p)`` with ``p`` the prefill tokens/s per worker
(latency_model's form). A request's TPOT is the mean of its steps, so appends that land in its
lifetime raise it: the p99 adds ``z99`` standard deviations of that compound-Poisson extra
work, spread over the request's output tokens. Capacity per worker is the largest ``x``
within the TPOT SLO, within the KV cache (``B (prompt + output / 2) <= kv_capacity_tokens``)
and within ``max_num_seqs``; the first to bind names the constraint.

**Workers** = ``ceil(demand (1 + headroom) / capacity)``, at least 1 per role.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from controller.core.latency_model import ComponentParams

ROLES = ("prefill", "decode")
MAX_PREFILL_UTILISATION = 0.9  # beyond this an M/G/1 tail model is no longer trustworthy
UNREACHABLE_SLACK = 1.1  # plan for p99 within 10% of the unloaded floor when the SLO is below it
Z99 = 2.326  # standard normal 0.99 quantile
_QUANTILE = 0.99
_BISECT_STEPS = 40


class CapacityError(ValueError):
    """The inputs cannot describe a load (negative rates, shares outside [0, 1], ...)."""


@dataclass(frozen=True, slots=True)
class CapacityDemand:
    """The load to plan for (whole cluster)."""

    qps: float  # requests/s, all turns
    input_tokens: float  # mean prompt tokens per request (full prompt)
    cached_fraction: float  # share of prompt tokens served from prefix cache / held KV
    output_tokens: float  # mean generated tokens per request
    decode_local_share: float  # share of requests whose (append-)prefill runs on decode workers
    local_append_tokens: float  # mean tokens those decode-local requests compute on decode
    prefill_scv: float = 1.0  # squared coeff. of variation of prefill-node computed tokens
    append_scv: float = 1.0  # same, of the decode-local appends

    def __post_init__(self) -> None:
        for name in ("qps", "input_tokens", "output_tokens", "local_append_tokens",
                     "prefill_scv", "append_scv"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise CapacityError(f"{name}: must be a finite number >= 0, got {v!r}")
        for name in ("cached_fraction", "decode_local_share"):
            v = getattr(self, name)
            if not math.isfinite(v) or not 0.0 <= v <= 1.0:
                raise CapacityError(f"{name}: must be within [0, 1], got {v!r}")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.qps * self.output_tokens

    @property
    def prefill_rate(self) -> float:
        """Requests/s that a prefill node computes."""
        return self.qps * (1.0 - self.decode_local_share)

    @property
    def prefill_node_tokens(self) -> float:
        """Mean uncached tokens one prefill-node request computes: all uncached prompt tokens
        minus what decode-local requests compute on the decode side."""
        share_p = 1.0 - self.decode_local_share
        if share_p <= 0:
            return 0.0
        uncached = self.input_tokens * (1.0 - self.cached_fraction)
        local = self.decode_local_share * self.local_append_tokens
        return max(uncached - local, 0.0) / share_p

    @property
    def decode_prefill_tokens_per_s(self) -> float:
        """Prefill tokens/s decode workers compute: local appends, plus the last prompt
        position a P/D decode worker recomputes."""
        return self.qps * (self.decode_local_share * self.local_append_tokens
                           + (1.0 - self.decode_local_share))


@dataclass(frozen=True, slots=True)
class ObservedRange:
    """The largest per-worker loads the fitted models have seen (beyond: extrapolation)."""

    prefill_rate_per_worker: float  # req/s computed on one prefill worker
    decode_tokens_per_worker: float  # generated tokens/s on one decode worker


@dataclass(frozen=True, slots=True)
class RoleRecommendation:
    role: str  # "prefill" | "decode"
    workers: int  # recommended count (>= 1)
    current_workers: int | None
    per_worker_capacity: float  # largest sustainable load per worker within the SLO
    capacity_unit: str  # "req/s" (prefill) or "tokens/s" (decode)
    demand: float  # same unit, whole cluster
    utilisation: float  # demand / (workers * per_worker_capacity)
    binding: str  # "p99 TTFT", "p99 TPOT", "KV cache", "max_num_seqs", "compute saturation"
    predicted_p99_s: float  # predicted p99 TTFT (prefill) / TPOT (decode) at the recommendation
    extrapolated: bool  # model used beyond the observed load range
    explanation: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["explanation"] = list(self.explanation)
        return {k: _json_safe(v) for k, v in d.items()}


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    prefill: RoleRecommendation
    decode: RoleRecommendation
    demand: CapacityDemand
    slo_ttft_s: float
    slo_tpot_s: float
    headroom: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe (non-finite numbers become None); also what the store keeps."""
        return {
            "prefill": self.prefill.to_dict(),
            "decode": self.decode.to_dict(),
            "demand": {k: _json_safe(v) for k, v in asdict(self.demand).items()},
            "slo_ttft_s": self.slo_ttft_s,
            "slo_tpot_s": self.slo_tpot_s,
            "headroom": self.headroom,
        }


def _json_safe(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


# ---------------------------------------------------------------------------------------------
# Prefill


def prefill_service_s(p: ComponentParams, tokens: float, cached: float) -> float:
    """One request's prefill time computing ``tokens`` on top of ``cached`` held ones."""
    return (p.prefill_base_s + p.prefill_per_token_s * tokens
            + p.prefill_per_token2_s * (tokens * tokens + 2.0 * tokens * cached))


def transfer_s(p: ComponentParams, prompt_tokens: float) -> float:
    """KV transfer of a whole prompt, unloaded link."""
    return p.xfer_setup_s + p.xfer_per_byte_s * p.kv_bytes_per_token * prompt_tokens


_GRID = 1024  # quantile points of the token law, and points of the time grid


def token_quantiles(mean: float, scv: float, n: int = _GRID) -> np.ndarray:
    """``n`` equally likely values (mid-quantiles) of a gamma law of tokens with this mean
    and squared coefficient of variation (``scv = 0``: every request has the mean)."""
    if mean <= 0:
        return np.zeros(n)
    if scv <= 1e-6:
        return np.full(n, mean)
    from scipy import stats

    u = (np.arange(n) + 0.5) / n
    values = np.asarray(stats.gamma.ppf(u, 1.0 / scv, scale=mean * scv), dtype=np.float64)
    out: np.ndarray = values * (mean / values.mean())  # exact mean on the grid
    return out


def sojourn_quantile(rho: float, mean_wait: float, own: np.ndarray, q: float = _QUANTILE,
                     ) -> float:
    """Quantile ``q`` of queueing wait + a request's own time (equally likely values ``own``).

    Wait of an M/G/1 queue (the standard tail approximation): an atom ``1 - rho`` at zero and
    an exponential tail of mean ``E[W] / rho``, i.e. ``P(W > t) = rho exp(-rho t / E[W])``.
    """
    own = np.sort(own)
    if rho <= 0 or mean_wait <= 0:
        return float(np.quantile(own, q))
    theta = mean_wait / rho
    hi = float(own[-1]) + 12.0 * theta
    t = np.linspace(0.0, hi, _GRID)
    dt = t[1] - t[0]
    surv_own = 1.0 - np.searchsorted(own, t, side="right") / own.size
    # P(E + X > t) = P(X > t) + sum_{x <= t} P(X = x) exp(-(t - x) / theta)
    from scipy.signal import fftconvolve

    mass = np.bincount(np.minimum((own / dt).astype(np.int64), _GRID - 1),
                       minlength=_GRID) / own.size
    conv = fftconvolve(mass, np.exp(-t / theta))[:_GRID]
    total = (1.0 - rho) * surv_own + rho * np.minimum(surv_own + conv, 1.0)
    idx = int(np.searchsorted(-total, -(1.0 - q)))
    return float(t[min(idx, _GRID - 1)])


@dataclass(frozen=True, slots=True)
class PrefillState:
    rate_per_worker: float
    utilisation: float
    mean_service_s: float
    mean_wait_s: float
    p99_ttft_s: float


def _prefill_laws(p: ComponentParams, demand: CapacityDemand) -> tuple[np.ndarray, np.ndarray]:
    """Equally likely (service time, TTFT without queueing) of prefill-node requests."""
    tokens = token_quantiles(demand.prefill_node_tokens, demand.prefill_scv)
    cached = max(demand.input_tokens - demand.prefill_node_tokens, 0.0)
    service = (p.prefill_base_s + p.prefill_per_token_s * tokens
               + p.prefill_per_token2_s * (tokens * tokens + 2.0 * tokens * cached))
    own = service + p.xfer_setup_s + p.xfer_per_byte_s * p.kv_bytes_per_token * (tokens + cached)
    return service, own


def prefill_quantile(demand: CapacityDemand) -> float:
    """The quantile of prefill-node TTFT that is the p99 of all requests: decode-local
    requests (fast first tokens) fill the rest of the top percent."""
    share_p = max(1.0 - demand.decode_local_share, 1e-3)
    return max(0.9, 1.0 - (1.0 - _QUANTILE) / share_p)


def prefill_state(p: ComponentParams, demand: CapacityDemand, rate_per_worker: float,
                  decode_step_s: float, laws: tuple[np.ndarray, np.ndarray] | None = None,
                  ) -> PrefillState:
    """p99 TTFT of prefill-node requests when one prefill worker sees ``rate_per_worker``."""
    service, own = laws if laws is not None else _prefill_laws(p, demand)
    mean_s = float(service.mean())
    second = float((service * service).mean())
    rho = rate_per_worker * mean_s
    if rho >= 1.0:
        return PrefillState(rate_per_worker, rho, mean_s, math.inf, math.inf)
    # Pollaczek-Khinchine, scaled as the latency model fitted it
    wait = p.prefill_queue_scale * rate_per_worker * second / (2.0 * (1.0 - rho))
    # after the KV arrives the decode worker emits the first token in its next step (on
    # average half a step to join one, plus the step itself)
    body = sojourn_quantile(rho, wait, own + 1.5 * decode_step_s, prefill_quantile(demand))
    return PrefillState(rate_per_worker, rho, mean_s, wait, body)


def _largest(ok: Any, hi: float) -> float:
    """Largest x in [0, hi] with ok(x) (ok monotone: true then false)."""
    lo = 0.0
    if ok(hi):
        return hi
    for _ in range(_BISECT_STEPS):
        mid = 0.5 * (lo + hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _ceil_workers(demand: float, capacity: float, headroom: float) -> int:
    if demand <= 0:
        return 1
    if capacity <= 0:
        return 1
    return max(1, math.ceil(demand * (1.0 + headroom) / capacity - 1e-9))


def _plan_prefill(p: ComponentParams, demand: CapacityDemand, slo_ttft_s: float,
                  headroom: float, current: int | None, observed: ObservedRange | None,
                  decode_step_s: float) -> RoleRecommendation:
    rate = demand.prefill_rate
    tokens = demand.prefill_node_tokens
    laws = _prefill_laws(p, demand)
    mean_s = float(laws[0].mean())
    lines = [
        f"prefill-node requests: {rate:.3g} req/s ({1 - demand.decode_local_share:.0%} of "
        f"{demand.qps:.3g} req/s), {tokens:.0f} uncached tokens each "
        f"({demand.cached_fraction:.0%} of prompt tokens cached, decode-local computes "
        f"{demand.local_append_tokens:.0f} tokens on {demand.decode_local_share:.0%} of requests)",
        f"service {mean_s * 1e3:.1f} ms/request => at most {1 / mean_s:.3g} req/s per worker "
        "when saturated",
    ]
    saturation = MAX_PREFILL_UTILISATION / mean_s
    zero = prefill_state(p, demand, 0.0, decode_step_s, laws).p99_ttft_s
    # An SLO below the unloaded p99 cannot be met by any count: plan for a p99 close to that
    # floor instead (a tighter SLO never asks for fewer workers than a looser one).
    target = max(slo_ttft_s, UNREACHABLE_SLACK * zero)
    if zero > slo_ttft_s:
        lines.append(f"p99 TTFT is {zero:.3g} s even with no queueing, above the "
                     f"{slo_ttft_s:g} s SLO: no prefill count meets it; sized for a p99 of "
                     f"{target:.3g} s instead")
    cap = _largest(lambda x: prefill_state(p, demand, x, decode_step_s, laws).p99_ttft_s
                   <= target,
                   saturation)
    if zero > slo_ttft_s:
        binding = "p99 TTFT (unreachable)"
    elif cap >= saturation * (1 - 1e-9):
        binding = "compute saturation"
        lines.append(f"p99 TTFT stays within {slo_ttft_s:g} s up to "
                     f"{MAX_PREFILL_UTILISATION:.0%} utilisation: throughput binds")
    else:
        binding = "p99 TTFT"
        lines.append(f"p99 TTFT reaches the {slo_ttft_s:g} s SLO at {cap:.3g} req/s "
                     f"per worker ({cap * mean_s:.0%} busy; M/G/1 tail)")
    workers = _ceil_workers(rate, cap, headroom)
    at = prefill_state(p, demand, rate / workers, decode_step_s, laws)
    lines.append(f"{workers} worker(s) = ceil({rate:.3g} x {1 + headroom:g} headroom / "
                 f"{cap:.3g}); predicted p99 TTFT {at.p99_ttft_s:.3g} s at "
                 f"{at.utilisation:.0%} busy")
    extrapolated = observed is None or rate / workers > observed.prefill_rate_per_worker * 1.05
    if observed is None:
        lines.append("no observed load range: the model is not checked against measurements")
    elif extrapolated:
        lines.append(f"extrapolated: {rate / workers:.3g} req/s per worker is beyond the "
                     f"observed {observed.prefill_rate_per_worker:.3g}")
    return RoleRecommendation(
        role="prefill", workers=workers, current_workers=current, per_worker_capacity=cap,
        capacity_unit="req/s", demand=rate,
        utilisation=rate / (workers * cap) if cap > 0 else math.inf, binding=binding,
        predicted_p99_s=at.p99_ttft_s, extrapolated=extrapolated, explanation=tuple(lines),
    )


# ---------------------------------------------------------------------------------------------
# Decode


@dataclass(frozen=True, slots=True)
class DecodeState:
    tokens_per_worker: float
    step_s: float  # mean step time
    batch: float  # mean running sequences
    p99_tpot_s: float
    saturated: bool


def decode_state(p: ComponentParams, demand: CapacityDemand, tokens_per_worker: float,
                 ) -> DecodeState:
    """Step time, batch and p99 TPOT when one decode worker generates ``tokens_per_worker``."""
    x = tokens_per_worker
    d = demand.decode_tokens_per_s
    prefill_ratio = demand.decode_prefill_tokens_per_s / d if d > 0 else 0.0
    ctx = demand.input_tokens + demand.output_tokens / 2.0
    u = p.step_per_seq_s + p.step_per_ctx_token_s * ctx
    c = p.step_per_prefill_token_s
    den = 1.0 - u * x - c * prefill_ratio * x
    if den <= 0:
        return DecodeState(x, math.inf, math.inf, math.inf, True)
    step = p.step_base_s / den
    batch = x * step
    # Extra step time a request sees from appends landing during its life: compound Poisson
    # (arrivals of decode-local appends on this worker x their tokens), spread over its output.
    out = max(demand.output_tokens, 1.0)
    appends_per_s = (demand.qps * demand.decode_local_share * x / d) if d > 0 else 0.0
    life = out * step
    a = demand.local_append_tokens
    # each append lengthens the step it lands in by c x its tokens
    var = appends_per_s * life * (a * a * (1.0 + demand.append_scv)) * c * c
    p99 = step + Z99 * math.sqrt(var) / out
    return DecodeState(x, step, batch, p99, False)


def _plan_decode(p: ComponentParams, demand: CapacityDemand, slo_tpot_s: float,
                 headroom: float, current: int | None, observed: ObservedRange | None,
                 kv_capacity_tokens: float | None, max_num_seqs: int | None,
                 ) -> RoleRecommendation:
    d = demand.decode_tokens_per_s
    ctx = demand.input_tokens + demand.output_tokens / 2.0
    u = p.step_per_seq_s + p.step_per_ctx_token_s * ctx
    prefill_ratio = demand.decode_prefill_tokens_per_s / d if d > 0 else 0.0
    hi = 1.0 / (u + p.step_per_prefill_token_s * prefill_ratio)  # the pool's throughput limit
    lines = [
        f"decode: {d:.4g} generated tokens/s ({demand.qps:.3g} req/s x "
        f"{demand.output_tokens:.0f} tokens), {demand.decode_prefill_tokens_per_s:.4g} prefill "
        f"tokens/s computed on decode workers (appends + P/D last-position recomputes)",
        f"step = {p.step_base_s * 1e3:.2f} ms / (1 - {u * 1e6:.1f} us x tokens/s - "
        f"{p.step_per_prefill_token_s * 1e6:.1f} us x prefill tokens/s) at "
        f"{ctx:.0f} mean resident context tokens",
    ]
    candidates: list[tuple[float, str]] = []
    if p.step_base_s > slo_tpot_s:
        lines.append(f"p99 TPOT: the step floor {p.step_base_s * 1e3:.1f} ms is above the "
                     f"{slo_tpot_s:g} s SLO: no decode count meets it")
        candidates.append((0.98 * hi, "p99 TPOT (unreachable)"))
    else:
        tpot_cap = _largest(lambda x: decode_state(p, demand, x).p99_tpot_s <= slo_tpot_s,
                            hi * 0.999)
        candidates.append((tpot_cap, "p99 TPOT"))
    if kv_capacity_tokens is not None and kv_capacity_tokens > 0:
        max_batch_kv = kv_capacity_tokens / max(ctx, 1.0)
        kv_cap = _largest(lambda x: decode_state(p, demand, x).batch <= max_batch_kv, hi * 0.999)
        candidates.append((kv_cap, "KV cache"))
        lines.append(f"KV cache: {kv_capacity_tokens:.0f} tokens hold {max_batch_kv:.0f} "
                     f"sequences of {ctx:.0f} tokens")
    if max_num_seqs is not None and max_num_seqs > 0:
        seq_cap = _largest(lambda x: decode_state(p, demand, x).batch <= max_num_seqs,
                           hi * 0.999)
        candidates.append((seq_cap, "max_num_seqs"))
    cap, binding = min(candidates, key=lambda c: c[0])
    if binding == "p99 TPOT" and cap >= hi * 0.998:
        binding = "compute saturation"
    cap = max(cap, 1e-9)
    for value, name in sorted(candidates):
        lines.append(f"{name} limits a worker to {value:.4g} tokens/s")
    workers = _ceil_workers(d, cap, headroom)
    at = decode_state(p, demand, d / workers)
    lines.append(f"{workers} worker(s) = ceil({d:.4g} x {1 + headroom:g} headroom / "
                 f"{cap:.4g}); predicted step {at.step_s * 1e3:.1f} ms, batch {at.batch:.0f}, "
                 f"p99 TPOT {at.p99_tpot_s * 1e3:.1f} ms")
    extrapolated = observed is None or d / workers > observed.decode_tokens_per_worker * 1.05
    if observed is None:
        lines.append("no observed load range: the model is not checked against measurements")
    elif extrapolated:
        lines.append(f"extrapolated: {d / workers:.4g} tokens/s per worker is beyond the "
                     f"observed {observed.decode_tokens_per_worker:.4g}")
    return RoleRecommendation(
        role="decode", workers=workers, current_workers=current, per_worker_capacity=cap,
        capacity_unit="tokens/s", demand=d, utilisation=d / (workers * cap), binding=binding,
        predicted_p99_s=at.p99_tpot_s, extrapolated=extrapolated, explanation=tuple(lines),
    )


# ---------------------------------------------------------------------------------------------


def plan_capacity(
    demand: CapacityDemand,
    params: ComponentParams,
    *,
    slo_ttft_s: float,
    slo_tpot_s: float,
    headroom: float = 0.2,
    current: tuple[int, int] | None = None,
    observed: ObservedRange | None = None,
    kv_capacity_tokens: float | None = None,
    max_num_seqs: int | None = None,
) -> CapacityPlan:
    """Workers per role for ``demand`` within both p99 SLOs, with ``headroom`` spare.

    ``current`` is the (prefill, decode) shape running now (reported next to the
    recommendation); ``observed`` the per-worker load range the params were fitted on;
    ``kv_capacity_tokens`` and ``max_num_seqs`` are per decode worker (None: not a limit).
    """
    for name, v in (("slo_ttft_s", slo_ttft_s), ("slo_tpot_s", slo_tpot_s)):
        if not math.isfinite(v) or v <= 0:
            raise CapacityError(f"{name}: must be > 0, got {v!r}")
    if not math.isfinite(headroom) or headroom < 0:
        raise CapacityError(f"headroom: must be >= 0, got {headroom!r}")
    decode = _plan_decode(params, demand, slo_tpot_s, headroom,
                          current[1] if current else None, observed, kv_capacity_tokens,
                          max_num_seqs)
    step = decode_state(params, demand, demand.decode_tokens_per_s / decode.workers).step_s
    if not math.isfinite(step):
        step = params.step_base_s
    prefill = _plan_prefill(params, demand, slo_ttft_s, headroom,
                            current[0] if current else None, observed, step)
    return CapacityPlan(prefill=prefill, decode=decode, demand=demand, slo_ttft_s=slo_ttft_s,
                        slo_tpot_s=slo_tpot_s, headroom=headroom)
