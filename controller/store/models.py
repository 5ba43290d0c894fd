"""The history schema (SQLAlchemy 2 typed ORM). Alembic migrations follow these models.

Every constraint is named through the naming convention, so batch migrations on SQLite can
alter them and both engines agree on names. Times are aware UTC datetimes
(:class:`UtcDateTime`); window bodies and other structured values are JSON text.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from controller.core.rollout import PolicyStatus
from controller.store.types import JsonText, SafeString, SafeText, UtcDateTime

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# superseded: an approved canary replaced by its canary refit (not a regression: 0003).
# The values of controller.core.rollout.PolicyStatus, in its order (the CHECK constraint).
POLICY_STATUSES = tuple(s.value for s in PolicyStatus)
REQUEST_KINDS = ("recalibrate", "rollback", "pause", "resume")
REQUEST_STATUSES = ("pending", "claimed", "done", "failed")
DRIFT_KINDS = ("workload", "performance", "slo")

ROUTER_ID = String(255)


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class WindowRow(Base):
    """One observed window; ``body`` is ``Window.to_dict()`` as JSON text."""

    __tablename__ = "windows"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    start_at: Mapped[datetime] = mapped_column(UtcDateTime, index=True)
    end_at: Mapped[datetime] = mapped_column(UtcDateTime)
    interval_s: Mapped[float] = mapped_column(Float)
    source: Mapped[str] = mapped_column(String(32))
    n_workers: Mapped[int] = mapped_column(Integer)
    n_failures: Mapped[int] = mapped_column(Integer)
    requests: Mapped[float | None] = mapped_column(Float)  # routers' requests in the window
    body: Mapped[str] = mapped_column(Text)


class PolicyRow(Base):
    __tablename__ = "policies"
    __table_args__ = (CheckConstraint(_in("status", POLICY_STATUSES), name="status"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    version: Mapped[int] = mapped_column(BigInteger, unique=True)
    checksum: Mapped[str] = mapped_column(String(64))
    body: Mapped[str] = mapped_column(Text)  # the policy JSON file format
    status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(SafeText())
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime)
    # When a canary became the fleet's policy: the post-promotion watch counts from it (0004).
    promoted_at: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)
    # The version whose table a re-issue carries: the rollout orders tables by it (0005).
    reissue_of: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # The exploration share the controller turned on in an adopted policy that explored
    # nowhere (its provenance, typed: 0006); NULL for every other policy.
    seeded_exploration: Mapped[float | None] = mapped_column(Float, nullable=True)
    # Where the policy came from, a controller.store.kinds.PolicyKind value (0007).
    kind: Mapped[str] = mapped_column(String(16), server_default="other")


class CalibrationRow(Base):
    __tablename__ = "calibrations"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, index=True)
    first_window_id: Mapped[int | None] = mapped_column(Integer)
    last_window_id: Mapped[int | None] = mapped_column(Integer)
    training_window_ids: Mapped[Any] = mapped_column(JsonText)
    heldout_error: Mapped[Any] = mapped_column(JsonText)
    predicted_goodput_new: Mapped[float | None] = mapped_column(Float)
    predicted_goodput_current: Mapped[float | None] = mapped_column(Float)
    policy_version: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("policies.version"), index=True
    )
    details: Mapped[Any] = mapped_column(JsonText, nullable=True)
    # The policy whose drift reference this calibration renewed (details["reference_for"],
    # indexed: a restart or a rollback looks it up, 0004).
    reference_for: Mapped[int | None] = mapped_column(BigInteger, nullable=True, index=True)
    # The candidate the guardrail refused (the policy JSON file format, its version field a
    # placeholder) and its checksum: a refused candidate takes no policy version (0008).
    # NULL for every other calibration.
    candidate_body: Mapped[str | None] = mapped_column(Text, nullable=True)
    candidate_checksum: Mapped[str | None] = mapped_column(String(64), nullable=True)


class RouterDesiredRow(Base):
    """The version each router should run (a canary differs from the rest)."""

    __tablename__ = "router_desired"

    router_id: Mapped[str] = mapped_column(ROUTER_ID, primary_key=True)
    version: Mapped[int] = mapped_column(BigInteger, ForeignKey("policies.version"))
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime)


class RouterRow(Base):
    """What each router last acknowledged (may be ahead of the store: no foreign key)."""

    __tablename__ = "routers"

    router_id: Mapped[str] = mapped_column(ROUTER_ID, primary_key=True)
    acked_version: Mapped[int | None] = mapped_column(BigInteger)
    acked_checksum: Mapped[str | None] = mapped_column(String(64))
    last_seen: Mapped[datetime | None] = mapped_column(UtcDateTime)
    last_error: Mapped[str | None] = mapped_column(SafeText())
    last_error_at: Mapped[datetime | None] = mapped_column(UtcDateTime)


class DriftEventRow(Base):
    __tablename__ = "drift_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UtcDateTime, index=True)
    kind: Mapped[str] = mapped_column(String(32))
    statistic: Mapped[float] = mapped_column(Float)
    threshold: Mapped[float] = mapped_column(Float)
    window_ids: Mapped[Any] = mapped_column(JsonText)
    details: Mapped[Any] = mapped_column(JsonText, nullable=True)


class PushRow(Base):
    __tablename__ = "pushes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UtcDateTime, index=True)
    router_id: Mapped[str] = mapped_column(ROUTER_ID)
    version: Mapped[int] = mapped_column(BigInteger)
    result: Mapped[str] = mapped_column(String(32))
    latency_s: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(SafeText())


class OperatorRequestRow(Base):
    """``pdctl`` writes a request; the daemon's leader claims it and records the outcome."""

    __tablename__ = "operator_requests"
    __table_args__ = (
        CheckConstraint(_in("kind", REQUEST_KINDS), name="kind"),
        CheckConstraint(_in("status", REQUEST_STATUSES), name="status"),
        Index("ix_operator_requests_status_id", "status", "id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    who: Mapped[str] = mapped_column(SafeString(255))
    kind: Mapped[str] = mapped_column(String(32))
    args: Mapped[Any] = mapped_column(JsonText)
    reason: Mapped[str] = mapped_column(SafeText())
    status: Mapped[str] = mapped_column(String(16))
    claimed_by: Mapped[str | None] = mapped_column(SafeString(255))
    claimed_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    outcome: Mapped[str | None] = mapped_column(SafeText())
    finished_at: Mapped[datetime | None] = mapped_column(UtcDateTime)


class LeaderLeaseRow(Base):
    """One row per lease name; ``term`` grows with every change of holder (fencing token)."""

    __tablename__ = "leader_lease"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str | None] = mapped_column(SafeString(255))
    term: Mapped[int] = mapped_column(BigInteger)
    acquired_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    expires_at: Mapped[datetime | None] = mapped_column(UtcDateTime)


class RecommendationRow(Base):
    """One capacity recommendation; ``body`` is ``CapacityPlan.to_dict()`` (inputs, per-role
    numbers, explanation). No foreign key to ``windows``: retention compacts windows, and the
    ids stay as a record of what the plan was computed from."""

    __tablename__ = "recommendations"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, index=True)
    first_window_id: Mapped[int | None] = mapped_column(Integer)
    last_window_id: Mapped[int | None] = mapped_column(Integer)
    window_ids: Mapped[Any] = mapped_column(JsonText)
    prefill_workers: Mapped[int] = mapped_column(Integer)
    decode_workers: Mapped[int] = mapped_column(Integer)
    current_prefill: Mapped[int | None] = mapped_column(Integer)
    current_decode: Mapped[int | None] = mapped_column(Integer)
    prefill_binding: Mapped[str] = mapped_column(String(64))
    decode_binding: Mapped[str] = mapped_column(String(64))
    prefill_utilisation: Mapped[float] = mapped_column(Float)
    decode_utilisation: Mapped[float] = mapped_column(Float)
    body: Mapped[Any] = mapped_column(JsonText)
    # Set when the observed worker counts reached this recommendation (the operator or an
    # autoscaler applied it): the scaling event that followed was expected, not drift.
    applied_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
