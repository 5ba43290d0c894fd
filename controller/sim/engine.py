"""A continuous-batching engine (vLLM V1 scheduler semantics, simplified) in virtual time.

Per step the scheduler serves running requests first (a decode token each, or the next
prefill chunk), then admits waiting ones FIFO while the token budget (``max_batch_tokens``),
``max_num_seqs`` and the KV pool allow. KV lives in ``block_size``-token blocks; when a running
request cannot grow, idle prefix-cache entries are evicted (LRU) and then the most recently
admitted request is preempted (its KV freed, recomputed later), as vLLM V1 does.

The prefix cache is per session: when a request finishes, its full blocks stay cached for the
session until evicted. A later request of the session hits ``min(cached, shared prefix,
prompt - 1)`` tokens, rounded down to whole blocks.

Runs: when a step is pure decode and every running request emitted a token in the previous
step, the next ``k`` steps are identical in composition (until the first request finishes, the
free pool would need an eviction, or an input arrives). They are computed in one go, with the
same per-step arithmetic as step-by-step mode, so every exported number is the same.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Literal

from controller.sim.profiles import Profile
from controller.sim.vllm_metrics import WorkerMetrics

Kind = Literal["local", "prefill", "pd_decode"]
FetchStage = Literal["waiting_to_start", "in_progress", "completed_waiting", "done"]


@dataclass(eq=False, slots=True)
class EngineRequest:
    """One request as an engine sees it."""

    rid: int
    session: str
    kind: Kind
    prompt: int
    shared_prefix: int  # prompt tokens shared with the session's earlier content
    max_out: int  # tokens this engine generates (1 on a prefill worker)
    max_tokens_param: int
    arrival: float
    on_first_token: Callable[[EngineRequest, float], None] | None = None
    on_done: Callable[[EngineRequest, float], None] | None = None
    on_token: Callable[[EngineRequest, float], None] | None = None  # live streaming
    # filled by the engine
    computed: int = 0
    generated: int = 0
    blocks: int = 0
    prefill_target: int = 0
    hit: int = 0
    external: int = 0
    queried: bool = False
    first_sched: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    preemptions: int = 0
    fetch_stage: FetchStage = "done"
    finished: bool = False
    aborted: bool = False
    admitted_seq: int = 0
    tag: object = field(default=None)

    @property
    def in_decode(self) -> bool:
        return self.generated > 0 and self.computed >= self.prefill_target


class Engine:
    """One worker: a KV pool, a scheduler, a prefix cache and its vLLM metrics."""

    def __init__(
        self,
        name: str,
        role: Literal["prefill", "decode"],
        profile: Profile,
        *,
        max_batch_tokens: int = 8192,
        prefix_cache: bool = True,
        runs: bool = True,
        metrics: WorkerMetrics | None = None,
        custom_buckets: dict[str, tuple[float, ...]] | None = None,
    ) -> None:
        self.name = name
        self.role = role
        self.profile = profile
        self.max_batch_tokens = max_batch_tokens
        self.prefix_cache = prefix_cache
        self.runs = runs
        self.bs = profile.block_size
        self.total_blocks = profile.num_gpu_blocks
        self.used_blocks = 0
        self.cached_blocks = 0
        self.cache: OrderedDict[str, int] = OrderedDict()  # session -> cached tokens (aligned)
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.fetching: list[EngineRequest] = []  # pd_decode requests waiting for their KV
        self.alive = True
        self.metrics = metrics or WorkerMetrics(
            model_name=profile.model_name,
            kv_role={"prefill": "kv_producer", "decode": "kv_consumer"}[role],
            num_gpu_blocks=profile.num_gpu_blocks,
            block_size=profile.block_size,
            max_model_len=profile.max_model_len,
            enable_prefix_caching=prefix_cache,
            custom_buckets=custom_buckets,
        )
        # What /metrics serves: the vLLM exposition, or a view of it (cluster.add_worker).
        self.registry = self.metrics.registry
        self._admit_seq = 0
        # the run in progress: steps left to apply, their composition and timing
        self.busy = False
        self.version = 0  # bumped whenever the pending run-end event becomes stale
        self.run_start = 0.0
        self.run_end = 0.0
        self._run_steps = 0
        self._run_mixed: list[tuple[EngineRequest, int]] | None = None
        self.on_alloc: Callable[[EngineRequest, float], None] | None = None
        self.steps = 0
        self.busy_time = 0.0
        self.sessions_assigned = 0
        p = profile
        self._fixed = p.fixed_s
        self._floor = p.floor_s
        self._a = p.a_s
        self._b = p.b_s
        self._cdec = p.c_dec_s
        self._cpf = p.c_pf_s
        self._run_batch = 0
        self._run_ctx0 = 0
        self._dts: list[float] = []
        self._ends: list[float] = []
        self._pos = 0

    def step_time(self, n_new: int, ctx_sum: int, pairs: float) -> float:
        """The step-time model (same arithmetic as :meth:`Profile.step_time_s`)."""
        lin = self._a + self._b * n_new
        if lin < self._floor:
            lin = self._floor
        return self._fixed + lin + self._cdec * ctx_sum + self._cpf * pairs

    # ---------------------------------------------------------------- KV pool and cache
    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self.used_blocks - self.cached_blocks

    def cached_tokens(self, session: str) -> int:
        return self.cache.get(session, 0)

    def usable_hit(self, session: str, prompt: int, shared_prefix: int) -> int:
        """Prompt tokens this engine would serve from its prefix cache."""
        if not self.prefix_cache:
            return 0
        c = self.cache.get(session, 0)
        h = min(c, shared_prefix, prompt - 1)
        return max(0, h - h % self.bs)

    def _evict_for(self, need: int, keep: str | None) -> bool:
        """Free idle cache entries (LRU first) until ``need`` blocks are free."""
        if self.free_blocks >= need:
            return True
        for sess in list(self.cache):
            if self.free_blocks >= need:
                break
            if sess == keep:
                continue
            self.cached_blocks -= self.cache.pop(sess) // self.bs
        return self.free_blocks >= need

    def _cache_put(self, req: EngineRequest) -> None:
        tokens = req.computed - req.computed % self.bs
        old = self.cache.pop(req.session, None)
        if old is not None:
            self.cached_blocks -= old // self.bs
        self.used_blocks -= req.blocks
        req.blocks = 0
        if self.prefix_cache and tokens > 0:
            self.cache[req.session] = tokens
            self.cached_blocks += tokens // self.bs

    def drop_session(self, session: str) -> None:
        old = self.cache.pop(session, None)
        if old is not None:
            self.cached_blocks -= old // self.bs

    def _take_hit(self, req: EngineRequest, hit: int) -> None:
        """Move the session's cached blocks into the request (the part it hits)."""
        old = self.cache.pop(req.session, None)
        if old is not None:
            self.cached_blocks -= old // self.bs
        hb = hit // self.bs
        self.used_blocks += hb
        req.blocks += hb

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.bs)

    # ---------------------------------------------------------------- inputs
    def pending_prefill_tokens(self) -> int:
        n = 0
        for r in self.waiting:
            n += r.prefill_target - r.computed if r.queried else r.prompt
        for r in self.running:
            if not r.in_decode:
                n += r.prefill_target - r.computed
        return n

    def load(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.fetching)

    def add(self, req: EngineRequest, now: float) -> None:
        """A new request (local or prefill kind)."""
        req.prefill_target = req.prompt
        self.waiting.append(req)
        self._update_gauges()

    def add_pd(self, req: EngineRequest, now: float, missing_only: bool) -> int:
        """A P/D request arriving on a decode worker; returns tokens to pull over the link.

        The worker reserves blocks for the prompt's KV (minus the last position, which it
        recomputes) and then fetches; the request waits with reason ``deferred``.
        """
        req.prefill_target = req.prompt
        hit = self.usable_hit(req.session, req.prompt, req.shared_prefix) if missing_only else 0
        req.hit = hit
        req.external = req.prompt - 1 - hit
        req.fetch_stage = "waiting_to_start"
        self.fetching.append(req)
        self._try_alloc_fetches(now)
        self._update_gauges()
        return req.external

    def _try_alloc_fetches(self, now: float) -> None:
        for req in self.fetching:
            if req.fetch_stage != "waiting_to_start" or req.queried:
                continue
            own = self.cache.get(req.session, 0) // self.bs
            need = self._blocks_for(req.prompt - 1) - req.hit // self.bs
            if self.free_blocks + (own - req.hit // self.bs) < need and not self._evict_for(
                need - (own - req.hit // self.bs), req.session
            ):
                break  # FIFO: later fetches wait too
            if req.hit:
                self._take_hit(req, req.hit)
            else:
                self.drop_session(req.session)
            if self.free_blocks < need:
                self._evict_for(need, None)
            self.used_blocks += need
            req.blocks += need
            req.computed = req.prompt - 1
            req.queried = True
            m = self.metrics
            m.prefix_queries += req.prompt
            m.prefix_hits += req.hit
            m.external_queries += req.prompt - req.hit
            m.external_hits += req.external
            if self.on_alloc is not None:
                self.on_alloc(req, now)

    def fetch_started(self, req: EngineRequest) -> None:
        req.fetch_stage = "in_progress"
        self._update_gauges()

    def kv_arrived(self, req: EngineRequest, now: float, xfer_s: float, nbytes: int) -> None:
        """The pulled KV is in: the request becomes schedulable at the next step."""
        req.fetch_stage = "completed_waiting"
        self.fetching.remove(req)
        self.waiting.append(req)
        m = self.metrics
        m.h_xfer.observe(xfer_s)
        m.h_post.observe(0.0005)
        m.h_bytes.observe(float(nbytes))
        m.h_desc.observe(max(1, self._blocks_for(req.external)) * 1.0)
        self._update_gauges()

    # ---------------------------------------------------------------- scheduling
    def _preempt_last(self, now: float) -> EngineRequest:
        victim = self.running.pop()
        self.used_blocks -= victim.blocks
        victim.blocks = 0
        victim.computed = 0
        victim.hit = 0
        victim.external = 0
        victim.prefill_target = victim.prompt + max(0, victim.generated - 1)
        victim.preemptions += 1
        self.metrics.preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    def _schedule(self, now: float) -> list[tuple[EngineRequest, int]]:
        """Pick this step's work: (request, new tokens) pairs, allocating KV."""
        budget = self.max_batch_tokens
        out: list[tuple[EngineRequest, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            q = 1 if r.in_decode else min(r.prefill_target - r.computed, budget)
            need = self._blocks_for(r.computed + q) - r.blocks
            ok = True
            while need > 0 and not self._evict_for(need, None):
                victim = self._preempt_last(now)
                preempted = True
                if victim is r:
                    ok = False
                    break
            if not ok:
                break
            if need > 0:
                self.used_blocks += need
                r.blocks += need
            out.append((r, q))
            budget -= q
            i += 1
        if preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.profile.max_num_seqs:
            r = self.waiting[0]
            if r.queried:
                hit = 0
                own_extra = 0
            else:
                hit = self.usable_hit(r.session, r.prompt, r.shared_prefix)
                own = self.cache.get(r.session, 0) // self.bs
                own_extra = own - hit // self.bs
            start = r.computed + hit
            q = min(r.prefill_target - start, budget)
            need = self._blocks_for(start + q) - r.blocks - hit // self.bs
            if self.free_blocks + own_extra < need and not self._evict_for(
                need - own_extra, r.session
            ):
                break
            self.waiting.popleft()
            if not r.queried:
                r.queried = True
                r.hit = hit
                self.metrics.prefix_queries += r.prompt
                self.metrics.prefix_hits += hit
                if hit:
                    self._take_hit(r, hit)
                else:
                    self.drop_session(r.session)
                r.computed = hit
            if self.free_blocks < need:
                self._evict_for(need, None)
            self.used_blocks += need
            r.blocks += need
            if r.first_sched is None:
                r.first_sched = now
            r.fetch_stage = "done"
            self._admit_seq += 1
            r.admitted_seq = self._admit_seq
            self.running.append(r)
            out.append((r, q))
            budget -= q
        return out

    # ---------------------------------------------------------------- runs
    def kick(self, now: float) -> float | None:
        """An input arrived at ``now``. Returns the end time of a newly planned run (the
        caller schedules an event for it with the current :attr:`version`), or None."""
        if not self.alive:
            return None
        if not self.busy:
            return self._plan(now)
        if self._run_mixed is None and self._run_steps > 1:
            self._apply_completed(now)
            if self._run_steps > 1:
                # the step in progress finishes as planned; the input joins after it
                self._run_steps = 1
                self.run_end = self._ends[self._pos]
                self.version += 1
                return self.run_end
        return None

    def sync(self, now: float) -> None:
        """Apply the steps of the current run that completed by ``now`` (for a scrape)."""
        if self.busy and self._run_mixed is None and self._run_steps > 1:
            self._apply_completed(now)

    def _apply_completed(self, now: float) -> None:
        # steps of the run (all but its last) whose end is <= now
        pos = self._pos
        j = bisect_right(self._ends, now, pos, pos + self._run_steps - 1) - pos
        if j > 0:
            self._apply_decode_steps(j)

    def on_run_end(self, now: float) -> float | None:
        """The pending run ended at ``now``: apply it, finish requests, plan the next run."""
        if self._run_mixed is not None:
            self._apply_mixed(self._run_mixed, now)
        else:
            self._apply_decode_steps(self._run_steps)
        self._run_mixed = None
        self._run_steps = 0
        self.busy = False
        done = [r for r in self.running if r.generated >= r.max_out or r.aborted]
        if done:
            for r in done:
                self._finish(r, now)
            self.running = [r for r in self.running if not r.finished]
        return self._plan(now)

    def _plan(self, now: float) -> float | None:
        if self.fetching:
            self._try_alloc_fetches(now)
        sched = self._schedule(now)
        self._update_gauges()
        if not sched:
            self.busy = False
            return None
        self.busy = True
        self.run_start = now
        batch = len(sched)
        pure = batch == len(self.running) and all(q == 1 and r.in_decode for r, q in sched)
        if pure:
            ctx = 0
            for r in self.running:
                ctx += r.computed + 1
            k = 1
            if self.runs and all(r.last_token == now for r in self.running):
                k = min(r.max_out - r.generated for r in self.running)
                if k > 1:
                    k = self._block_limited_steps(k)
            self._run_mixed = None
            self._run_steps = k
            self._run_batch = batch
            self._run_ctx0 = ctx
            # per-step durations, with step_time()'s arithmetic (pairs = 0 adds exactly 0)
            lin = self._a + self._b * batch
            if lin < self._floor:
                lin = self._floor
            base = self._fixed + lin
            cdec = self._cdec
            # step i lasts base + cdec * (ctx + i * batch); its end is the running sum from
            # ``now``, added left to right (the same float operations as a step-by-step loop)
            dts = self._dts = [base + cdec * c for c in range(ctx, ctx + k * batch, batch)]
            ends = self._ends = list(accumulate(dts, initial=now))
            del ends[0]
            self._pos = 0
            self.run_end = ends[-1]
        else:
            n_new = 0
            ctx = 0
            pairs = 0.0
            for r, q in sched:
                n_new += q
                if r.in_decode:
                    ctx += r.computed + 1
                else:
                    pairs += q * (r.computed + q / 2)
            self._run_mixed = sched
            self._run_steps = 1
            self.run_end = now + self.step_time(n_new, ctx, pairs)
        self.version += 1
        return self.run_end

    def _block_limited_steps(self, k: int) -> int:
        """Largest run length <= k whose KV growth fits in the free pool (no eviction)."""
        free = self.free_blocks
        bs = self.bs

        def extra(j: int) -> int:
            # blocks needed for steps 2..j (step 1 is allocated by the scheduler)
            n = 0
            for r in self.running:
                n += -(-(r.computed + j) // bs) - r.blocks
            return n

        if extra(k) <= free:
            return k
        lo, hi = 1, k  # extra(lo) <= free < extra(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if extra(mid) <= free:
                lo = mid
            else:
                hi = mid
        return lo

    def _apply_decode_steps(self, j: int) -> None:
        """Apply the next ``j`` steps of the current decode run (bulk histogram updates)."""
        m = self.metrics
        batch = self._run_batch
        pos = self._pos
        dts = self._dts
        itl = m.h_itl
        bounds = itl.bounds
        counts = itl.counts
        nb = len(bounds)
        # durations grow within a run, so the bucket index only moves up
        idx = bisect_left(bounds, dts[pos])
        total = itl.sum
        for i in range(pos, pos + j):
            dt = dts[i]
            while idx < nb and bounds[idx] < dt:
                idx += 1
            counts[idx] += batch
            total += dt * batch
        itl.sum = total
        # j equal integer samples: the float sum is exact, as with j single observations
        m.h_iter.observe(batch, j)
        t = self._ends[pos + j - 1]
        m.generation_tokens += batch * j
        self.steps += j
        self.busy_time += t - self.run_start
        bs = self.bs
        grown = 0
        # a partial apply (a scrape mid-run) leaves the next step in progress: its KV is
        # allocated already, as the scheduler of step-by-step mode would have done
        ahead = 1 if self._run_steps > j else 0
        for r in self.running:
            r.computed += j
            r.generated += j
            r.last_token = t
            need = -(-(r.computed + ahead) // bs)
            if need > r.blocks:
                grown += need - r.blocks
                r.blocks = need
            if r.on_token is not None:
                r.on_token(r, t)
        self.used_blocks += grown
        self._run_steps -= j
        self._run_ctx0 += batch * j
        self._pos = pos + j
        self.run_start = t
        self._update_gauges()

    def _apply_mixed(self, sched: list[tuple[EngineRequest, int]], now: float) -> None:
        m = self.metrics
        n_new = 0
        for r, q in sched:
            n_new += q
            if r.in_decode:
                r.computed += 1
                r.generated += 1
                if r.last_token is not None:
                    m.h_itl.observe(now - r.last_token)
                r.last_token = now
                m.generation_tokens += 1
                if r.on_token is not None:
                    r.on_token(r, now)
            else:
                r.computed += q
                if r.computed >= r.prefill_target and r.generated == 0:
                    r.generated = 1
                    r.first_token = now
                    r.last_token = now
                    m.generation_tokens += 1
                    m.h_ttft.observe(now - r.arrival)
                    local = r.prompt - r.hit - r.external
                    m.prompt_tokens += r.prompt
                    m.prompt_by_source["local_compute"] += local
                    m.prompt_by_source["local_cache_hit"] += r.hit
                    m.prompt_by_source["external_kv_transfer"] += r.external
                    if r.on_first_token is not None:
                        r.on_first_token(r, now)
        m.h_iter.observe(n_new)
        self.steps += 1
        self.busy_time += now - self.run_start
        self._update_gauges()

    def _finish(self, r: EngineRequest, now: float) -> None:
        r.finished = True
        m = self.metrics
        first = r.first_token if r.first_token is not None else now
        sched = r.first_sched if r.first_sched is not None else now
        m.h_e2e.observe(now - r.arrival)
        m.h_queue.observe(sched - r.arrival)
        m.h_prefill.observe(first - sched)
        m.h_decode.observe(now - first)
        m.h_inference.observe(now - sched)
        if r.generated > 1:
            m.h_tpot.observe((now - first) / (r.generated - 1))
        m.h_prompt.observe(r.prompt)
        m.h_generation.observe(r.generated)
        m.h_max_generation.observe(r.max_tokens_param)
        m.h_max_tokens.observe(r.max_tokens_param)
        m.h_n.observe(1)
        m.h_kv_computed.observe(r.prompt - r.hit - r.external)
        m.h_preempt.observe(r.preemptions)
        if r.aborted:
            m.success["abort"] += 1
        else:
            m.success["length" if r.generated >= r.max_tokens_param else "stop"] += 1
        self._cache_put(r)
        if r.on_done is not None:
            r.on_done(r, now)

    def _update_gauges(self) -> None:
        m = self.metrics
        m.running = len(self.running)
        deferred = len(self.fetching)
        completed = 0
        for r in self.waiting:
            if r.fetch_stage == "completed_waiting":
                completed += 1
        m.waiting_deferred = deferred + completed
        m.waiting_capacity = len(self.waiting) - completed
        starting = 0
        for r in self.fetching:
            if r.fetch_stage == "waiting_to_start":
                starting += 1
        m.kv_fetch["waiting_to_start"] = starting
        m.kv_fetch["in_progress"] = deferred - starting
        m.kv_fetch["completed_waiting"] = completed
        m.kv_usage = self.used_blocks / self.total_blocks

    # ---------------------------------------------------------------- aborts
    def abort(self, req: EngineRequest, now: float) -> bool:
        """The client went away (vLLM aborts the request): a queued or fetching request
        leaves at once, its KV freed; a running one leaves at the end of the step in
        progress, counted ``finished_reason="abort"``. Its callbacks never fire again.
        False when the request had already finished."""
        if req.finished or req.aborted:
            return False
        req.aborted = True
        req.on_first_token = req.on_token = req.on_done = None
        if req in self.running:
            return True
        if req in self.fetching:
            self.fetching.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        else:
            return True
        self.used_blocks -= req.blocks
        req.blocks = 0
        req.finished = True
        self.metrics.success["abort"] += 1
        self._update_gauges()
        return True

    # ---------------------------------------------------------------- removal
    def shutdown(self) -> list[EngineRequest]:
        """The worker goes away: returns every unfinished request (to be retried)."""
        self.alive = False
        self.busy = False
        self.version += 1
        out = [*self.running, *self.waiting, *self.fetching]
        self.running = []
        self.waiting.clear()
        self.fetching = []
        self.cache.clear()
        self.used_blocks = 0
        self.cached_blocks = 0
        self._update_gauges()
        return out
