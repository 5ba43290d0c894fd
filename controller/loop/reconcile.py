"""Reconcile: push the desired versions to the routers and record what they acknowledged.

Every replica may run it (sidecar mode: each its own router; standalone: the leader, every
router). A router behind its desired version gets it pushed; one at a stored version the
fleet moved back from gets a rollback push; one ahead at a version never stored gets the
desired policy re-issued above it (stored as a re-issue, desired instead). Pushes,
acknowledgements and router errors are stored in one small transaction after the pass.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

from controller.clock import Clock
from controller.core.rollout import operator_state
from controller.loop.metrics import ControllerMetrics
from controller.loop.policies import PolicyBook
from controller.loop.report import CycleReport, join
from controller.policy import dumps
from controller.rollout.reconciler import Reconciler, RouterStatus
from controller.store import Store


class RouterSync:
    """Reconciles routers to the store's desired versions (policies from ``book``)."""

    def __init__(self, *, store: Store, clock: Clock, book: PolicyBook, reconciler: Reconciler,
                 metrics: ControllerMetrics) -> None:
        self.store = store
        self.clock = clock
        self.book = book
        self.reconciler = reconciler
        self.metrics = metrics
        self.exported = False  # pdctl_router_*_version set by this replica

    def withdraw(self) -> None:
        """Clear the router version gauges (a follower that reconciles nothing)."""
        if self.exported:
            self.metrics.clear_router_versions()
            self.exported = False

    async def run(self, mine: Sequence[str], report: CycleReport) -> None:
        """Push each of ``mine`` whose running version differs from its desired one, and
        record the pushes and acknowledgements. Paused: no pushes, the gauges still say
        what the store holds."""
        with self.store.read() as tx:
            ops = operator_state(tx.requests(status="done"))
            desired_versions = tx.desired_versions()
            if ops.paused:
                report.reason = join(report.reason, "paused: no pushes")
                # Still what the store says: a router held behind by the pause shows it.
                acked = {r.router_id: r.acked_version for r in tx.routers()}
                for r in mine:
                    self.metrics.set_router_versions(r, desired_versions.get(r, 0),
                                                     acked.get(r) or 0)
                self.exported = True
                return
            desired = {r: self.book.policy(tx, v) for r, v in desired_versions.items() if r in mine}
            # A router at a version we stored and moved back from (a rollback, a pin, a
            # rolled-back canary) gets a rollback push; a router ahead at a version we never
            # stored (a restored backup) gets the desired policy re-issued above it.
            acked = {r.router_id: r.acked_version for r in tx.routers()}
            back = {
                r for r, p in desired.items()
                if (a := acked.get(r)) is not None and a > p.version
                and tx.policy(a) is not None
            }
            # A re-issue above a router that is ahead (a manual `pdctl push`, a restored
            # backup) takes a number no stored policy has: one above the routers' can still
            # be a rejected candidate's, and storing it then failed the cycle after the
            # router had applied it.
            floor = tx.next_version()
        if not desired:
            return
        forward = {r: p for r, p in desired.items() if r not in back}
        backward = {r: p for r, p in desired.items() if r in back}
        statuses: dict[str, RouterStatus] = {}
        t0 = self.clock.monotonic()
        for d, rb in ((forward, False), (backward, True)):
            if not d:
                continue
            part = await self.reconciler.reconcile(d, rollback=rb, version_floor=floor)
            statuses.update(part)  # one pass after the other: their re-issues never collide
            floor = max([floor, *(s.reissued_as + 1 for s in part.values()
                                  if s.reissued_as is not None)])
        self.metrics.observe_job("reconcile", self.clock.monotonic() - t0)
        self._record_statuses(statuses, desired_versions, report)

    def _record_statuses(self, statuses: Mapping[str, RouterStatus],
                         desired_versions: Mapping[str, int], report: CycleReport) -> None:
        at = self.clock.utcnow()
        with self.store.cycle() as tx:
            reissued: dict[int, int] = {}
            acks: list[tuple[str, int, str]] = []
            for router, s in statuses.items():
                if s.reissued_as is not None:
                    old = desired_versions[router]
                    if old not in reissued and tx.policy(s.reissued_as) is None:
                        policy = self.book.policy(tx, old).with_version(s.reissued_as)
                        rec = tx.policy(old)
                        tx.add_policy(s.reissued_as, policy.checksum, dumps(policy), "approved",
                                      f"v{old} re-issued above a router that was ahead",
                                      reissue_of=(rec.reissue_of if rec and rec.reissue_of
                                                  else old))
                        self.book.cache[s.reissued_as] = policy
                    reissued[old] = s.reissued_as
                    tx.set_desired(router, s.reissued_as, at=at)
                if s.ok and s.acked_version is not None and s.acked_checksum is not None:
                    acks.append((router, s.acked_version, s.acked_checksum))
                elif not s.ok:
                    tx.record_router_error(router, f"{s.outcome}: {s.last_error}", at=at)
                if s.pushed:
                    report.pushes += 1
                    version = s.reissued_as or desired_versions[router]
                    tx.add_push(router, version, _push_result(s), s.latency_s,
                                None if s.ok else s.last_error, at=at)
                    self.metrics.observe_push(router, _push_result(s), s.latency_s)
                if s.ok:  # "acked" in the log: only what acknowledged the desired version
                    report.acked[router] = s.acked_version
                desired = s.reissued_as or desired_versions[router]
                self.metrics.set_router_versions(router, desired, s.acked_version or 0)
                self.exported = True
            tx.record_acks(acks, at=at)


class PushResult(enum.StrEnum):
    """A push's result as stored and counted (``pdctl_pushes_total``)."""

    OK = "ok"
    CONFLICT = "conflict"
    REJECTED = "rejected"
    FAILED = "failed"


def _push_result(s: RouterStatus) -> PushResult:
    if s.ok:
        return PushResult.OK
    if s.outcome in ("conflict", "stale"):
        return PushResult.CONFLICT
    if s.outcome in ("invalid", "refused"):
        return PushResult.REJECTED
    return PushResult.FAILED


__all__ = ["PushResult", "RouterSync"]
