"""The PostgreSQL server restarted, then crashed, under two running `pdctl run` replicas
(issue 8: "PostgreSQL restarted mid-cycle").

The server is the test's own (:func:`private_postgres`: initdb + pg_ctl on a free port), never
the machine's shared one. Three router agents are real ``grpc.aio`` servers in this test's
process, one of them slow on purpose (:class:`SlowAgent`). Two `pdctl run` replicas share
the store; the advisory lock decides who leads, and that lock lives in a server session, so
every restart takes it away from the leader.

1. v1 (an operator decision through `pdctl fallback prefill`) is approved and acknowledged.
2. ``pg_ctl restart -m fast`` while the replicas run 0.5 s cycles. Leadership is re-taken on
   a new connection, later cycles store their windows, and a second decision (v2) is
   approved once and acknowledged everywhere.
3. A third decision (v3): while the slow router holds its push, the server is killed
   (``pg_ctl stop -m immediate``, a crash) and kept down for several cycles; the held push
   is released into the outage, so the cycle that made it cannot record it. The server
   starts again (crash recovery) and the next leader finds the routers on v3.

Expected: neither replica exits (no crash loop) and both stop with 0 on SIGTERM; cycles
during the outage are counted ``failed`` with the store unavailable, and no replica claims
leadership meanwhile; never two leaders at once; every row stored before each fault is still
there unchanged after it, and every stored window, drift event, calibration, push and ack
refers to rows that exist (no half-written cycle); versions 1, 2, 3 once each; every router
runs v3 with the stored checksum.
"""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from controller.store import Store
from tests.faults.harness import Routers, SlowAgent, applied_count
from tests.support.daemon import (
    acked_everywhere,
    decide_with_push_held,
    operator_decision,
    write_config,
)
from tests.support.postgres import PrivatePostgres, private_postgres
from tests.support.processes import (
    SCRAPE_TIMEOUT_S,
    free_port,
    http_get,
    start_daemon,
    stop_daemon,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

INTERVAL_S = 0.5
LEASE_TTL_S = 3
DROPPED_WITHIN_S = 2.0  # a leader that lost its server stops leading within this
# The watch thread's 0.1 s samples wait 2 s at most: a late sample is a missing one, never a
# wrong one. One-off reads wait a scrape's timeout.
SAMPLE_TIMEOUT_S = 2.0
REPLICAS = ("a", "b")


def _config(tmp_path: Path, replica: str, routers: list[str], listen: str,
            store_url: str) -> Path:
    return write_config(tmp_path / f"pd-controller-{replica}.toml", listen, store_url, {
        "routers": {"targets": routers},
        "controller": {"replica_id": replica, "interval_s": INTERVAL_S,
                       "lease_ttl_s": LEASE_TTL_S, "stalled_after_s": 2.0,
                       "shutdown_timeout_s": 5},
        "rollout": {"push_deadline_s": 30, "max_attempts": 2},
    })


def _records(store: Store) -> dict[str, list[str]]:
    """Every row of the history, as text (``repr`` compares NaN equal to itself)."""
    return {
        "policies": [repr(p) for p in store.policies()],
        "requests": [repr(r) for r in store.requests() if r.status == "done"],
        "pushes": [repr(p) for p in store.pushes()],
        # By id, not by start: a window may start before one stored earlier (see S6).
        "windows": [repr(w) for w in sorted(store.windows(), key=lambda w: w.id)],
        "drift": [repr(e) for e in store.drift_events()],
        "calibrations": [repr(c) for c in store.calibrations()],
    }


def _assert_kept(before: dict[str, list[str]], after: dict[str, list[str]], fault: str) -> None:
    for table, rows in before.items():
        assert after[table][: len(rows)] == rows, f"{table} changed across {fault}"


def _assert_whole(store: Store) -> None:
    """No half-written cycle: everything a row refers to was stored with it."""
    windows = {w.id for w in store.windows()}
    versions = {p.version for p in store.policies()}
    for e in store.drift_events():
        assert set(e.window_ids) <= windows, e
    for c in store.calibrations():
        assert set(c.training_window_ids) <= windows, c
        assert c.policy_version is None or c.policy_version in versions, c
    for p in store.pushes():
        assert p.version in versions, p
    for r in store.routers():
        assert r.acked_version is None or r.acked_version in versions, r
    assert set(store.desired_versions().values()) <= versions


def _acked(store: Store, version: int, routers: list[str]) -> bool:
    try:
        return acked_everywhere(store, version, routers)
    except Exception:  # the server may still be recovering
        return False


def _health(listen: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> dict[str, Any] | None:
    r = http_get(f"http://{listen}/healthz", timeout_s)
    return r.json() if r is not None else None


def _leaders(listens: dict[str, str]) -> int:
    """How many replicas say they lead, asked now (the watch thread's samples can be
    seconds apart on a loaded machine)."""
    return sum(bool((_health(listen) or {}).get("leader")) for listen in listens.values())


def _cycles(listen: str, result: str) -> float:
    r = http_get(f"http://{listen}/metrics")
    assert r is not None, f"{listen}: no /metrics"
    prefix = f'pdctl_cycles_total{{result="{result}"}} '
    return sum(float(line[len(prefix):]) for line in r.text.splitlines()
               if line.startswith(prefix))


class LeaderWatch:
    """Polls every replica's /healthz every 0.1 s in a thread: who says it leads."""

    def __init__(self, listens: dict[str, str]) -> None:
        self.listens = listens
        self.samples: list[tuple[float, dict[str, bool | None]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            seen: dict[str, bool | None] = {}
            for name, listen in self.listens.items():
                doc = _health(listen, SAMPLE_TIMEOUT_S)
                seen[name] = None if doc is None else bool(doc.get("leader"))
            self.samples.append((time.monotonic(), seen))
            self._stop.wait(0.1)

    def since(self, t0: float) -> list[dict[str, bool | None]]:
        return [s for t, s in self.samples if t >= t0]

    @contextmanager
    def running(self) -> Iterator[LeaderWatch]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(5)


def _leader_changes(samples: list[tuple[float, dict[str, bool | None]]]) -> list[str]:
    """Who led, in order, each change once ("-": nobody)."""
    seen: list[str] = []
    for _, s in samples:
        now = ",".join(n for n, lead in s.items() if lead) or "-"
        if not seen or seen[-1] != now:
            seen.append(now)
    return seen


def _overlaps(store: Store) -> list[tuple[int, int]]:
    """(earlier id, later id) of stored windows whose time spans overlap."""
    spans = sorted((w.window.start, w.window.end, w.id) for w in store.windows())
    return [(a[2], b[2]) for a, b in itertools.pairwise(spans) if b[0] < a[1] - 1e-6]


async def _wait(what: str, check: Any, timeout_s: float, log: Path) -> Any:
    # The routers are served by this event loop: every blocking wait runs in a thread.
    return await asyncio.to_thread(wait_for, what, check, timeout_s, log)


async def test_postgres_restarted_and_crashed_under_running_daemons(tmp_path: Path) -> None:
    with private_postgres() as pg:
        await _scenario(tmp_path, pg)


async def _scenario(tmp_path: Path, pg: PrivatePostgres) -> None:
    routers = Routers(tmp_path, 3, agent_factory=SlowAgent)
    await routers.start()
    store = Store(pg.url)
    store.upgrade()
    listens = {name: f"127.0.0.1:{free_port()}" for name in REPLICAS}
    logs = {name: tmp_path / f"run-{name}.log" for name in REPLICAS}
    log = logs["a"]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    slow_address = routers.addresses[1]
    slow = routers.agent(slow_address)
    assert isinstance(slow, SlowAgent)
    watch = LeaderWatch(listens)
    try:
        for name in REPLICAS:
            config = _config(tmp_path, name, routers.addresses, listens[name], pg.url)
            procs[name] = start_daemon(config, logs[name])
        for name in REPLICAS:
            await _wait(f"{name} /healthz", lambda n=name: _health(listens[n]) is not None,
                        60, logs[name])
        with watch.running():
            # 1. v1 approved and acknowledged before any fault.
            await asyncio.to_thread(operator_decision, pg.url, "decision 1")
            await _wait("v1 acknowledged everywhere",
                        lambda: _acked(store, 1, routers.addresses), 30, log)
            before = await asyncio.to_thread(_records, store)
            assert before["windows"], "no window stored before the restart"

            # 2. A clean restart (every session ended: the leader's lock with it).
            t_restart = time.monotonic()
            await asyncio.to_thread(pg.restart, "fast")
            n_windows = len(before["windows"])
            await _wait("windows stored again after the restart",
                        lambda: len(store.windows()) > n_windows + 2, 30, log)
            t_windows = time.monotonic()
            await asyncio.to_thread(operator_decision, pg.url, "decision 2")
            await _wait("v2 acknowledged everywhere after the restart",
                        lambda: _acked(store, 2, routers.addresses), 30, log)
            await _wait("one replica leading after the restart",
                        lambda: _leaders(listens) == 1, 15, log)
            after_restart = await asyncio.to_thread(_records, store)
            _assert_kept(before, after_restart, "the restart")
            assert all(p.poll() is None for p in procs.values()), "a replica exited"

            # 3. A crash in the middle of a push: the cycle cannot record what it pushed.
            await decide_with_push_held(routers, slow_address, pg.url, 3)
            at_crash = await asyncio.to_thread(_records, store)
            failed_before = {n: await asyncio.to_thread(_cycles, listens[n], "failed")
                             for n in REPLICAS}
            await asyncio.to_thread(pg.stop, "immediate")
            t_down = time.monotonic()
            slow.release.set()  # the push completes into the outage
            await asyncio.sleep(6 * INTERVAL_S + LEASE_TTL_S)
            # The next lease renewal (every LEASE_TTL_S / 3) or cycle finds the lock gone.
            down = watch.since(t_down + DROPPED_WITHIN_S)
            failed_during = {n: await asyncio.to_thread(_cycles, listens[n], "failed")
                             - failed_before[n] for n in REPLICAS}
            health_down = {n: await asyncio.to_thread(_health, listens[n]) for n in REPLICAS}
            await asyncio.to_thread(pg.start)
            t_up = time.monotonic()
            await _wait("v3 acknowledged everywhere after the crash",
                        lambda: _acked(store, 3, routers.addresses), 30, log)
            t_converged = time.monotonic()
            await _wait("one replica leading after the crash",
                        lambda: _leaders(listens) == 1, 15, log)
            await asyncio.sleep(4 * INTERVAL_S)  # a few more cycles
            assert all(p.poll() is None for p in procs.values()), "a replica exited"
        codes = {n: await asyncio.to_thread(stop_daemon, p, 20) for n, p in procs.items()}
        procs.clear()
        assert codes == dict.fromkeys(REPLICAS, 0), codes

        after = await asyncio.to_thread(_records, store)
        # The figures docs/reliability.md S6 quotes (`pytest -s` shows them).
        print(f"\nS6: restart -m fast -> 3 windows stored again in {t_windows - t_restart:.1f} s; "
              f"crash: down {t_up - t_down:.1f} s, failed cycles {failed_during}, "
              f"v3 acknowledged everywhere {t_converged - t_up:.1f} s after the start; "
              f"leaders {_leader_changes(watch.samples)}; rows "
              f"{ {k: len(v) for k, v in after.items()} }; overlapping windows "
              f"{_overlaps(store)}")
        _assert_kept(at_crash, after, "the crash")
        # Leadership moved: the windows still tile time (none counted twice).
        assert not _overlaps(store), _overlaps(store)
        await asyncio.to_thread(_assert_whole, store)
        # Never two leaders; none during the outage; one again after each fault.
        both = [s for _, s in watch.samples if all(s.values())]
        assert not both, f"two replicas led at once: {both[:3]}"
        assert down and not any(any(s.values()) for s in down), down
        # The outage was seen: cycles failed, with the store named as the reason.
        assert sum(failed_during.values()) >= 3, failed_during
        assert any(h is not None and h.get("status", "").startswith("stalled")
                   for h in health_down.values()), health_down
        text = "".join(p.read_text(errors="replace") for p in logs.values())
        assert "StoreUnavailable" in text
        # Versions 1, 2, 3, once each; one approval per decision; every router on v3.
        policies = store.policies()
        assert [(p.version, p.status) for p in policies] == [
            (1, "approved"), (2, "approved"), (3, "approved")]
        assert store.next_version() == 4
        assert [(r.kind, r.status) for r in store.requests()] == [("rollback", "done")] * 3
        v3 = store.policy(3)
        assert v3 is not None
        assert routers.versions() == dict.fromkeys(routers.addresses, 3)
        assert {(r.acked_version, r.acked_checksum) for r in store.routers()} == {
            (3, v3.checksum)}
        # The push made into the outage was not recorded (its cycle failed whole); the next
        # leader found the routers on v3 and pushed nothing again: each applied 3 updates.
        assert [p.version for p in store.pushes()] == [1, 1, 1, 2, 2, 2]
        assert [applied_count(routers.agent(a)) for a in routers.addresses] == [3.0] * 3
    except AssertionError as e:  # say what the store, the routers and the daemons saw
        tails = "\n".join(f"--- run-{n}.log\n{p.read_text(errors='replace')[-3000:]}"
                          for n, p in logs.items() if p.exists())
        try:
            rows = _records(store)
        except Exception as err:
            rows = {"unreadable": [repr(err)]}
        raise AssertionError(f"{e}\nrouters: {routers.versions()}\nstore: {rows}\n"
                             f"{tails}") from None
    finally:
        for p in procs.values():
            p.kill()
            p.wait(5)
        slow.release.set()
        store.close()
        await routers.close()
