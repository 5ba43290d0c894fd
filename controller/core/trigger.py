"""Why a calibration runs, as typed values rather than reason strings read back.

:class:`Trigger` names what started a calibration; its values are the strings stored in a
calibration's details (``"trigger"``), used as the ``trigger`` label of
``pdctl_recalibrations_total`` and printed by the CLI, so the stored and printed forms are
those strings exactly. :class:`Cause` pairs a trigger with the detail its policy reason
carries (an operator's reason, the scaling event) and renders that reason: ``"drift"``,
``"scaling: <event>"``, ``"operator: <reason>"``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Trigger(enum.StrEnum):
    """What started a calibration. A ``str`` whose ``str()`` is its value, so that JSON,
    metric labels and f-strings hold the value itself; an enum so that code compares
    members, never spelled strings (kopf's ``Reason(str, enum.Enum)`` for the same end)."""

    DRIFT = "drift"
    SCHEDULE = "schedule"
    SCALING = "scaling"
    OPERATOR = "operator"
    CANARY = "canary"  # a refit of the baking canary on its bake's windows
    ACTIVE = "active"  # pdctl calibrate-active: forced phases, then one calibration


@dataclass(frozen=True, slots=True)
class Cause:
    """The typed cause of one calibration.

    ``detail`` is the text the policy reason carries after the trigger. ``refits`` is, for
    a :attr:`Trigger.CANARY` refit, the trigger of the calibration behind the canary it
    refits (None when that canary came from no calibration): the refit trains on the same
    regime's windows. ``text`` replaces the rendered reason where it is not
    ``trigger[: detail]`` (a refit keeps the canary's own reason).
    """

    trigger: Trigger
    detail: str | None = None
    refits: Trigger | None = None
    text: str | None = None

    @property
    def regime(self) -> Trigger | None:
        """The trigger whose change the training windows follow: a refit's origin, else
        the trigger itself."""
        return self.refits if self.trigger is Trigger.CANARY else self.trigger

    def __str__(self) -> str:
        if self.text is not None:
            return self.text
        return self.trigger.value if self.detail is None else f"{self.trigger.value}: {self.detail}"
