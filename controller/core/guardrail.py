"""Guardrail: approve a candidate only if it is predicted to beat the current policy.

The gain needed is an absolute margin, and in an overloaded regime (the current policy
predicted to meet both SLOs for fewer than ``overload_below`` of its requests) at least the
model's held-out goodput error too: there the model predicts latency tails it has barely
seen, and a predicted gain smaller than its own error is no evidence that the candidate is
better.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GuardrailVerdict:
    approved: bool
    candidate_goodput: float
    current_goodput: float | None
    margin: float
    forced: bool  # the check was asked to force an approval
    reason: str
    # Approved only because it was forced: the gain fell short of the margin (not in
    # to_dict: a stored verdict keeps its fields; its reason says "forced").
    overridden: bool = False

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
    heldout_error: float | None = None,
    overload_below: float = 0.0,
) -> GuardrailVerdict:
    """Approve iff ``candidate >= current + margin`` (or no current policy, or forced), where
    ``margin`` is raised to ``heldout_error`` when ``current < overload_below``; the
    verdict's ``margin`` is the gain that was needed."""
    if margin < 0:
        raise ValueError(f"guardrail margin must be >= 0, got {margin}")
    if heldout_error is not None and not heldout_error >= 0:
        raise ValueError(f"held-out goodput error must be >= 0, got {heldout_error}")
    if current_goodput is None:
        return GuardrailVerdict(True, candidate_goodput, None, margin, force,
                                "no current policy to compare with")
    if heldout_error is not None and current_goodput < overload_below:
        margin = max(margin, heldout_error)
    gain = candidate_goodput - current_goodput
    numbers = (f"predicted goodput {candidate_goodput:.4f} vs current {current_goodput:.4f} "
               f"(gain {gain:+.4f}, margin {margin:.4f})")
    if gain >= margin:
        return GuardrailVerdict(True, candidate_goodput, current_goodput, margin, force,
                                f"approved: {numbers}")
    if force:
        return GuardrailVerdict(True, candidate_goodput, current_goodput, margin, True,
                                f"forced despite guardrail: {numbers}", overridden=True)
    return GuardrailVerdict(False, candidate_goodput, current_goodput, margin, False,
                            f"rejected: {numbers}")
