"""``InProcessSource``: the simulator's registries, read exactly as a scrape would see them.

It renders ``generate_latest(registry)`` for every target and feeds the text to the same
parser and window builder as :class:`~controller.observe.scrape.ScrapeSource`; nothing the
simulator knows internally leaks into the window. Time comes from the given clock, so a
virtual-time run gets virtual snapshot times.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry, generate_latest

from controller.clock import Clock
from controller.observe.snapshot import FetchError, SnapshotSource
from controller.observe.source import Target


class InProcessSource(SnapshotSource):
    name = "inprocess"

    def __init__(
        self,
        targets: Sequence[Target],
        registries: Mapping[str, CollectorRegistry],
        clock: Clock | None = None,
    ) -> None:
        missing = [t.name for t in targets if t.name not in registries]
        if missing:
            raise ValueError(f"no registry for target(s): {', '.join(missing)}")
        super().__init__(targets, clock)
        self._registries = dict(registries)
        self._down: set[str] = set()

    def set_down(self, target: str, down: bool = True) -> None:
        """Make a target stop answering (a crashed worker), as a scrape would see it."""
        (self._down.add if down else self._down.discard)(target)

    def replace_registry(self, target: str, registry: CollectorRegistry) -> None:
        """A restarted worker: same target, fresh counters (the next window sees a reset)."""
        if target not in self._registries:
            raise KeyError(target)
        self._registries[target] = registry

    async def fetch_all(self, targets: Sequence[Target]) -> list[str | FetchError]:
        out: list[str | FetchError] = []
        for t in targets:
            if t.name in self._down:
                out.append(FetchError("unreachable", "target is down"))
                continue
            try:
                out.append(generate_latest(self._registries[t.name]).decode("utf-8"))
            except Exception as e:  # a collector that raises is a broken target, not a crash
                out.append(FetchError("parse", f"rendering the registry failed: {e!r}"))
        return out
