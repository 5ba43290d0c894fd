"""Synthetic windows from a KNOWN ground-truth P/D cluster (test helper, not a test).

The ground truth uses the step-time formula of latency-model.md §1 (Llama-3.1-8B, H100):
``T_step = T_fixed + max(F, a + b·N_new) + c_dec·Σctx + c_pf·Σ q(k + q/2)``, an M/G/1
(Pollaczek–Khinchine) queue per prefill worker, and a KV link ``setup + bytes/bw`` with
contention. These forms differ on purpose from the controller's fitted model (linear step,
M/M/1 wait): the test checks that the learner recovers the truth, not that it matches itself.
Observed means carry sampling noise; request counts are Poisson; ``met`` is binomial.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from controller.core.features import (
    N_CTX_BINS,
    N_IO_BINS,
    ROUTER_CONTEXT_EDGES,
    ROUTER_CTX_REP,
    ROUTER_IO_EDGES,
    ROUTER_IO_REP,
)
from controller.core.window import Histogram, RouteOutcome, Summary, Window, WorkerStats, Workload
from controller.policy.model import Route, Slo


@dataclass(frozen=True)
class Truth:
    t_fixed: float = 0.001
    floor: float = 0.0065
    a: float = 0.0033
    b: float = 21e-6
    c_dec: float = 48.5e-9
    c_pf: float = 1.31e-9
    budget: float = 2048.0
    kv_bytes_per_token: float = 131_072.0
    link_bw: float = 20e9
    link_setup: float = 0.002
    n_prefill: int = 2
    n_decode: int = 2
    output_tokens: float = 200.0
    sigma_ttft: float = 0.35  # per-request log-normal spread
    sigma_tpot: float = 0.15

    def prefill_time(self, tokens: np.ndarray) -> np.ndarray:
        return (self.t_fixed + np.maximum(self.floor, self.a + self.b * tokens)
                + self.c_pf * tokens**2 / 2.0)

    def xfer_time(self, tokens: np.ndarray) -> np.ndarray:
        return self.link_setup + tokens * self.kv_bytes_per_token / self.link_bw


@dataclass
class Mix:
    """Router cells (ctx bin, io bin) with request shares."""

    cells: dict[tuple[int, int], float] = field(default_factory=lambda: {
        (1, 2): 0.15, (2, 4): 0.15, (3, 1): 0.1, (4, 3): 0.15, (5, 5): 0.1, (6, 2): 0.1,
        (3, 6): 0.1, (7, 3): 0.15,
    })

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        k = np.array([c * N_IO_BINS + i for c, i in self.cells], dtype=np.int64)
        share = np.array(list(self.cells.values()), dtype=np.float64)
        return k, share / share.sum()

    def scaled_context(self, factor: float) -> Mix:
        """Context x factor: move each cell to the bin its scaled representative falls in."""
        out: dict[tuple[int, int], float] = {}
        for (c, i), s in self.cells.items():
            v = ROUTER_CTX_REP[c] * factor
            nc = int(np.searchsorted(np.array(ROUTER_CONTEXT_EDGES), v, side="left"))
            out[(min(nc, N_CTX_BINS - 1), i)] = out.get((min(nc, N_CTX_BINS - 1), i), 0.0) + s
        return Mix(out)


@dataclass(frozen=True)
class TrueLoad:
    ttft: np.ndarray  # [K, 2]
    tpot: np.ndarray  # [K, 2]
    step: float
    wait_p: float
    prefill_mean: float
    xfer_mean: float
    link_busy: float
    running: float
    rho_p: float


def true_latencies(t: Truth, context: np.ndarray, append: np.ndarray, rate_p: np.ndarray,
                   rate_l: np.ndarray) -> TrueLoad:
    """Fluid ground truth for per-cell rates (req/s) on each route; vectors over cells."""
    o = t.output_tokens
    prompt = context + append
    total = rate_p + rate_l
    r_all = float(total.sum())
    r_p = float(rate_p.sum())
    s = t.prefill_time(prompt)
    if r_p > 0:
        es = float((rate_p * s).sum() / r_p)
        es2 = float((rate_p * s**2).sum() / r_p)
    else:
        es, es2 = float(s.mean()), float((s**2).mean())
    lam = r_p / t.n_prefill
    rho = lam * es
    wait = lam * es2 / (2.0 * (1.0 - rho)) if rho < 0.97 else 30.0 * es * (1 + rho)
    ctx_mean = (float((total * prompt).sum() / r_all) if r_all > 0 else 1000.0) + o / 2.0
    lam_pf = float((rate_l * append).sum() + r_p) / t.n_decode  # tokens/s per decode worker
    att_rate = float((rate_l * append * (context + append / 2.0)).sum()) / t.n_decode
    step = 0.01
    saturated = False
    for _ in range(200):
        b = r_all * o * step / t.n_decode
        new = (t.t_fixed + max(t.floor, t.a + t.b * (b + lam_pf * step))
               + t.c_dec * b * ctx_mean + t.c_pf * att_rate * step)
        if new > 5.0:
            saturated = True
            break
        if abs(new - step) < 1e-9:
            step = new
            break
        step = new
    if saturated:
        step = 5.0
    running = r_all * o * step / t.n_decode
    xfer = t.xfer_time(prompt)
    busy = float((rate_p * xfer).sum()) / t.n_decode
    xfer_loaded = xfer / (1.0 - min(busy, 0.95))
    ttft_p = wait + s + xfer_loaded + 1.5 * step
    chunks = np.maximum(np.ceil(append / t.budget), 1.0)
    chunk = np.minimum(append, t.budget)
    chunk_step = (t.t_fixed + np.maximum(t.floor, t.a + t.b * (running + chunk))
                  + t.c_dec * running * ctx_mean + t.c_pf * chunk * (context + chunk / 2.0))
    ttft_l = 0.5 * step + chunks * chunk_step
    tpot = np.full_like(context, step)
    xfer_mean = float((rate_p * xfer_loaded).sum() / r_p) if r_p > 0 else float(xfer.mean())
    return TrueLoad(np.stack([ttft_p, ttft_l], axis=1), np.stack([tpot, tpot], axis=1), step,
                    wait, es, xfer_mean, busy, running, rho)


def cell_tokens(t: Truth, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ctx = ROUTER_CTX_REP[k // N_IO_BINS]
    ratio = ROUTER_IO_REP[k % N_IO_BINS]
    return ctx, ratio * t.output_tokens


def _hist(edges: tuple[float, ...], counts: np.ndarray) -> Histogram:
    return Histogram(edges=(*edges, math.inf), counts=tuple(float(c) for c in counts))


def make_window(
    t: Truth,
    mix: Mix,
    qps: float,
    local: np.ndarray | float,
    rng: np.random.Generator,
    start: float,
    interval_s: float = 30.0,
    slo: Slo | None = None,
    n_routers: int = 2,
) -> tuple[Window, TrueLoad]:
    """One observed window: ``qps`` per router, ``local`` share per mix cell."""
    slo = slo or Slo(ttft_s=1.0, tpot_s=0.05)
    k, share = mix.arrays()
    context, append = cell_tokens(t, k)
    local_share = np.broadcast_to(np.asarray(local, dtype=np.float64), share.shape)
    total_rate = qps * n_routers
    # Latencies follow the arrivals that actually happened (Poisson counts), as in a real window.
    counts = rng.poisson(np.stack([total_rate * share * (1.0 - local_share),
                                   total_rate * share * local_share], axis=1) * interval_s)
    rate_p = counts[:, 0] / interval_s
    rate_l = counts[:, 1] / interval_s
    truth = true_latencies(t, context, append, rate_p, rate_l)
    outcomes: list[RouteOutcome] = []
    ctx_counts = np.zeros(N_CTX_BINS)
    io_counts = np.zeros(N_IO_BINS)
    for j, cell in enumerate(k):
        for col, route, rate in ((0, Route.PREFILL_NODE, rate_p), (1, Route.DECODE_LOCAL, rate_l)):
            n = float(rate[j] * interval_s)
            if n <= 0:
                continue
            ctx_counts[cell // N_IO_BINS] += n
            io_counts[cell % N_IO_BINS] += n
            mt, mp = truth.ttft[j, col], truth.tpot[j, col]
            ttft_mean = mt * math.exp(rng.normal(0, t.sigma_ttft / math.sqrt(n)))
            tpot_mean = mp * math.exp(rng.normal(0, t.sigma_tpot / math.sqrt(n)))
            p_ok = _lognorm_cdf(slo.ttft_s, mt, t.sigma_ttft) * _lognorm_cdf(slo.tpot_s, mp,
                                                                              t.sigma_tpot)
            met = float(rng.binomial(int(n), min(max(p_ok, 0.0), 1.0)))
            # split across routers
            half = math.floor(n / 2)
            for r_i, part in enumerate((n - half, half)):
                if part <= 0:
                    continue
                outcomes.append(RouteOutcome(
                    router=f"router-{r_i}", route=route, ctx_bin=int(cell // N_IO_BINS),
                    io_bin=int(cell % N_IO_BINS), requests=part,
                    met=min(part, round(met * part / n)), ttft_sum=ttft_mean * part,
                    ttft_count=part, tpot_sum=tpot_mean * part, tpot_count=part,
                ))
    workers: list[WorkerStats] = []
    r_p = float(rate_p.sum())
    prompt_p = float((rate_p * (context + append)).sum() / r_p) if r_p > 0 else 0.0
    for i in range(t.n_prefill):
        n = float(rng.poisson(r_p * interval_s / t.n_prefill))
        if n > 0:
            workers.append(WorkerStats(
                worker=f"p{i}", role="prefill", request_rate=n / interval_s,
                prefill_s=Summary(truth.prefill_mean * _noise(rng, 0.3, n), n),
                queue_s=Summary(truth.wait_p * _noise(rng, 0.5, n), n),
                prompt_tokens_by_source={"local_compute": prompt_p * n},
                generation_tokens=n,
            ))
        else:
            workers.append(WorkerStats(worker=f"p{i}", role="prefill", request_rate=0.0))
    r_all = float((rate_p + rate_l).sum())
    local_tokens = float((rate_l * append).sum() + r_p)
    for i in range(t.n_decode):
        n = float(rng.poisson(r_all * interval_s / t.n_decode))
        n_x = float(rng.poisson(r_p * interval_s / t.n_decode))
        steps = interval_s / truth.step
        workers.append(WorkerStats(
            worker=f"d{i}", role="decode", request_rate=n / interval_s,
            inter_token_s=Summary(truth.step * _noise(rng, 0.05, max(steps, 1.0)),
                                  max(n * t.output_tokens, 1.0)),
            running=max(truth.running * _noise(rng, 0.15, 1.0), 0.0),
            prompt_tokens_by_source={"local_compute": local_tokens * interval_s / t.n_decode},
            generation_tokens=n * t.output_tokens * _noise(rng, 0.05, 1.0),
            kv_transfer_s=(Summary(truth.xfer_mean * _noise(rng, 0.2, n_x), n_x)
                           if n_x > 0 else None),
            kv_transfer_bytes=(Summary(prompt_p * t.kv_bytes_per_token, n_x)
                               if n_x > 0 else None),
        ))
    qps_noise = [qps * _noise(rng, 0.15, qps * interval_s) for _ in range(n_routers)]
    workload = Workload(
        context_tokens=_hist(ROUTER_CONTEXT_EDGES, ctx_counts),
        io_ratio=_hist(ROUTER_IO_EDGES, io_counts),
        qps_by_router={f"router-{i}": q for i, q in enumerate(qps_noise)},
    )
    window = Window.build(start, start + interval_s, interval_s, workers, outcomes, workload,
                          source="synthetic")
    return window, truth


def _noise(rng: np.random.Generator, cv: float, n: float) -> float:
    return math.exp(rng.normal(0.0, cv / math.sqrt(max(n, 1.0))))


def _lognorm_cdf(limit: float, mean: float, sigma: float) -> float:
    mu = math.log(max(mean, 1e-9)) - sigma**2 / 2.0
    return 0.5 * (1.0 + math.erf((math.log(limit) - mu) / (sigma * math.sqrt(2.0))))


def training_windows(
    t: Truth, mix: Mix, n: int, seed: int, qps_range: tuple[float, float] = (0.5, 4.0),
    start: float = 1_700_000_000.0, interval_s: float = 30.0, slo: Slo | None = None,
) -> list[Window]:
    """Windows under varied QPS and random per-cell local shares (exploration-rich)."""
    rng = np.random.default_rng(seed)
    k, _ = mix.arrays()
    out = []
    lo, hi = qps_range
    for i in range(n):
        qps = float(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        local = rng.uniform(0.05, 0.95, size=k.shape[0])
        w, _ = make_window(t, mix, qps, local, rng, start + i * interval_s, interval_s, slo)
        out.append(w)
    return out


def with_truth(t: Truth, **changes: float) -> Truth:
    return replace(t, **changes)  # type: ignore[arg-type]


def stationary(
    t: Truth, mix: Mix, qps: float, local: float | np.ndarray, n: int, seed: int,
    start: float = 1_750_000_000.0, interval_s: float = 30.0, slo: Slo | None = None,
) -> list[Window]:
    """``n`` windows of one regime (fixed QPS and routing): only sampling noise varies."""
    rng = np.random.default_rng(seed)
    return [make_window(t, mix, qps, local, rng, start + i * interval_s, interval_s, slo)[0]
            for i in range(n)]
