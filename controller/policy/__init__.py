"""The routing-policy contract (pure): tables, decisions, checksum, JSON format, validation."""

from controller.policy.checksum import canonical_bytes, policy_checksum
from controller.policy.decide import (
    Decision,
    Features,
    Reason,
    bin_index,
    decide,
    first_turn_busy_waiting,
    later_turn_busy_waiting,
    locate,
)
from controller.policy.jsonfile import dumps, loads, policy_from_dict, policy_to_dict
from controller.policy.model import (
    Axes,
    LookupTable,
    Overrides,
    Policy,
    Provenance,
    Route,
    Slo,
    Weights,
)
from controller.policy.validation import (
    PolicyValidationError,
    Problem,
    check_policy,
    validate_policy,
)

__all__ = [
    "Axes", "Decision", "Features", "LookupTable", "Overrides", "Policy", "PolicyValidationError",
    "Problem", "Provenance", "Reason", "Route", "Slo", "Weights", "bin_index", "canonical_bytes",
    "check_policy", "decide", "dumps", "first_turn_busy_waiting", "later_turn_busy_waiting",
    "loads", "locate",
    "policy_checksum", "policy_from_dict", "policy_to_dict", "validate_policy",
]
