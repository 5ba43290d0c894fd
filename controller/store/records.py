"""What the store hands back: plain frozen values, never live ORM objects."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from controller.core.window import Window
from controller.store.kinds import PolicyKind


@dataclass(frozen=True, slots=True)
class StoredWindow:
    id: int
    window: Window


@dataclass(frozen=True, slots=True)
class PolicyRecord:
    version: int
    checksum: str
    body_json: str
    status: str
    reason: str
    created_at: datetime
    updated_at: datetime
    promoted_at: datetime | None = None  # a canary's promotion to every router
    reissue_of: int | None = None  # re-issued under this number: the table of that version
    # The exploration share the controller turned on in every cell of an adopted policy
    # that explored nowhere ([controller] adopted_exploration); None for every other policy.
    seeded_exploration: float | None = None
    kind: PolicyKind = PolicyKind.OTHER  # where it came from (policies.kind, 0007)


@dataclass(frozen=True, slots=True)
class CalibrationRecord:
    id: int
    created_at: datetime
    training_window_ids: tuple[int, ...]
    first_window_id: int | None
    last_window_id: int | None
    heldout_error: Any
    predicted_goodput_new: float | None
    predicted_goodput_current: float | None
    policy_version: int | None
    details: Any
    # A candidate the guardrail refused, kept here instead of under a version (0008): the
    # policy JSON (its version field a placeholder) and its checksum; None otherwise.
    candidate_body_json: str | None = None
    candidate_checksum: str | None = None

    @property
    def rejected_candidate(self) -> bool:
        """The calibration keeps a refused candidate (no version was taken for it)."""
        return self.candidate_body_json is not None


@dataclass(frozen=True, slots=True)
class RouterRecord:
    router_id: str
    acked_version: int | None
    acked_checksum: str | None
    last_seen: datetime | None
    last_error: str | None
    last_error_at: datetime | None


@dataclass(frozen=True, slots=True)
class DriftEventRecord:
    id: int
    at: datetime
    kind: str
    statistic: float
    threshold: float
    window_ids: tuple[int, ...]
    details: Any


@dataclass(frozen=True, slots=True)
class PushRecord:
    id: int
    at: datetime
    router_id: str
    version: int
    result: str
    latency_s: float | None
    error: str | None


@dataclass(frozen=True, slots=True)
class OperatorRequest:
    id: int
    created_at: datetime
    who: str
    kind: str
    args: Any
    reason: str
    status: str
    claimed_by: str | None
    claimed_at: datetime | None
    outcome: str | None
    finished_at: datetime | None


@dataclass(frozen=True, slots=True)
class Lease:
    name: str
    holder: str | None
    term: int  # grows with every change of holder: a fencing token
    acquired_at: datetime | None
    expires_at: datetime | None



@dataclass(frozen=True, slots=True)
class RecommendationRecord:
    """A stored capacity recommendation; per-role numbers as columns, the rest in ``body``."""

    id: int
    created_at: datetime
    window_ids: tuple[int, ...]
    first_window_id: int | None
    last_window_id: int | None
    prefill_workers: int
    decode_workers: int
    current_prefill: int | None  # answering workers when it was computed
    current_decode: int | None
    prefill_binding: str  # the constraint that limits each side
    decode_binding: str
    prefill_utilisation: float  # demand / capacity at the recommended counts
    decode_utilisation: float
    body: Any  # CapacityPlan.to_dict(): inputs, per-role numbers and explanation
    applied_at: datetime | None

    def workers(self, role: str) -> int:
        """The recommended count of ``role`` ("prefill" or "decode")."""
        if role == "prefill":
            return self.prefill_workers
        if role == "decode":
            return self.decode_workers
        raise ValueError(f"unknown role {role!r}; expected prefill or decode")
