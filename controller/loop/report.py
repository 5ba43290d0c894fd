"""What one cycle did: :class:`CycleReport`, logged after each cycle and kept as
``Cycle.last_report``."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from controller.core.rollout import PolicyStatus
from controller.core.trigger import Trigger


class CycleResult(enum.StrEnum):
    """How a cycle ended; the values are logged and are ``pdctl_cycles_total``'s label."""

    OK = "ok"
    SKIPPED = "skipped"  # no window (observe failed) or leadership lost before writing
    FAILED = "failed"


@dataclass
class CycleReport:
    """What one cycle did (also logged and kept as :attr:`Cycle.last_report`)."""

    result: CycleResult = CycleResult.OK
    reason: str = ""
    leader: bool = True
    window_id: int | None = None
    drift: list[str] = field(default_factory=list)
    trigger: Trigger | None = None
    calibration_id: int | None = None
    candidate_version: int | None = None  # None for a refused candidate: it takes none
    candidate_status: PolicyStatus | None = None  # as stored
    not_stored: str = "dry run"  # why a calibration stored no policy (candidate_version None)
    approved_version: int | None = None
    guardrail: str | None = None
    canary: str | None = None
    requests: list[str] = field(default_factory=list)
    pushes: int = 0
    acked: dict[str, int | None] = field(default_factory=dict)
    recommendation_id: int | None = None
    capacity: str | None = None  # the recommendation in words, or why there is none

    def summary(self) -> str:
        """The cycle in one line, for a text log (the JSON log has every field too): its
        result, then only what happened in it. A quiet cycle is just its result."""
        parts = [] if self.leader else ["follower"]
        if self.reason:
            parts.append(self.reason)
        if self.drift:
            parts.append("drift: " + ", ".join(self.drift))
        if self.trigger is not None and self.guardrail is not None:
            # The guardrail's reason starts with its verdict; the version's stored status
            # is the cycle's (advisory, and a held rollout, keep an approval back).
            stored = (f"v{self.candidate_version} {self.candidate_status}"
                      if self.candidate_version is not None
                      else f"rejected, kept with calibration #{self.calibration_id} (no "
                      "version)" if self.candidate_status is PolicyStatus.REJECTED
                      else f"not stored ({self.not_stored})")
            parts.append(f"recalibration ({self.trigger}): {stored}, guardrail {self.guardrail}")
        parts += self.requests
        if self.canary:
            parts.append(f"canary {self.canary}")
        if self.pushes:
            acked = ", ".join(f"{r} v{v}" for r, v in sorted(self.acked.items())
                              if v is not None)
            parts.append(f"{self.pushes} push(es); acked: {acked or 'none'}")
        if self.recommendation_id is not None and self.capacity:
            parts.append(f"capacity: {self.capacity}")
        return ": ".join([self.result, "; ".join(parts)]) if parts else self.result


def join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b


def report_fields(r: CycleReport) -> dict[str, Any]:
    return {k: v for k, v in r.__dict__.items() if v not in (None, [], {}, "")}


__all__ = ["CycleReport", "CycleResult", "join", "report_fields"]
