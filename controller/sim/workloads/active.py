"""One phase of an active calibration plan as a simulator workload.

:func:`controller.core.active.plan_active_calibration` plans the PPD paper's grid (context
classes x io-ratio classes x QPS points, two-turn conversations); the daemon's
:mod:`controller.loop.calibration_runner` sends it to live routers over HTTP. This is the same
load for the simulator, so that the bench's ``ppd-static`` table is calibrated the way an
operator calibrates one: on the grid, before the cluster takes traffic.

Times follow :func:`controller.core.active.schedule`. The runner sends turn 2 one gap after
turn 1 started or when turn 1 answered, if later; the simulator's sessions can only wait
after an answer, so turn 2 follows turn 1's answer by one gap (never earlier than planned).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from controller.core.active import LoadPoint, schedule
from controller.sim.workloads.base import SessionSpec, TurnSpec

if TYPE_CHECKING:
    import random


class ActivePlanWorkload:
    """``points`` (one phase of a plan) shared by ``routers`` routers, from ``start_s``."""

    name = "active-calibration"

    def __init__(self, points: Sequence[LoadPoint], routers: int, start_s: float = 0.0) -> None:
        self.plan = schedule(points, routers)
        self.start_s = start_s

    @property
    def end_s(self) -> float:
        """When the last conversation has started."""
        return self.start_s + (self.plan[-1].end_s if self.plan else 0.0)

    def sessions(self, rng: random.Random) -> Iterator[SessionSpec]:
        """Deterministic: the plan draws nothing (``rng`` is unused)."""
        for i, sp in enumerate(self.plan):
            p = sp.point
            turn1 = p.turn1_prompt_tokens
            for j in range(p.sessions):
                at = self.start_s + sp.start_s + 2 * j * sp.gap_s
                sid = f"active-{i}-{j}"
                yield SessionSpec(sid, at, (
                    TurnSpec(sid, 1, at, turn1, turn1, p.output_tokens, p.output_tokens, 0.0),
                    TurnSpec(sid, 2, at + sp.gap_s, turn1 + p.output_tokens + p.append_tokens,
                             p.append_tokens, p.output_tokens, p.output_tokens, sp.gap_s,
                             parent_turn=1),
                ))
