"""Sources that read exposition text and diff consecutive snapshots.

:class:`SnapshotSource` does everything but fetching: parse (keeping only the families the
window uses), validate histograms, diff against the target's previous snapshot, assemble.
:class:`~controller.observe.scrape.ScrapeSource` fetches over HTTP and
:class:`~controller.observe.inprocess.InProcessSource` renders registries in process; both
run this same code, so over the same registries they produce the same window.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from controller.clock import Clock, WallClock
from controller.core.catalog import wanted_families
from controller.core.exposition import ExpositionError, Snapshot, parse_exposition
from controller.core.window import FailureKind, TargetFailure, Window
from controller.observe.counters import PROCESS_START
from controller.observe.rediscovery import Rediscovery
from controller.observe.source import Target
from controller.observe.window_builder import (
    TargetResult,
    assemble_window,
    check_histograms,
    diff_snapshots,
)
from controller.policy.bins import CONTEXT_BINS, IO_RATIO_BINS

# process_start_time_seconds tells a restart from a counter that fell (observe.counters).
_WANTED = wanted_families() | {PROCESS_START}


class FetchError(Exception):
    """A target did not answer usable text; ``kind`` is the window's failure kind for it."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def snapshot_from_text(text: str, target: str, taken_at: float) -> Snapshot:
    """Parse and validate one target's exposition (raises :class:`ExpositionError`)."""
    snap = parse_exposition(text, target=target, taken_at=taken_at, keep=_WANTED)
    check_histograms(snap)
    return snap


class SnapshotSource(abc.ABC):
    name = "snapshot"

    def __init__(self, targets: Sequence[Target], clock: Clock | None = None,
                 rediscovery: Rediscovery | None = None) -> None:
        self._targets = list(targets)
        self._clock = clock or WallClock()
        self._previous: dict[str, Snapshot] = {}
        self._rediscovery = rediscovery  # ``dns+`` names resolved again as it runs

    def targets(self) -> Sequence[Target]:
        return list(self._targets)

    @abc.abstractmethod
    async def fetch_all(self, targets: Sequence[Target]) -> list[str | FetchError]:
        """Each target's exposition text, or why there is none (same order)."""

    async def window(self, start: float, end: float) -> Window:
        if self._rediscovery is not None:
            found = await self._rediscovery.refresh(self._targets, end)
            if found is not None:
                gone = {t.name for t in self._targets} - {t.name for t in found}
                self._targets = found
                for name in gone:
                    self._previous.pop(name, None)
                await self.forget_targets(gone)
            self._rediscovery.require(self._targets)
        texts = await self.fetch_all(self._targets)
        taken_at = self._clock.now()
        results = [self._result(t, text, taken_at) for t, text in zip(self._targets, texts,
                                                                      strict=True)]
        return assemble_window(
            start, end, results, source=self.name,
            ctx_labels=CONTEXT_BINS.labels, io_labels=IO_RATIO_BINS.labels,
        )

    def _result(self, target: Target, text: str | FetchError, taken_at: float) -> TargetResult:
        if isinstance(text, FetchError):
            # A later answer must not be diffed across the gap: start from a fresh baseline.
            self._previous.pop(target.name, None)
            return TargetResult(target.name, target.role,
                                failure=TargetFailure(target.name, text.kind, str(text)))
        try:
            snap = snapshot_from_text(text, target.name, taken_at)
        except ExpositionError as e:
            self._previous.pop(target.name, None)
            return TargetResult(target.name, target.role,
                                failure=TargetFailure(target.name, e.kind, str(e)))
        delta = diff_snapshots(self._previous.get(target.name), snap)
        self._previous[target.name] = snap
        return TargetResult(target.name, target.role, delta=delta)

    async def forget_targets(self, names: set[str]) -> None:
        """Targets no longer observed: a subclass frees what it holds for them."""
        return None

    def forget_baselines(self) -> None:
        # Counters diffed from a snapshot older than the window would be divided by the
        # window's length: without a baseline the first window has gauges only.
        self._previous.clear()

    async def aclose(self) -> None:
        return None
