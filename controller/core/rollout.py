"""The rollout's rules as functions of plain values: no store, no clock, no metrics.

The loop (:mod:`controller.loop`) gathers what the store and this cycle's window say into
the frozen values below, asks these functions what to do, and applies the answer in its
write transaction. Everything here is deterministic in its arguments, so each rule is
tested on plain dataclasses (``tests/core/test_rollout.py``).

- :class:`PolicyStatus` and :data:`POLICY_TRANSITIONS`: the policy state machine the store
  enforces on every status change.
- :class:`OperatorState` / :func:`operator_state`: what operators asked for, folded from
  their finished requests.
- :class:`Rollout`: fleet and canary versions as the desired versions say.
- :func:`judge_canary`: promote, wait or roll back a baking canary on its bake windows.
- :func:`judge_watch`: keep or roll back a promotion on the fleet's windows since it.
- :func:`choose_trigger`: whether (and why) this cycle calibrates.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from statistics import NormalDist
from typing import Any, Protocol

from controller.core.trigger import Trigger
from controller.core.window import Window
from controller.policy.validation import MAX_VERSION

FALLBACK_PREFILL = "fallback-prefill"


class PolicyStatus(enum.StrEnum):
    """A stored policy's status; the values are the strings stored and printed."""

    CANDIDATE = "candidate"
    APPROVED = "approved"
    REJECTED = "rejected"
    ROLLED_BACK = "rolled_back"
    ADVISORY = "advisory"
    SUPERSEDED = "superseded"


# Policy status changes that make sense; anything else is a bug in the caller.
POLICY_TRANSITIONS: Mapping[str, frozenset[str]] = {
    PolicyStatus.CANDIDATE: frozenset({PolicyStatus.APPROVED, PolicyStatus.REJECTED,
                                       PolicyStatus.ADVISORY}),
    PolicyStatus.ADVISORY: frozenset({PolicyStatus.APPROVED, PolicyStatus.REJECTED}),
    PolicyStatus.APPROVED: frozenset({PolicyStatus.ROLLED_BACK, PolicyStatus.SUPERSEDED}),
    PolicyStatus.REJECTED: frozenset(),
    PolicyStatus.ROLLED_BACK: frozenset(),
    PolicyStatus.SUPERSEDED: frozenset(),
}


def may_transition(current: str, new: str) -> bool:
    """Whether a policy in status ``current`` may be set to ``new`` (unchanged: always)."""
    return new == current or new in POLICY_TRANSITIONS[current]


# -- operator state -----------------------------------------------------------------------


class FinishedRequest(Protocol):
    """What :func:`operator_state` reads of an operator request (the store's record)."""

    @property
    def id(self) -> int: ...

    @property
    def kind(self) -> str: ...

    @property
    def status(self) -> str: ...

    @property
    def args(self) -> Mapping[str, Any] | None: ...


@dataclass(frozen=True, slots=True)
class OperatorState:
    """What operators asked for, folded from the finished requests in order."""

    paused: bool = False
    pinned: int | None = None
    fallback: bool = False
    exploration_off: bool = False

    @property
    def holding(self) -> bool:
        """No automatic approvals while paused, pinned or in fallback."""
        return self.paused or self.pinned is not None or self.fallback


NOT_A_VERSION = f"not a policy version (1 to {MAX_VERSION})"


def version_arg(value: Any) -> int | None:
    """A request's version, or None when it cannot name a policy (a bool, a fraction,
    inf/NaN, out of range): such a request is refused rather than failing the write."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        return None
    try:
        v = int(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return v if 1 <= v <= MAX_VERSION else None


def _fold(state: OperatorState, kind: str, args: Mapping[str, Any]) -> OperatorState:
    what = args.get("what", "approvals")
    if kind == "pause":
        if what == "pin":
            return replace(state, pinned=int(args["version"]), fallback=False)
        if what == "exploration":
            return replace(state, exploration_off=True)
        return replace(state, paused=True)
    if kind == "resume":
        if what == "pin":
            return replace(state, pinned=None, fallback=False)
        if what == "exploration":
            return replace(state, exploration_off=False)
        return replace(state, paused=False)
    if kind == "rollback" and args.get("to") == FALLBACK_PREFILL:
        return replace(state, fallback=True, pinned=None)
    return state


def operator_state(requests: Sequence[FinishedRequest]) -> OperatorState:
    """Fold finished (``done``) operator requests, oldest first, into the current state."""
    state = OperatorState()
    for r in sorted(requests, key=lambda x: x.id):
        if r.status == "done":
            state = _fold(state, r.kind, r.args or {})
    return state


# -- the rollout --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rollout:
    """The rollout state read from the desired versions."""

    fleet_version: int | None  # what the non-canary routers run (None: no policy yet)
    canary_version: int | None  # set while a canary bakes
    canary_routers: tuple[str, ...] = ()
    control_routers: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class VersionInfo:
    """What :func:`rollout_of` reads of a stored policy version."""

    status: str
    reissue_of: int | None = None


def rollout_of(desired: Mapping[str, int], records: Mapping[int, VersionInfo | None]
               ) -> Rollout:
    """Fleet and canary versions from the desired versions: a canary is the newest
    approved version desired by some routers only. Versions are ordered by when their
    table was made (a re-issue counts as its original), so a fleet table re-issued
    mid-bake under a number above the canary's is still the fleet's."""
    if not desired:
        return Rollout(None, None)
    versions = sorted(set(desired.values()))
    if len(versions) == 1:
        return Rollout(versions[0], None)

    def made(v: int) -> tuple[int, int]:
        rec = records.get(v)
        return (rec.reissue_of if rec is not None and rec.reissue_of is not None else v), v

    canary = max(versions, key=made)
    rec = records.get(canary)
    counts: dict[int, int] = {}
    for v in desired.values():
        counts[v] = counts.get(v, 0) + 1
    fleet = max((v for v in versions if v != canary), key=lambda v: (counts[v], v))
    if rec is None or rec.status != PolicyStatus.APPROVED:
        return Rollout(fleet, None)
    return Rollout(
        fleet, canary,
        tuple(sorted(r for r, v in desired.items() if v == canary)),
        tuple(sorted(r for r, v in desired.items() if v != canary)),
    )


def canary_subset(routers: Sequence[str], fraction: float, version: int) -> tuple[str, ...]:
    """``ceil(fraction * n)`` routers (at least one, at most n - 1), rotated by version so
    successive canaries land on different routers."""
    ordered = sorted(routers)
    n = len(ordered)
    k = max(1, min(math.ceil(fraction * n), n - 1))
    start = version % n
    return tuple(sorted(ordered[(start + i) % n] for i in range(k)))


class GuardrailVerdict(enum.StrEnum):
    """The guardrail's decision as counted (``pdctl_guardrail_decisions_total``)."""

    APPROVED = "approved"
    REJECTED = "rejected"
    FORCED = "forced"  # approved by an operator's force despite the guardrail


def candidate_status(approved: bool, advisory: bool, ops: OperatorState,
                     canary_version: int | None) -> tuple[PolicyStatus, str | None]:
    """The status a calibration's candidate is stored with, and why it is held (None: not
    held). Advisory mode stores every candidate as advisory; an approved one is held as a
    candidate while an operator holds the rollout or a canary bakes."""
    if advisory:
        return PolicyStatus.ADVISORY, None
    if not approved:
        return PolicyStatus.REJECTED, None
    if ops.holding or canary_version is not None:
        held = ("paused" if ops.paused else "in fallback" if ops.fallback
                else f"v{ops.pinned} is pinned" if ops.pinned is not None
                else f"v{canary_version} is baking")
        return PolicyStatus.CANDIDATE, held
    return PolicyStatus.APPROVED, None


# -- statistics ---------------------------------------------------------------------------


def two_proportion_z(met_a: float, n_a: float, met_b: float, n_b: float, margin: float
                     ) -> float | None:
    """z of ``p_a - p_b + margin`` (unpooled): very negative = ``a`` is worse than ``b`` by
    more than ``margin``. None without requests on both sides."""
    if n_a <= 0 or n_b <= 0:
        return None
    pa, pb = met_a / n_a, met_b / n_b
    diff = pa - pb + margin
    se = math.sqrt(pa * (1 - pa) / n_a + pb * (1 - pb) / n_b)
    if se == 0.0:
        return math.copysign(math.inf, diff) if diff != 0 else 0.0
    return diff / se


def watch_critical(alpha: float, looks: int) -> float:
    """The z each of a watch's ``looks`` must fall below (negative). The watch tests the
    windows since a promotion again at each of them, so at ``alpha`` per look it would roll
    back a policy at the allowed drop more often than ``alpha``; Bonferroni's
    ``alpha / looks`` bounds the whole watch's false-rollback rate by ``alpha`` whatever the
    looks' correlation (``benchmarks/watch_false_rollbacks.py`` measures both)."""
    return NormalDist().inv_cdf(alpha / max(1, looks))


def pct(p: float | None) -> str:
    return "n/a" if p is None else f"{p:.4f}"


def num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def seen_by(windows: Sequence[Window], routers: Collection[str]) -> list[Window]:
    """The windows in which none of ``routers`` (outcome names) failed: unreachable, or a
    snapshot source's first read, which only sets the counters' baseline."""
    names = set(routers)
    return [w for w in windows if not names & {f.target for f in w.failures}]


def pooled(windows: Sequence[Window]) -> tuple[float, float, float]:
    """Requests that met the SLO, requests, and requests per second over ``windows``."""
    met = sum(o.met for w in windows for o in w.outcomes)
    n = sum(o.requests for w in windows for o in w.outcomes)
    seconds = sum(w.end - w.start for w in windows)
    return met, n, n / seconds if seconds > 0 else 0.0


# -- the canary judge ---------------------------------------------------------------------


class CanaryAction(enum.StrEnum):
    WAIT = "wait"
    PROMOTE = "promote"
    ROLL_BACK = "roll_back"
    SUPERSEDED = "superseded"  # promoted, but its approved refit bakes instead


@dataclass(frozen=True, slots=True)
class CanaryVerdict:
    action: CanaryAction
    reason: str
    canary_goodput: float | None = None
    control_goodput: float | None = None
    canary_requests: float = 0.0
    control_requests: float = 0.0
    z: float | None = None


@dataclass(frozen=True, slots=True)
class JudgeParams:
    """The rollout settings the canary judge and the watch read."""

    interval_s: float = 30.0
    bake_windows: int = 3
    bake_min_requests: float = 100.0
    max_bake_windows: int = 12
    promote_margin: float = 0.02
    promote_alpha: float = 0.05
    watch_windows: int = 3
    watch_drop: float = 0.1
    watch_load_rise: float = 0.1

    @property
    def watch_s(self) -> float | None:
        """How long a promotion is watched at most (None: no watch): its windows and one
        interval more, so failed observes do not stretch it."""
        return (self.watch_windows + 1) * self.interval_s if self.watch_windows else None


def _goodputs(windows: Sequence[Window], canary: Collection[str], control: Collection[str]
              ) -> tuple[float, float, float, float]:
    met_c = n_c = met_k = n_k = 0.0
    for w in windows:
        for o in w.outcomes:
            if o.router in canary:
                met_c += o.met
                n_c += o.requests
            elif o.router in control:
                met_k += o.met
                n_k += o.requests
    return met_c, n_c, met_k, n_k


def judge_canary(bake: Sequence[Window], canary: Collection[str], control: Collection[str],
                 p: JudgeParams) -> CanaryVerdict:
    """Compare canary and control routers' goodput (``canary``/``control``: their outcome
    names) over the bake windows since the canary's approval. A window in which a canary
    or control router's metrics failed saw none of its requests: it is no bake window.
    Canary and control share the workers, so this compares routing, not load."""
    windows = seen_by(bake, set(canary) | set(control))
    met_c, n_c, met_k, n_k = _goodputs(windows, canary, control)
    pc = met_c / n_c if n_c else None
    pk = met_k / n_k if n_k else None
    z = two_proportion_z(met_c, n_c, met_k, n_k, p.promote_margin)
    numbers = (f"canary goodput {pct(pc)} of {n_c:.0f} requests vs control {pct(pk)} "
               f"of {n_k:.0f} over {len(windows)} window(s), margin {p.promote_margin:g}")
    enough = n_c >= p.bake_min_requests and n_k >= p.bake_min_requests
    if len(windows) < p.bake_windows or not enough:
        if len(windows) >= p.max_bake_windows:
            return CanaryVerdict(CanaryAction.ROLL_BACK,
                                 f"not enough traffic to judge: {numbers}", pc, pk, n_c, n_k, z)
        return CanaryVerdict(CanaryAction.WAIT, f"baking: {numbers}", pc, pk, n_c, n_k, z)
    critical = NormalDist().inv_cdf(p.promote_alpha)  # negative
    if z is not None and z < critical:
        return CanaryVerdict(CanaryAction.ROLL_BACK, f"canary worse than control: {numbers}, "
                             f"z {z:.2f} < {critical:.2f}", pc, pk, n_c, n_k, z)
    return CanaryVerdict(CanaryAction.PROMOTE, f"promoted: {numbers}, z {num(z)}",
                         pc, pk, n_c, n_k, z)


# -- the post-promotion watch -------------------------------------------------------------


class WatchAction(enum.StrEnum):
    WATCH = "watch"
    KEEP = "keep"  # the watch's last window
    ROLL_BACK = "roll_back"
    OVER = "over"


@dataclass(frozen=True, slots=True)
class WatchVerdict:
    """The post-promotion watch: the fleet's goodput since a promotion against the bake's."""

    action: WatchAction
    reason: str  # with the numbers: goodput and requests since the promotion and over the bake


WATCH_OVER = WatchVerdict(WatchAction.OVER, "watch over")


def judge_watch(now: float, promoted: float, since_approval: Sequence[Window],
                routers: Collection[str], p: JudgeParams) -> WatchVerdict:
    """The fleet's goodput over the windows since the promotion at ``promoted`` (at most
    ``watch_windows``) against all routers' (``routers``: outcome names) over its bake
    (``since_approval``: the windows since the approval). Rolled back when below by more
    than ``watch_drop`` (one-sided, ``promote_alpha`` over the whole watch: each look at
    ``promote_alpha / watch_windows``) while the request rate rose by at most
    ``watch_load_rise``: a load that rose explains a fall without the policy. Over after
    ``watch_windows`` windows or ``watch_s`` of time: a policy running for days is not
    re-read. A window no router answered in is no look (it saw no requests); one router's
    failure leaves the others' requests, pooled."""
    assert p.watch_s is not None
    if now - promoted > p.watch_s:
        return WATCH_OVER
    half = 0.5 * p.interval_s
    names = set(routers)
    windows = [w for w in since_approval if not names <= {f.target for f in w.failures}]
    bake = [w for w in windows if w.end < promoted + half]
    watch = [w for w in windows if w.end >= promoted + half]
    if len(watch) > p.watch_windows:
        return WATCH_OVER
    met_w, n_w, rate_w = pooled(watch)
    met_b, n_b, rate_b = pooled(bake)
    pw = met_w / n_w if n_w else None
    pb = met_b / n_b if n_b else None
    z = two_proportion_z(met_w, n_w, met_b, n_b, p.watch_drop)
    numbers = (f"fleet goodput {pct(pw)} of {n_w:.0f} requests over {len(watch)} "
               f"window(s) since the promotion vs {pct(pb)} of {n_b:.0f} over the bake's "
               f"{len(bake)}, drop allowed {p.watch_drop:g}")
    done = len(watch) == p.watch_windows
    critical = watch_critical(p.promote_alpha, p.watch_windows)
    worse = z is not None and z < critical and n_w >= p.bake_min_requests
    rise = rate_w / rate_b - 1 if rate_b > 0 else math.inf
    if worse and rise <= p.watch_load_rise:
        return WatchVerdict(WatchAction.ROLL_BACK, f"{numbers}, z {z:.2f} < {critical:.2f}")
    if worse:
        numbers += f"; the request rate rose {rise:.0%}: not the policy's doing"
    return WatchVerdict(WatchAction.KEEP if done else WatchAction.WATCH,
                        f"{'kept after' if done else 'watching'} the promotion: {numbers}")


# -- the trigger --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TriggerInputs:
    """What the trigger choice reads, gathered before it.

    ``refit_due``: a canary bakes, is no refit itself, and the judge would promote it with
    this cycle's window. ``since_last_change``: seconds since the last change of the
    routers' policy (inf: none, or the clock stepped back). ``scaling_damped``: every role
    of the pending scaling cause had a scaling recalibration within the damping time."""

    now: float
    operator_recalibrate: bool
    canary_baking: bool
    canary_refit: bool
    refit_due: bool
    holding: bool
    pending_drift: bool
    pending_measured: bool
    pending_scaling: bool
    pending_recommendation: bool
    scaling_damped: bool
    drift_fired: bool
    since_last_change: float
    min_policy_interval_s: float
    fit_failed_at: float | None
    fit_retry_s: float
    link_retry_at: float | None
    next_due: float | None


class TriggerNote(enum.StrEnum):
    """What the choice has to say beyond the trigger (logged by the loop)."""

    RATE_LIMITED_DRIFT = "rate-limited drift"  # drift fired within min_policy_interval_s
    SCALING_HELD = "scaling held"  # a scaling cause waits for its roles' damping
    LINK_RETRY = "link retry"  # calibrating again on the KV link's windows alone


@dataclass(frozen=True, slots=True)
class TriggerChoice:
    trigger: Trigger | None
    clear_pending_drift: bool = False  # a canary bakes: drift during it is void
    notes: tuple[TriggerNote, ...] = ()


def choose_trigger(i: TriggerInputs) -> TriggerChoice:
    """Why to calibrate now, or None. An operator's request first. While a canary bakes
    the routers run two policies, so drift says nothing about the fleet's: the pending
    drift is dropped and only a refit of the canary may run. A drift led by a directly
    measured change (the KV link) is not rate-limited: the limit holds back the model's
    second thoughts, not a slower link. A failed fit is retried after ``fit_retry_s``. An
    applied recommendation calibrates as the scaling it is, before drift it causes."""
    if i.operator_recalibrate:
        return TriggerChoice(Trigger.OPERATOR)
    if i.canary_baking:
        refit = i.canary_refit and not i.holding and i.refit_due
        return TriggerChoice(Trigger.CANARY if refit else None, clear_pending_drift=True)
    if i.holding:
        return TriggerChoice(None)
    measured = i.pending_drift and i.pending_measured
    if not measured and i.since_last_change < i.min_policy_interval_s:
        return TriggerChoice(None, notes=(TriggerNote.RATE_LIMITED_DRIFT,) if i.drift_fired
                             else ())
    if i.fit_failed_at is not None and i.now - i.fit_failed_at < i.fit_retry_s:
        return TriggerChoice(None)
    if i.pending_recommendation:
        return TriggerChoice(Trigger.SCALING)
    if i.pending_drift:
        return TriggerChoice(Trigger.DRIFT)
    notes: tuple[TriggerNote, ...] = ()
    if i.pending_scaling:
        if not i.scaling_damped:
            return TriggerChoice(Trigger.SCALING)
        notes = (TriggerNote.SCALING_HELD,)
    if i.link_retry_at is not None and i.now >= i.link_retry_at:
        return TriggerChoice(Trigger.DRIFT, notes=(*notes, TriggerNote.LINK_RETRY))
    if i.next_due is not None and i.now >= i.next_due:
        return TriggerChoice(Trigger.SCHEDULE, notes=notes)
    return TriggerChoice(None, notes=notes)


def scaling_damped(roles: Collection[str], recal_at: Mapping[str, float], now: float,
                   bound: float) -> bool:
    """Whether every role of a pending scaling cause (none: the role ``""``) had a scaling
    recalibration less than ``bound`` seconds ago. A clock stepped back lifts the
    damping."""
    for role in roles or {""}:
        at = recal_at.get(role)
        if at is None or not 0 <= now - at < bound:
            return False
    return True


__all__ = [
    "FALLBACK_PREFILL",
    "NOT_A_VERSION",
    "POLICY_TRANSITIONS",
    "WATCH_OVER",
    "CanaryAction",
    "CanaryVerdict",
    "FinishedRequest",
    "GuardrailVerdict",
    "JudgeParams",
    "OperatorState",
    "PolicyStatus",
    "Rollout",
    "TriggerChoice",
    "TriggerInputs",
    "TriggerNote",
    "VersionInfo",
    "WatchAction",
    "WatchVerdict",
    "canary_subset",
    "candidate_status",
    "choose_trigger",
    "judge_canary",
    "judge_watch",
    "may_transition",
    "operator_state",
    "pooled",
    "rollout_of",
    "scaling_damped",
    "seen_by",
    "two_proportion_z",
    "version_arg",
    "watch_critical",
]
