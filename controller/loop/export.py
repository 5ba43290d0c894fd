"""Capacity recommendations: plan one when due, store it in the cycle's write, export it
(``pdctl_recommended_workers{role}``) once stored, and match scaling events against the
recent ones.

Planning is advisory: a failed plan is logged and counted, retried once per
``capacity_interval_s``, and never fails the cycle. Only the leader exports; the newest
stored recommendation is exported again after a restart or a change of leader while it is
fresh, and withdrawn once no plan succeeded for ``STALE_RECOMMENDATION_INTERVALS``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from controller.core.capacity import CapacityPlan
from controller.core.drift import ScalingEvent
from controller.core.window import Window
from controller.loop.metrics import ControllerMetrics
from controller.store import Store, StoreError, Tx
from controller.store.types import dumps_json

log = logging.getLogger("pdctl.cycle")

RECENT_RECOMMENDATIONS = 5  # a scaling event is matched against this many of the newest
STALE_RECOMMENDATION_INTERVALS = 3  # older than this many capacity intervals: not re-exported


class CapacityPlanner(Protocol):
    """Recent complete windows (oldest first) -> a capacity plan. The daemon's is
    :func:`controller.loop.capacity.plan_from_windows` on the configured SLOs."""

    def plan(self, windows: Sequence[Window]) -> CapacityPlan: ...


@dataclass(frozen=True, slots=True)
class CapacitySettings:
    interval_s: float  # the control interval
    capacity_interval_s: float
    capacity_min_windows: int


@dataclass(slots=True)
class CapacityDraft:
    """A plan made this cycle, stored by the cycle's write."""

    capacity: CapacityPlan
    window_ids: list[int] = field(default_factory=list)  # stored ids it was planned on
    with_window: bool = False  # ...plus this cycle's window


class CapacityExport:
    """Plans, stores and exports capacity recommendations (``planner`` None: none)."""

    def __init__(self, planner: CapacityPlanner | None, metrics: ControllerMetrics,
                 settings: CapacitySettings,
                 run_blocking: Callable[[Callable[[], Any]], Awaitable[Any]]) -> None:
        self.planner = planner
        self.metrics = metrics
        self.settings = settings
        self._run_blocking = run_blocking
        self._plan_failed_at: float | None = None
        self.exported = False  # a recommendation is on /metrics, set by this replica

    def withdraw(self) -> None:
        """Clear the exported recommendation (a follower feeds no autoscaler)."""
        if self.exported:
            self.metrics.clear_recommendation()
            self.exported = False

    def _due(self, store: Store, now: float) -> list[Any] | None:
        """The usable stored windows of the last capacity interval when a plan is due."""
        cfg = self.settings
        with store.read() as tx:
            last = tx.recommendations(limit=1)
            if last:
                self.refresh(last[-1].body, last[-1].created_at.timestamp(), now)
            if last and 0 <= now - last[-1].created_at.timestamp() < cfg.capacity_interval_s:
                return None
            if self._plan_failed_at is not None \
                    and 0 <= now - self._plan_failed_at < cfg.capacity_interval_s:
                return None  # a failing plan is retried once per interval, not every cycle
            # The load of the last interval: windows that started within it (after downtime,
            # older ones would describe a load that may be gone).
            since = datetime.fromtimestamp(now - cfg.capacity_interval_s, tz=UTC)
            covering = max(cfg.capacity_min_windows,
                           math.ceil(cfg.capacity_interval_s / cfg.interval_s))
            return list(tx.windows(since=since, limit=covering))

    async def recommend(self, store: Store, window: Window | None, now: float,
                        usable: Callable[[Window], bool]
                        ) -> tuple[CapacityDraft | None, str | None]:
        """A capacity plan when one is due, and why there is none when planning failed."""
        if self.planner is None:
            return None, None
        due = self._due(store, now)
        if due is None:
            return None, None
        stored = [s for s in due if usable(s.window)]
        windows = [s.window for s in stored]
        with_window = window is not None and usable(window)
        if with_window:
            assert window is not None
            windows.append(window)
        if len(windows) < self.settings.capacity_min_windows:
            return None, None
        planner = self.planner
        try:
            capacity: CapacityPlan = await self._run_blocking(lambda: planner.plan(windows))
            _check_storable(capacity)
        except Exception as e:  # planning is advisory: it never fails the cycle
            log.warning("capacity plan failed: %s: %s", type(e).__name__, e)
            self.metrics.capacity_plan_failed()
            self._plan_failed_at = now
            return None, f"plan failed: {type(e).__name__}: {e}"
        self._plan_failed_at = None
        return CapacityDraft(capacity, [s.id for s in stored], with_window), None

    @staticmethod
    def record(tx: Tx, applied: int | None, draft: CapacityDraft | None,
               window_id: int | None) -> tuple[int | None, str | None]:
        """Store the draft (and mark ``applied``, a recommendation a scaling reached): its id
        and the recommendation in words."""
        if applied is not None:
            tx.mark_recommendation_applied(applied)
        if draft is None:
            return None, None
        capacity = draft.capacity
        ids = list(draft.window_ids)
        if draft.with_window and window_id is not None:
            ids.append(window_id)
        p, d = capacity.prefill, capacity.decode
        rid = tx.add_recommendation(
            window_ids=ids, workers=(p.workers, d.workers),
            current=(p.current_workers, d.current_workers), binding=(p.binding, d.binding),
            utilisation=(p.utilisation, d.utilisation), body=capacity.to_dict(),
        )
        return rid, f"prefill {p.workers} ({p.binding}), decode {d.workers} ({d.binding})"

    @staticmethod
    def reached(store: Store, events: Sequence[ScalingEvent]) -> int | None:
        """The newest recent recommendation whose counts every confirmed scaling event
        reached, for a role it asked to change; None if the change was not recommended."""
        with store.read() as tx:
            recent = tx.recommendations(limit=RECENT_RECOMMENDATIONS)
        for rec in reversed(recent):
            asked = {"prefill": rec.current_prefill, "decode": rec.current_decode}
            if all(e.after == rec.workers(e.role) and asked[e.role] != e.after
                   for e in events):
                return rec.id
        return None

    def refresh(self, body: Mapping[str, Any], at: float, now: float) -> None:
        """Export the newest stored recommendation while it is fresh (after a restart or a
        change of leader an autoscaler is not left without a value until the next plan),
        and withdraw it once no plan has succeeded for a few intervals (an autoscaler then
        holds its count instead of following a load that may be gone)."""
        stale = now - at >= STALE_RECOMMENDATION_INTERVALS * self.settings.capacity_interval_s
        if stale and self.exported:
            log.warning("capacity recommendation withdrawn: none for %.0f s", now - at)
            self.withdraw()
        if stale or self.exported:
            return
        try:
            self.export(body, at)
        except (KeyError, TypeError, ValueError) as e:
            log.warning("stored recommendation not exported: %s: %s", type(e).__name__, e)

    def export(self, body: Mapping[str, Any], at: float) -> None:
        """``body`` is ``CapacityPlan.to_dict()`` (a new plan or a stored one)."""
        for role in ("prefill", "decode"):
            r = body[role]
            util = r.get("utilisation")
            self.metrics.set_recommendation(
                role, int(r["workers"]), math.nan if util is None else float(util),
                r.get("current_workers"), bool(r.get("extrapolated")),
            )
        self.metrics.recommended(at)
        self.exported = True


def _check_storable(capacity: CapacityPlan) -> None:
    """Refuse a plan the store would refuse, before it can fail the cycle's transaction."""
    for r in (capacity.prefill, capacity.decode):
        if r.workers < 1 or not math.isfinite(r.utilisation):
            raise StoreError(f"{r.role}: {r.workers} workers at utilisation {r.utilisation}")
    dumps_json(capacity.to_dict())


__all__ = ["RECENT_RECOMMENDATIONS", "STALE_RECOMMENDATION_INTERVALS", "CapacityDraft",
           "CapacityExport", "CapacityPlanner", "CapacitySettings"]
