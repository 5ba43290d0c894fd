"""The daemon's composition root: ``pdctl run --config FILE``.

Builds everything from the config (store, metrics source, router transport, reconciler,
leadership, learner, cycle, health server), then runs the control cycle as an APScheduler
3.11 ``AsyncIOScheduler`` job: no overlapping runs (``max_instances=1``), missed runs
coalesced, skips and misses counted. Heavy fits run off the event loop (the cycle hands them
to ``asyncio.to_thread``). The next scheduled calibration follows from the last one stored,
so a restart does not forget it.

systemd: ``READY=1`` once the store, health server and scheduler are up; ``WATCHDOG=1``
only while the loop's heartbeat is fresh; ``STOPPING=1`` on SIGTERM, SIGINT or SIGQUIT (each
logged; SIGHUP is logged and ignored: the config is read at start only). Shutdown: pause the
scheduler, let the in-flight cycle finish within ``shutdown_timeout_s`` (else cancel it:
a push is either acknowledged and recorded or retried by the next leader), release the
lease, exit 0.

Logs are structured (``--log-json``: one JSON object per line). Secrets (the bearer token,
database passwords) are never logged: URLs are rendered with the password hidden.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from controller import sdnotify
from controller.clock import Clock, WallClock
from controller.config import Settings, windows_compaction_keeps
from controller.errors import ConfigError, TerminalError, TransientError
from controller.heap import release_free_heap

if TYPE_CHECKING:
    from controller.core.capacity import CapacityPlan
    from controller.core.window import Window

log = logging.getLogger("pdctl.daemon")

JOB_ID = "cycle"
COMPACT_FIRST_S = 300.0  # the first compaction, after the start (then hourly)
# The one scheduler job runs the whole cycle; overlap and misses are counted under the label
# of its first phase. Phase durations (observe, assess, calibrate, reconcile) come from the
# cycle itself.
JOB_LABEL = "observe"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and structured extras."""

    _STANDARD = frozenset(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 3), "level": record.levelname.lower(),
            "logger": record.name, "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in self._STANDARD and not key.startswith("_"):
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure_logging(json_lines: bool, level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)


def notify(*lines: str) -> bool:
    """sd_notify that never raises and never blocks the loop (a full or missing socket is
    logged and skipped: the next message will try again)."""
    try:
        return sdnotify.notify(*lines)
    except OSError as e:
        log.warning("sd_notify %s failed: %s", lines[0], e)
        return False


@dataclass
class Parts:
    """Everything the daemon built (tests reach into it)."""

    store: Any
    source: Any
    transport: Any
    leadership: Any
    cycle: Any
    health: Any
    server: Any


class SettingsPlanner:
    """The cycle's capacity planner: the observed windows against the configured SLOs and
    headroom (``[slo]``, ``[capacity]``)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def plan(self, windows: Sequence[Window]) -> CapacityPlan:
        from controller.loop.capacity import plan_from_windows

        return plan_from_windows(windows, self.settings)


class Daemon:
    def __init__(self, settings: Settings, *, advisory: bool = False,
                 clock: Clock | None = None, registry: CollectorRegistry | None = None,
                 init: bool = False) -> None:
        self.settings = settings
        self.init = init  # may create a missing SQLite store (`pdctl run --init`)
        self.exit_code = 0
        self.store_problem: str | None = None
        self.advisory = advisory or settings.controller.advisory
        self.clock: Clock = clock or WallClock()
        self.registry = registry or CollectorRegistry()
        self.parts: Parts | None = None
        self._inflight: asyncio.Task[Any] | None = None
        self._stop = asyncio.Event()
        self._started_at = self.clock.now()

    # -- building -------------------------------------------------------------------------

    async def build(self) -> Parts:
        from controller.loop.metrics import ControllerMetrics
        from controller.store import Store

        s = self.settings
        metrics = ControllerMetrics(self.registry)
        store = Store.from_config(s.store, self.clock)
        try:
            return await self._build(store, metrics)
        except BaseException:
            store.close()
            raise

    async def _build(self, store: Any, metrics: Any) -> Parts:
        from controller.config import (
            canary_names_problem,
            router_outcome_names,
            sidecar_store_problem,
        )
        from controller.health import Health, HealthServer
        from controller.loop.cycle import Cycle, CycleConfig
        from controller.loop.leader import leadership_for, process_holder
        from controller.loop.learning import CoreLearner
        from controller.observe.factory import source_from_settings
        from controller.rollout.client import GrpcRouterTransport
        from controller.rollout.reconciler import Reconciler

        s = self.settings
        c = s.controller
        for problem in (sidecar_store_problem(s), canary_names_problem(s)):
            if problem is not None:
                raise ConfigError(problem)
        routers = list(s.routers.targets)
        if not routers:
            raise ConfigError("[routers] targets is empty: the daemon needs routers to control")
        if store.dialect == "sqlite":
            refuse_a_new_store(store, self.init)
            await asyncio.to_thread(store.upgrade_embedded)  # the embedded default
            mark_store(store)
        else:
            await asyncio.to_thread(store.require_schema)  # production: `pdctl db upgrade`
        names = router_outcome_names(s)
        source = await source_from_settings(s, clock=self.clock, wait_for_targets=True)
        transport = GrpcRouterTransport(s.security)
        reconciler = Reconciler.from_config(transport, self.clock, s.rollout)
        holder = process_holder(c.replica_id)
        leadership = leadership_for(store, self.clock, holder, c.lease_ttl_s)
        cycle = Cycle(
            clock=self.clock, source=source, store=store, learner=CoreLearner(s),
            reconciler=reconciler, metrics=metrics, routers=routers,
            config=CycleConfig.from_settings(s, advisory=self.advisory),
            leadership=leadership, outcome_names=names,
            reconcile_only=[c.sidecar_router] if c.sidecar_router else None,
            planner=SettingsPlanner(s) if s.capacity.enabled else None,
        )
        if s.export.format is not None:
            from controller.exporter import ApprovalExporter
            from controller.loop.learning import calibration_config

            cycle.on_approval = ApprovalExporter(s.export, calibration_config(s).slo)
        health = Health(self.clock, c.stalled_after(), lambda: cycle.last_completed_at,
                        lambda: cycle.last_ended_at, started_at=self._started_at)
        health.details = lambda: {"leader": leadership.is_leader, "holder": holder}
        server = None
        if s.metrics.enable:
            server = HealthServer(health, self.registry, s.metrics.listen)
            try:
                await server.start()
            except OSError as e:  # e.g. another daemon already on the port
                await transport.close()
                await source.aclose()
                raise ConfigError(f"cannot listen on [metrics] listen {s.metrics.listen}: "
                                  f"{e.strerror or e}") from None
        log.info("built", extra={"store": store.safe_url, "routers": len(routers),
                                 "holder": holder, "advisory": self.advisory,
                                 "interval_s": c.interval_s,
                                 "listen": server.address if server else None})
        self.parts = Parts(store, source, transport, leadership, cycle, health, server)
        return self.parts

    # -- running --------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop.set()

    def _on_signal(self, sig: signal.Signals) -> None:
        if sig in TERMINATING_SIGNALS:
            log.info("%s received: stopping (the lease is released)", sig.name)
            self.request_stop()
        else:
            log.info("%s received and ignored: the configuration is read at start only "
                     "(restart to apply a change)", sig.name)

    def _handle_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        """Every terminating signal stops the daemon the same graceful way (the in-flight
        cycle finished or abandoned, the lease released, exit 0); SIGHUP is logged and
        ignored (a closed terminal or a reload request must not end the loop silently)."""
        for sig in (*TERMINATING_SIGNALS, signal.SIGHUP):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._on_signal, sig)

    async def _job(self) -> None:
        """The scheduler job: one cycle, tracked so shutdown can wait for it."""
        assert self.parts is not None
        if self._store_lost():
            return
        task = asyncio.ensure_future(self.parts.cycle.run_once())
        self._inflight = task
        try:
            await asyncio.shield(task)
        finally:
            if task.done():
                self._inflight = None
                # A calibration's freed arrays stay mapped by glibc otherwise: RSS ratchets.
                release_free_heap()
            self._store_lost()

    def _store_lost(self) -> bool:
        """Whether the SQLite file was removed or replaced under the daemon. The first time:
        no more cycles (the store refuses every write), the health endpoints fail with the
        reason, and the daemon stops after ``STORE_GONE_GRACE_S`` with exit 3, so that its
        supervisor restarts it (and the restart refuses to start an empty history there)."""
        assert self.parts is not None
        if self.store_problem is not None:
            return True
        problem = self.parts.store.identity_problem()
        if problem is None:
            return False
        self.store_problem = problem
        self.exit_code = 3
        self.parts.health.failure = problem
        log.error("%s: writes stopped; exiting with 3 in %g s", problem, STORE_GONE_GRACE_S)
        asyncio.get_running_loop().call_later(STORE_GONE_GRACE_S, self.request_stop)
        return True

    async def _renew_lease(self) -> None:
        assert self.parts is not None
        if self._store_lost():
            return
        try:
            leader = await self.parts.leadership.ensure()
        except Exception as e:  # the next renewal or cycle tries again
            log.warning("lease renewal failed: %s", e)
            # Say who leads as the leadership says it now (a lost server took the lock).
            self.parts.cycle.metrics.set_leader(self.parts.leadership.is_leader)
            return
        self.parts.cycle.metrics.set_leader(leader)

    async def _compact(self) -> None:
        """Retention: the leader deletes windows older than ``[store] retention_days``
        (training windows of approved policies are kept by the store)."""
        assert self.parts is not None
        if not self.parts.leadership.is_leader:
            return
        older_than = self.clock.utcnow() - timedelta(days=self.settings.store.retention_days)
        try:
            n = await asyncio.to_thread(self.parts.store.compact_windows, older_than,
                                        windows_compaction_keeps(self.settings))
        except Exception as e:  # retention is housekeeping: never fatal
            log.warning("compaction failed: %s", e)
            return
        if n:
            log.info("compacted %d window(s) older than %s", n, older_than.isoformat())

    def _heartbeat_fresh(self) -> bool:
        # The loop turns, as /livez says: an outage of what it observes is not cured by a kill.
        assert self.parts is not None
        fresh: bool = self.parts.health.live()[0]
        return fresh

    async def _watchdog(self, interval: float) -> None:
        while not self._stop.is_set():
            if self._heartbeat_fresh():
                notify("WATCHDOG=1")
            else:
                log.warning("loop heartbeat stale: not petting the watchdog")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), interval)

    async def run(self) -> int:
        from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_MAX_INSTANCES, EVENT_JOB_MISSED
        from apscheduler.schedulers.asyncio import AsyncIOScheduler

        self._handle_signals(asyncio.get_running_loop())
        parts = await self.build()
        metrics = parts.cycle.metrics
        interval = self.settings.controller.interval_s
        scheduler = AsyncIOScheduler(job_defaults={
            "coalesce": True, "max_instances": 1,
            "misfire_grace_time": max(1, int(interval)),
        })

        def on_event(event: Any) -> None:
            if event.code == EVENT_JOB_MAX_INSTANCES:
                metrics.job_skipped_run(JOB_LABEL, "overlap")
            elif event.code == EVENT_JOB_MISSED:
                metrics.job_skipped_run(JOB_LABEL, "missed")
            elif event.code == EVENT_JOB_ERROR:
                log.error("cycle job raised: %r", event.exception)

        scheduler.add_listener(on_event, EVENT_JOB_MAX_INSTANCES | EVENT_JOB_MISSED
                               | EVENT_JOB_ERROR)
        scheduler.add_job(self._job, "interval", seconds=interval, id=JOB_ID,
                          replace_existing=True, next_run_time=_now_dt(self.clock),
                          jitter=None)
        # The lease is renewed on its own clock (a third of its lifetime), not only at the
        # start of each cycle: a control interval longer than the lease must not hand
        # leadership around between cycles.
        ttl = self.settings.controller.lease_ttl_s
        scheduler.add_job(self._renew_lease, "interval", seconds=max(ttl / 3, 0.5),
                          id="lease", replace_existing=True)
        # First a few minutes after the start, then hourly: a daemon restarted more often
        # than hourly (a crash loop, frequent deploys) never compacted.
        scheduler.add_job(self._compact, "interval", seconds=3600, id="compact",
                          replace_existing=True, jitter=60,
                          next_run_time=_now_dt(self.clock) + timedelta(seconds=COMPACT_FIRST_S))
        scheduler.start()
        parts.health.ready = True
        notify("READY=1", f"STATUS=controlling {len(parts.cycle.routers)} router(s)")
        watchdog = None
        wd_interval = sdnotify.watchdog_interval_s()
        if wd_interval is not None:
            watchdog = asyncio.ensure_future(self._watchdog(wd_interval))
        log.info("running")
        try:
            await self._stop.wait()
        finally:
            await self._shutdown(scheduler, watchdog)
        return self.exit_code

    async def _shutdown(self, scheduler: Any, watchdog: asyncio.Task[None] | None) -> None:
        assert self.parts is not None
        parts = self.parts
        notify("STOPPING=1")
        log.info("stopping")
        parts.health.ready = False
        scheduler.pause()
        task = self._inflight
        if task is not None and not task.done():
            timeout = self.settings.controller.shutdown_timeout_s
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout)
            except TimeoutError:
                log.warning("in-flight cycle abandoned after %.1f s", timeout)
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            except Exception:
                log.exception("in-flight cycle failed during shutdown")
        scheduler.shutdown(wait=False)
        if watchdog is not None:
            watchdog.cancel()
            with contextlib.suppress(BaseException):
                await watchdog
        with contextlib.suppress(Exception):
            await parts.leadership.release()
        parts.cycle.metrics.set_leader(False)
        for closer in (parts.source.aclose, parts.transport.close):
            with contextlib.suppress(Exception):
                await closer()
        if parts.server is not None:
            await parts.server.stop()
        parts.store.close()
        log.info("stopped")


TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
# After the SQLite file was removed or replaced: how long /healthz says why before the exit.
STORE_GONE_GRACE_S = 10.0


def store_marker(path: str) -> Path:
    """The file beside a SQLite store that says a store was created at ``path``: a dot
    file, so neither ``rm history.db*`` nor ``rm dir/*`` removes it with the store."""
    p = Path(path)
    return p.with_name(f".{p.name}.pdctl-store")


def refuse_a_new_store(store: Any, init: bool) -> None:
    """A SQLite store is created at a path where none was before (its marker absent: a
    first start), or when asked (``pdctl run --init``, ``pdctl db upgrade``). A missing file
    whose marker is there was removed or moved: the daemon refuses to start an empty
    history in its place. The marker is written whenever the store exists."""
    from controller.store import StoreError

    path = store.sqlite_file
    if path is None:
        return
    marker = store_marker(path)
    if not Path(path).exists() and marker.exists() and not init:
        raise StoreError(
            f"no store at {path}, where one was created ({marker} says so): refusing to "
            "start an empty history in its place (removed or moved?). Restore it, or "
            "create a new, empty one with `pdctl run --init` or `pdctl db upgrade`")


def mark_store(store: Any) -> None:
    """Write the marker of a SQLite store that exists (best effort: a read-only
    directory only loses the protection)."""
    path = store.sqlite_file
    if path is not None and Path(path).exists():
        with contextlib.suppress(OSError):
            store_marker(path).touch()


def _now_dt(clock: Clock) -> Any:
    return clock.utcnow()


def run_daemon(settings: Settings, *, advisory: bool = False, init: bool = False) -> int:
    """Run until SIGTERM, SIGINT or SIGQUIT (exit 0), or until the store's file is lost
    (exit 3); the process exit code."""
    import faulthandler

    # `kill -USR1 PID` dumps every thread's stack to stderr (a wedged loop, diagnosed live).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Until the loop's handlers are installed: SIGHUP's default action ended the process
    # silently (exit 129).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    daemon = Daemon(settings, advisory=advisory, init=init)
    try:
        return asyncio.run(daemon.run())
    except ConfigError as e:
        log.error("%s", e)
        return 2
    except TerminalError as e:  # e.g. the store is not at the schema head
        log.error("%s", e)
        return 3
    except TransientError as e:  # e.g. the database is unreachable at start
        log.error("%s", e)
        return 3


__all__ = ["Daemon", "JsonFormatter", "configure_logging", "run_daemon"]
