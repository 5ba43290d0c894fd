"""Synthetic targets for the observe tests: prometheus_client registries with vLLM 0.33's
exact family names, labels and bucket edges (``docs/engines.md``) and the
router agent's real ``pdrouter_*`` metrics, plus a FakeSource fed the same traffic."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from controller.observe.source import FakeSource, Target
from controller.policy.bins import (
    CONTEXT_BINS,
    FEATURE_CONTEXT_EDGES,
    FEATURE_IO_RATIO_EDGES,
    IO_RATIO_BINS,
)
from controller.policy.model import Route
from controller.rollout.agent_metrics import RouterMetrics, slo_label

# vLLM's bucket edges, restated from docs/engines.md on purpose rather than
# imported from controller/sim/vllm_metrics.py: these tests then cross-check the simulator's
# exposition against the reference instead of against itself.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
NIXL_XFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
NIXL_BYTES_BUCKETS = tuple(float(2**e) for e in range(11, 34, 2))
LABELS = ("model_name", "engine")
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")

HIST_FAMILIES = {
    "ttft_s": ("vllm:time_to_first_token_seconds", TTFT_BUCKETS),
    "inter_token_s": ("vllm:inter_token_latency_seconds", ITL_BUCKETS),
    "tpot_s": ("vllm:request_time_per_output_token_seconds", ITL_BUCKETS),
    "queue_s": ("vllm:request_queue_time_seconds", REQUEST_LATENCY_BUCKETS),
    "prefill_s": ("vllm:request_prefill_time_seconds", REQUEST_LATENCY_BUCKETS),
    "kv_transfer_s": ("vllm:nixl_xfer_time_seconds", NIXL_XFER_BUCKETS),
    "kv_transfer_bytes": ("vllm:nixl_bytes_transferred", NIXL_BYTES_BUCKETS),
}


class VllmWorker:
    """One vLLM 0.33 API server's families (one DP engine, ``engine="0"``)."""

    def __init__(self, model: str = "llama-3.1-8b", engine: str = "0",
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        lv = (model, engine)
        self.hist = {
            key: Histogram(name, f"{name} (test)", LABELS, buckets=b, registry=r).labels(*lv)
            for key, (name, b) in HIST_FAMILIES.items()
        }
        self.running = Gauge("vllm:num_requests_running", "running", LABELS, registry=r).labels(*lv)
        self.waiting = Gauge("vllm:num_requests_waiting", "waiting", LABELS, registry=r).labels(*lv)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "kv", LABELS, registry=r).labels(*lv)
        success = Counter("vllm:request_success", "ok", [*LABELS, "finished_reason"], registry=r)
        self.success = {reason: success.labels(*lv, reason)
                        for reason in ("stop", "length", "abort", "error", "repetition")}
        self.generation = Counter("vllm:generation_tokens", "gen", LABELS, registry=r).labels(*lv)
        prompt = Counter("vllm:prompt_tokens_by_source", "p", [*LABELS, "source"], registry=r)
        self.prompt = {s: prompt.labels(*lv, s) for s in SOURCES}
        # A family the window does not use: the parser skips it.
        Counter("vllm:num_preemptions", "pre", LABELS, registry=r).labels(*lv)


class Router:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.metrics = RouterMetrics(self.registry)


@dataclass
class Truth:
    """What the traffic since the last ``Cluster.mark()`` was, kept by the test itself."""

    hist: dict[tuple[str, str], list[float]] = field(default_factory=dict)  # count, total
    requests: dict[str, float] = field(default_factory=dict)
    aborted: dict[str, float] = field(default_factory=dict)
    errored: dict[str, float] = field(default_factory=dict)
    generation: dict[str, float] = field(default_factory=dict)
    prompt: dict[str, dict[str, float]] = field(default_factory=dict)
    gauges: dict[str, dict[str, float]] = field(default_factory=dict)  # latest, not reset
    cells: dict[tuple[str, str, int, int], list[float]] = field(default_factory=dict)
    latency: dict[tuple[str, str, int], list[float]] = field(default_factory=dict)
    context: dict[float, float] = field(default_factory=dict)
    io: dict[float, float] = field(default_factory=dict)
    qps: dict[str, float] = field(default_factory=dict)  # latest, not reset


@dataclass
class Cluster:
    """Workers and routers as registries, and a FakeSource fed the same traffic."""

    targets: list[Target]
    workers: dict[str, VllmWorker] = field(default_factory=dict)
    routers: dict[str, Router] = field(default_factory=dict)
    fake: FakeSource | None = None
    truth: Truth = field(default_factory=Truth)

    def mark(self) -> Truth:
        """The traffic since the previous mark; gauges and qps carry over."""
        done = self.truth
        self.truth = Truth(gauges={k: dict(v) for k, v in done.gauges.items()},
                           qps=dict(done.qps))
        return done

    @classmethod
    def build(cls, prefill: int, decode: int, routers: int, names: list[str] | None = None
              ) -> Cluster:
        n = prefill + decode + routers
        names = names or [f"127.0.0.1:{9000 + i}" for i in range(n)]
        roles = ["prefill"] * prefill + ["decode"] * decode + ["router"] * routers
        targets = [Target(name, role) for name, role in zip(names, roles, strict=True)]  # type: ignore[arg-type]
        c = cls(targets=targets)
        for t in targets:
            if t.role == "router":
                c.routers[t.name] = Router()
            else:
                c.workers[t.name] = VllmWorker()
        c.fake = FakeSource(targets)
        return c

    def renamed(self, names: list[str]) -> Cluster:
        """The same registries under other target names (e.g. the ports they are served on)."""
        mapping = dict(zip([t.name for t in self.targets], names, strict=True))
        targets = [Target(mapping[t.name], t.role) for t in self.targets]
        return Cluster(
            targets=targets,
            workers={mapping[k]: v for k, v in self.workers.items()},
            routers={mapping[k]: v for k, v in self.routers.items()},
            fake=FakeSource(targets),
        )

    def registries(self) -> dict[str, CollectorRegistry]:
        out = {n: w.registry for n, w in self.workers.items()}
        out.update({n: r.registry for n, r in self.routers.items()})
        return out

    # --- traffic: applied to the registries and to the fake ledgers -----------------------
    def observe(self, worker: str, key: str, value: float) -> None:
        self.workers[worker].hist[key].observe(value)
        h = self.truth.hist.setdefault((worker, key), [0.0, 0.0])
        h[0] += 1
        h[1] += value
        assert self.fake is not None
        self.fake.observe(worker, key, value)

    def finish_request(self, worker: str, gen_tokens: int, prompt: dict[str, int]) -> None:
        w = self.workers[worker]
        w.success["stop"].inc()
        w.generation.inc(gen_tokens)
        for src, n in prompt.items():
            w.prompt[src].inc(n)
        t = self.truth
        t.requests[worker] = t.requests.get(worker, 0.0) + 1
        t.generation[worker] = t.generation.get(worker, 0.0) + gen_tokens
        for src, n in prompt.items():
            t.prompt.setdefault(worker, {})[src] = t.prompt.get(worker, {}).get(src, 0.0) + n
        assert self.fake is not None
        self.fake.finish_request(worker, gen_tokens, {k: float(v) for k, v in prompt.items()})

    def abort_requests(self, worker: str, n: int, reason: str = "abort") -> None:
        """Requests that were not served: vLLM counts them under finished_reason="abort"
        (the client gave up) or "error" (an engine failure), apart from the served ones."""
        self.workers[worker].success[reason].inc(n)
        ledger = self.truth.aborted if reason == "abort" else self.truth.errored
        ledger[worker] = ledger.get(worker, 0.0) + n
        assert self.fake is not None
        self.fake.fail_requests(worker, **{"aborted" if reason == "abort" else "errored": n})

    def set_gauges(self, worker: str, running: float, waiting: float, kv: float) -> None:
        w = self.workers[worker]
        w.running.set(running)
        w.waiting.set(waiting)
        w.kv_usage.set(kv)
        self.truth.gauges[worker] = {"running": running, "waiting": waiting,
                                     "kv_cache_usage": kv}
        assert self.fake is not None
        for key, v in (("running", running), ("waiting", waiting), ("kv_cache_usage", kv)):
            self.fake.set_gauge(worker, key, v)

    def route(self, router: str, route: Route, context_tokens: float, io_ratio: float,
              ttft_s: float, tpot_s: float, slo_ttft: float = 2.0, slo_tpot: float = 0.1) -> None:
        m = self.routers[router].metrics
        ctx_label = CONTEXT_BINS.label(context_tokens)
        io_label = IO_RATIO_BINS.label(io_ratio)
        met_ttft, met_tpot = ttft_s <= slo_ttft, tpot_s <= slo_tpot
        m.count_request(route.name, ctx_label, io_label, slo_label(met_ttft, met_tpot))
        m.observe_ttft(route.name, ctx_label, ttft_s)
        m.observe_tpot(route.name, ctx_label, tpot_s)
        m.context_tokens.observe(context_tokens)
        m.io_ratio.observe(io_ratio)
        assert self.fake is not None
        ci = CONTEXT_BINS.labels.index(ctx_label)
        ii = IO_RATIO_BINS.labels.index(io_label)
        cell = self.truth.cells.setdefault((router, route.name, ci, ii), [0.0, 0.0])
        cell[0] += 1
        cell[1] += 1 if (met_ttft and met_tpot) else 0
        lat = self.truth.latency.setdefault((router, route.name, ci), [0.0] * 4)
        lat[0] += 1
        lat[1] += ttft_s
        lat[2] += 1
        lat[3] += tpot_s
        self.fake.route_request(router, route, ci, ii, ttft_s, tpot_s, met_ttft and met_tpot)
        ctx_edges = (*FEATURE_CONTEXT_EDGES, float("inf"))
        io_edges = (*FEATURE_IO_RATIO_EDGES, float("inf"))
        self.fake.feature(router, ctx_edges[ci], io_edges[ii])
        t = self.truth
        t.context[ctx_edges[ci]] = t.context.get(ctx_edges[ci], 0.0) + 1
        t.io[io_edges[ii]] = t.io.get(io_edges[ii], 0.0) + 1

    def set_qps(self, router: str, qps: float) -> None:
        self.routers[router].metrics.qps.set(qps)
        self.truth.qps[router] = qps
        assert self.fake is not None
        self.fake.set_qps(router, qps)

    def traffic(self, rng: random.Random, requests_per_worker: int = 20) -> None:
        """Deterministic mixed traffic on every worker and router."""
        for name, _w in self.workers.items():
            role = next(t.role for t in self.targets if t.name == name)
            for _ in range(requests_per_worker):
                self.observe(name, "ttft_s", rng.uniform(0.02, 1.5))
                self.observe(name, "queue_s", rng.uniform(0.0, 0.4))
                self.observe(name, "prefill_s", rng.uniform(0.05, 0.6))
                if role == "decode":
                    for _ in range(5):
                        self.observe(name, "inter_token_s", rng.uniform(0.004, 0.03))
                    self.observe(name, "tpot_s", rng.uniform(0.006, 0.04))
                    self.observe(name, "kv_transfer_s", rng.uniform(0.003, 0.2))
                    self.observe(name, "kv_transfer_bytes", float(rng.randint(2**16, 2**26)))
                self.finish_request(name, rng.randint(1, 300), {
                    "local_compute": rng.randint(10, 2000),
                    "local_cache_hit": rng.randint(0, 500),
                })
            self.abort_requests(name, rng.randint(1, 4))
            self.abort_requests(name, rng.randint(0, 2), reason="error")
            self.set_gauges(name, float(rng.randint(0, 16)), float(rng.randint(0, 4)),
                            round(rng.uniform(0.0, 0.95), 4))
        for name in self.routers:
            for _ in range(30):
                self.route(name, rng.choice(list(Route)), rng.choice([0, 300, 5000, 70000]),
                           rng.choice([0.1, 1.0, 3.0, 100.0]), rng.uniform(0.05, 3.0),
                           rng.uniform(0.01, 0.2))
            self.set_qps(name, round(rng.uniform(1, 50), 3))


def serve_http(cluster: Cluster) -> tuple[Cluster, dict[str, Any]]:
    """Serve every registry with prometheus_client's own HTTP server on 127.0.0.1."""
    servers: dict[str, Any] = {}
    names = []
    registries = cluster.registries()
    for t in cluster.targets:
        server, _thread = start_http_server(0, addr="127.0.0.1", registry=registries[t.name])
        name = f"127.0.0.1:{server.server_port}"
        names.append(name)
        servers[name] = server
    return cluster.renamed(names), servers


def stop_http(server: Any) -> None:
    server.shutdown()
    server.server_close()
