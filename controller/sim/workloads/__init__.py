"""Workloads the simulated P/D cluster replays: sessions of turns (see docs/workloads.md).

Sources: ``mooncake`` (conversation chains linked by prefix hashes), ``azure-conv`` /
``azure-code`` and ``servegen`` (turn-less traces grouped into sessions of the Mooncake-fitted
shape), ``synthetic`` (the PPD paper's classes). :func:`build_workload` turns a
:class:`WorkloadConfig` into a :class:`Workload`; :func:`apply_events` adds scenario rate
events and workload switches.
"""

from controller.sim.workloads.base import (
    SOURCES,
    SessionSpec,
    TurnSpec,
    Workload,
    WorkloadConfig,
    WorkloadError,
    build_workload,
)
from controller.sim.workloads.compose import (
    Phase,
    PhasedWorkload,
    RateSchedule,
    ScheduledWorkload,
    TransformedWorkload,
    WorkloadSwitch,
    apply_events,
    switch_workload,
)

__all__ = [
    "SOURCES",
    "Phase",
    "PhasedWorkload",
    "RateSchedule",
    "ScheduledWorkload",
    "SessionSpec",
    "TransformedWorkload",
    "TurnSpec",
    "Workload",
    "WorkloadConfig",
    "WorkloadError",
    "WorkloadSwitch",
    "apply_events",
    "build_workload",
    "switch_workload",
]
