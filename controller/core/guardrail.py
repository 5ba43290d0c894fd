"""Guardrail: approve a candidate only if it is predicted to beat the current policy."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GuardrailVerdict:
    approved: bool
    candidate_goodput: float
    current_goodput: float | None
    margin: float
    forced: bool
    reason: str

    def to_dict(self) -> dict[str, object]:
        return {
            "approved": self.approved, "candidate_goodput": self.candidate_goodput,
            "current_goodput": self.current_goodput, "margin": self.margin,
            "forced": self.forced, "reason": self.reason,
        }


def check(
    candidate_goodput: float,
    current_goodput: float | None,
    margin: float,
    force: bool = False,
) -> GuardrailVerdict:
    """Approve iff ``candidate >= current + margin`` (or no current policy, or forced)."""
    if margin < 0:
        raise ValueError(f"guardrail margin must be >= 0, got {margin}")
    if current_goodput is None:
        return GuardrailVerdict(True, candidate_goodput, None, margin, force,
                                "no current policy to compare with")
    gain = candidate_goodput - current_goodput
    numbers = (f"predicted goodput {candidate_goodput:.4f} vs current {current_goodput:.4f} "
               f"(gain {gain:+.4f}, margin {margin:.4f})")
    if gain >= margin:
        return GuardrailVerdict(True, candidate_goodput, current_goodput, margin, force,
                                f"approved: {numbers}")
    if force:
        return GuardrailVerdict(True, candidate_goodput, current_goodput, margin, True,
                                f"forced despite guardrail: {numbers}")
    return GuardrailVerdict(False, candidate_goodput, current_goodput, margin, False,
                            f"rejected: {numbers}")
