"""The cycle's gather step: this cycle's window from the metrics source.

:class:`Gather` owns where windows start (they tile time: each continues from the last one
while this replica leads without a break, else from the store's newest, at most one interval
back) and the observe itself, which yields a window or None (the cycle is then "skipped").
On an empty store it also reads the policy every router runs, to adopt it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from controller.clock import Clock
from controller.core.window import Window
from controller.errors import TransientError
from controller.loop.metrics import ControllerMetrics
from controller.loop.report import CycleReport, CycleResult, join
from controller.loop.write import Plan
from controller.observe.source import MetricsSource
from controller.policy import Policy
from controller.rollout.reconciler import Reconciler
from controller.store import Store

log = logging.getLogger("pdctl.cycle")


class NothingAnswered(TransientError):
    """A window in which every worker and router target failed."""


class Gather:
    """Observes windows that tile time for one leading replica."""

    def __init__(self, *, source: MetricsSource, store: Store, clock: Clock,
                 metrics: ControllerMetrics, interval_s: float) -> None:
        self.source = source
        self.store = store
        self.clock = clock
        self.metrics = metrics
        self.interval_s = interval_s
        self.last_end: float | None = None  # while leading without a break

    def restart(self) -> None:
        """Leading again, or in a new term: another replica may have led and stored windows
        meanwhile, so counters diffed across the gap are forgotten and the next window
        starts from the store."""
        if self.last_end is not None:
            self.source.forget_baselines()
        self.last_end = None

    async def window(self, now: float, report: CycleReport) -> Window | None:
        """This cycle's window, ending ``now`` (:meth:`observe`)."""
        window = await self.observe(self._start(now), now, report)
        self.last_end = now
        return window

    def _start(self, end: float) -> float:
        """Windows tile time: continue from the last one, ours while leading without a
        break, else the store's newest (a restart, or leading again after another replica:
        a window overlapping stored ones would count that time twice in training and
        drift). From the store, at most one interval back: after an outage the window
        starts fresh rather than averaging over it."""
        floor = end - self.interval_s
        if self.last_end is not None:
            return self.last_end if self.last_end < end else floor
        with self.store.read() as tx:
            stored = tx.last_window_end()
        last = stored.timestamp() if stored is not None else None
        return last if last is not None and floor < last < end else floor

    async def observe(self, start: float, end: float, report: CycleReport) -> Window | None:
        """The window ``[start, end)``, or None (the cycle is then "skipped"): the source
        failed, or no target answered (the cluster, or the path to it, is down: not a
        scaling event to plan for, and not a successful cycle, as PdControllerStalled and
        /healthz say). Reconciling and operator requests go on either way."""
        t0 = self.clock.monotonic()
        try:
            window = await self.source.window(start, end)
            self.metrics.observe_job("observe", self.clock.monotonic() - t0)
            for failure in window.failures:  # why, on /metrics
                self.metrics.observe_failed(failure.kind)
            if window.failures and not window.answered:
                failed = sorted({f.target for f in window.failures})
                raise NothingAnswered(f"no target answered ({len(failed)} failed: "
                                      f"{', '.join(failed[:3])}"
                                      f"{', ...' if len(failed) > 3 else ''})")
        except Exception as e:
            if not isinstance(e, NothingAnswered):  # the source itself failed
                self.metrics.observe_failed("source")
            report.result = CycleResult.SKIPPED
            report.reason = f"observe failed: {type(e).__name__}: {e}"
            log.warning("%s", report.reason)
            return None
        return window

    @staticmethod
    async def adopt_running(reconciler: Reconciler, routers: Sequence[str], plan: Plan,
                            report: CycleReport) -> Policy | None:
        """The policy every router already runs, adopted as the fleet's in this cycle's
        write: the first table is then judged against it and canaried, not approved
        unchecked to every router (docs/operations.md, "First start"). Sidecar replicas
        reach their own router only, so they adopt nothing."""
        found = await reconciler.running_policy(routers)
        if found.policy is not None:
            plan.adopted = found
        elif found.why:
            report.reason = join(report.reason, f"no running policy adopted: {found.why}")
        return found.policy
