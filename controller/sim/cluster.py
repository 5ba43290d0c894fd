"""The simulated P/D cluster in virtual time: engines, KV links, routers, one event heap.

A request's path:

- ``DECODE_LOCAL``: the session's decode worker computes the prompt tokens it does not hold
  (the whole prompt when its cached context was evicted) and generates the output.
- ``PREFILL_NODE``: a prefill worker (the one with the least pending prefill work, counting
  its own prefix-cache hit when ``prefill_prefix_cache`` is on) computes the prompt part it
  does not hold and emits one token (vLLM's ``max_tokens=1`` proxy semantics). The session's
  decode worker then reserves KV blocks and pulls the KV over the prefill worker's NIC: only
  the blocks it lacks (``transfer_missing_only = true``, what vLLM's NIXL connector does) or
  the whole prompt (``false``). It recomputes the last prompt position and decodes. The
  KV-fetch wait is queue time on the decode worker, as in vLLM.

User-visible TTFT = first token on the decode worker - arrival at the router.
"""

from __future__ import annotations

import heapq
import itertools
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from controller.clock import VirtualClock
from controller.policy import Decision, Features, Policy, Route
from controller.sim.engine import Engine, EngineRequest, Kind
from controller.sim.link import KvLink
from controller.sim.profiles import Profile
from controller.sim.router import SimRouter
from controller.sim.sglang_metrics import SglangView

Role = Literal["prefill", "decode"]
KV_LEASE_S = 30.0  # vLLM NIXL kv_lease_duration default


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    prefill_workers: int = 1
    decode_workers: int = 3
    profile: Profile | None = None
    kv_link_gbps: float = 100.0
    kv_link_setup_s: float = 0.001
    max_batch_tokens: int = 8192
    routers: int = 1
    prefill_prefix_cache: bool = True
    transfer_missing_only: bool = True
    closed_form_runs: bool = True
    qps_window_s: float = 10.0
    # vLLM --custom-histogram-buckets: bucket family -> boundaries
    custom_histogram_buckets: tuple[tuple[str, tuple[float, ...]], ...] = ()
    # The engine whose exposition the workers serve: "vllm" or "sglang" (SglangView, its
    # scheduler series repeated on sglang_tp_ranks ranks).
    metrics_engine: str = "vllm"
    sglang_tp_ranks: int = 1

    def __post_init__(self) -> None:
        if self.metrics_engine not in ("vllm", "sglang"):
            raise ValueError(f"metrics_engine must be vllm or sglang, got "
                             f"{self.metrics_engine!r}")


@dataclass(slots=True)
class SimRequest:
    """One client request and what happened to it."""

    rid: int
    session: str
    turn: int
    arrival: float
    prompt: int
    new_tokens: int
    output_tokens: int
    max_tokens: int
    router: int = 0
    route: Route | None = None
    reason: str = ""
    context_tokens: int = 0
    prefill_worker: str | None = None
    decode_worker: str | None = None
    first_token: float | None = None
    finish: float | None = None
    tpot: float | None = None
    kv_bytes: int = 0
    xfer_s: float = 0.0
    prefill_done_at: float | None = None
    rejected: bool = False
    reject_reason: str = ""
    retries: int = 0
    direct: bool = False  # addressed to one worker over HTTP (protocol mode): never rerouted
    features: Features | None = None
    decision: Decision | None = None
    on_complete: Callable[[SimRequest], None] | None = field(default=None, repr=False)
    stream: Any = field(default=None, repr=False)  # live mode: token listener

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def shared_prefix(self) -> int:
        return self.prompt - self.new_tokens


class EventLoop:
    """A heap of timed callbacks over a :class:`VirtualClock`."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.now = clock.monotonic()
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.processed = 0

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn, args))

    def advance_to(self, t: float, max_events: int = 1_000_000) -> None:
        """Process events up to ``t`` and move the clock to ``t`` (live mode pacing)."""
        self.run(t, max_events)
        if t > self.now:
            self.now = t
            self.clock.set(t)

    def next_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def run(self, until: float, max_events: int) -> bool:
        """Process events up to ``until``; False when ``max_events`` ran out first."""
        heap = self._heap
        clock = self.clock
        budget = max_events
        while heap and heap[0][0] <= until:
            if budget <= 0:
                return False
            budget -= 1
            t, _, fn, args = heapq.heappop(heap)
            if t > self.now:
                self.now = t
                clock.set(t)
            fn(*args)
        self.processed += max_events - budget
        return True

    def __len__(self) -> int:
        return len(self._heap)


class SimCluster:
    def __init__(
        self,
        config: ClusterConfig,
        profile: Profile,
        policy: Policy | Callable[[int], Policy] | None,
        *,
        clock: VirtualClock | None = None,
        seed: int = 0,
    ) -> None:
        self.config = config
        self.profile = profile
        self.clock = clock or VirtualClock(start=0.0)
        self.loop = EventLoop(self.clock)
        self.kv_bytes_per_token = profile.kv_bytes_per_token
        self.prefill: list[Engine] = []
        self.decode: list[Engine] = []
        self.retired: list[Engine] = []
        self.links: dict[str, KvLink] = {}
        self.link_factor = 1.0
        self._names = {"prefill": itertools.count(), "decode": itertools.count()}
        self.session_decode: dict[str, Engine] = {}
        self.requests_by_tag: dict[int, SimRequest] = {}
        self.routers = [
            SimRouter(i, self.clock, policy(i) if callable(policy) else policy,
                      seed=seed * 1000 + i, qps_window_s=config.qps_window_s)
            for i in range(config.routers)
        ]
        self.kv_bytes = 0
        for _ in range(config.prefill_workers):
            self.add_worker("prefill")
        for _ in range(config.decode_workers):
            self.add_worker("decode")

    # ------------------------------------------------------------ workers
    def add_worker(self, role: Role) -> Engine:
        name = f"{role}-{next(self._names[role])}"
        eng = Engine(
            name, role, self.profile,
            max_batch_tokens=self.config.max_batch_tokens,
            prefix_cache=self.config.prefill_prefix_cache if role == "prefill" else True,
            runs=self.config.closed_form_runs,
            custom_buckets=dict(self.config.custom_histogram_buckets) or None,
        )
        if self.config.metrics_engine == "sglang":
            eng.registry = SglangView(eng.metrics, tp_size=self.config.sglang_tp_ranks).registry
        if role == "prefill":
            self.prefill.append(eng)
            self.links[name] = KvLink(name, self.config.kv_link_gbps,
                                      self.config.kv_link_setup_s, self.link_factor)
        else:
            eng.on_alloc = self._on_kv_alloc
            self.decode.append(eng)
        return eng

    def remove_worker(self, role: Role) -> Engine | None:
        pool = self.prefill if role == "prefill" else self.decode
        if not pool:
            return None
        eng = pool.pop()
        self.retired.append(eng)
        orphans = eng.shutdown()
        if role == "decode":
            for s in [s for s, d in self.session_decode.items() if d is eng]:
                del self.session_decode[s]
        now = self.loop.now
        for er in orphans:
            req = self.requests_by_tag.get(id(er))
            if req is not None and req.direct:
                self._reject(req, "worker_removed")
            elif req is not None and req.finish is None and not req.rejected:
                req.retries += 1
                self.loop.at(now, self._route, req)
        return eng

    def set_link_factor(self, factor: float) -> None:
        self.link_factor = factor
        for link in self.links.values():
            link.set_factor(factor)

    @property
    def engines(self) -> list[Engine]:
        return [*self.prefill, *self.decode]

    def _kick(self, eng: Engine) -> None:
        end = eng.kick(self.loop.now)
        if end is not None:
            self.loop.at(end, self._run_end, eng, eng.version)

    def _run_end(self, eng: Engine, version: int) -> None:
        if version != eng.version or not eng.alive:
            return
        end = eng.on_run_end(self.loop.now)
        if end is not None:
            self.loop.at(end, self._run_end, eng, eng.version)

    def sync(self) -> None:
        """Bring every engine's metrics up to now (runs in progress included)."""
        for eng in self.engines:
            eng.sync(self.loop.now)

    # ------------------------------------------------------------ requests
    def router_for(self, session: str) -> SimRouter:
        return self.routers[zlib.crc32(session.encode()) % len(self.routers)]

    def submit(self, req: SimRequest, router: int | None = None) -> None:
        """A request arrives now (at ``router``, else the router its session hashes to)."""
        req.arrival = self.loop.now
        req.router = self.router_for(req.session).index if router is None else router
        self._route(req)

    def _decode_for(self, session: str) -> Engine | None:
        d = self.session_decode.get(session)
        if d is not None and d.alive:
            return d
        if not self.decode:
            return None
        # least loaded; ties go to the worker given the fewest sessions so far
        d = min(self.decode, key=lambda e: (e.load(), e.sessions_assigned, e.name))
        d.sessions_assigned += 1
        self.session_decode[session] = d
        return d

    def _reject(self, req: SimRequest, reason: str) -> None:
        req.rejected = True
        req.reject_reason = reason
        if req.on_complete is not None:
            req.on_complete(req)

    def _route(self, req: SimRequest) -> None:
        prof = self.profile
        total = req.prompt + req.max_tokens
        if total > prof.max_model_len or -(-total // prof.block_size) > prof.num_gpu_blocks:
            self._reject(req, "too_long")
            return
        d = self._decode_for(req.session)
        if d is None:
            self._reject(req, "no_decode_worker")
            return
        router = self.routers[req.router]
        ctx = d.usable_hit(req.session, req.prompt, req.shared_prefix)
        req.context_tokens = ctx
        waiting = min((len(e.waiting) for e in self.prefill), default=None)
        features, decision = router.decide(req.turn, ctx, req.prompt, req.max_tokens, waiting)
        req.features = features
        req.decision = decision
        req.route = decision.route
        req.reason = str(decision.reason)
        req.decode_worker = d.name
        now = self.loop.now
        if decision.route is Route.PREFILL_NODE and self.prefill:
            p = min(
                self.prefill,
                key=lambda e: (e.pending_prefill_tokens() + req.prompt
                               - e.usable_hit(req.session, req.prompt, req.shared_prefix),
                               e.name),
            )
            req.prefill_worker = p.name
            er = EngineRequest(
                rid=req.rid, session=req.session, kind="prefill", prompt=req.prompt,
                shared_prefix=req.shared_prefix, max_out=1, max_tokens_param=1, arrival=now,
                on_done=self._prefill_done, tag=req,
            )
            self.requests_by_tag[id(er)] = req
            p.add(er, now)
            self._kick(p)
        else:
            if decision.route is Route.PREFILL_NODE:
                req.reason = "no_prefill_worker"
                req.route = Route.DECODE_LOCAL
            er = EngineRequest(
                rid=req.rid, session=req.session, kind="local", prompt=req.prompt,
                shared_prefix=req.shared_prefix, max_out=req.output_tokens,
                max_tokens_param=req.max_tokens, arrival=now,
                on_first_token=self._first_token, on_done=self._decode_done, tag=req,
                on_token=self._token if req.stream is not None else None,
            )
            self.requests_by_tag[id(er)] = req
            d.add(er, now)
            self._kick(d)

    def run_on(self, eng: Engine, req: SimRequest, kind: Kind,
               pull_from: str | None = None) -> EngineRequest:
        """Protocol mode: run ``req`` on the worker it was sent to, now, as that worker's
        HTTP request asked — ``prefill`` (the P leg: one token, then ``req.on_complete``),
        ``local`` (prefill from the worker's own prefix cache, then decode) or
        ``pd_decode`` (pull the blocks the worker lacks from prefill worker ``pull_from``
        over its link, then decode). No router decides and nothing is rerouted."""
        now = self.loop.now
        req.arrival = now
        req.direct = True
        leg = kind == "prefill"
        er = EngineRequest(
            rid=req.rid, session=req.session, kind=kind, prompt=req.prompt,
            shared_prefix=req.shared_prefix, max_out=1 if leg else req.output_tokens,
            max_tokens_param=1 if leg else req.max_tokens, arrival=now,
            on_first_token=self._first_token,
            on_done=self._leg_done if leg else self._decode_done,
            on_token=self._token if req.stream is not None and not leg else None, tag=req,
        )
        if leg:
            req.prefill_worker = eng.name
        else:
            req.decode_worker = eng.name
        self.requests_by_tag[id(er)] = req
        if kind == "pd_decode":
            req.prefill_worker = pull_from
            req.prefill_done_at = now
            eng.add_pd(er, now, self.config.transfer_missing_only)
        else:
            eng.add(er, now)
        self._kick(eng)
        return er

    def abort(self, eng: Engine, er: EngineRequest) -> None:
        """The HTTP client of a protocol-mode request went away: abort it on its worker."""
        self.requests_by_tag.pop(id(er), None)
        if eng.abort(er, self.loop.now):
            self._kick(eng)

    def _leg_done(self, er: EngineRequest, now: float) -> None:
        req = er.tag
        assert isinstance(req, SimRequest)
        self.requests_by_tag.pop(id(er), None)
        req.finish = now
        req.output_tokens = er.generated
        if req.on_complete is not None:
            req.on_complete(req)

    def _prefill_done(self, er: EngineRequest, now: float) -> None:
        req = er.tag
        assert isinstance(req, SimRequest)
        self.requests_by_tag.pop(id(er), None)
        req.prefill_done_at = now
        d = self._decode_for(req.session)
        if d is None:
            self._reject(req, "no_decode_worker")
            return
        req.decode_worker = d.name
        der = EngineRequest(
            rid=req.rid, session=req.session, kind="pd_decode", prompt=req.prompt,
            shared_prefix=req.shared_prefix, max_out=req.output_tokens,
            max_tokens_param=req.max_tokens, arrival=now,
            on_first_token=self._first_token, on_done=self._decode_done, tag=req,
            on_token=self._token if req.stream is not None else None,
        )
        self.requests_by_tag[id(der)] = req
        d.add_pd(der, now, self.config.transfer_missing_only)
        self._kick(d)

    def _on_kv_alloc(self, er: EngineRequest, now: float) -> None:
        req = er.tag
        assert isinstance(req, SimRequest)
        d = next((e for e in self.decode if e.name == req.decode_worker), None)
        link = self.links.get(req.prefill_worker or "")
        if link is None:  # its prefill worker is gone: any NIC with the same settings
            link = KvLink("detached", self.config.kv_link_gbps, self.config.kv_link_setup_s,
                          self.link_factor)
        nbytes = er.external * self.kv_bytes_per_token
        start, end = link.schedule(now, nbytes)
        if req.prefill_done_at is not None and start - req.prefill_done_at > KV_LEASE_S:
            # vLLM NIXL: the decoder read the KV after P's lease ran out (counted on P; the
            # simulated blocks are still there, so the transfer proceeds)
            p = next((e for e in self.prefill if e.name == req.prefill_worker), None)
            if p is not None:
                p.metrics.nixl_expired += 1
        req.kv_bytes += nbytes
        req.xfer_s = end - start
        self.kv_bytes += nbytes
        if d is not None:
            if start <= now:
                d.fetch_started(er)
            else:
                self.loop.at(start, self._fetch_started, d, er)
            self.loop.at(end, self._kv_arrived, d, er, end - start, nbytes)

    def _fetch_started(self, d: Engine, er: EngineRequest) -> None:
        if d.alive and er in d.fetching:
            d.fetch_started(er)

    def _kv_arrived(self, d: Engine, er: EngineRequest, xfer_s: float, nbytes: int) -> None:
        if not d.alive or er not in d.fetching:
            return
        d.kv_arrived(er, self.loop.now, xfer_s, nbytes)
        self._kick(d)

    def _first_token(self, er: EngineRequest, now: float) -> None:
        req = er.tag
        assert isinstance(req, SimRequest)
        req.first_token = now
        if req.stream is not None:
            req.stream(req, 1, now)

    def _token(self, er: EngineRequest, now: float) -> None:
        req = er.tag
        assert isinstance(req, SimRequest)
        if req.stream is not None and er.generated < er.max_out:
            req.stream(req, er.generated, now)

    def _decode_done(self, er: EngineRequest, now: float) -> None:
        req = er.tag
        assert isinstance(req, SimRequest)
        self.requests_by_tag.pop(id(er), None)
        req.finish = now
        first = req.first_token if req.first_token is not None else now
        req.tpot = (now - first) / (er.generated - 1) if er.generated > 1 else None
        ttft = first - req.arrival
        if req.decision is not None and req.features is not None:
            self.routers[req.router].observe(req.decision, ttft, req.tpot, req.features)
        if req.stream is not None:
            req.stream(req, er.generated, now)
        if req.on_complete is not None:
            req.on_complete(req)

    def busy(self) -> bool:
        return any(e.busy or e.waiting or e.fetching for e in self.engines)


def finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)
