"""SLO-aware P:D capacity planning: how many prefill and decode workers a load needs.

Pure: values in, a :class:`CapacityPlan` out. The physics are the fitted
:class:`~controller.core.latency_model.ComponentParams` the latency model uses; this module only
turns them around (load -> latency becomes SLO -> largest load per worker).

**Load that varies.** ``CapacityDemand.rate_profile`` holds each observed window's arrival
rate over the mean. The SLO is a p99 over *all* requests, so every latency below is computed
per rate level and mixed by the share of requests each level carries (prefill: over the
profile in its order); a steady load is the one-level profile ``(1.0,)``. A profile may be
finer than the windows (a gateway's arrival log, ``profile_window_s`` = 1 s): decode sees it
averaged over a request's stay (its output tokens at the TPOT SLO), since a burst shorter than
that does not fill a decode batch.

**Prefill.** Requests the policy sends to a prefill node compute their uncached prompt
tokens ``L`` on top of ``C`` cached ones: ``S = base + a L + a2 (L^2 + 2 L C)`` (the quadratic
term is causal attention, which also reads the cached prefix). ``L`` follows a gamma law with
the observed mean and squared CV ``prefill_scv`` (kept as 1,024 equally likely values), so the
service law follows from the fitted curve. Routers send a prefill request to the worker with
the least pending prefill work, so the pool is one M/G/c FCFS queue (a request waits for the
first worker to free up, not behind whatever one worker drew): its waits are simulated
(Kiefer-Wolfowitz recursion, ``POOL_SAMPLES`` requests, a fixed seed and common random numbers,
so the result is deterministic and grows with the rate) with Poisson arrivals whose rate follows
the profile window by window *in its observed order* (a busy window leaves its backlog to the
next), each wait stretched by the latency model's fitted ``prefill_queue_scale`` and added to
the request's own time (prefill + KV transfer + the first decode step). The p99 of the pool is
not a function of the load per worker alone (a pool of 3 absorbs a long prompt better than one
worker), so the count is searched: the fewest workers whose p99 TTFT at the demand (with
headroom) is within the SLO, from the throughput bound (``MAX_PREFILL_UTILISATION``) up. The
quantile is the one of prefill-node requests that makes the p99 of all requests (decode-local
first tokens are fast). (The first versions modelled each worker as its own M/G/1 queue, with
an exponential tail and then the exact Benes law; :func:`sojourn_quantile` keeps the latter as
a check of the simulation at one worker.)

**Decode.** A decode step takes ``T = base + u B + c P_step`` (``u`` = per-sequence plus
per-context-token cost at the mean resident context, ``c`` per prefill token computed in the
step, ``P_step`` = tokens of decode-local appends and P/D last-position recomputes that land in
the step). With Little's law (``B = x T`` at ``x`` generated tokens/s per worker) the step time
has the closed form ``T = base / (1 - u x - c p)`` with ``p`` the prefill tokens/s per worker
(latency_model's form). A request's TPOT is the mean of its steps, so appends that land in its
lifetime raise it: each level adds a normal spread for that compound-Poisson extra work,
spread over the request's output tokens. Capacity per worker is the largest ``x`` within the
TPOT SLO, within the KV cache (the p99 of the resident tokens of ``B`` sequences, prompt
lengths varying with ``input_scv``, at the p99 request's rate level) and within
``max_num_seqs``; the first to bind names the constraint.

**The shape feedback.** A later turn runs decode-local (and its prefix counts as cached) only
while its session's KV is still held on its decode worker, and idle session KV is evicted LRU.
With a :class:`SessionCache` (what the observed decode pool held), the plan scales the
decode-local share and the decode-held cached share with the fraction of the sessions' working
set a candidate decode count keeps (working-set approximation: hits proportional to the idle
KV, relative to the observed shape, never above it); the turns that lose it compute their
prompt on a prefill worker, less what the prefill workers' own prefix caches hold of it
(routers dispatch to the worker with the least pending work net of its hit). The decode count
and the shares are a fixed point (at most ``MAX_SHAPE_ROUNDS`` rounds), then the prefill count
is searched with the demand each candidate count sees.

**Workers** = ``ceil(demand (1 + headroom) / capacity)`` for decode (capacity per worker does
not depend on the count there), the searched count for prefill; at least 1 per role. A p99 TTFT SLO
below the unloaded p99 cannot be met by any count: the plan says so and sizes for a p99 10%
above that floor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, NoReturn

import numpy as np

from controller.core.latency_model import ComponentParams

ROLES = ("prefill", "decode")
MAX_PREFILL_UTILISATION = 0.9  # mean utilisation the prefill pool is planned up to (throughput)
MAX_HEADROOM = 10.0  # 1000 % spare: beyond it the input is a mistake, not a plan
UNREACHABLE_SLACK = 1.1  # plan for p99 within 10% of the unloaded floor when the SLO is below it
Z99 = 2.326  # standard normal 0.99 quantile
_QUANTILE = 0.99
MAX_RATE_LEVELS = 24  # rate levels a decode load is evaluated at
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
    input_scv: float = 1.0  # same, of whole prompts (the KV a decoding request holds)
    # Arrival rate of each observed window (equal lengths) over the mean: the load varies and
    # the p99 is over all requests, the busy windows' included. (1.0,): a steady rate.
    rate_profile: tuple[float, ...] = (1.0,)
    profile_window_s: float = 30.0  # length of each window of the profile

    def __post_init__(self) -> None:
        if not math.isfinite(self.profile_window_s) or self.profile_window_s <= 0:
            raise CapacityError(f"profile_window_s: must be > 0, got {self.profile_window_s!r}")
        prof = self.rate_profile
        if not prof or any(not math.isfinite(f) or f < 0 for f in prof) or sum(prof) <= 0:
            raise CapacityError(f"rate_profile: needs finite factors >= 0 with a positive "
                                f"sum, got {prof!r}")
        for name in ("qps", "input_tokens", "output_tokens", "local_append_tokens",
                     "prefill_scv", "append_scv", "input_scv"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise CapacityError(f"{name}: must be a finite number >= 0, got {v!r}")
        for name in ("cached_fraction", "decode_local_share"):
            v = getattr(self, name)
            if not math.isfinite(v) or not 0.0 <= v <= 1.0:
                raise CapacityError(f"{name}: must be within [0, 1], got {v!r}")

    def rate_levels(self) -> tuple[np.ndarray, np.ndarray]:
        """(rate factor, share of requests) per level, at most ``MAX_RATE_LEVELS`` levels
        (windows of similar rate merged, the busiest kept apart); factors average 1 over time."""
        f = np.sort(np.asarray(self.rate_profile, dtype=np.float64))
        f = f / f.mean()
        if f.size > MAX_RATE_LEVELS:
            # the busiest windows each keep their own level: they decide the p99
            keep = MAX_RATE_LEVELS // 2
            groups = np.array_split(f[:-keep], MAX_RATE_LEVELS - keep)
            lows = [(float(g.mean()), float(g.sum())) for g in groups if g.size]
            levels = lows + [(float(v), float(v)) for v in f[-keep:]]
        else:
            levels = [(float(v), float(v)) for v in f]
        factors = np.array([lv[0] for lv in levels])
        weights = np.array([lv[1] for lv in levels])
        return factors, weights / weights.sum()

    def smoothed(self, seconds: float) -> CapacityDemand:
        """This demand with its rate profile averaged over ``seconds`` (a moving average):
        what a role whose requests stay ``seconds`` sees (a decode worker holds a request for
        its whole output, so a one-second burst does not fill its batch)."""
        k = int(seconds // self.profile_window_s)
        if k <= 1 or len(self.rate_profile) < 2:
            return self
        f = np.asarray(self.rate_profile, dtype=np.float64)
        if k >= f.size:
            return replace(self, rate_profile=(1.0,))
        avg = np.convolve(f, np.ones(k) / k, mode="valid")
        return replace(self, rate_profile=tuple(float(v) for v in avg))

    def peak_factor(self, quantile: float = 0.99) -> float:
        """The rate factor the ``quantile`` request sees (request-weighted)."""
        factors, weights = self.rate_levels()
        above = np.cumsum(weights[::-1])[::-1]  # share of requests at this level or busier
        ok = np.flatnonzero(above >= 1.0 - quantile)
        return float(factors[ok[-1]]) if ok.size else float(factors[-1])

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
    # the demand at the recommended decode count (its session KV feedback on the decode-local
    # and cached shares); None: not modelled (no SessionCache given)
    demand_at_shape: CapacityDemand | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe (non-finite numbers become None); also what the store keeps."""
        shaped = self.demand_at_shape
        return {
            "prefill": self.prefill.to_dict(),
            "decode": self.decode.to_dict(),
            "demand": {k: _json_safe(v) for k, v in asdict(self.demand).items()},
            "demand_at_shape": None if shaped is None else {
                k: _json_safe(v) for k, v in asdict(shaped).items() if k != "rate_profile"},
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


def _grid_pmf(values: np.ndarray, dt: float, n: int) -> np.ndarray:
    """Equally likely ``values`` as probability mass on the grid ``k dt`` (last cell: beyond)."""
    idx = np.minimum((values / dt).astype(np.int64), n - 1)
    out: np.ndarray = np.bincount(idx, minlength=n) / values.size
    return out


def mg1_wait_pmf(rho: float, service: np.ndarray, dt: float, n: int) -> np.ndarray:
    """Queueing wait of an M/G/1 FCFS queue as mass on the grid ``k dt`` (exact in law).

    Pollaczek-Khinchine (Benes) form: the wait is a geometric number ``N`` of residual service
    times, ``P(N = k) = (1 - rho) rho^k``, a residual having density ``P(S > x) / E[S]``; its
    transform is ``(1 - rho) / (1 - rho R(s))``, evaluated with FFTs over a doubled grid. Unlike
    an exponential tail fitted to ``E[W]``, it keeps the shape of the service law: with
    heavy-tailed prompts most requests wait little and a few wait behind a very long one.
    """
    wait = np.zeros(n)
    wait[0] = 1.0
    if rho <= 0 or service.size == 0 or service.mean() <= 0:
        return wait
    x = np.arange(n) * dt
    surv = 1.0 - np.searchsorted(np.sort(service), x, side="right") / service.size
    residual = surv / service.mean() * dt
    total = residual.sum()
    if total <= 0:
        return wait
    residual = residual / total
    m = 2 * n
    r_hat = np.fft.rfft(residual, m)
    w_hat = (1.0 - rho) / (1.0 - rho * r_hat)
    out = np.fft.irfft(w_hat, m)[:n]
    out = np.clip(out, 0.0, None)
    mass = float(out.sum())
    return out / mass if mass > 0 else wait


def sojourn_survival(rho: float, service: np.ndarray, own: np.ndarray, t: np.ndarray,
                     wait_scale: float = 1.0) -> np.ndarray:
    """``P(wait + own time > t)`` on the even grid ``t`` of an M/G/1 FCFS queue at ``rho`` with
    service law ``service`` (equally likely values; the wait stretched by ``wait_scale``, the
    latency model's fitted queue scale) and the request's own time law ``own``."""
    surv_own = 1.0 - np.searchsorted(np.sort(own), t, side="right") / own.size
    if rho <= 0:
        out: np.ndarray = surv_own
        return out
    from scipy.signal import fftconvolve

    n = t.size
    dt = float(t[1] - t[0])
    wait = mg1_wait_pmf(rho, service * wait_scale, dt, n)
    sojourn = fftconvolve(wait, _grid_pmf(own, dt, n))[:n]
    out = np.clip(1.0 - np.cumsum(sojourn), 0.0, 1.0)
    return out


def quantile_of(t: np.ndarray, survival: np.ndarray, q: float) -> float:
    """Smallest grid time whose survival is at most ``1 - q`` (inf: not on the grid)."""
    idx = np.flatnonzero(survival <= 1.0 - q + 1e-12)
    return float(t[idx[0]]) if idx.size else math.inf


def sojourn_quantile(rho: float, service: np.ndarray, own: np.ndarray,
                     q: float = _QUANTILE) -> float:
    """Quantile ``q`` of M/G/1 wait + own time (see :func:`sojourn_survival`)."""
    mean_s = float(service.mean()) if service.size else 0.0
    wait = rho * float((service * service).mean()) / (2 * mean_s * (1 - rho)) \
        if 0 < rho < 1 and mean_s > 0 else 0.0
    t = np.linspace(0.0, float(np.max(own)) + 30.0 * wait + 1e-9, 4 * _GRID)
    return quantile_of(t, sojourn_survival(rho, service, own, t), q)


@dataclass(frozen=True, slots=True)
class PrefillState:
    rate_per_worker: float
    utilisation: float
    mean_service_s: float
    mean_wait_s: float
    p99_ttft_s: float
    workers: int = 1


def _prefill_laws(p: ComponentParams, demand: CapacityDemand) -> tuple[np.ndarray, np.ndarray]:
    """Equally likely (service time, TTFT without queueing) of prefill-node requests, paired
    (the same index is the same request)."""
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


POOL_SAMPLES = 30_000  # requests simulated per evaluation of the prefill pool (at least)
MAX_POOL_SAMPLES = 120_000  # ... and at most, even when one pass over the profile has more
POOL_SEED = 20_261_130  # fixed: the same draws for every load (monotone in it, reproducible)


def _pool_draws(n: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``n`` unit-rate Poisson points and request indices into a law of ``size``
    values; the same for every call (common random numbers: a higher rate only compresses
    the same arrivals, so every request's wait grows with it)."""
    points = np.cumsum(np.random.default_rng(POOL_SEED).exponential(1.0, n))
    # stratified: every value of the law equally often, in random order (the rare long
    # prompts that make the p99 are never over- or under-drawn)
    idx = np.random.default_rng(POOL_SEED + 1).permutation(np.resize(np.arange(size), n))
    return points, idx


def _arrival_times(points: np.ndarray, rate: float, profile: Sequence[float],
                   window_s: float) -> np.ndarray:
    """Times of the unit-rate ``points`` in a Poisson process whose rate is ``rate x f`` in
    successive windows of ``window_s`` (``f`` = the profile in its observed order, repeated):
    the inverse of the cumulative intensity."""
    f = np.asarray(profile, dtype=np.float64)
    f = f / f.mean()
    cum = np.concatenate([[0.0], np.cumsum(f)]) * window_s  # intensity over one cycle, rate 1
    y = points / rate
    cycle, rest = np.divmod(y, cum[-1])
    i = np.clip(np.searchsorted(cum, rest, side="right") - 1, 0, f.size - 1)
    inside = np.where(f[i] > 0, (rest - cum[i]) / np.where(f[i] > 0, f[i], 1.0), 0.0)
    out: np.ndarray = cycle * f.size * window_s + i * window_s + inside
    return out


def pool_waits(arrivals: np.ndarray, service: np.ndarray, servers: int) -> np.ndarray:
    """Queueing wait of each arrival (sorted times) at ``servers`` FCFS servers fed by
    least-pending-work dispatch: a request joins the server that frees first, so the pool is
    one M/G/c FCFS queue (the Kiefer-Wolfowitz recursion, exact for this dispatch)."""
    import heapq

    free = [0.0] * max(servers, 1)
    waits = np.empty(arrivals.size)
    for j, (t, s) in enumerate(zip(arrivals.tolist(), service.tolist(), strict=True)):
        f = free[0]
        start = f if f > t else t
        heapq.heapreplace(free, start + s)
        waits[j] = start - t
    return waits


def pool_ttft_quantile(rate: float, servers: int, service: np.ndarray, own: np.ndarray,
                       q: float, profile: Sequence[float] = (1.0,), window_s: float = 30.0,
                       wait_scale: float = 1.0, samples: int | None = None,
                       ) -> tuple[float, float]:
    """(quantile ``q``, mean wait) of wait + own time over ``samples`` requests arriving at
    ``rate`` (modulated by ``profile``) to ``servers`` prefill workers. ``service`` and
    ``own`` are paired equally likely values (a request's own time includes its service);
    the wait is stretched by ``wait_scale`` (the latency model's fitted queue scale)."""
    if rate <= 0:
        return float(np.quantile(own, q)), 0.0
    # at least one whole pass over the profile: its busiest window must be in the sample
    per_pass = rate * len(profile) * window_s
    n = int(max(samples or POOL_SAMPLES, min(1.05 * per_pass + 1, MAX_POOL_SAMPLES)))
    points, idx = _pool_draws(n, service.size)
    arrivals = _arrival_times(points, rate, profile, window_s)
    waits = pool_waits(arrivals, service[idx], servers) * wait_scale
    return float(np.quantile(waits + own[idx], q)), float(waits.mean())


def prefill_state(p: ComponentParams, demand: CapacityDemand, rate_per_worker: float,
                  decode_step_s: float, laws: tuple[np.ndarray, np.ndarray] | None = None,
                  workers: int = 1) -> PrefillState:
    """p99 TTFT of prefill-node requests when a pool of ``workers`` prefill workers sees
    ``rate_per_worker`` each on average, the rate varying as the demand's profile does (in
    its observed order: a busy window leaves its backlog to the next)."""
    service, own = laws if laws is not None else _prefill_laws(p, demand)
    mean_s = float(service.mean())
    # after the KV arrives the decode worker emits the first token in its next step (on
    # average half a step to join one, plus the step itself)
    own = own + 1.5 * decode_step_s
    p99, wait = pool_ttft_quantile(rate_per_worker * workers, workers, service, own,
                                   prefill_quantile(demand), demand.rate_profile,
                                   demand.profile_window_s, p.prefill_queue_scale)
    return PrefillState(rate_per_worker, rate_per_worker * mean_s, mean_s, wait, p99, workers)


def _largest(ok: Any, hi: float, steps: int = _BISECT_STEPS) -> float:
    """Largest x in [0, hi] with ok(x) (ok monotone: true then false)."""
    lo = 0.0
    if ok(hi):
        return hi
    for _ in range(steps):
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


MAX_WORKERS = 4096  # per role: a plan beyond it is refused (the prefill search stops here)


def _beyond_range(rate: float, workers: int) -> NoReturn:
    """``workers``: the count the pool needs at least (above ``MAX_WORKERS``), or
    ``MAX_WORKERS`` itself when the search reached it without meeting the target."""
    need = f"{workers} or more" if workers > MAX_WORKERS else f"more than {MAX_WORKERS}"
    raise CapacityError(
        f"{rate:.4g} prefill-node req/s need {need} prefill workers: beyond the planner's "
        f"range ({MAX_WORKERS} per role); plan the load in parts or check the inputs")


def _plan_prefill(p: ComponentParams, demand: CapacityDemand, slo_ttft_s: float,
                  headroom: float, current: int | None, observed: ObservedRange | None,
                  decode_step_s: float,
                  demand_for: Callable[[int], CapacityDemand] | None = None,
                  ) -> RoleRecommendation:
    """``demand_for(workers)``: the demand a pool of that many prefill workers sees (their
    prefix caches hold some of the sessions' KV); None: ``demand`` at every count."""
    rate = demand.prefill_rate
    pool = _PrefillPool(p, demand, decode_step_s, demand_for)
    mean_s = float(pool.laws[0].mean())
    lines = _prefill_demand_lines(demand, mean_s)
    zero = pool.p99(0.0, 1)
    # An SLO below the unloaded p99 cannot be met by any count: plan for a p99 close to that
    # floor instead (a tighter SLO never asks for fewer workers than a looser one).
    target = max(slo_ttft_s, UNREACHABLE_SLACK * zero)
    if zero > slo_ttft_s:
        lines.append(f"p99 TTFT is {zero:.3g} s even with no queueing, above the "
                     f"{slo_ttft_s:g} s SLO: no prefill count meets it; sized for a p99 of "
                     f"{target:.3g} s instead")
    load = rate * (1.0 + headroom)
    saturated, workers = _prefill_count(pool, rate, load, mean_s, target)
    final, final_laws = pool.at_count(workers)
    if final is not demand:
        mean_s = float(final_laws[0].mean())
        lines.append(f"at {workers} prefill worker(s) their prefix caches hold some of the "
                     f"sessions' KV: {final.cached_fraction:.1%} of prompt tokens cached, "
                     f"{final.prefill_node_tokens:.0f} uncached tokens per prefill-node "
                     f"request, service {mean_s * 1e3:.1f} ms")
    saturation = MAX_PREFILL_UTILISATION / mean_s
    # largest rate per worker this pool carries within the target (the recommendation's
    # capacity): at least the planned load, which the search found within the target
    floor = load / workers
    # each step simulates the pool: 1/65,000 of saturation is precise enough
    cap = _largest(lambda x: x <= floor or pool.p99(x, workers) <= target, saturation, 16)
    if zero > slo_ttft_s:
        binding = "p99 TTFT (unreachable)"
    elif workers == saturated and cap >= saturation * (1 - 1e-9):
        binding = "compute saturation"
        lines.append(f"p99 TTFT stays within {slo_ttft_s:g} s up to "
                     f"{MAX_PREFILL_UTILISATION:.0%} utilisation: throughput binds")
    else:
        binding = "p99 TTFT"
        lines.append(f"p99 TTFT reaches the {slo_ttft_s:g} s SLO at {cap:.3g} req/s per "
                     f"worker with {workers} worker(s) ({cap * mean_s:.0%} busy; one FCFS "
                     "queue for the pool, simulated over the rate profile)")
    cap = max(cap, 1e-12)
    at = prefill_state(p, final, rate / workers, decode_step_s, final_laws, workers)
    lines += _prefill_outcome_lines(pool, workers, rate, headroom, target, at, observed)
    return RoleRecommendation(
        role="prefill", workers=workers, current_workers=current, per_worker_capacity=cap,
        capacity_unit="req/s", demand=rate,
        utilisation=rate / (workers * cap), binding=binding,
        predicted_p99_s=at.p99_ttft_s, extrapolated=_prefill_extrapolated(rate / workers,
                                                                          observed),
        explanation=tuple(lines),
    )


class _PrefillPool:
    """A prefill pool's service laws by worker count, memoised: with ``demand_for``, more
    workers hold more session KV (fewer uncached tokens each)."""

    def __init__(self, p: ComponentParams, demand: CapacityDemand, decode_step_s: float,
                 demand_for: Callable[[int], CapacityDemand] | None) -> None:
        self.p, self.demand, self.decode_step_s = p, demand, decode_step_s
        self.demand_for = demand_for
        self.laws = _prefill_laws(p, demand)
        self.by_count: dict[int, tuple[CapacityDemand, tuple[np.ndarray, np.ndarray]]] = {}

    def at_count(self, workers: int) -> tuple[CapacityDemand, tuple[np.ndarray, np.ndarray]]:
        if self.demand_for is None:
            return self.demand, self.laws
        if workers not in self.by_count:
            dem = self.demand_for(workers)
            self.by_count[workers] = (dem, _prefill_laws(self.p, dem))
        return self.by_count[workers]

    def p99(self, x: float, workers: int) -> float:
        """p99 TTFT at ``x`` req/s per worker with ``workers`` workers."""
        dem, dem_laws = self.at_count(workers)
        return prefill_state(self.p, dem, x, self.decode_step_s, dem_laws, workers).p99_ttft_s

    def saturated_at(self, workers: int, load: float) -> bool:
        """The count's mean service time beyond the throughput bound at ``load``."""
        return load * float(self.at_count(workers)[1][0].mean()) > \
            workers * MAX_PREFILL_UTILISATION * (1 + 1e-9)


def _prefill_count(pool: _PrefillPool, rate: float, load: float, mean_s: float,
                   target: float) -> tuple[int, int]:
    """(the throughput bound's count, the fewest workers whose p99 TTFT meets ``target``).

    The pool is one queue (least-pending-work dispatch): its p99 depends on the count, not
    only on the load per worker, so the count is searched, from the throughput bound up."""
    saturated = max(1, math.ceil(load * mean_s / MAX_PREFILL_UTILISATION - 1e-9))
    if saturated > MAX_WORKERS:  # before simulating a pool that size
        _beyond_range(rate, saturated)
    # more workers may hold more session KV (fewer tokens each): a smaller count can be the
    # throughput bound then
    while saturated > 1 and not pool.saturated_at(saturated - 1, load):
        saturated -= 1
    while saturated < MAX_WORKERS and pool.saturated_at(saturated, load):
        saturated += 1
    workers = saturated
    if load > 0:
        while workers < MAX_WORKERS and pool.p99(load / workers, workers) > target:
            workers += 1
    if pool.saturated_at(workers, load) or (load > 0 and pool.p99(load / workers, workers)
                                            > target):
        _beyond_range(rate, workers)  # the searches stopped at MAX_WORKERS
    return saturated, workers


def _prefill_demand_lines(demand: CapacityDemand, mean_s: float) -> list[str]:
    rate, tokens = demand.prefill_rate, demand.prefill_node_tokens
    factors, _ = demand.rate_levels()
    lines = [
        f"prefill-node requests: {rate:.3g} req/s ({1 - demand.decode_local_share:.0%} of "
        f"{demand.qps:.3g} req/s), {tokens:.0f} uncached tokens each "
        f"({demand.cached_fraction:.0%} of prompt tokens cached, decode-local computes "
        f"{demand.local_append_tokens:.0f} tokens on {demand.decode_local_share:.0%} of requests)",
        f"service {mean_s * 1e3:.1f} ms/request => at most {1 / mean_s:.3g} req/s per worker "
        "when saturated",
    ]
    if factors.size > 1:
        lines.append(f"arrival rate varies: windows of {demand.profile_window_s:g} s from "
                     f"{factors[0]:.2g}x to {factors[-1]:.2g}x the mean, in their observed "
                     "order; the p99 is over the requests of all of them")
    return lines


def _prefill_outcome_lines(pool: _PrefillPool, workers: int, rate: float, headroom: float,
                           target: float, at: PrefillState,
                           observed: ObservedRange | None) -> list[str]:
    lines = [f"{workers} worker(s): the fewest whose p99 TTFT at {rate:.3g} x "
             f"{1 + headroom:g} headroom req/s is within {target:.3g} s; predicted p99 "
             f"TTFT {at.p99_ttft_s:.3g} s at {at.utilisation:.0%} busy"]
    if workers > 1:
        fewer = pool.p99(rate / (workers - 1), workers - 1)
        lines.append(f"with {workers - 1} at the demand itself ({rate:.3g} req/s): "
                     f"predicted p99 TTFT {fewer:.3g} s")
    if observed is None:
        lines.append("no observed load range: the model is not checked against measurements")
    elif _prefill_extrapolated(rate / workers, observed):
        lines.append(f"extrapolated: {rate / workers:.3g} req/s per worker is beyond the "
                     f"observed {observed.prefill_rate_per_worker:.3g}")
    return lines


def _prefill_extrapolated(per_worker: float, observed: ObservedRange | None) -> bool:
    return observed is None or per_worker > observed.prefill_rate_per_worker * 1.05


# ---------------------------------------------------------------------------------------------
# Decode


@dataclass(frozen=True, slots=True)
class DecodeState:
    tokens_per_worker: float
    step_s: float  # mean step time
    batch: float  # mean running sequences
    p99_tpot_s: float
    saturated: bool


def _decode_level(p: ComponentParams, demand: CapacityDemand, x: float,
                  ) -> tuple[float, float, float]:
    """(mean step, batch, sd of one request's TPOT) at ``x`` generated tokens/s per worker."""
    d = demand.decode_tokens_per_s
    prefill_ratio = demand.decode_prefill_tokens_per_s / d if d > 0 else 0.0
    ctx = demand.input_tokens + demand.output_tokens / 2.0
    u = p.step_per_seq_s + p.step_per_ctx_token_s * ctx
    c = p.step_per_prefill_token_s
    den = 1.0 - u * x - c * prefill_ratio * x
    if den <= 0:
        return math.inf, math.inf, math.inf
    step = p.step_base_s / den
    # Extra step time a request sees from appends landing during its life: compound Poisson
    # (decode-local appends on this worker x their tokens), spread over its output tokens;
    # each append lengthens the step it lands in by c x its tokens.
    out = max(demand.output_tokens, 1.0)
    appends_per_s = (demand.qps * demand.decode_local_share * x / d) if d > 0 else 0.0
    a = demand.local_append_tokens
    var = appends_per_s * out * step * (a * a * (1.0 + demand.append_scv)) * c * c
    return step, x * step, math.sqrt(var) / out


def decode_state(p: ComponentParams, demand: CapacityDemand, tokens_per_worker: float,
                 ) -> DecodeState:
    """Mean step time and batch, and the p99 TPOT over the rate levels, when one decode worker
    generates ``tokens_per_worker`` on average."""
    x = tokens_per_worker
    step, batch, _ = _decode_level(p, demand, x)
    factors, weights = demand.rate_levels()
    levels = [(w, *_decode_level(p, demand, x * f)) for f, w in zip(factors, weights,
                                                                    strict=True)]
    finite = [lv for lv in levels if math.isfinite(lv[1])]
    if not finite:
        return DecodeState(x, step, batch, math.inf, True)
    q = _QUANTILE

    def survival(t: float) -> float:
        return sum(w if not math.isfinite(m) else
                   # an sd below float resolution at m is no spread (m + 6 sd == m)
                   (w * 0.5 * math.erfc((t - m) / (sd * math.sqrt(2.0))) if sd > 1e-12 * m
                    else (w if m > t else 0.0))
                   for w, m, _, sd in levels)

    lo = min(m for _, m, _, _ in finite)
    hi = max(m + 6.0 * sd for _, m, _, sd in finite)
    if survival(hi) > 1.0 - q:
        return DecodeState(x, step, batch, math.inf, not math.isfinite(step))
    for _ in range(_BISECT_STEPS):
        mid = 0.5 * (lo + hi)
        if survival(mid) > 1.0 - q:
            lo = mid
        else:
            hi = mid
    return DecodeState(x, step, batch, hi, not math.isfinite(step))


def kv_batch_limit(kv_capacity_tokens: float, demand: CapacityDemand) -> float:
    """Most sequences a decode worker can run with the p99 of their KV within its pool.

    Resident tokens of ``B`` running sequences: mean ``B m`` (``m`` = prompt + half the
    output), variance ``B E[ctx^2]`` (prompt lengths vary); solved for ``B`` at ``Z99``.
    """
    m = max(demand.input_tokens + demand.output_tokens / 2.0, 1.0)
    share = demand.input_tokens / m
    k = math.sqrt(1.0 + demand.input_scv * share * share)  # sqrt(E[ctx^2]) / m
    # m s^2 + Z99 m k s - KV = 0 with s = sqrt(B)
    s = (-Z99 * m * k + math.sqrt((Z99 * m * k) ** 2 + 4.0 * m * kv_capacity_tokens)) / (2 * m)
    return s * s


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
    candidates = [_decode_tpot_limit(p, demand, slo_tpot_s, hi, lines)]
    candidates += _decode_memory_limits(p, demand, hi, kv_capacity_tokens, max_num_seqs, lines)
    cap, binding = min(candidates, key=lambda c: c[0])
    if binding == "p99 TPOT" and cap >= hi * 0.998:
        binding = "compute saturation"
    cap = max(cap, 1e-9)
    for value, name in sorted(candidates):
        lines.append(f"{name} limits a worker to {value:.4g} tokens/s")
    workers = _ceil_workers(d, cap, headroom)
    if workers > MAX_WORKERS:
        raise CapacityError(
            f"{d:.4g} generated tokens/s need more than {MAX_WORKERS} decode workers "
            f"({binding} limits one to {cap:.4g} tokens/s): beyond the planner's range; "
            "plan the load in parts or check the inputs")
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


def _decode_tpot_limit(p: ComponentParams, demand: CapacityDemand, slo_tpot_s: float,
                       hi: float, lines: list[str]) -> tuple[float, str]:
    """The largest tokens/s per worker whose p99 TPOT meets the target, and its name.

    Near the step floor the per-worker load allowed goes to zero and the count to infinity;
    below it no count meets the SLO. Either way the target is a p99 TPOT 10 % above the floor
    (as prefill does), so a tighter SLO never asks for fewer workers."""
    target = max(slo_tpot_s, UNREACHABLE_SLACK * p.step_base_s)
    tpot_cap = _largest(lambda x: decode_state(p, demand, x).p99_tpot_s <= target, hi * 0.999)
    if p.step_base_s > slo_tpot_s:
        lines.append(f"p99 TPOT: the step floor {p.step_base_s * 1e3:.1f} ms is above the "
                     f"{slo_tpot_s:g} s SLO: no decode count meets it; sized for a p99 of "
                     f"{target * 1e3:.2f} ms instead")
        return tpot_cap, "p99 TPOT (unreachable)"
    if target > slo_tpot_s:
        lines.append(f"p99 TPOT: the {slo_tpot_s:g} s SLO is within "
                     f"{UNREACHABLE_SLACK - 1:.0%} of the step floor "
                     f"{p.step_base_s * 1e3:.2f} ms, met only as the load per worker goes "
                     f"to zero; sized for a p99 of {target * 1e3:.2f} ms instead")
    return tpot_cap, "p99 TPOT"


def _decode_memory_limits(p: ComponentParams, demand: CapacityDemand, hi: float,
                          kv_capacity_tokens: float | None, max_num_seqs: int | None,
                          lines: list[str]) -> list[tuple[float, str]]:
    """The tokens/s per worker the KV cache and ``max_num_seqs`` allow (checked at the p99
    request's rate), when known."""
    ctx = demand.input_tokens + demand.output_tokens / 2.0
    peak = demand.peak_factor()
    limits: list[tuple[float, str]] = []
    if kv_capacity_tokens is not None and kv_capacity_tokens > 0:
        max_batch_kv = kv_batch_limit(kv_capacity_tokens, demand)
        if max_batch_kv < 1.0:
            raise CapacityError(
                f"a decode worker's KV cache of {kv_capacity_tokens:.0f} tokens cannot hold one "
                f"sequence of {ctx:.0f} tokens on average (at the p99 of its length): no decode "
                "count serves this load; check --kv-tokens")
        kv_cap = _largest(lambda x: _decode_level(p, demand, x * peak)[1] <= max_batch_kv,
                          hi * 0.999 / peak)
        limits.append((kv_cap, "KV cache"))
        lines.append(f"KV cache: {kv_capacity_tokens:.0f} tokens hold {max_batch_kv:.0f} "
                     f"sequences of {ctx:.0f} tokens on average at the p99 of their total "
                     f"(checked at the p99 request's rate, {peak:.2g}x the mean)")
    else:
        lines.append("KV cache: not checked (the pool size per decode worker is not known)")
    if max_num_seqs is not None and max_num_seqs > 0:
        seq_cap = _largest(lambda x: _decode_level(p, demand, x * peak)[1] <= max_num_seqs,
                           hi * 0.999 / peak)
        limits.append((seq_cap, "max_num_seqs"))
    return limits


# ---------------------------------------------------------------------------------------------
# The shape feedback: what the decode pool's session KV sustains


MAX_SHAPE_ROUNDS = 8  # rounds of decode count -> local share -> decode count before giving up


@dataclass(frozen=True, slots=True)
class SessionCache:
    """What the decode workers' held session KV did at the observed shape.

    A later turn runs decode-local (and its prefix counts as cached) only while its session's
    KV is still held on its decode worker; idle session KV is evicted LRU when the pool needs
    room. Fewer decode workers hold less of it, so the decode-local share and the cached share
    of prompts fall with the decode count, and the turns that lose their KV compute their whole
    prompt on a prefill worker.
    """

    observed_decode_workers: int
    kv_capacity_tokens: float  # per decode worker
    observed_running_tokens: float  # KV of running requests, whole decode pool (kv_cache_usage)
    decode_cached_fraction: float  # share of prompt tokens served from decode-held session KV
    # KV of sessions between turns the pool would have to hold for every later turn to find
    # its own (finished requests' context x the mean wait between turns); None: unknown, taken
    # as the observed idle capacity (the observed pool just held it: the cautious reading)
    working_set_tokens: float | None = None
    # KV pool of one prefill worker (None: as a decode worker's). Routers send a prefill
    # request to the worker with the least pending work net of its prefix-cache hit, so a
    # session whose turns run on prefill workers finds its prefix there while it is held
    prefill_kv_capacity_tokens: float | None = None

    def __post_init__(self) -> None:
        if self.observed_decode_workers < 1:
            raise CapacityError(f"observed_decode_workers: must be >= 1, got "
                                f"{self.observed_decode_workers!r}")
        for name in ("kv_capacity_tokens", "observed_running_tokens"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise CapacityError(f"{name}: must be a finite number >= 0, got {v!r}")
        if self.kv_capacity_tokens <= 0:
            raise CapacityError("kv_capacity_tokens: must be > 0")
        v = self.decode_cached_fraction
        if not math.isfinite(v) or not 0.0 <= v <= 1.0:
            raise CapacityError(f"decode_cached_fraction: must be within [0, 1], got {v!r}")
        for name in ("working_set_tokens", "prefill_kv_capacity_tokens"):
            w = getattr(self, name)
            if w is not None and (not math.isfinite(w) or w < 0):
                raise CapacityError(f"{name}: must be a finite number >= 0, got {w!r}")

    def idle_tokens(self, decode_workers: int, running_tokens: float) -> float:
        """KV the pool of ``decode_workers`` has left for idle session KV."""
        return max(decode_workers * self.kv_capacity_tokens - running_tokens, 0.0)

    @property
    def observed_idle_tokens(self) -> float:
        return self.idle_tokens(self.observed_decode_workers, self.observed_running_tokens)

    def held_ratio(self, decode_workers: int, running_tokens: float) -> float:
        """Share of the observed session-KV hits a pool of ``decode_workers`` keeps (0..1).

        Working-set approximation of LRU: the pool holds the fraction ``min(1, idle / W)`` of
        the working set ``W`` (with the waits between turns spread exponentially, the share of
        turns that find their KV is proportional to the time idle KV survives, which is
        proportional to the idle capacity), so hits scale with it. Relative to the observed
        shape; a larger pool is not credited with hits it was not seen to get (at most 1).
        """
        observed = self.observed_idle_tokens
        work = self.working_set_tokens if self.working_set_tokens is not None else observed
        if work <= 0:
            return 1.0
        seen = min(1.0, observed / work)
        if seen <= 0:
            return 1.0  # nothing was held when observed: nothing to lose
        return min(1.0, min(1.0, self.idle_tokens(decode_workers, running_tokens) / work) / seen)

    def prefill_held(self, prefill_workers: int) -> float:
        """Share of the working set a pool of ``prefill_workers`` holds (0..1): the turns that
        lost their decode-held KV run P/D, their prompts stay cached on the prefill worker that
        computed them, and the next turn is dispatched there while it is held (same
        working-set approximation; a prefill worker's running KV is small and ignored)."""
        work = self.working_set_tokens if self.working_set_tokens is not None \
            else self.observed_idle_tokens
        pool = self.prefill_kv_capacity_tokens if self.prefill_kv_capacity_tokens is not None \
            else self.kv_capacity_tokens
        if work <= 0:
            return 1.0
        return min(1.0, max(prefill_workers, 0) * pool / work)


def demand_at_shape(demand: CapacityDemand, cache: SessionCache, decode_workers: int,
                    running_tokens: float, prefill_workers: int | None = None,
                    ) -> tuple[CapacityDemand, float]:
    """(the demand a pool of ``decode_workers`` sees, the held ratio): the decode-local share
    and the decode-held cached share scaled by :meth:`SessionCache.held_ratio`; the turns that
    lose their held KV go to a prefill worker and compute their whole prompt there, less what
    a pool of ``prefill_workers`` still holds of it (:meth:`SessionCache.prefill_held`; None:
    nothing)."""
    ratio = cache.held_ratio(decode_workers, running_tokens)
    if ratio >= 1.0:
        return demand, 1.0
    held = min(cache.decode_cached_fraction, demand.cached_fraction)
    regained = 0.0 if prefill_workers is None else cache.prefill_held(prefill_workers)
    shaped = replace(demand, decode_local_share=demand.decode_local_share * ratio,
                     cached_fraction=demand.cached_fraction
                     - held * (1.0 - ratio) * (1.0 - regained))
    return shaped, ratio


def running_tokens(p: ComponentParams, demand: CapacityDemand, decode_workers: int) -> float:
    """KV of the running requests of a pool of ``decode_workers`` (Little's law on the
    predicted step: batch x mean resident context), whole pool."""
    if decode_workers < 1:
        return 0.0
    state = decode_state(p, demand, demand.decode_tokens_per_s / decode_workers)
    if not math.isfinite(state.batch):
        return math.inf
    return decode_workers * state.batch * (demand.input_tokens + demand.output_tokens / 2.0)


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
    session_cache: SessionCache | None = None,
) -> CapacityPlan:
    """Workers per role for ``demand`` within both p99 SLOs, with ``headroom`` spare.

    ``current`` is the (prefill, decode) shape running now (reported next to the
    recommendation); ``observed`` the per-worker load range the params were fitted on;
    ``kv_capacity_tokens`` and ``max_num_seqs`` are per decode worker (None: not a limit).
    ``session_cache``: what the decode pool's session KV did at the observed shape; with it the
    decode count and the decode-local / cached shares it sustains are planned jointly (a fixed
    point of decode count -> held session KV -> shares -> decode count, at most
    ``MAX_SHAPE_ROUNDS`` rounds), and prefill is planned on the demand at that decode count.
    """
    _check_plan_inputs(slo_ttft_s, slo_tpot_s, headroom)
    stay_s = demand.output_tokens * slo_tpot_s

    def plan_decode(dem: CapacityDemand) -> tuple[CapacityDemand, RoleRecommendation]:
        # decode sees the rate averaged over a request's stay (its output at the TPOT SLO)
        held = dem.smoothed(stay_s)
        return held, _plan_decode(params, held, slo_tpot_s, headroom,
                                  current[1] if current else None, observed,
                                  kv_capacity_tokens, max_num_seqs)

    held, decode = plan_decode(demand)
    shaped = demand
    shape_lines: list[str] = []
    shape_at = (decode.workers, 0.0)  # decode count whose shares prefill sees, its running KV
    if session_cache is not None:
        shaped, held, decode, shape_lines, shape_at = _joint_decode_shape(
            params, demand, session_cache, held, decode, plan_decode)
    if held is not shaped:
        decode = replace(decode, explanation=(
            f"arrival rate averaged over {stay_s:.3g} s (a request's "
            f"stay: {demand.output_tokens:.0f} tokens at the TPOT SLO) for decode",
            *decode.explanation))
    step = decode_state(params, held, shaped.decode_tokens_per_s / decode.workers).step_s
    if not math.isfinite(step):
        step = params.step_base_s
    demand_for = None
    if session_cache is not None and shaped is not demand:
        demand_for = _prefill_demand_for(demand, session_cache, *shape_at)
    prefill = _plan_prefill(params, shaped, slo_ttft_s, headroom,
                            current[0] if current else None, observed, step, demand_for)
    if shape_lines:
        prefill = replace(prefill, explanation=(*shape_lines, *prefill.explanation))
        decode = replace(decode, explanation=(*shape_lines, *decode.explanation))
    return CapacityPlan(prefill=prefill, decode=decode, demand=demand, slo_ttft_s=slo_ttft_s,
                        slo_tpot_s=slo_tpot_s, headroom=headroom,
                        demand_at_shape=shaped if session_cache is not None else None)


def _check_plan_inputs(slo_ttft_s: float, slo_tpot_s: float, headroom: float) -> None:
    for name, v in (("slo_ttft_s", slo_ttft_s), ("slo_tpot_s", slo_tpot_s)):
        if not math.isfinite(v) or v <= 0:
            raise CapacityError(f"{name}: must be > 0, got {v!r}")
    if not math.isfinite(headroom) or not 0 <= headroom <= MAX_HEADROOM:
        raise CapacityError(f"headroom: must be between 0 and {MAX_HEADROOM:g} (a fraction: "
                            f"0.2 is 20 % spare), got {headroom!r}")


def _prefill_demand_for(demand: CapacityDemand, cache: SessionCache, workers_d: int,
                        running: float) -> Callable[[int], CapacityDemand]:
    """The demand a pool of that many prefill workers sees, at the planned decode shape."""

    def demand_for(prefill_workers: int) -> CapacityDemand:
        return demand_at_shape(demand, cache, workers_d, running, prefill_workers)[0]

    return demand_for


def _joint_decode_shape(
    p: ComponentParams, demand: CapacityDemand, cache: SessionCache, held: CapacityDemand,
    decode: RoleRecommendation,
    plan_decode: Any,
) -> tuple[CapacityDemand, CapacityDemand, RoleRecommendation, list[str], tuple[int, float]]:
    """Decode count and the demand it sustains, planned jointly: a decode count holds some of
    the session KV (:meth:`SessionCache.held_ratio`), which sets the decode-local and cached
    shares (:func:`demand_at_shape`), which set the decode work and so the count; repeated
    until the count repeats. Prefill does not feed back (the share depends on the held KV,
    not on how busy the prefill pool is), so it is planned once, on the result."""
    work = cache.working_set_tokens
    lines = [
        f"session KV: {cache.observed_decode_workers} decode worker(s) of "
        f"{cache.kv_capacity_tokens:.0f} tokens held {cache.observed_idle_tokens:.4g} idle "
        f"tokens beside {cache.observed_running_tokens:.4g} running; working set "
        + (f"{work:.4g} tokens" if work is not None else
           "taken as that idle capacity (not known: the cautious reading)")
        + f"; {demand.decode_local_share:.1%} decode-local and "
        f"{cache.decode_cached_fraction:.1%} of prompt tokens from decode-held KV there"]
    tried: list[int] = []
    shaped = demand
    converged = False
    for round_no in range(1, MAX_SHAPE_ROUNDS + 1):
        workers = decode.workers
        tried.append(workers)
        running = running_tokens(p, held, workers)
        shaped, ratio = demand_at_shape(demand, cache, workers, running)
        held, decode = plan_decode(shaped)
        lines.append(f"shape round {round_no}: {workers} decode worker(s) keep {ratio:.0%} of "
                     f"the observed session-KV hits -> {shaped.decode_local_share:.1%} "
                     f"decode-local, {shaped.cached_fraction:.1%} cached, "
                     f"{shaped.prefill_node_tokens:.0f} tokens per prefill-node request -> "
                     f"{decode.workers} decode worker(s)")
        if decode.workers == workers:
            converged = True
            break
    if not converged:
        # the count cycles: plan on the largest it visited (more decode KV, more held turns
        # is the optimistic side for prefill, so take that shape's demand for decode and
        # the fewest-held one's for prefill)
        most = max(tried)
        fewest = min(tried)
        held, decode = plan_decode(demand_at_shape(demand, cache, most,
                                                   running_tokens(p, held, most))[0])
        running = running_tokens(p, held, fewest)
        shaped = demand_at_shape(demand, cache, fewest, running)[0]
        lines.append(f"shape: no fixed point in {MAX_SHAPE_ROUNDS} rounds ({tried}); decode "
                     f"planned at {most}, prefill on the shares {fewest} decode worker(s) keep")
        return shaped, held, decode, lines, (fewest, running)
    lines.append(f"shape: stable after {len(tried)} round(s) at {decode.workers} decode "
                 "worker(s); prefill is planned on that demand")
    return shaped, held, decode, lines, (tried[-1], running)
