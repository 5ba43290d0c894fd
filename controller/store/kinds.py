"""What kind of policy a stored record is, as a :class:`PolicyKind`.

The kind is carried by the reason a policy is stored with (the writers below put these
prefixes first) and by the ``seeded_exploration`` column; :func:`policy_kind` is the one
place that reads it back, so the loop and the CLI compare members, never reason prefixes.
A status change that rewrites the reason (rolled back, superseded, dropped from its bake)
rewrites what the reason says: the kind is read for stored approved and baking policies,
whose reason is the one they were stored with.
"""

from __future__ import annotations

import enum

from controller.store.records import PolicyRecord

ADOPTED_PREFIX = "adopted: "  # the routers' own policy, recorded on an empty store
SEEDED_PREFIX = "exploration "  # a seeded policy's reason: "exploration 0.05 in every cell of v1 …"
REFIT_PREFIX = "canary refit of v"  # a refit's policy reason starts so (never refitted)
FORCED_PREFIX = "active calibration: forced "  # an active calibration's forced phase


class PolicyKind(enum.StrEnum):
    """Where a stored policy came from, as far as the loop and the CLI act on it."""

    ADOPTED = "adopted"  # what every router already ran, recorded on an empty store
    SEEDED = "seeded"  # an adopted policy with exploration turned on in every cell
    REFIT = "refit"  # a baking canary refitted on its bake's windows
    FORCED = "forced"  # a phase of an active calibration (one route everywhere)
    OTHER = "other"  # a calibration's candidate, a re-issued table, one stored by hand


_BY_PREFIX = ((ADOPTED_PREFIX, PolicyKind.ADOPTED), (REFIT_PREFIX, PolicyKind.REFIT),
              (FORCED_PREFIX, PolicyKind.FORCED))


def policy_kind(record: PolicyRecord) -> PolicyKind:
    """The kind of ``record``: seeded when the controller turned exploration on in it,
    else the kind its stored reason names, else :attr:`PolicyKind.OTHER`."""
    if record.seeded_exploration is not None:
        return PolicyKind.SEEDED
    for prefix, kind in _BY_PREFIX:
        if record.reason.startswith(prefix):
            return kind
    return PolicyKind.OTHER
