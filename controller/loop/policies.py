"""The policies the loop reads and makes desired.

:class:`PolicyBook` owns the bounded cache of decoded tables by version over the store (the
store is the truth: anything evicted or forgotten is read back), the rollout of the
configured routers, and the writes that put one version on every router. The functions
below are the store reads and writes that the loop and ``pdctl`` share, and
:func:`restore_learner`, the learner's drift reference for the policy the routers run.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from controller.core.rollout import OperatorState, Rollout, VersionInfo, rollout_of
from controller.loop.learning import Learner, LearnerState, without_exploration
from controller.loop.metric_events import MetricEvents, PolicyChanged
from controller.policy import Policy, dumps, loads
from controller.rollout.reconciler import RunningPolicy
from controller.store import CalibrationRecord, Tx
from controller.store.kinds import ADOPTED_PREFIX, PolicyKind


def without_exploration_key(policy: Policy) -> str:
    """What decides a route once exploration is set aside (version aside too)."""
    return without_exploration(policy).with_version(1).checksum


def reference_calibration(tx: Tx, version: int) -> CalibrationRecord | None:
    """The calibration whose drift reference ``version`` runs against: the newest that
    renewed it (its own, or a later one refused on the traffic since a change alone, which
    records ``reference_for``), else its own (stored before ``reference_for``)."""
    return tx.newest_renewal(version) or tx.calibration_for(version)


def restore_learner(tx: Tx, rollout: Rollout, learner: Learner, state: LearnerState,
                    state_for: int | None) -> tuple[LearnerState, int | None]:
    """The learner's state and the version it belongs to for the policy the routers run (the
    canary's, else the fleet's): unchanged while that is ``state_for``; after a restart or a
    rollback, the drift reference last renewed for it. That is its own calibration's, or a
    later one's refused on the traffic since a change alone (the policy was judged on it
    and kept), so traffic the running policy was already judged on does not fire a drift
    again. A version with no calibration of its own (re-issued, exploration off, fallback)
    keeps the reference the learner has."""
    version = rollout.canary_version or rollout.fleet_version
    if version is None or version == state_for:
        return state, state_for
    record = reference_calibration(tx, version)
    if record is not None or state_for is None:
        state = learner.restore(record.details if record else None)
    return state, version


def read_rollout(tx: Tx, routers: Sequence[str] | None = None) -> Rollout:
    """Fleet and canary versions from the desired versions (of ``routers``, default all):
    :func:`controller.core.rollout.rollout_of` on the stored versions they name."""
    desired = {r: v for r, v in tx.desired_versions().items()
               if routers is None or r in routers}
    records: dict[int, VersionInfo | None] = {}
    if len(set(desired.values())) > 1:
        for v in sorted(set(desired.values())):
            rec = tx.policy(v)
            records[v] = None if rec is None else VersionInfo(rec.status, rec.reissue_of)
    return rollout_of(desired, records)


class RecentPolicies(OrderedDict[int, Policy]):
    """The policies the cycle decoded or built lately, by version. Bounded: a long-running
    daemon makes a candidate per calibration (one an hour in the soak), each with its whole
    table. The oldest go first; any version evicted is read back from the store (and cached
    again) when needed."""

    def __init__(self, capacity: int = 32) -> None:
        super().__init__()
        self.capacity = capacity

    def __setitem__(self, version: int, policy: Policy) -> None:
        super().__setitem__(version, policy)
        self.move_to_end(version)
        while len(self) > self.capacity:
            self.popitem(last=False)


class PolicyBook:
    """Decoded policies by version (a bounded cache over the store) and the configured
    routers they are made desired on."""

    def __init__(self, routers: Sequence[str]) -> None:
        self.routers = tuple(sorted(routers))
        self.cache = RecentPolicies()

    def policy(self, tx: Tx, version: int) -> Policy:
        """Policy ``version``, decoded once and cached (LookupError: not stored)."""
        cached = self.cache.get(version)
        if cached is None:
            rec = tx.policy(version)
            if rec is None:
                raise LookupError(f"desired policy v{version} is not stored")
            cached = loads(rec.body_json)
            self.cache[version] = cached
        return cached

    def rollout(self, tx: Tx) -> Rollout:
        """The rollout of the configured routers."""
        return read_rollout(tx, self.routers)

    def current(self, tx: Tx, rollout: Rollout) -> Policy | None:
        return None if rollout.fleet_version is None else self.policy(tx, rollout.fleet_version)

    def everywhere(self, tx: Tx, policy: Policy, reason: str, events: MetricEvents) -> None:
        """Store ``policy`` as approved and make it every router's desired version at once
        (no canary: an adoption, an operator's fallback or exploration off)."""
        tx.add_policy(policy.version, policy.checksum, dumps(policy), "approved", reason)
        self.cache[policy.version] = policy
        for router in self.routers:
            tx.set_desired(router, policy.version)
        events.append(PolicyChanged(policy.version))

    def everywhere_without_exploration(self, tx: Tx, policy: Policy, reason: str,
                                        events: MetricEvents) -> int:
        """``policy``'s table with no exploration, as a new version on every router."""
        version = tx.next_version()
        self.everywhere(tx, without_exploration(policy).with_version(version), reason, events)
        return version

    def rollback_target(self, tx: Tx, newest: int | None, ops: OperatorState) -> int | None:
        """The newest approved version below ``newest``. While exploration is off, one that
        differs from ``newest`` only in exploration is passed over: it would be re-issued
        without exploration, the same table again (e.g. the one `exploration off` copied)."""
        approved = sorted((p.version for p in tx.policies(status="approved")), reverse=True)
        below = [v for v in approved if newest is None or v < newest]
        if newest is None or not ops.exploration_off:
            return below[0] if below else None
        quiet = without_exploration_key(self.policy(tx, newest))
        return next((v for v in below
                     if without_exploration_key(self.policy(tx, v)) != quiet), None)

    def desire_back(self, tx: Tx, target: int, ops: OperatorState, events: MetricEvents
                    ) -> str:
        """Every router to ``target``; while exploration is off, a target that explores is
        re-issued without it (as ``exploration off`` does). What runs, for the outcome."""
        policy = self.policy(tx, target)
        if ops.exploration_off and any(policy.table.exploration):
            version = self.everywhere_without_exploration(
                tx, policy, f"v{target} without exploration (rolled back while exploration "
                "is off)", events)
            return f", re-issued without exploration as v{version}"
        for router in self.routers:
            tx.set_desired(router, target)
        return ""


def record_adoption(tx: Tx, found: RunningPolicy, routers: Sequence[str], who: str
                    ) -> tuple[Policy, str, bool]:
    """Record the one policy every router runs (``found.policy``) as the fleet's, desired
    for every router, when no configured router has a desired version: an empty store, or
    routers that replaced every earlier one (``who`` started then). The policy as stored,
    what was done, and whether a version was added (False: a stored one desired again)."""
    policy = found.policy
    assert policy is not None
    ran = policy.version
    stored = tx.policy(policy.version)
    if stored is not None and stored.checksum == policy.checksum:
        # The routers run a stored version (their rows were under other names): it is
        # desired again as it is, no push.
        for router in routers:
            tx.set_desired(router, policy.version)
        return policy, f"the routers run stored v{policy.version}: desired again", False
    if tx.policies(limit=1):
        where = f"{who} found no configured router with a desired version"
        if stored is not None or policy.version < tx.next_version():
            # Its number is taken or behind the store's: stored under the next one (the
            # routers get the same table under it, one push each).
            policy = policy.with_version(tx.next_version())
    else:
        where = f"{who} started on an empty store"
    tx.add_policy(policy.version, policy.checksum, dumps(policy), "approved",
                  f"{ADOPTED_PREFIX}{found.why} when {where}", kind=PolicyKind.ADOPTED)
    for router in routers:
        tx.set_desired(router, policy.version)
    renumbered = "" if policy.version == ran else f" (it ran as v{ran})"
    return policy, f"adopted the routers' policy as v{policy.version}{renumbered}", True


__all__ = ["PolicyBook", "RecentPolicies", "read_rollout", "record_adoption",
           "reference_calibration", "without_exploration_key"]
