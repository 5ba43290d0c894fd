"""The active cold-start calibration, executed: the PPD paper's offline method, done live.

:func:`controller.core.active.plan_active_calibration` plans (pure); this module does the
I/O. For each phase of the plan (forced all-prefill-node, then forced all-decode-local):

1. the forced policy is stored as a normal approved, versioned policy (reason "active
   calibration: forced prefill" / "... decode-local"), made every router's desired version
   and pushed through the :class:`~controller.rollout.reconciler.Reconciler`; every router
   must acknowledge it, else the run stops and the routers go back to what they ran;
2. the phase's synthetic two-turn conversations go through the OpenAI-compatible endpoints
   (``POST {base}/chat/completions``, ``X-Session-Id`` per conversation) with ``httpx``,
   paced at each load point's QPS, under a concurrency bound, a request budget and a
   deadline (progress shown with rich on a TTY);
3. meanwhile the configured :class:`~controller.observe.source.MetricsSource` is read every
   ``window_s`` and every window is stored.

Then the learner calibrates on the usable windows of both phases, the candidate is recorded
like the daemon records one (policy + calibration with its drift reference, trigger
``active``) and, approved (always, with no current policy) or not, the routers are brought
to the outcome: the first table, or back to the policy they ran before.

What they ran before: the store's fleet version; when no configured router has a desired
version (an empty store, or routers replaced under new addresses) the policy every router
reports (``GetPolicy``), adopted and recorded as the daemon adopts it, and judged by the
guardrail against the first table. Routers that run no policy at all return to
classic P/D (the forced all-prefill-node table, stored as its own version): a forced
policy, decode-local above all, must never be left behind by a failed, refused or
interrupted (Ctrl-C) run. A run refuses to start when it cannot tell what the routers run.

Run it with the daemon stopped: a live leader lease held by someone else refuses the run
(the leader would push its own policy over the forced ones). Given a leadership, the run
takes the leader lease itself and holds it to the end, so a daemon started meanwhile follows
(it may reconcile the routers to the desired version, which is the run's) and takes over
once the run is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import httpx

from controller.clock import Clock
from controller.core.active import ActivePlan, LoadPoint, Phase, schedule
from controller.core.rollout import FALLBACK_PREFILL, operator_state
from controller.core.trigger import Trigger
from controller.core.window import Window
from controller.loop.leader import LeaseLeadership
from controller.loop.learning import (
    CalibrationOutcome,
    Learner,
    LearnerError,
    without_exploration,
)
from controller.loop.policies import read_rollout, record_adoption
from controller.observe.source import MetricsSource
from controller.policy import Policy, Route, dumps, loads
from controller.rollout.reconciler import Reconciler, RouterStatus
from controller.store import Lease, OperatorRequest, PolicyKind, Store, policy_kind
from controller.store.kinds import FORCED_PREFIX
from controller.tokenize import Tokenizer, bundled_tokenizer_dir, fill_message, load_tokenizer

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

log = logging.getLogger("pdctl.calibrate_active")

PHASE_REASON = {Route.PREFILL_NODE: f"{FORCED_PREFIX}prefill",
                Route.DECODE_LOCAL: f"{FORCED_PREFIX}decode-local"}
FALLBACK_REASON = ("active calibration: classic P/D, the routers ran no policy before "
                   "the run")


class ActiveCalibrationError(Exception):
    """The active calibration could not run or finish (the message says why; ``report``
    holds what was done until then)."""

    def __init__(self, message: str, report: ActiveReport | None = None) -> None:
        super().__init__(message)
        self.report = report


@dataclass(frozen=True, slots=True)
class RunnerLimits:
    max_requests: int = 4000  # requests sent, both phases together
    max_duration_s: float = 1800.0  # wall time of the load, both phases together
    concurrency: int = 32  # requests in flight at once
    window_s: float = 10.0  # metrics window length while the load runs
    request_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.max_requests < 1 or self.concurrency < 1:
            raise ValueError("max_requests and concurrency must be >= 1")
        if self.max_duration_s <= 0 or self.window_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("durations must be > 0")


@dataclass(slots=True)
class PhaseReport:
    name: str
    version: int
    reason: str
    acked: dict[str, int | None] = field(default_factory=dict)
    window_ids: list[int] = field(default_factory=list)
    usable_window_ids: list[int] = field(default_factory=list)
    requests_sent: int = 0
    requests_ok: int = 0
    requests_failed: int = 0
    points_run: int = 0
    stopped: str | None = None  # why the load stopped before the plan's end


@dataclass(slots=True)
class ActiveReport:
    phases: list[PhaseReport] = field(default_factory=list)
    calibration_id: int | None = None
    policy_version: int | None = None  # the first table's (None: refused, it takes none)
    approved: bool = False
    reason: str = ""
    predicted_goodput: dict[str, float | None] = field(default_factory=dict)
    heldout_error: Mapping[str, Any] = field(default_factory=dict)
    final_version: int | None = None  # what the routers run at the end
    final_acked: dict[str, int | None] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ActiveCalibrationRunner:
    def __init__(
        self,
        *,
        plan: ActivePlan,
        store: Store,
        reconciler: Reconciler,
        routers: Sequence[str],
        endpoints: Sequence[str],
        source: MetricsSource,
        learner: Learner,
        clock: Clock,
        limits: RunnerLimits | None = None,
        model: str | None = None,
        progress: Progress | None = None,
        http: httpx.AsyncClient | None = None,
        leadership: LeaseLeadership | None = None,
        on_start: Callable[[], None] | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        if not routers:
            raise ValueError("an active calibration needs routers to force policies on")
        if not endpoints:
            raise ValueError("an active calibration needs an OpenAI-compatible endpoint")
        self.plan = plan
        self.store = store
        self.reconciler = reconciler
        self.routers = list(routers)
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.source = source
        self.learner = learner
        self.clock = clock
        self.limits = limits or RunnerLimits()
        self.model = model
        # Prompts are sized with the served model's tokenizer (default: the simulator's), so
        # each conversation lands in the context class and append size of its load point.
        self.tokenizer = tokenizer or load_tokenizer(bundled_tokenizer_dir())
        self.progress = progress
        self._http = http
        # Held for the whole run (renewed every third of its lifetime): a daemon started
        # meanwhile follows instead of calibrating and approving over the forced policies.
        self.leadership = leadership
        self.on_start = on_start  # called once the checks passed, before anything is forced
        self._lease_lost: str | None = None
        self._exploration_off = False
        self.report: ActiveReport | None = None  # the run's, as far as it got
        self._budget = self.limits.max_requests
        self._sessions = 0
        self._run_id = f"{int(clock.now() * 1000):x}"

    # -- the run ------------------------------------------------------------------------

    async def run(self) -> ActiveReport:
        if self.leadership is None:
            return await self._run_leading()
        if not await self.leadership.ensure():
            raise ActiveCalibrationError(self._lease_refusal())
        keeper = asyncio.create_task(self._keep_lease(self.leadership))
        try:
            return await self._run_leading()
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
            await self.leadership.release()

    def _lease_holder(self) -> tuple[str, Lease | None]:
        with self.store.read() as tx:
            lease = tx.lease()
        return (lease.holder if lease is not None and lease.holder
                else "another controller"), lease

    def _lease_refusal(self) -> str:
        holder, lease = self._lease_holder()
        left = ""
        if lease is not None and lease.expires_at is not None:
            seconds = (lease.expires_at - self.clock.utcnow()).total_seconds()
            left = f" for {max(seconds, 0.0):.0f} s more"
        return (f"{holder} holds the leader lease{left}: stop the daemon first (it would push "
                "its own policy over the forced ones); a run that was killed holds it until it "
                "expires")

    async def _keep_lease(self, leadership: LeaseLeadership) -> None:
        while True:
            await self.clock.sleep(leadership.ttl_s / 3)
            try:
                if await leadership.ensure():
                    continue
                self._lease_lost = f"{self._lease_holder()[0]} took the leader lease"
            except Exception as e:  # the store unreachable: the next renewal tries again
                log.warning("cannot renew the leader lease: %s", e)

    def _check_lease(self) -> None:
        """Stop before the next push when another controller leads now."""
        if self._lease_lost is not None:
            raise ActiveCalibrationError(f"{self._lease_lost} during the run: stopped")

    async def _run_leading(self) -> ActiveReport:
        previous = await self._before()
        if self.on_start is not None:
            self.on_start()
        report = self.report = ActiveReport()
        try:
            await self._run(previous, report)
        except (ActiveCalibrationError, asyncio.CancelledError) as e:
            # Nothing forced stays behind: the routers go back before the error (or the
            # Ctrl-C) goes on. A second Ctrl-C during this push stops it.
            await self._restore(previous, report)
            if isinstance(e, ActiveCalibrationError) and e.report is None:
                e.report = report
            raise
        finally:
            self._retire_forced()
        return report

    def _retire_forced(self) -> None:
        """The forced policies no router is to run any more become ``superseded``: an
        approved all-decode-local table must not be what `pdctl rollback` (newest approved
        version below the fleet's) or a promotion watch's rollback returns to."""
        with self.store.cycle() as tx:
            desired = set(tx.desired_versions().values())
            for p in tx.policies(status="approved"):
                if policy_kind(p) is PolicyKind.FORCED and p.version not in desired:
                    tx.set_policy_status(p.version, "superseded",
                                         f"{p.reason} (the run is over: not a rollback target)")

    async def _run(self, previous: Policy | None, report: ActiveReport) -> None:
        deadline = self.clock.monotonic() + self.limits.max_duration_s
        own_http = self._http is None
        http = self._http or httpx.AsyncClient(
            timeout=self.limits.request_timeout_s,
            limits=httpx.Limits(max_connections=self.limits.concurrency))
        windows: list[tuple[int, Window]] = []
        try:
            for i, phase in enumerate(self.plan.phases):
                now = self.clock.monotonic()
                if self._budget <= 0 or now >= deadline:
                    break
                # Each phase gets its share of the time left: the first cannot starve the
                # second (the plan's durations ignore answer latency).
                share = now + (deadline - now) / (len(self.plan.phases) - i)
                _, got = await self._phase(phase, http, share, report)
                windows += got
        finally:
            if own_http:
                await http.aclose()
        if len(report.phases) < len(self.plan.phases):
            raise ActiveCalibrationError(
                f"the bounds ({self.limits.max_requests} requests, "
                f"{self.limits.max_duration_s:g} s) ran out before the "
                f"{self.plan.phases[len(report.phases)].route.name} phase", report)
        outcome = await self._calibrate(windows, previous)
        if self._exploration_off:  # an operator turned it off: the cycle's rule too
            outcome = replace(outcome, policy=without_exploration(outcome.policy))
        self._check_lease()
        first_table = self._record(outcome, windows, previous, report)
        if outcome.approved:
            final, statuses = await self._push(first_table, report.reason)
            report.final_version, report.final_acked = final.version, _acked(statuses)
        else:
            await self._restore(previous, report)

    async def _before(self) -> Policy | None:
        """Refuse while another leader holds a live lease; the policy the routers run now
        (None: they run none, or only a forced one an interrupted run left behind)."""
        now = self.clock.utcnow()
        with self.store.read() as tx:
            lease = tx.lease()
            ours = self.leadership.holder if self.leadership is not None else None
            held = (lease is not None and lease.holder is not None and lease.holder != ours
                    and lease.expires_at is not None and lease.expires_at > now)
            ops = operator_state(tx.requests(status="done"))
            waiting = [r for r in tx.requests(status="pending") + tx.requests(status="claimed")
                       if r.kind in _ROLLOUT_REQUESTS]
            rollout = read_rollout(tx, self.routers)
            rec = tx.policy(rollout.fleet_version) if rollout.fleet_version else None
        if held:
            raise ActiveCalibrationError(self._lease_refusal())
        if ops.holding:
            what = ("paused (`pdctl resume`)" if ops.paused else
                    f"pinned to v{ops.pinned} (`pdctl unpin`)" if ops.pinned is not None else
                    "in fallback (`pdctl unpin`)")
            raise ActiveCalibrationError(
                f"an operator holds the rollout: {what}; release it with the daemon running, "
                "stop the daemon, then run again")
        if waiting:
            # The daemon would apply them when it starts, over the first table: a pin
            # filed while it was stopped would undo the run the moment the loop took over.
            listed = ", ".join(f"#{r.id} {_requested(r)}"
                               for r in sorted(waiting, key=lambda r: r.id))
            raise ActiveCalibrationError(
                f"operator requests wait for the daemon: {listed}; start the daemon to apply "
                "them (release a hold with it running), stop it, then run again")
        self._exploration_off = ops.exploration_off
        # Every router must answer before anything is forced: one that cannot would fail
        # the run only after the others ran the forced policy.
        found = await self.reconciler.running_policy(self.routers)
        if found.unanswered:
            raise ActiveCalibrationError(
                f"not every router answered, nothing was pushed: {'; '.join(found.unanswered)}")
        if rec is not None:
            return None if policy_kind(rec) is PolicyKind.FORCED else loads(rec.body_json)
        # No configured router has a desired version: an empty store, or routers that
        # replaced every earlier one (a redeploy under new addresses). What they run is
        # adopted as the daemon adopts it, else a failed run would leave them on classic P/D
        # and the first table would be approved with nothing to compare it with.
        if found.policy is None:
            if found.why:
                raise ActiveCalibrationError(
                    f"cannot tell what the routers run ({found.why}), so a failed run could "
                    "not return them to it: make every router answer and run one policy "
                    "(`pdctl push FILE`), then run again")
            return None  # new routers: a failed run leaves them on classic P/D
        with self.store.cycle() as tx:
            policy, said, _ = record_adoption(tx, found, self.routers, "calibrate-active")
            stored = tx.policy(policy.version)
        log.info("%s", said)
        # A stored forced version they still run (an interrupted run's) is nothing to keep.
        forced = stored is not None and policy_kind(stored) is PolicyKind.FORCED
        return None if forced else policy

    # -- one phase ----------------------------------------------------------------------

    async def _phase(self, phase: Phase, http: httpx.AsyncClient, deadline: float,
                     report: ActiveReport) -> tuple[PhaseReport, list[tuple[int, Window]]]:
        """Force the phase's policy everywhere and drive its load (its report is added to
        ``report`` first, so a failure shows what was done)."""
        self._check_lease()
        reason = PHASE_REASON[phase.route]
        with self.store.cycle() as tx:
            version = tx.next_version()
            policy = phase.policy.with_version(version)
            tx.add_policy(version, policy.checksum, dumps(policy), "approved", reason,
                          kind=PolicyKind.FORCED)
            for r in self.routers:
                tx.set_desired(r, version)
        name = "all-prefill-node" if phase.route == Route.PREFILL_NODE else "all-decode-local"
        policy, statuses = await self._push(policy, reason)
        ph = PhaseReport(name, policy.version, reason, _acked(statuses))
        report.phases.append(ph)
        missing = [r for r, s in statuses.items() if not s.ok]
        if missing:
            raise ActiveCalibrationError(
                f"v{policy.version} ({name}) was not acknowledged by {', '.join(missing)}: "
                + "; ".join(f"{s.outcome}: {s.last_error}" for s in statuses.values()
                            if not s.ok))

        # The first read sets the baseline (scrape sources diff snapshots); what it covers
        # ran under the previous policy and is not this phase's.
        start = self.clock.now()
        await self.source.window(start - self.limits.window_s, start)
        done = asyncio.Event()
        collector = asyncio.create_task(self._collect(done, start))
        try:
            await self._drive(phase, ph, http, deadline)
        finally:
            done.set()
            got = await collector
        for wid, w in got:
            ph.window_ids.append(wid)
            if _usable(w):
                ph.usable_window_ids.append(wid)
        if ph.requests_ok < ph.requests_sent / 2:
            # The windows may still hold routed requests (the cluster's own traffic), but
            # not the grid this phase was to measure: a table from them is no calibration.
            raise ActiveCalibrationError(
                f"{ph.name}: only {ph.requests_ok} of {ph.requests_sent} requests were "
                f"answered: the grid was not measured (check --openai "
                f"{', '.join(self.endpoints)} and --model)")
        return ph, [(i, w) for i, w in got if _usable(w)]

    async def _collect(self, done: asyncio.Event, start: float) -> list[tuple[int, Window]]:
        """One window every ``window_s`` until the load is done, then the last partial one."""
        out: list[tuple[int, Window]] = []
        while True:
            finished = await self._sleep_or(done, start + self.limits.window_s
                                            - self.clock.now())
            end = self.clock.now()
            if end - start > 1e-3:
                w = await self.source.window(start, end)
                with self.store.cycle() as tx:
                    out.append((tx.add_window(w), w))
                start = end
            if finished:
                return out

    async def _sleep_or(self, event: asyncio.Event, seconds: float) -> bool:
        """Sleep ``seconds`` on the clock or until ``event``; True when the event is set."""
        if event.is_set():
            return True
        sleeper = asyncio.ensure_future(self.clock.sleep(max(seconds, 0.0)))
        waiter = asyncio.ensure_future(event.wait())
        await asyncio.wait({sleeper, waiter}, return_when=asyncio.FIRST_COMPLETED)
        for t in (sleeper, waiter):
            t.cancel()
        return event.is_set()

    async def _drive(self, phase: Phase, ph: PhaseReport, http: httpx.AsyncClient,
                     deadline: float) -> None:
        """Every load point starts at its scheduled time (:func:`schedule`), not after the
        previous point's slowest answer: the phase takes about its scheduled time, and a
        point's tail overlaps the next point's start."""
        task: TaskID | None = None
        if self.progress is not None:
            task = self.progress.add_task(ph.name, total=min(phase.requests, self._budget))
        gate = asyncio.Semaphore(self.limits.concurrency)
        t0 = self.clock.monotonic()
        await asyncio.gather(*(
            self._drive_point(sp.point, f"{ph.name}-{i}", ph, gate, http, deadline, task,
                              t0 + sp.start_s, sp.gap_s)
            for i, sp in enumerate(schedule(phase.points, len(self.endpoints)))))

    async def _drive_point(self, point: LoadPoint, tag: str, ph: PhaseReport,
                           gate: asyncio.Semaphore, http: httpx.AsyncClient, deadline: float,
                           task: TaskID | None, t0: float, gap: float) -> None:
        """``point.sessions`` two-turn conversations from ``t0``, spread over the endpoints
        round robin: conversation j starts at ``2j·gap``, its second turn one ``gap`` later
        (or when the first answered, if later).
        """
        await self._sleep_until(t0)
        if self._budget <= 0 or self.clock.monotonic() >= deadline:
            ph.stopped = ph.stopped or ("request budget spent" if self._budget <= 0
                                        else "deadline reached")
            return
        ph.points_run += 1
        tok = self.tokenizer
        first = [{"role": "user", "content": fill_message(tok, [], point.turn1_prompt_tokens)}]
        # turn 2's prompt: turn 1's prompt and output (the context) + the append
        second_total = tok.count_chat(first) + point.output_tokens + point.append_tokens

        async def conversation(j: int) -> None:
            endpoint = self.endpoints[self._sessions % len(self.endpoints)]
            self._sessions += 1
            session = f"pdctl-active-{self._run_id}-{tag}-{j}"
            await self._sleep_until(t0 + 2 * j * gap)
            reply = await self._turn(http, gate, endpoint, session, first,
                                     point.output_tokens, ph, deadline, task)
            if reply is None:
                return
            before = [*first, {"role": "assistant", "content": reply}]
            second = [*before, {"role": "user",
                                "content": fill_message(tok, before, second_total)}]
            await self._sleep_until(t0 + (2 * j + 1) * gap)
            await self._turn(http, gate, endpoint, session, second, point.output_tokens, ph,
                             deadline, task)

        await asyncio.gather(*(conversation(j) for j in range(point.sessions)))

    async def _sleep_until(self, at_monotonic: float) -> None:
        delay = at_monotonic - self.clock.monotonic()
        if delay > 0:
            await self.clock.sleep(delay)

    async def _turn(self, http: httpx.AsyncClient, gate: asyncio.Semaphore, endpoint: str,
                    session: str, messages: list[dict[str, str]], max_tokens: int,
                    ph: PhaseReport, deadline: float, task: TaskID | None) -> str | None:
        """One request; the assistant's text, or None (failed, or out of budget or time)."""
        if self._budget <= 0 or self.clock.monotonic() >= deadline:
            ph.stopped = ph.stopped or ("request budget spent" if self._budget <= 0
                                        else "deadline reached")
            return None
        self._budget -= 1
        body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens,
                                "stream": False}
        if self.model is not None:
            body["model"] = self.model
        ph.requests_sent += 1
        try:
            async with gate:
                resp = await http.post(f"{endpoint}/chat/completions", json=body,
                                       headers={"X-Session-Id": session})
            resp.raise_for_status()
            text = str(resp.json()["choices"][0]["message"]["content"])
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            ph.requests_failed += 1
            return None
        finally:
            if self.progress is not None and task is not None:
                self.progress.advance(task)
        ph.requests_ok += 1
        return text

    # -- calibrate, record, push --------------------------------------------------------

    async def _calibrate(self, windows: list[tuple[int, Window]], previous: Policy | None
                         ) -> CalibrationOutcome:
        now = self.clock.now()

        def fit() -> CalibrationOutcome:
            return self.learner.calibrate([w for _, w in windows], previous, now,
                                          "active calibration")

        try:
            return await asyncio.to_thread(fit)
        except LearnerError as e:
            raise ActiveCalibrationError(
                f"cannot calibrate from the {len(windows)} usable window(s): {e}") from None

    def _record(self, outcome: CalibrationOutcome, windows: list[tuple[int, Window]],
                previous: Policy | None, report: ActiveReport) -> Policy:
        """Store the first table and its calibration as the daemon's cycle does; the table
        (renumbered by the store when approved; a refused one takes no version and is kept
        with its calibration, as the cycle keeps a refused candidate)."""
        with self.store.cycle() as tx:
            version: int | None = None
            candidate: tuple[str, str] | None = None
            policy = outcome.policy
            if outcome.approved:
                version = tx.next_version()
                policy = outcome.policy.with_version(version)
                tx.add_policy(version, policy.checksum, dumps(policy), "approved",
                              f"active calibration: {outcome.reason}")
            else:
                candidate = (dumps(policy), policy.checksum)
            # Approved: the first table; refused: back to what ran before (with no policy
            # before there is nothing to refuse against: the guardrail approves).
            keep = version if outcome.approved else previous.version if previous else None
            if keep is not None:
                for r in self.routers:
                    tx.set_desired(r, keep)
            report.calibration_id = tx.add_calibration(
                [i for i, _ in windows], outcome.heldout_error, outcome.predicted_goodput_new,
                outcome.predicted_goodput_current, version,
                {**outcome.details, "trigger": Trigger.ACTIVE, "dry_run": False,
                 "approved": outcome.approved, "reason": outcome.reason,
                 "forced_versions": [p.version for p in report.phases]},
                candidate=candidate,
            )
        report.policy_version = version
        report.approved = outcome.approved
        report.reason = outcome.reason
        report.predicted_goodput = {"current": outcome.predicted_goodput_current,
                                    "candidate": outcome.predicted_goodput_new}
        report.heldout_error = outcome.heldout_error
        return policy

    async def _push(self, policy: Policy, reason: str, rollback: bool = False
                    ) -> tuple[Policy, dict[str, RouterStatus]]:
        """Bring every router to ``policy`` and record the outcome. A router found at the
        same version with other content (or ahead) gets it re-issued above (the reconciler's
        rule); the re-issued version is stored and made desired, as the daemon does."""
        with self.store.read() as tx:
            floor = tx.next_version()  # a re-issue must not take a stored version's number
        statuses = await self.reconciler.reconcile(dict.fromkeys(self.routers, policy),
                                                   rollback=rollback, version_floor=floor)
        reissued = sorted({s.reissued_as for s in statuses.values() if s.reissued_as})
        if reissued:
            old, policy = policy.version, policy.with_version(reissued[-1])
            with self.store.cycle() as tx:
                if tx.policy(policy.version) is None:
                    tx.add_policy(policy.version, policy.checksum, dumps(policy), "approved",
                                  f"{reason} (v{old} re-issued above a router that was "
                                  f"ahead)".lstrip())
                for r in self.routers:
                    tx.set_desired(r, policy.version)
        self._record_statuses(statuses, policy.version)
        return policy, dict(statuses)

    async def _restore(self, previous: Policy | None, report: ActiveReport) -> None:
        """After a failed, refused or interrupted run: every router back to what it ran, or
        to classic P/D when it ran no policy (recorded in ``report.final_*``)."""
        with self.store.cycle() as tx:
            if previous is None:
                prefill = next(p for p in self.plan.phases if p.route == Route.PREFILL_NODE)
                previous = prefill.policy.with_version(tx.next_version())
                tx.add_policy(previous.version, previous.checksum, dumps(previous),
                              "approved", FALLBACK_REASON)
            for r in self.routers:
                tx.set_desired(r, previous.version)
        final, statuses = await self._push(previous, "", rollback=True)
        report.final_version, report.final_acked = final.version, _acked(statuses)

    def _record_statuses(self, statuses: Mapping[str, RouterStatus], version: int) -> None:
        at = self.clock.utcnow()
        with self.store.cycle() as tx:
            for router, s in statuses.items():
                if s.ok and s.acked_version is not None and s.acked_checksum is not None:
                    tx.record_ack(router, s.acked_version, s.acked_checksum, at=at)
                elif not s.ok:
                    tx.record_router_error(router, f"{s.outcome}: {s.last_error}", at=at)
                if s.pushed:
                    tx.add_push(router, s.reissued_as or version,
                                "ok" if s.ok else s.outcome, s.latency_s,
                                None if s.ok else s.last_error, at=at)


def _acked(statuses: Mapping[str, RouterStatus]) -> dict[str, int | None]:
    return {r: s.acked_version for r, s in statuses.items()}


def _usable(w: Window) -> bool:
    """Fit to learn from: routed requests and every target read."""
    return bool(w.outcomes) and not w.failures


# The requests a daemon would apply over the first table: holds and rollbacks.
_ROLLOUT_REQUESTS = ("pause", "rollback")


def _requested(r: OperatorRequest) -> str:
    """What an operator asked, in the words of the command that filed it."""
    args = r.args or {}
    if r.kind == "rollback":
        to = args.get("to")
        return "fallback" if to == FALLBACK_PREFILL else f"rollback to v{args.get('version')}"
    what = args.get("what", "approvals")
    if what == "pin":
        return f"pin v{args.get('version')}"
    return "exploration off" if what == "exploration" else "pause"
