"""What kind of policy a stored record is, as a :class:`PolicyKind`.

The kind is a column of ``policies`` (revision 0007), written with the policy and never
changed by a status change, so the loop and the CLI compare members, never reason prefixes.
Writers that know the kind pass it to ``add_policy``; for one that does not,
:func:`kind_of_reason` derives it from the reason by the rule the migration backfilled the
policies stored before the column with (the prefixes below, which the writers put first).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from controller.store.records import PolicyRecord

ADOPTED_PREFIX = "adopted: "  # the routers' own policy, recorded on an empty store
SEEDED_PREFIX = "exploration "  # a seeded policy's reason: "exploration 0.05 in every cell of v1 …"
REFIT_PREFIX = "canary refit of v"  # a refit's policy reason starts so (never refitted)
FORCED_PREFIX = "active calibration: forced "  # an active calibration's forced phase


class PolicyKind(enum.StrEnum):
    """Where a stored policy came from, as far as the loop and the CLI act on it. The
    values are what the ``policies.kind`` column holds."""

    ADOPTED = "adopted"  # what every router already ran, recorded on an empty store
    SEEDED = "seeded"  # an adopted policy with exploration turned on in every cell
    REFIT = "refit"  # a baking canary refitted on its bake's windows
    FORCED = "forced"  # a phase of an active calibration (one route everywhere)
    OTHER = "other"  # a calibration's candidate, a re-issued table, one stored by hand


# Also the backfill of migrations/versions/0007 (as SQL there: a migration is frozen).
BY_PREFIX = ((ADOPTED_PREFIX, PolicyKind.ADOPTED), (REFIT_PREFIX, PolicyKind.REFIT),
             (FORCED_PREFIX, PolicyKind.FORCED))


def kind_of_reason(reason: str, seeded_exploration: float | None = None) -> PolicyKind:
    """The kind a policy stored with ``reason`` has: seeded when the controller turned
    exploration on in it, else the kind its reason's prefix names, else ``OTHER``."""
    if seeded_exploration is not None:
        return PolicyKind.SEEDED
    for prefix, kind in BY_PREFIX:
        if reason.startswith(prefix):
            return kind
    return PolicyKind.OTHER


def policy_kind(record: PolicyRecord) -> PolicyKind:
    """The stored kind of ``record``."""
    return record.kind
