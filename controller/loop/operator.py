"""Operator requests: claim them, carry them out inside the cycle's write, and roll back a
canary an operator action took off its routers.

Request kinds (the store's): ``pause``/``resume`` with ``args.what`` in ``approvals``
(default), ``pin`` (``args.version``) or ``exploration``; ``rollback`` with
``args.version`` (None: the previous approved) or ``args.to == "fallback-prefill"``;
``recalibrate`` (run by the cycle's calibration) with ``args.dry_run``/``args.force``.
"""

from __future__ import annotations

from typing import Any

from controller.clock import Clock
from controller.core.rollout import FALLBACK_PREFILL, NOT_A_VERSION, operator_state, version_arg
from controller.loop.metric_events import CanaryState, MetricEvents, RolledBack
from controller.loop.policies import PolicyBook
from controller.loop.report import CycleReport
from controller.policy import Policy, Provenance, Route
from controller.store import OperatorRequest, Store, Tx

ABANDONED_PREFIX = "dropped from its bake by "  # a canary an operator action took off
MAX_REQUESTS_PER_CYCLE = 16


class OperatorRequests:
    """Operator requests, applied on the policies of ``book``."""

    def __init__(self, book: PolicyBook, clock: Clock) -> None:
        self.book = book
        self.clock = clock

    def claim(self, store: Store, holder: str, stale_after_s: float) -> list[OperatorRequest]:
        claimed: list[OperatorRequest] = []
        with store.cycle() as tx:
            # Requests a previous leader claimed before our term began died with it (its
            # writes are fenced out): claimed again now, not after request_stale_after_s.
            lease = tx.lease()
            since = lease.acquired_at if lease is not None and lease.holder == holder else None
            for _ in range(MAX_REQUESTS_PER_CYCLE):
                r = tx.claim_next_request(holder, stale_after_s=stale_after_s,
                                          reclaim_before=since)
                if r is None:
                    break
                claimed.append(r)
        return claimed

    def apply(self, tx: Tx, r: OperatorRequest, report: CycleReport, events: MetricEvents
              ) -> tuple[str, bool]:
        """Carry out one claimed request (all but ``recalibrate``): its outcome and whether
        it succeeded."""
        args = r.args or {}
        what = args.get("what", "approvals")
        if r.kind == "pause":
            if what == "pin":
                version = version_arg(args.get("version"))
                if version is None:
                    return f"cannot pin {args.get('version')!r}: {NOT_A_VERSION}", False
                rec = tx.policy(version)
                if rec is None or rec.status != "approved":
                    return (f"cannot pin v{version}: "
                            f"{'no such version' if rec is None else rec.status}"), False
                for router in self.book.routers:
                    tx.set_desired(router, version)
                return f"pinned v{version} on every router", True
            if what == "exploration":
                return self._exploration_off(tx, report, events), True
            return "paused: no approvals and no pushes until resume", True
        if r.kind == "resume":
            # Done either way (the state is what was asked), but say when nothing changed.
            ops = operator_state(tx.requests(status="done"))
            if what == "pin":
                held = ops.pinned is not None or ops.fallback
                return ("unpinned" if held else "nothing was pinned (no change)"), True
            if what == "exploration":
                return ("exploration back on" if ops.exploration_off
                        else "exploration was on (no change)"), True
            return ("resumed" if ops.paused else "was not paused (no change)"), True
        if r.kind == "rollback":
            if args.get("to") == FALLBACK_PREFILL:
                return self._fallback(tx, r, events), True
            return self._rollback(tx, args.get("version"), events)
        return f"unknown request kind {r.kind}", False

    def drop_abandoned_canary(self, tx: Tx, baking: int | None, why: str,
                              events: MetricEvents) -> None:
        """A canary that an operator action took off its routers (a pin of another version,
        a fallback, exploration off) without promoting it is rolled back: left approved, a
        later rollback or a watch went back to it though it had never run on the fleet."""
        if baking is None:
            return
        after = self.book.rollout(tx)
        record = tx.policy(baking)
        if after.canary_version is None and after.fleet_version != baking \
                and record is not None and record.status == "approved":
            tx.set_policy_status(baking, "rolled_back", f"{ABANDONED_PREFIX}{why}")
            events.append(CanaryState("rolled_back"))

    def _rollback(self, tx: Tx, version: Any, events: MetricEvents) -> tuple[str, bool]:
        asked = None if version is None else version_arg(version)
        if version is not None and asked is None:
            return f"cannot roll back to {version!r}: {NOT_A_VERSION}", False
        rollout = self.book.rollout(tx)
        newest = rollout.canary_version or rollout.fleet_version
        ops = operator_state(tx.requests(status="done"))
        if asked is not None and rollout.canary_version is None \
                and rollout.fleet_version == asked:
            return f"v{rollout.fleet_version} already runs on every router (no change)", True
        if asked is None:
            found = self.book.rollback_target(tx, newest, ops)
            if found is None:
                return "nothing to roll back to", False
            target = found
        else:
            target = asked
            rec = tx.policy(target)
            if rec is None or rec.status != "approved":
                return (f"cannot roll back to v{target}: "
                        f"{'no such version' if rec is None else rec.status}"), False
        if newest is not None and newest > target:
            for p in tx.policies(status="approved"):
                if p.version > target:
                    tx.set_policy_status(p.version, "rolled_back", "operator rollback")
        runs = self.book.desire_back(tx, target, ops, events)
        events.append(RolledBack("operator", target))
        return f"rolled back to v{target}{runs}", True

    def _fallback(self, tx: Tx, r: OperatorRequest, events: MetricEvents) -> str:
        version = tx.next_version()
        policy = Policy.uniform(version, Route.PREFILL_NODE, provenance=Provenance(
            created_at=self.clock.utcnow(), reason=f"operator fallback ({r.who})",
            created_by="pdctl fallback prefill"))
        self.book.everywhere(tx, policy, f"fallback prefill by {r.who}: {r.reason}", events)
        return f"fallback: every router to all-prefill-node v{version} (held until unpin)"

    def _exploration_off(self, tx: Tx, report: CycleReport, events: MetricEvents) -> str:
        rollout = self.book.rollout(tx)
        if rollout.fleet_version is None:
            return "exploration off (no policy yet)"
        current = self.book.policy(tx, rollout.fleet_version)
        if not any(current.table.exploration):
            return f"exploration off (v{rollout.fleet_version} explores nothing)"
        version = self.book.everywhere_without_exploration(
            tx, current, f"v{rollout.fleet_version} without exploration (operator)", events)
        report.approved_version = version
        return f"exploration off: every router to v{version}"


__all__ = ["ABANDONED_PREFIX", "MAX_REQUESTS_PER_CYCLE", "OperatorRequests"]
