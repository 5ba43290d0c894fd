"""The reconciler: bring every router to its desired policy, level-triggered by router id.

For each router it reads what the router runs (``GetPolicy``) and pushes only where that
differs from the desired policy. Calls have deadlines; failures the transport calls
transient are retried with exponential backoff and full jitter (slept on the injected
:class:`Clock`); routers are handled concurrently under a concurrency bound, and a router's
retries sleep outside that bound, so an unreachable router never delays the others beyond
its own attempts.

A router found *ahead* of its desired policy (a higher version, e.g. after the store was
restored from a backup), or running the desired version under another checksum, is never
left diverged: the desired content is re-issued under ``max(every router's version, every
desired version) + 1`` to every router of that desired policy, and each status says
``reissued_as`` so the caller records the new version. Deciding that number needs every
router's version, so only the diverged path waits for the slowest ``GetPolicy``; routers in
sync or behind are pushed right away.

The transport is a seam (:class:`RouterTransport`): :class:`GrpcRouterTransport` in
:mod:`controller.rollout.client` talks to real routers; :class:`FakeRouterTransport` calls
:class:`RouterAgent` objects in memory. One contract test suite runs against both.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from controller.clock import Clock
from controller.config import RolloutConfig
from controller.errors import TerminalError, TransientError
from controller.policy import Policy
from controller.policy.validation import MAX_VERSION
from controller.rollout.agent import ApplyOutcome, RouterAgent

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RouterState:
    """What a router runs: version 0 and checksum "" when it has no policy."""

    version: int
    checksum: str


@dataclass(frozen=True, slots=True)
class ApplyReply:
    outcome: ApplyOutcome
    applied_version: int
    checksum: str
    message: str


class RouterTransport(Protocol):
    """How the reconciler reaches routers. Raise :class:`TransientError` for what may pass
    (unreachable, deadline exceeded) and :class:`TerminalError` for what will not (refused
    credentials, unimplemented)."""

    async def apply(
        self, router: str, policy: Policy, rollback: bool, deadline_s: float
    ) -> ApplyReply: ...

    async def get(self, router: str, deadline_s: float) -> RouterState: ...

    async def get_policy(
        self, router: str, deadline_s: float
    ) -> tuple[Policy | None, RouterState, float | None]:
        """The router's policy itself (None when it has none), its state, when applied."""
        ...


@dataclass(frozen=True, slots=True)
class RunningPolicy:
    """What :meth:`Reconciler.running_policy` found: the one policy every router runs, or
    why there is none (``policy`` None; ``why`` empty when no router runs any)."""

    policy: Policy | None
    why: str
    unanswered: tuple[str, ...] = ()  # "router: error" for each router that did not answer


@dataclass(frozen=True, slots=True)
class RouterStatus:
    """The outcome of one reconcile pass for one router.

    ``outcome``: ``in_sync`` (nothing pushed), ``applied``, ``noop``, or why it failed:
    ``unreachable``, ``refused`` (a terminal transport error), ``conflict``, ``stale``,
    ``invalid``, ``persist_failed``, ``mismatch`` (acked something other than pushed),
    ``ahead`` (found ahead after the re-issue version was chosen: next pass),
    ``held_off`` (not contacted: its last pushes were not acknowledged, see
    :meth:`Reconciler.hold_s`).
    """

    router: str
    ok: bool
    outcome: str
    acked_version: int | None
    acked_checksum: str | None
    last_error: str | None
    latency_s: float
    attempts: int
    pushed: bool = False
    reissued_as: int | None = None


@dataclass(frozen=True, slots=True)
class _Hold:
    """A router left alone after pushes it did not acknowledge: ``failures`` in a row of
    the policy content ``checksum``, not contacted before ``until`` (monotonic)."""

    checksum: str
    failures: int
    until: float
    last: str


class _RetriesExhausted(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)


@dataclass
class _Track:
    """Per-router bookkeeping during one pass."""

    router: str
    attempts: int = 0
    last_error: str | None = None
    pushed: bool = False
    state: RouterState | None = None
    status: RouterStatus | None = None
    refused_persist: ApplyReply | None = None


def _key(policy: Policy, checksum: str) -> tuple[int, str]:
    return (policy.version, checksum)


class Reconciler:
    def __init__(
        self,
        transport: RouterTransport,
        clock: Clock,
        *,
        max_concurrency: int = 64,
        deadline_s: float = 2.0,
        max_attempts: int = 5,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 5.0,
        unacked_hold_initial_s: float = 10.0,
        unacked_hold_max_s: float = 900.0,
        draw: Callable[[], float] | None = None,
    ) -> None:
        if max_concurrency < 1 or max_attempts < 1:
            raise ValueError("max_concurrency and max_attempts must be >= 1")
        self._transport = transport
        self._clock = clock
        self._max_concurrency = max_concurrency
        self._deadline_s = deadline_s
        self._max_attempts = max_attempts
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._draw: Callable[[], float] = draw if draw is not None else random.Random().random
        self._hold_initial_s = unacked_hold_initial_s
        self._hold_max_s = unacked_hold_max_s
        self._holds: dict[str, _Hold] = {}  # across passes: this object lives as the daemon

    @classmethod
    def from_config(
        cls,
        transport: RouterTransport,
        clock: Clock,
        config: RolloutConfig,
        draw: Callable[[], float] | None = None,
    ) -> Reconciler:
        return cls(
            transport,
            clock,
            max_concurrency=config.max_concurrency,
            deadline_s=config.push_deadline_s,
            max_attempts=config.max_attempts,
            backoff_initial_s=config.backoff_initial_s,
            backoff_max_s=config.backoff_max_s,
            unacked_hold_initial_s=config.unacked_hold_initial_s,
            unacked_hold_max_s=config.unacked_hold_max_s,
            draw=draw,
        )

    def backoff_s(self, attempt: int) -> float:
        """Full jitter: uniform in [0, min(max, initial * 2^(attempt-1)))."""
        cap = min(self._backoff_max_s, self._backoff_initial_s * 2.0 ** (attempt - 1))
        return self._draw() * cap

    def hold_s(self, failures: int) -> float:
        """How long a router is left alone after ``failures`` pushes in a row that it did
        not acknowledge: ``min(max, initial * 2^(failures-1))``, no jitter."""
        exponent = min(failures - 1, 60)
        return float(min(self._hold_max_s, self._hold_initial_s * 2.0 ** exponent))

    async def running_policy(self, routers: Sequence[str]) -> RunningPolicy:
        """The policy every one of ``routers`` runs, fetched from one of them: what a
        controller with nothing stored can adopt as the fleet's, to judge its first table
        against. One call per router, no retries (the next cycle asks again); the policy
        itself (up to megabytes) is fetched once, only when every router runs the same."""
        sem = asyncio.Semaphore(self._max_concurrency)

        async def state(router: str) -> RouterState | str:
            async with sem:
                try:
                    return await self._transport.get(router, self._deadline_s)
                except (TransientError, TerminalError) as e:
                    return f"{router}: {e}"

        if not routers:
            return RunningPolicy(None, "")
        answers = await asyncio.gather(*(state(r) for r in routers))
        failed = [a for a in answers if isinstance(a, str)]
        if failed:
            return RunningPolicy(None, f"not every router answered ({failed[0]})",
                                 tuple(failed))
        runs = {(a.version, a.checksum) for a in answers if isinstance(a, RouterState)}
        if runs == {(0, "")}:
            return RunningPolicy(None, "")  # new routers: nothing to adopt, nothing wrong
        if any(v == 0 for v, _ in runs):
            return RunningPolicy(None, "some routers run no policy")
        if len(runs) > 1:
            shown = ", ".join(f"v{v} {c[:12]}" for v, c in sorted(runs))
            return RunningPolicy(None, f"the routers run different policies ({shown})")
        ((version, checksum),) = runs
        try:
            policy, got, _ = await self._transport.get_policy(routers[0], self._deadline_s)
        except (TransientError, TerminalError) as e:
            return RunningPolicy(None, f"{routers[0]}: {e}")
        if policy is None or (got.version, got.checksum) != (version, checksum) \
                or policy.checksum != checksum:
            return RunningPolicy(None, f"{routers[0]} changed its policy while asked")
        return RunningPolicy(policy, f"every router runs v{version} ({checksum[:12]})")

    async def reconcile(
        self, desired: Mapping[str, Policy], *, rollback: bool = False,
        version_floor: int = 0,
    ) -> dict[str, RouterStatus]:
        """One pass over ``desired`` (router id -> policy); returns a status per router.

        ``rollback``: push a lower version as a rollback instead of re-issuing it above the
        routers that are ahead. ``version_floor``: the lowest version a re-issue may take
        (the store's next version: a number above the routers' may still be a stored,
        e.g. rejected, version).
        """
        now = self._clock.monotonic()
        held = {r: h for r, p in desired.items()
                if (h := self._holds.get(r)) is not None and now < h.until
                and h.checksum == p.checksum}
        todo = {r: p for r, p in desired.items() if r not in held}
        statuses = await _Pass(self, todo, rollback, version_floor).run()
        self._update_holds(todo, statuses)
        out = {}
        for router in desired:
            h = held.get(router)
            out[router] = statuses[router] if h is None else _held_status(router, h, now)
        return out

    def _update_holds(self, pushed: Mapping[str, Policy],
                      statuses: Mapping[str, RouterStatus]) -> None:
        """A router that was pushed and did not acknowledge (a mismatch, a conflict, an
        apply that never answered...) is held off for :meth:`hold_s`; an acknowledgement,
        or another policy content to push, starts it afresh."""
        now = self._clock.monotonic()
        for router, s in statuses.items():
            if s.ok:
                self._holds.pop(router, None)
            elif s.pushed:
                checksum = pushed[router].checksum
                prev = self._holds.get(router)
                failures = prev.failures + 1 if prev and prev.checksum == checksum else 1
                self._holds[router] = _Hold(checksum, failures, now + self.hold_s(failures),
                                            f"{s.outcome}: {s.last_error}")


def _held_status(router: str, hold: _Hold, now: float) -> RouterStatus:
    return RouterStatus(
        router=router, ok=False, outcome=HELD_OFF, acked_version=None, acked_checksum=None,
        last_error=(f"not contacted for {hold.until - now:.0f} s more after {hold.failures} "
                    f"push(es) in a row it did not acknowledge (last: {hold.last})"),
        latency_s=0.0, attempts=0,
    )


HELD_OFF = "held_off"


class _Pass:
    """The state of one reconcile pass (kept out of Reconciler so passes never share it)."""

    def __init__(self, rec: Reconciler, desired: Mapping[str, Policy], rollback: bool,
                 version_floor: int = 0) -> None:
        self.rec = rec
        self.desired = dict(desired)
        self.rollback = rollback
        self.version_floor = version_floor
        self.sem = asyncio.Semaphore(rec._max_concurrency)
        self.started = rec._clock.monotonic()
        # Checksums are computed once per distinct policy object (large tables are slow).
        self.checksums: dict[int, str] = {}
        for policy in self.desired.values():
            if id(policy) not in self.checksums:
                self.checksums[id(policy)] = policy.checksum
        self.tracks = {router: _Track(router) for router in self.desired}
        self.gets_pending = len(self.desired)
        self.all_gets_done = asyncio.Event()
        if not self.desired:
            self.all_gets_done.set()
        self.reissued: dict[tuple[int, str], Policy] | None = None

    def checksum(self, policy: Policy) -> str:
        cs = self.checksums.get(id(policy))
        if cs is None:
            cs = self.checksums[id(policy)] = policy.checksum
        return cs

    async def run(self) -> dict[str, RouterStatus]:
        await asyncio.gather(*(self.first_round(r) for r in self.desired))
        # Routers of a re-issued policy that were brought to the old desired version in the
        # first round follow it to the new one, so the pass ends with one version per policy.
        if self.reissued:
            laggards = [
                r for r, t in self.tracks.items()
                if t.status is not None and t.status.ok and t.status.reissued_as is None
                and self.group_key(r) in self.reissued
            ]
            await asyncio.gather(*(self.follow_reissue(r) for r in laggards))
        return {r: self.tracks[r].status or self.failed(r, "internal", "no status") for r in
                self.desired}

    def group_key(self, router: str) -> tuple[int, str]:
        policy = self.desired[router]
        return _key(policy, self.checksum(policy))

    # -- calls with retries ---------------------------------------------------------------

    async def call(self, track: _Track, op: Callable[[], Awaitable[T]]) -> T:
        rec = self.rec
        for attempt in range(1, rec._max_attempts + 1):
            async with self.sem:
                track.attempts += 1
                try:
                    return await op()
                except TransientError as e:
                    track.last_error = str(e)
            if attempt < rec._max_attempts:
                await rec._clock.sleep(rec.backoff_s(attempt))
        raise _RetriesExhausted(
            f"gave up after {rec._max_attempts} attempt(s): {track.last_error}"
        )

    async def get(self, track: _Track) -> RouterState:
        rec = self.rec
        return await self.call(track, lambda: rec._transport.get(track.router, rec._deadline_s))

    async def push(self, track: _Track, policy: Policy) -> ApplyReply:
        rec = self.rec
        track.pushed = True

        async def once() -> ApplyReply:
            # Only the last attempt's answer says what the router is: a refusal to persist
            # remembered from an earlier attempt would hide an outage (or a lost reply) after it.
            track.refused_persist = None
            reply = await rec._transport.apply(
                track.router, policy, self.rollback, rec._deadline_s
            )
            if reply.outcome is ApplyOutcome.PERSIST_FAILED:  # a disk may recover: retry
                track.refused_persist = reply
                raise TransientError(f"router {track.router}: {reply.message}")
            return reply

        try:
            return await self.call(track, once)
        except _RetriesExhausted:
            if track.refused_persist is not None:
                return track.refused_persist
            raise

    # -- statuses -------------------------------------------------------------------------

    def elapsed(self) -> float:
        return self.rec._clock.monotonic() - self.started

    def failed(self, router: str, outcome: str, error: str,
               reissued_as: int | None = None) -> RouterStatus:
        t = self.tracks[router]
        acked = t.state
        return RouterStatus(
            router=router, ok=False, outcome=outcome,
            acked_version=acked.version if acked else None,
            acked_checksum=acked.checksum if acked else None,
            last_error=error, latency_s=self.elapsed(), attempts=t.attempts, pushed=t.pushed,
            reissued_as=reissued_as,
        )

    def succeeded(
        self, router: str, outcome: str, state: RouterState, reissued_as: int | None
    ) -> RouterStatus:
        t = self.tracks[router]
        return RouterStatus(
            router=router, ok=True, outcome=outcome, acked_version=state.version,
            acked_checksum=state.checksum, last_error=None, latency_s=self.elapsed(),
            attempts=t.attempts, pushed=t.pushed, reissued_as=reissued_as,
        )

    # -- the per-router flow --------------------------------------------------------------

    def diverged(self, state: RouterState, target: Policy, checksum: str) -> bool:
        if state.version == target.version:
            return state.checksum != checksum
        return state.version > target.version and not self.rollback

    def got(self) -> None:
        self.gets_pending -= 1
        if self.gets_pending == 0:
            self.all_gets_done.set()

    async def first_round(self, router: str) -> None:
        try:
            await self._first_round(router)
        except Exception as e:  # a bug or surprise for one router must not sink the pass
            self.tracks[router].status = self.failed(router, "error", f"{type(e).__name__}: {e}")

    async def _first_round(self, router: str) -> None:
        track = self.tracks[router]
        try:
            try:
                track.state = await self.get(track)
            finally:
                self.got()
        except _RetriesExhausted as e:
            track.status = self.failed(router, "unreachable", str(e))
            return
        except TerminalError as e:
            track.status = self.failed(router, "refused", str(e))
            return
        target = self.desired[router]
        reissued_as: int | None = None
        if self.diverged(track.state, target, self.checksum(target)):
            await self.all_gets_done.wait()
            target = self.reissue_target(router)
            reissued_as = target.version
            if self._versions_used_up(track, target):
                return
            if track.state.version > target.version:  # cannot happen: target is above all
                track.status = self.failed(router, "ahead", "ahead of the re-issued version")
                return
        track.status = await self.bring_to(track, target, reissued_as)

    async def follow_reissue(self, router: str) -> None:
        track = self.tracks[router]
        target = self.reissue_target(router)
        if target.version > MAX_VERSION:
            return  # no re-issue to follow: it stays in sync with the desired version
        try:
            track.status = await self.bring_to(track, target, target.version)
        except Exception as e:
            track.status = self.failed(router, "error", f"{type(e).__name__}: {e}")

    def _versions_used_up(self, track: _Track, target: Policy) -> bool:
        """A re-issue above the last version (2^63-1) is refused, with the way out."""
        if target.version <= MAX_VERSION:
            return False
        track.status = self.failed(track.router, "refused", _VERSIONS_USED_UP)
        return True

    async def bring_to(
        self, track: _Track, target: Policy, reissued_as: int | None
    ) -> RouterStatus:
        router = track.router
        checksum = self.checksum(target)
        state = track.state
        assert state is not None
        if state.version == target.version and state.checksum == checksum:
            return self.succeeded(router, "in_sync", state, reissued_as)
        # A failed push of a re-issue still names its number: the router may have applied
        # it with the reply lost, and the store must know that number's content (else the
        # next pass saw a router ahead at an unknown version and re-issued once more).
        try:
            reply = await self.push(track, target)
        except _RetriesExhausted as e:
            return self.failed(router, "unreachable", str(e), reissued_as)
        except TerminalError as e:
            return self.failed(router, "refused", str(e), reissued_as)
        acked = RouterState(reply.applied_version, reply.checksum)
        track.state = acked
        if reply.outcome in (ApplyOutcome.APPLIED, ApplyOutcome.NOOP):
            if acked.version == target.version and acked.checksum == checksum:
                return self.succeeded(router, reply.outcome.value, acked, reissued_as)
            return self.failed(
                router, "mismatch",
                f"router acked v{acked.version} ({acked.checksum[:12]}), expected "
                f"v{target.version} ({checksum[:12]})", reissued_as,
            )
        return self.failed(router, reply.outcome.value, reply.message, reissued_as)

    def reissue_target(self, router: str) -> Policy:
        """The re-issued policy of ``router``'s desired group (decided once per pass)."""
        if self.reissued is None:
            self.reissued = {}
            known = [t.state.version for t in self.tracks.values() if t.state is not None]
            next_version = max([*known, *(p.version for p in self.desired.values()),
                                self.version_floor - 1]) + 1
            diverged_groups = sorted(
                {
                    self.group_key(r)
                    for r, t in self.tracks.items()
                    if t.state is not None
                    and self.diverged(t.state, self.desired[r], self.checksum(self.desired[r]))
                }
            )
            for key in diverged_groups:
                policy = next(p for r, p in self.desired.items() if self.group_key(r) == key)
                reissue = policy.with_version(next_version)
                self.checksums[id(reissue)] = key[1]  # same content, same checksum
                self.reissued[key] = reissue
                next_version += 1
        return self.reissued[self.group_key(router)]


_VERSIONS_USED_UP = (f"cannot re-issue above the router's version: versions end at "
                     f"{MAX_VERSION}; push with --rollback (the file's version as it is)")


class FakeRouterTransport:
    """In-memory transport over :class:`RouterAgent` objects (tests, simulator).

    ``down`` holds router ids that behave as unreachable (a :class:`TransientError`);
    ``calls`` records every call as ``(kind, router)``.
    """

    def __init__(self, agents: Mapping[str, RouterAgent] | None = None) -> None:
        self.agents: dict[str, RouterAgent] = dict(agents or {})
        self.down: set[str] = set()
        self.calls: list[tuple[str, str]] = []

    def _agent(self, kind: str, router: str) -> RouterAgent:
        self.calls.append((kind, router))
        if router in self.down or router not in self.agents:
            raise TransientError(f"router {router}: unreachable (fake transport)")
        return self.agents[router]

    async def apply(
        self, router: str, policy: Policy, rollback: bool, deadline_s: float
    ) -> ApplyReply:
        await asyncio.sleep(0)  # a real call yields to the loop; so does the fake
        result = self._agent("apply", router).apply(policy, rollback=rollback)
        return ApplyReply(result.outcome, result.applied_version, result.checksum, result.message)

    async def get(self, router: str, deadline_s: float) -> RouterState:
        await asyncio.sleep(0)
        snap = self._agent("get", router).snapshot
        if snap is None:
            return RouterState(0, "")
        return RouterState(snap.version, snap.checksum)

    async def get_policy(
        self, router: str, deadline_s: float
    ) -> tuple[Policy | None, RouterState, float | None]:
        await asyncio.sleep(0)
        snap = self._agent("get_policy", router).snapshot
        if snap is None:
            return None, RouterState(0, ""), None
        return snap.policy, RouterState(snap.version, snap.checksum), snap.applied_at


def reissued_versions(statuses: Mapping[str, RouterStatus]) -> dict[str, int]:
    """Router id -> the version its desired policy was re-issued under (for the store)."""
    return {r: s.reissued_as for r, s in statuses.items() if s.reissued_as is not None}
