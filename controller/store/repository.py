"""The history store: short repository functions over one SQL database.

``with store.cycle() as tx:`` groups one control cycle's writes into ONE transaction: a crash
(or an exception) before the block ends leaves the previous state, never half a cycle. Each
``Store`` method of the same name runs alone in its own transaction.

Time comes in as arguments (``at=``/``now=``); a missing ``at`` is read from the injected
:class:`~controller.clock.Clock`, never from the system directly.
"""

from __future__ import annotations

import gc
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar, cast

from sqlalchemy import (
    ColumnElement,
    CursorResult,
    Select,
    and_,
    case,
    delete,
    exists,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, Engine
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.orm import InstrumentedAttribute, Session

if TYPE_CHECKING:
    from controller.config import StoreConfig

from controller.clock import Clock, WallClock
from controller.core.rollout import may_transition
from controller.core.window import Window
from controller.errors import TerminalError, TransientError
from controller.store.engine import WRITE_OPTION, make_engine, normalize_url
from controller.store.kinds import PolicyKind, kind_of_reason
from controller.store.models import (
    POLICY_STATUSES,
    REQUEST_KINDS,
    Base,
    CalibrationRow,
    DriftEventRow,
    LeaderLeaseRow,
    OperatorRequestRow,
    PolicyRow,
    PushRow,
    RecommendationRow,
    RouterDesiredRow,
    RouterRow,
    WindowRow,
)
from controller.store.records import (
    CalibrationRecord,
    DriftEventRecord,
    Lease,
    OperatorRequest,
    PolicyRecord,
    PushRecord,
    RecommendationRecord,
    RouterRecord,
    StoredWindow,
)
from controller.store.types import dumps_json

P = ParamSpec("P")
R = TypeVar("R")

LEADER = "leader"
_CLAIM_ATTEMPTS = 8


# Calibrations looked through, newest first, for the one a version with no calibration of
# its own took its table from (`pdctl explain`); compaction keeps their windows.
LINEAGE_LOOKBACK = 50


class StoreError(TerminalError):
    """The store refused a write (unknown version, illegal status change, duplicate...)."""


class StoreUnavailable(TransientError):
    """The database could not be reached or was busy; the cycle may be retried."""


class StoreGone(TerminalError):
    """The SQLite file this store opened was removed or replaced under it: every write
    would go where nobody can read it (an unlinked file), so none is made."""


# PostgreSQL errors by SQLSTATE (psycopg raises most of them as InternalError,
# ProgrammingError or DataError, which said nothing about whether to retry). Passing:
# connection (08), transaction rollback (40: serialization failure, deadlock), insufficient
# resources (53), operator intervention (57: admin or crash shutdown, cannot connect now),
# and a read-only server (25006: a demoted primary or a standby, mid-failover).
_PASSING_SQLSTATE_CLASSES = ("08", "40", "53", "57")
_PASSING_SQLSTATES = ("25006",)
# Refused: data exception (22: a value too long or out of range), integrity (23).
_REFUSED_SQLSTATE_CLASSES = ("22", "23")


def classify_db_error(e: DBAPIError, where: str) -> StoreError | StoreUnavailable | None:
    """The store's error for a driver error (``None``: neither, a bug to surface as is)."""
    state = str(getattr(e.orig, "sqlstate", None) or "")
    if (isinstance(e, OperationalError) or e.connection_invalidated
            or state[:2] in _PASSING_SQLSTATE_CLASSES or state in _PASSING_SQLSTATES):
        return StoreUnavailable(f"database error on {where}: {e.orig}")
    if isinstance(e, IntegrityError) or state[:2] in _REFUSED_SQLSTATE_CLASSES:
        return StoreError(f"refused by the database: {e.orig}")
    return None


class Tx:
    """The repository functions, bound to one open transaction."""

    def __init__(self, session: Session, clock: Clock) -> None:
        self._s = session
        self._clock = clock

    def _at(self, at: datetime | None) -> datetime:
        return at if at is not None else self._clock.utcnow()

    def flush(self) -> None:
        """Send pending writes to the database (still uncommitted)."""
        self._s.flush()

    # -- windows ----------------------------------------------------------------------

    def add_window(self, window: Window) -> int:
        # A Core INSERT on the session's connection (same transaction): the hot write skips
        # the ORM unit of work, about half its CPU; no WindowRow object is needed.
        body = dumps_json(window.to_dict(compact=True))
        result = self._s.connection().execute(_INSERT_WINDOW, {
            "start_at": _utc(window.start), "end_at": _utc(window.end),
            "interval_s": window.interval_s, "source": window.source[:32],
            "n_workers": len(window.workers), "n_failures": len(window.failures),
            "requests": _total_requests(window), "body": body,
        })
        key = result.inserted_primary_key
        if key is None:  # only a driver that cannot report it; both of ours do
            raise StoreError("the database returned no id for the new window")
        return int(key[0])

    def windows(
        self,
        since: datetime | None = None,
        limit: int | None = None,
        until: datetime | None = None,
    ) -> list[StoredWindow]:
        """Windows starting at or after ``since`` (and before ``until``), oldest first;
        with ``limit``, the newest ``limit`` of them."""
        q = select(WindowRow.id, WindowRow.body)
        if since is not None:
            q = q.where(WindowRow.start_at >= since)
        if until is not None:
            q = q.where(WindowRow.start_at < until)
        return _decode_windows(self._newest(q, WindowRow.start_at, WindowRow.id, limit))

    def window_ids(self, since: datetime | None = None, limit: int | None = None) -> list[int]:
        """The ids :meth:`windows` would return, in its order, without reading a body: a
        long read can then fetch the windows a chunk at a time."""
        q = select(WindowRow.id)
        if since is not None:
            q = q.where(WindowRow.start_at >= since)
        return [int(r[0]) for r in self._newest(q, WindowRow.start_at, WindowRow.id, limit)]

    def last_window_end(self) -> datetime | None:
        """Where the newest stored window (by start) ends: a replica that starts or leads
        again continues from there instead of re-observing time already stored."""
        q = select(WindowRow.end_at).order_by(WindowRow.start_at.desc()).limit(1)
        return self._s.execute(q).scalar_one_or_none()

    def windows_by_ids(self, ids: Sequence[int]) -> list[StoredWindow]:
        if not ids:
            return []
        rows = self._s.execute(
            select(WindowRow.id, WindowRow.body)
            .where(WindowRow.id.in_(list(ids)))
            .order_by(WindowRow.start_at, WindowRow.id)
        ).all()
        return _decode_windows(rows)

    def compact_windows(self, older_than: datetime, keep_newest: int = 1) -> int:
        """Delete windows that ended before ``older_than``; return how many.

        Kept: the training windows of the calibrations of the policies that still matter,
        and of the calibrations that renewed their drift reference (drift is measured against
        them, explain refits them): the version each router should run, the newest approved
        one, those approved since ``older_than``, and the versions any of them re-issues. A
        superseded version's windows age out like any other (keeping every approved one's
        kept every window once approvals came about hourly). Also kept, the newest
        ``keep_newest`` windows (at least one): a fit in flight trains on the newest ones
        and its calibration will name them, and SQLite numbers a new row one above the
        largest id left, so deleting the newest would hand its id to the next window while
        calibrations, drift events and recommendations still name it.
        Policies, calibrations, drift events, pushes and operator requests are never touched.
        """
        oldest_kept = self._s.scalar(
            select(WindowRow.id).order_by(WindowRow.id.desc())
            .offset(max(keep_newest, 1) - 1).limit(1)
        )
        if oldest_kept is None:
            return 0  # fewer windows than that: all kept
        kept = self._versions_still_in_use(older_than)
        protected = exists(
            select(CalibrationRow.id)
            .where(
                # Its own calibration's, or one that renewed its drift reference (a refused
                # candidate's, judged on the traffic since): what `pdctl explain` refits.
                # A version with none of its own is explained by one stored before it.
                or_(CalibrationRow.policy_version.in_(kept),
                    CalibrationRow.reference_for.in_(kept),
                    CalibrationRow.id.in_(self._lineage_calibrations(kept))),
                CalibrationRow.first_window_id <= WindowRow.id,
                CalibrationRow.last_window_id >= WindowRow.id,
            )
        )
        result = self._s.execute(
            delete(WindowRow).where(WindowRow.end_at < older_than, ~protected,
                                    WindowRow.id < oldest_kept),
            execution_options={"synchronize_session": False},
        )
        return _rowcount(result)

    def _lineage_calibrations(self, versions: set[int]) -> set[int]:
        """For each of ``versions`` with no calibration of its own and not a re-issue (whose
        original is kept): exploration turned off, a fallback, adopted. The calibrations
        `pdctl explain` looks through for the one its table came from: the newest
        :data:`LINEAGE_LOOKBACK` stored before it (for an adopted version, with none before
        it, the newest)."""
        own = {int(v) for v in self._s.scalars(
            select(CalibrationRow.policy_version)
            .where(CalibrationRow.policy_version.in_(versions))) if v is not None}
        ids: set[int] = set()
        for created_at in self._s.scalars(
                select(PolicyRow.created_at).where(PolicyRow.version.in_(versions - own),
                                                   PolicyRow.reissue_of.is_(None))):
            # The same query as explain's, so the two pick from the same calibrations.
            before = self.calibrations(limit=LINEAGE_LOOKBACK, until=created_at) \
                or self.calibrations(limit=1)
            ids.update(c.id for c in before)
        return ids

    def _versions_still_in_use(self, since: datetime) -> set[int]:
        """Desired versions, the newest approved, those approved since ``since``, and what
        any of them re-issues (a chain: a re-issue of a re-issue)."""
        versions = {int(v) for v in self._s.scalars(select(RouterDesiredRow.version))}
        newest = self._s.scalar(select(func.max(PolicyRow.version))
                                .where(PolicyRow.status == "approved"))
        if newest is not None:
            versions.add(int(newest))
        versions.update(int(v) for v in self._s.scalars(
            select(PolicyRow.version).where(PolicyRow.status == "approved",
                                            PolicyRow.updated_at >= since)))
        frontier = set(versions)
        while frontier:
            sources = {int(v) for v in self._s.scalars(
                select(PolicyRow.reissue_of).where(PolicyRow.version.in_(frontier),
                                                   PolicyRow.reissue_of.is_not(None)))
                       if v is not None}
            frontier = sources - versions
            versions |= frontier
        return versions

    # -- policies ---------------------------------------------------------------------

    def add_policy(
        self,
        version: int,
        checksum: str,
        body_json: str,
        status: str = "candidate",
        reason: str = "",
        at: datetime | None = None,
        reissue_of: int | None = None,
        seeded_exploration: float | None = None,
        kind: PolicyKind | None = None,
    ) -> PolicyRecord:
        """Store a policy. ``kind`` None: the kind its reason names
        (:func:`~controller.store.kinds.kind_of_reason`)."""
        if status not in POLICY_STATUSES:
            raise StoreError(f"unknown policy status {status!r}; expected one of {POLICY_STATUSES}")
        if version < 1:
            raise StoreError(f"policy version must be >= 1, got {version}")
        if self._s.scalar(select(PolicyRow.id).where(PolicyRow.version == version)) is not None:
            raise StoreError(f"policy version {version} is already stored")
        when = self._at(at)
        row = PolicyRow(
            version=version, checksum=checksum, body=body_json, status=status, reason=reason,
            created_at=when, updated_at=when, reissue_of=reissue_of,
            seeded_exploration=seeded_exploration,
            kind=(kind if kind is not None else kind_of_reason(reason, seeded_exploration)).value,
        )
        self._s.add(row)
        self._s.flush()
        return _policy(row)

    def policy(self, version: int) -> PolicyRecord | None:
        row = self._s.scalar(select(PolicyRow).where(PolicyRow.version == version))
        return None if row is None else _policy(row)

    def policies(
        self, since: datetime | None = None, limit: int | None = None, status: str | None = None
    ) -> list[PolicyRecord]:
        q = select(PolicyRow)
        if since is not None:
            q = q.where(PolicyRow.created_at >= since)
        if status is not None:
            q = q.where(PolicyRow.status == status)
        rows = self._newest(q, PolicyRow.version, PolicyRow.id, limit)
        return [_policy(r[0]) for r in rows]

    def latest_policy(self, status: str = "approved") -> PolicyRecord | None:
        row = self._s.scalar(
            select(PolicyRow).where(PolicyRow.status == status)
            .order_by(PolicyRow.version.desc()).limit(1)
        )
        return None if row is None else _policy(row)

    def set_policy_status(
        self, version: int, status: str, reason: str | None = None, at: datetime | None = None
    ) -> PolicyRecord:
        row = self._s.scalar(
            select(PolicyRow).where(PolicyRow.version == version).with_for_update()
        )
        if row is None:
            raise StoreError(f"no policy version {version}")
        if status not in POLICY_STATUSES:
            raise StoreError(f"unknown policy status {status!r}")
        if not may_transition(row.status, status):
            raise StoreError(f"policy {version}: cannot go from {row.status} to {status}")
        row.status = status
        if reason is not None:
            row.reason = reason
        row.updated_at = self._at(at)
        self._s.flush()
        return _policy(row)

    def mark_promoted(self, version: int, at: datetime | None = None) -> PolicyRecord:
        """``version``, an approved canary, now runs on every router (from ``at``)."""
        row = self._s.scalar(
            select(PolicyRow).where(PolicyRow.version == version).with_for_update()
        )
        if row is None:
            raise StoreError(f"no policy version {version}")
        if row.status != "approved":
            raise StoreError(f"policy {version} is {row.status}: only approved ones are promoted")
        row.promoted_at = row.updated_at = self._at(at)
        self._s.flush()
        return _policy(row)

    def next_version(self) -> int:
        """A version above every policy ever stored and every version a router acknowledged
        (a router restored from a backup may be ahead of the store)."""
        stored = self._s.scalar(select(func.max(PolicyRow.version))) or 0
        acked = self._s.scalar(select(func.max(RouterRow.acked_version))) or 0
        return max(int(stored), int(acked)) + 1

    # -- desired and acknowledged versions per router ---------------------------------

    def set_desired(self, router_id: str, version: int, at: datetime | None = None) -> None:
        status = self._s.scalar(select(PolicyRow.status).where(PolicyRow.version == version))
        if status is None:
            raise StoreError(f"no policy version {version}")
        if status != "approved":
            raise StoreError(f"policy {version} is {status}: only approved policies are desired")
        values = {"router_id": router_id, "version": version, "updated_at": self._at(at)}
        self._upsert(RouterDesiredRow, ["router_id"], values)

    def desired_versions(self) -> dict[str, int]:
        rows = self._s.execute(select(RouterDesiredRow.router_id, RouterDesiredRow.version))
        return {r: int(v) for r, v in rows}

    def clear_desired(self, router_id: str) -> None:
        self._s.execute(delete(RouterDesiredRow).where(RouterDesiredRow.router_id == router_id))

    def record_ack(
        self, router_id: str, version: int, checksum: str, at: datetime | None = None
    ) -> None:
        """The router runs ``version`` with ``checksum`` (from ApplyPolicy or GetPolicy)."""
        self.record_acks([(router_id, version, checksum)], at=at)

    def record_acks(
        self, acks: Sequence[tuple[str, int, str]], at: datetime | None = None
    ) -> None:
        """:meth:`record_ack` for many ``(router, version, checksum)`` in one statement: a
        cycle confirms every router it reconciles, one round trip instead of one per router."""
        if not acks:
            return
        when = self._at(at)
        stmt = self._insert(RouterRow)
        stmt = stmt.on_conflict_do_update(index_elements=["router_id"], set_={
            k: stmt.excluded[k] for k in ("acked_version", "acked_checksum", "last_seen",
                                          "last_error")})
        self._s.execute(stmt, [
            {"router_id": r, "acked_version": v, "acked_checksum": c, "last_seen": when,
             "last_error": None}
            for r, v, c in acks
        ])

    def record_router_error(self, router_id: str, error: str, at: datetime | None = None) -> None:
        values = {"router_id": router_id, "last_error": error, "last_error_at": self._at(at)}
        self._upsert(RouterRow, ["router_id"], values)

    def routers(self) -> list[RouterRecord]:
        rows = self._s.scalars(select(RouterRow).order_by(RouterRow.router_id)).all()
        return [
            RouterRecord(
                router_id=r.router_id, acked_version=r.acked_version,
                acked_checksum=r.acked_checksum, last_seen=r.last_seen,
                last_error=r.last_error, last_error_at=r.last_error_at,
            )
            for r in rows
        ]

    # -- pushes, drift, calibrations --------------------------------------------------

    def add_push(
        self,
        router_id: str,
        version: int,
        result: str,
        latency_s: float | None,
        error: str | None = None,
        at: datetime | None = None,
    ) -> int:
        row = PushRow(
            at=self._at(at), router_id=router_id, version=version, result=result[:32],
            latency_s=latency_s, error=error,
        )
        self._s.add(row)
        self._s.flush()
        return row.id

    def pushes(
        self, since: datetime | None = None, limit: int | None = None
    ) -> list[PushRecord]:
        q = select(PushRow)
        if since is not None:
            q = q.where(PushRow.at >= since)
        return [
            PushRecord(
                id=r.id, at=r.at, router_id=r.router_id, version=r.version, result=r.result,
                latency_s=r.latency_s, error=r.error,
            )
            for (r,) in self._newest(q, PushRow.at, PushRow.id, limit)
        ]

    def add_drift_event(
        self,
        kind: str,
        statistic: float,
        threshold: float,
        window_ids: Sequence[int],
        details: Mapping[str, Any] | None = None,
        at: datetime | None = None,
    ) -> int:
        row = DriftEventRow(
            at=self._at(at), kind=kind, statistic=statistic, threshold=threshold,
            window_ids=[int(i) for i in window_ids],
            details=None if details is None else dict(details),
        )
        self._s.add(row)
        self._s.flush()
        return row.id

    def drift_events(
        self, since: datetime | None = None, limit: int | None = None
    ) -> list[DriftEventRecord]:
        q = select(DriftEventRow)
        if since is not None:
            q = q.where(DriftEventRow.at >= since)
        return [
            DriftEventRecord(
                id=r.id, at=r.at, kind=r.kind, statistic=r.statistic, threshold=r.threshold,
                window_ids=tuple(r.window_ids), details=r.details,
            )
            for (r,) in self._newest(q, DriftEventRow.at, DriftEventRow.id, limit)
        ]

    def add_calibration(
        self,
        training_window_ids: Sequence[int],
        heldout_error: Mapping[str, Any],
        predicted_goodput_new: float | None,
        predicted_goodput_current: float | None,
        policy_version: int | None = None,
        details: Mapping[str, Any] | None = None,
        at: datetime | None = None,
        candidate: tuple[str, str] | None = None,
    ) -> int:
        """Store a calibration. ``candidate``: the (policy JSON, checksum) of a candidate the
        guardrail refused, kept with the calibration in place of a policy version (a refused
        candidate takes no version); never together with ``policy_version``."""
        if candidate is not None and policy_version is not None:
            raise StoreError("a calibration keeps a refused candidate or names its policy "
                             f"version (v{policy_version}), not both")
        ids = sorted(int(i) for i in training_window_ids)
        renewed = (details or {}).get("reference_for")
        row = CalibrationRow(
            reference_for=int(renewed) if isinstance(renewed, int) else None,
            created_at=self._at(at), training_window_ids=ids,
            first_window_id=ids[0] if ids else None, last_window_id=ids[-1] if ids else None,
            heldout_error=dict(heldout_error), predicted_goodput_new=predicted_goodput_new,
            predicted_goodput_current=predicted_goodput_current, policy_version=policy_version,
            details=None if details is None else dict(details),
            candidate_body=None if candidate is None else candidate[0],
            candidate_checksum=None if candidate is None else candidate[1],
        )
        self._s.add(row)
        self._s.flush()
        return row.id

    def calibrations(
        self, since: datetime | None = None, limit: int | None = None,
        until: datetime | None = None,
    ) -> list[CalibrationRecord]:
        """Calibrations stored at or after ``since`` (and at or before ``until``), oldest
        first; with ``limit``, the newest ``limit`` of them."""
        q = select(CalibrationRow)
        if since is not None:
            q = q.where(CalibrationRow.created_at >= since)
        if until is not None:
            q = q.where(CalibrationRow.created_at <= until)
        return [
            _calibration(r)
            for (r,) in self._newest(q, CalibrationRow.created_at, CalibrationRow.id, limit)
        ]

    def calibration(self, calibration_id: int) -> CalibrationRecord | None:
        """One calibration by its id (a refused candidate is found this way: it has no
        version)."""
        row = self._s.get(CalibrationRow, calibration_id)
        return None if row is None else _calibration(row)

    def newest_renewal(self, policy_version: int) -> CalibrationRecord | None:
        """The newest calibration that renewed ``policy_version``'s drift reference."""
        row = self._s.scalar(
            select(CalibrationRow).where(CalibrationRow.reference_for == policy_version)
            .order_by(CalibrationRow.id.desc()).limit(1)
        )
        return None if row is None else _calibration(row)

    def calibration_for(self, policy_version: int) -> CalibrationRecord | None:
        row = self._s.scalar(
            select(CalibrationRow).where(CalibrationRow.policy_version == policy_version)
            .order_by(CalibrationRow.id.desc()).limit(1)
        )
        return None if row is None else _calibration(row)

    # -- capacity recommendations -----------------------------------------------------

    def add_recommendation(
        self,
        *,
        window_ids: Sequence[int],
        workers: tuple[int, int],
        current: tuple[int | None, int | None],
        binding: tuple[str, str],
        utilisation: tuple[float, float],
        body: Mapping[str, Any],
        at: datetime | None = None,
    ) -> int:
        """Store one recommendation; the pairs are (prefill, decode)."""
        if min(workers) < 1:
            raise StoreError(f"recommended workers must be >= 1, got {workers}")
        if not all(math.isfinite(u) for u in utilisation):
            raise StoreError(f"utilisation must be finite, got {utilisation}")
        try:
            dumps_json(body)
        except (TypeError, ValueError) as e:
            raise StoreError(f"recommendation body is not storable JSON: {e}") from None
        ids = [int(i) for i in window_ids]
        row = RecommendationRow(
            created_at=self._at(at), window_ids=ids,
            first_window_id=min(ids) if ids else None, last_window_id=max(ids) if ids else None,
            prefill_workers=workers[0], decode_workers=workers[1],
            current_prefill=current[0], current_decode=current[1],
            prefill_binding=binding[0][:64], decode_binding=binding[1][:64],
            prefill_utilisation=utilisation[0], decode_utilisation=utilisation[1],
            body=dict(body),
        )
        self._s.add(row)
        self._s.flush()
        return row.id

    def recommendations(
        self, since: datetime | None = None, limit: int | None = None
    ) -> list[RecommendationRecord]:
        q = select(RecommendationRow)
        if since is not None:
            q = q.where(RecommendationRow.created_at >= since)
        rows = self._newest(q, RecommendationRow.created_at, RecommendationRow.id, limit)
        return [_recommendation(r) for (r,) in rows]

    def mark_recommendation_applied(
        self, recommendation_id: int, at: datetime | None = None
    ) -> RecommendationRecord:
        """Record that the observed worker counts reached this recommendation (the first
        time counts; marking it again keeps the first time)."""
        row = self._s.get(RecommendationRow, recommendation_id, with_for_update=True)
        if row is None:
            raise StoreError(f"no recommendation {recommendation_id}")
        if row.applied_at is None:
            row.applied_at = self._at(at)
            self._s.flush()
        return _recommendation(row)

    # -- operator requests ------------------------------------------------------------

    def add_request(
        self,
        kind: str,
        args: Mapping[str, Any],
        who: str,
        reason: str = "",
        at: datetime | None = None,
    ) -> int:
        if kind not in REQUEST_KINDS:
            raise StoreError(f"unknown request kind {kind!r}; expected one of {REQUEST_KINDS}")
        row = OperatorRequestRow(
            created_at=self._at(at), who=who, kind=kind, args=dict(args), reason=reason,
            status="pending",
        )
        self._s.add(row)
        self._s.flush()
        return row.id

    def claim_next_request(
        self, holder: str, at: datetime | None = None, stale_after_s: float | None = None,
        reclaim_before: datetime | None = None,
    ) -> OperatorRequest | None:
        """Claim the oldest pending request for ``holder``; exactly one claimer wins it.

        With ``stale_after_s``, a request claimed that long ago and never finished (its
        claimer died) is claimable again. With ``reclaim_before`` (when ``holder`` took the
        leader lease), so is one another holder claimed before then: a previous leader's,
        whose writes the lease now fences out, at once rather than after ``stale_after_s``.
        """
        now = self._at(at)
        claimed = OperatorRequestRow.status == "claimed"
        claimable: ColumnElement[bool] = OperatorRequestRow.status == "pending"
        if stale_after_s is not None:
            stale = now - timedelta(seconds=stale_after_s)
            claimable = or_(claimable, and_(claimed, OperatorRequestRow.claimed_at < stale))
        if reclaim_before is not None:
            claimable = or_(claimable, and_(claimed, OperatorRequestRow.claimed_by != holder,
                                            OperatorRequestRow.claimed_at < reclaim_before))
        pick = (
            select(OperatorRequestRow.id).where(claimable)
            .order_by(OperatorRequestRow.id).limit(1)
            .with_for_update(skip_locked=True)
        )
        for _ in range(_CLAIM_ATTEMPTS):
            request_id = self._s.scalar(pick)
            if request_id is None:
                return None
            won = self._s.execute(
                update(OperatorRequestRow)
                .where(OperatorRequestRow.id == request_id, claimable)
                .values(status="claimed", claimed_by=holder, claimed_at=now),
                execution_options={"synchronize_session": False},
            )
            if _rowcount(won) == 1:
                return self.request(request_id)
        return None

    def finish_request(
        self, request_id: int, outcome: str, ok: bool = True, at: datetime | None = None
    ) -> OperatorRequest:
        row = self._s.get(OperatorRequestRow, request_id, with_for_update=True)
        if row is None:
            raise StoreError(f"no operator request {request_id}")
        if row.status in ("done", "failed"):
            raise StoreError(f"operator request {request_id} is already {row.status}")
        row.status = "done" if ok else "failed"
        row.outcome = outcome
        row.finished_at = self._at(at)
        self._s.flush()
        return _request(row)

    def release_requests(self, request_ids: Sequence[int], holder: str) -> list[int]:
        """Give back requests ``holder`` claimed and did not finish (its cycle failed before
        its write committed): pending again, for the next claim. Returns those given back
        (one another claimer took, or that is finished, stays as it is)."""
        if not request_ids:
            return []
        mine = and_(OperatorRequestRow.id.in_(list(request_ids)),
                    OperatorRequestRow.status == "claimed",
                    OperatorRequestRow.claimed_by == holder)
        ids = sorted(self._s.scalars(select(OperatorRequestRow.id).where(mine)
                                     .with_for_update()))
        if ids:
            self._s.execute(
                update(OperatorRequestRow).where(OperatorRequestRow.id.in_(ids))  # locked
                .values(status="pending", claimed_by=None, claimed_at=None),
                execution_options={"synchronize_session": False})
        return ids

    def request(self, request_id: int) -> OperatorRequest | None:
        row = self._s.get(OperatorRequestRow, request_id, populate_existing=True)
        return None if row is None else _request(row)

    def requests(
        self, since: datetime | None = None, limit: int | None = None, status: str | None = None
    ) -> list[OperatorRequest]:
        q = select(OperatorRequestRow)
        if since is not None:
            q = q.where(OperatorRequestRow.created_at >= since)
        if status is not None:
            q = q.where(OperatorRequestRow.status == status)
        rows = self._newest(q, OperatorRequestRow.created_at, OperatorRequestRow.id, limit)
        return [_request(r) for (r,) in rows]

    # -- leader lease -----------------------------------------------------------------

    def try_acquire_lease(
        self, holder: str, ttl_s: float, now: datetime, name: str = LEADER
    ) -> Lease | None:
        """Take the lease if it is free, expired or already ours; ``None`` if another
        holder has it. A change of holder increments ``term``."""
        self._s.execute(
            self._insert(LeaderLeaseRow)
            .values(name=name, holder=None, term=0)
            .on_conflict_do_nothing(index_elements=["name"])
        )
        ours = LeaderLeaseRow.holder == holder
        result = self._s.execute(
            update(LeaderLeaseRow)
            .where(
                LeaderLeaseRow.name == name,
                or_(ours, LeaderLeaseRow.holder.is_(None), LeaderLeaseRow.expires_at <= now),
            )
            .values(
                holder=holder,
                expires_at=now + timedelta(seconds=ttl_s),
                term=case((ours, LeaderLeaseRow.term), else_=LeaderLeaseRow.term + 1),
                acquired_at=case((ours, LeaderLeaseRow.acquired_at), else_=now),
            ),
            execution_options={"synchronize_session": False},
        )
        return self.lease(name) if _rowcount(result) == 1 else None

    def renew_lease(
        self, holder: str, ttl_s: float, now: datetime, name: str = LEADER
    ) -> Lease | None:
        """Extend our unexpired lease; ``None`` if it expired or someone else holds it."""
        result = self._s.execute(
            update(LeaderLeaseRow)
            .where(
                LeaderLeaseRow.name == name, LeaderLeaseRow.holder == holder,
                LeaderLeaseRow.expires_at > now,
            )
            .values(expires_at=now + timedelta(seconds=ttl_s)),
            execution_options={"synchronize_session": False},
        )
        return self.lease(name) if _rowcount(result) == 1 else None

    def release_lease(self, holder: str, now: datetime, name: str = LEADER) -> bool:
        result = self._s.execute(
            update(LeaderLeaseRow)
            .where(LeaderLeaseRow.name == name, LeaderLeaseRow.holder == holder)
            .values(holder=None, expires_at=now),
            execution_options={"synchronize_session": False},
        )
        return _rowcount(result) == 1

    def lease(self, name: str = LEADER, *, lock: bool = False) -> Lease | None:
        """The lease row. ``lock`` (a fence, inside a write transaction): share-locked to the
        commit, so a takeover's update waits for this transaction on PostgreSQL, where a
        plain read let another replica take the lease and both commit (READ COMMITTED).
        SQLite's write transaction is exclusive already."""
        row = self._s.get(LeaderLeaseRow, name, populate_existing=True,
                          with_for_update={"read": True} if lock else None)
        if row is None:
            return None
        return Lease(row.name, row.holder, int(row.term), row.acquired_at, row.expires_at)

    # -- helpers ----------------------------------------------------------------------

    def _newest(
        self,
        q: Select[*tuple[Any, ...]],
        order: InstrumentedAttribute[Any],
        tiebreak: InstrumentedAttribute[Any],
        limit: int | None,
    ) -> list[Any]:
        """Rows of ``q`` oldest first; with ``limit``, only the newest ``limit``."""
        if limit is None:
            return list(self._s.execute(q.order_by(order, tiebreak)).all())
        rows = self._s.execute(q.order_by(order.desc(), tiebreak.desc()).limit(limit)).all()
        return list(reversed(rows))

    def _insert(self, model: type[Base]) -> Any:
        # Upserts are dialect-specific in SQLAlchemy; both spell ON CONFLICT the same way.
        dialect = self._s.get_bind().dialect.name
        return (postgresql.insert if dialect == "postgresql" else sqlite.insert)(model)

    def _upsert(self, model: type[Base], keys: list[str], values: dict[str, Any]) -> None:
        changes = {k: v for k, v in values.items() if k not in keys}
        stmt = self._insert(model).values(**values)
        self._s.execute(stmt.on_conflict_do_update(index_elements=keys, set_=changes))


def _in_own_transaction(fn: Callable[Concatenate[Tx, P], R]) -> Callable[Concatenate[Store, P], R]:
    def run(store: Store, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with store.cycle() as tx:
            return fn(tx, *args, **kwargs)

    run.__name__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run


class Store:
    """The history database. ``Store("sqlite:///pd.db")`` or ``postgresql+psycopg://...``.

    The schema is managed by Alembic (``pdctl db upgrade`` / :meth:`upgrade`).
    """

    def __init__(
        self,
        url: str | URL,
        clock: Clock | None = None,
        *,
        echo: bool = False,
        busy_timeout_ms: int = 5000,
        sqlite_synchronous: str = "NORMAL",
    ) -> None:
        self.url = normalize_url(url)
        self.clock: Clock = clock or WallClock()
        self.engine: Engine = make_engine(
            self.url, echo=echo, busy_timeout_ms=busy_timeout_ms,
            sqlite_synchronous=sqlite_synchronous,
        )
        self._writer = self.engine.execution_options(**{WRITE_OPTION: True})
        # A read sees one snapshot: PostgreSQL's READ COMMITTED gives each statement its own,
        # so two reads in one transaction could see another replica's commit between them.
        # (SQLite's deferred BEGIN takes its snapshot at the first read already.)
        self._reader = (self.engine.execution_options(isolation_level="REPEATABLE READ")
                        if self.dialect == "postgresql" else self.engine)
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the SQLite file
        self.identity_problem()  # records it when the file exists

    @classmethod
    def from_config(cls, config: StoreConfig, clock: Clock | None = None) -> Store:
        return cls(
            config.url, clock, echo=config.echo, busy_timeout_ms=config.busy_timeout_ms,
            sqlite_synchronous=config.sqlite_synchronous,
        )

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def upgrade(self, revision: str = "head") -> None:
        from controller.store import migrate

        migrate.upgrade(self.url, revision)
        self.engine.dispose()  # pooled connections predate the schema change
        self.identity_problem()  # a file just created is the one this store writes

    @property
    def sqlite_file(self) -> str | None:
        """The SQLite database file's path (None: PostgreSQL, in-memory or a ``file:`` URI)."""
        db = self.url.database
        if self.dialect != "sqlite" or not db or db == ":memory:" or db.startswith("file:"):
            return None
        return db

    def identity_problem(self) -> str | None:
        """Why the SQLite file is no longer the one this store opened (removed, or another
        file at its path: its device and inode changed), else None. The first call that
        finds the file records its identity. One ``stat`` per call."""
        path = self.sqlite_file
        if path is None:
            return None
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if self._identity is None:
                return None
            return f"the database file {path} was removed while the daemon had it open"
        identity = (st.st_dev, st.st_ino)
        if self._identity is None:
            self._identity = identity
        elif identity != self._identity:
            return (f"the database file {path} was replaced by another file while the "
                    "daemon had it open")
        return None

    def upgrade_embedded(self) -> None:
        """The embedded default (SQLite) migrates itself at start; a file that is not a
        database, a directory that does not exist or a database from a newer release is a
        StoreError naming it, not an alembic or sqlite traceback."""
        from controller.store import migrate

        try:
            current = migrate.current_revision(self.url)
        except DBAPIError as e:
            raise StoreUnavailable(f"cannot open {self.safe_url}: {e.orig}") from None
        problem = migrate.newer_release_problem(f"database {self.safe_url}", current)
        if problem is not None:
            raise StoreError(problem)
        self.upgrade()

    def require_schema(self) -> None:
        """Raise :class:`StoreError` unless the database is at the code's migration head."""
        from controller.store import migrate

        try:
            current = migrate.current_revision(self.url)
        except DBAPIError as e:
            raise StoreUnavailable(f"cannot reach {self.safe_url}: {e.orig}") from None
        head = migrate.head_revision()
        if current != head:
            raise StoreError(
                f"database {self.safe_url} is at revision {current or 'none'}, this version "
                f"needs {head}: {migrate.schema_advice(current, head)}"
            )

    @property
    def safe_url(self) -> str:
        return self.url.render_as_string(hide_password=True)

    @contextmanager
    def cycle(self) -> Iterator[Tx]:
        """One transaction for one control cycle's writes: all of them or none."""
        with self._session(self._writer) as tx:
            yield tx

    @contextmanager
    def read(self) -> Iterator[Tx]:
        """A read transaction (a consistent snapshot; does not block writers)."""
        with self._session(self._reader) as tx:
            yield tx

    @contextmanager
    def _session(self, bind: Engine) -> Iterator[Tx]:
        problem = self.identity_problem()
        if problem is not None:
            raise StoreGone(problem)
        try:
            with Session(bind, expire_on_commit=False) as session, session.begin():
                yield Tx(session, self.clock)
        except DBAPIError as e:
            mapped = classify_db_error(e, self.safe_url)
            if mapped is None:
                raise
            raise mapped from e

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    add_window = _in_own_transaction(Tx.add_window)
    windows = _in_own_transaction(Tx.windows)
    windows_by_ids = _in_own_transaction(Tx.windows_by_ids)
    compact_windows = _in_own_transaction(Tx.compact_windows)
    add_policy = _in_own_transaction(Tx.add_policy)
    policy = _in_own_transaction(Tx.policy)
    policies = _in_own_transaction(Tx.policies)
    latest_policy = _in_own_transaction(Tx.latest_policy)
    set_policy_status = _in_own_transaction(Tx.set_policy_status)
    mark_promoted = _in_own_transaction(Tx.mark_promoted)
    next_version = _in_own_transaction(Tx.next_version)
    set_desired = _in_own_transaction(Tx.set_desired)
    desired_versions = _in_own_transaction(Tx.desired_versions)
    clear_desired = _in_own_transaction(Tx.clear_desired)
    record_ack = _in_own_transaction(Tx.record_ack)
    record_acks = _in_own_transaction(Tx.record_acks)
    record_router_error = _in_own_transaction(Tx.record_router_error)
    routers = _in_own_transaction(Tx.routers)
    add_push = _in_own_transaction(Tx.add_push)
    pushes = _in_own_transaction(Tx.pushes)
    add_drift_event = _in_own_transaction(Tx.add_drift_event)
    drift_events = _in_own_transaction(Tx.drift_events)
    add_calibration = _in_own_transaction(Tx.add_calibration)
    calibrations = _in_own_transaction(Tx.calibrations)
    calibration_for = _in_own_transaction(Tx.calibration_for)
    calibration = _in_own_transaction(Tx.calibration)
    newest_renewal = _in_own_transaction(Tx.newest_renewal)
    add_recommendation = _in_own_transaction(Tx.add_recommendation)
    recommendations = _in_own_transaction(Tx.recommendations)
    mark_recommendation_applied = _in_own_transaction(Tx.mark_recommendation_applied)
    add_request = _in_own_transaction(Tx.add_request)
    claim_next_request = _in_own_transaction(Tx.claim_next_request)
    finish_request = _in_own_transaction(Tx.finish_request)
    release_requests = _in_own_transaction(Tx.release_requests)
    request = _in_own_transaction(Tx.request)
    requests = _in_own_transaction(Tx.requests)
    try_acquire_lease = _in_own_transaction(Tx.try_acquire_lease)
    renew_lease = _in_own_transaction(Tx.renew_lease)
    release_lease = _in_own_transaction(Tx.release_lease)
    lease = _in_own_transaction(Tx.lease)


def _utc(epoch_s: float) -> datetime:
    from datetime import UTC

    return datetime.fromtimestamp(epoch_s, tz=UTC)


def _total_requests(window: Window) -> float | None:
    if not window.outcomes:
        return None
    try:
        return math.fsum(window.outcomes.columns.float_column("requests"))
    except OverflowError:  # only absurd inputs; the body keeps every value anyway
        return None


_INSERT_WINDOW = insert(WindowRow)


# A read at least this large moves what it decoded to the oldest GC generation (below).
PROMOTE_DECODED_WINDOWS = 1000


def _decode_windows(rows: Sequence[tuple[int, str]]) -> list[StoredWindow]:
    """Stored bodies to windows, with the cyclic garbage collector kept out of the way.

    A calibration reads thousands of windows of dozens of objects each. Left alone, the
    collector walks the new objects every few hundred allocations, again as they age, and
    the whole heap whenever it grew by a quarter, a large share of the read's time
    (``benchmarks/core_calibrate.py`` measures it). These objects hold no reference cycles
    (nothing to free), so the collector is paused while they are made. After a large read
    they are moved straight to the oldest generation (``gc.freeze()`` + ``gc.unfreeze()``
    do that in constant time, without a walk), where the next full collection sees them
    once, so the collector's cost of a read stays small and constant. That also
    promotes whatever young garbage other threads had at that instant, so it is kept to
    large reads (a calibration), not the few windows a control cycle reads; and it is
    skipped when the application keeps objects frozen itself (a pre-fork server), which the
    unfreeze would undo.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        return [StoredWindow(i, Window.from_dict(json.loads(b))) for i, b in rows]
    finally:
        if len(rows) >= PROMOTE_DECODED_WINDOWS and gc.get_freeze_count() == 0:
            gc.freeze()
            gc.unfreeze()
        if enabled:
            gc.enable()


def _rowcount(result: Any) -> int:
    return int(cast(CursorResult[Any], result).rowcount)


def _policy(r: PolicyRow) -> PolicyRecord:
    return PolicyRecord(
        version=int(r.version), checksum=r.checksum, body_json=r.body, status=r.status,
        reason=r.reason, created_at=r.created_at, updated_at=r.updated_at,
        promoted_at=r.promoted_at, reissue_of=None if r.reissue_of is None else int(r.reissue_of),
        seeded_exploration=(None if r.seeded_exploration is None
                            else float(r.seeded_exploration)),
        kind=PolicyKind(r.kind),
    )


def _calibration(r: CalibrationRow) -> CalibrationRecord:
    return CalibrationRecord(
        id=r.id, created_at=r.created_at, training_window_ids=tuple(r.training_window_ids),
        first_window_id=r.first_window_id, last_window_id=r.last_window_id,
        heldout_error=r.heldout_error, predicted_goodput_new=r.predicted_goodput_new,
        predicted_goodput_current=r.predicted_goodput_current,
        policy_version=None if r.policy_version is None else int(r.policy_version),
        details=r.details, candidate_body_json=r.candidate_body,
        candidate_checksum=r.candidate_checksum,
    )


def _recommendation(r: RecommendationRow) -> RecommendationRecord:
    return RecommendationRecord(
        id=r.id, created_at=r.created_at, window_ids=tuple(r.window_ids),
        first_window_id=r.first_window_id, last_window_id=r.last_window_id,
        prefill_workers=r.prefill_workers, decode_workers=r.decode_workers,
        current_prefill=r.current_prefill, current_decode=r.current_decode,
        prefill_binding=r.prefill_binding, decode_binding=r.decode_binding,
        prefill_utilisation=r.prefill_utilisation, decode_utilisation=r.decode_utilisation,
        body=r.body, applied_at=r.applied_at,
    )


def _request(r: OperatorRequestRow) -> OperatorRequest:
    return OperatorRequest(
        id=r.id, created_at=r.created_at, who=r.who, kind=r.kind, args=r.args, reason=r.reason,
        status=r.status, claimed_by=r.claimed_by, claimed_at=r.claimed_at, outcome=r.outcome,
        finished_at=r.finished_at,
    )
