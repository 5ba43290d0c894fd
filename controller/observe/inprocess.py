"""``InProcessSource``: the simulator's registries, read exactly as a scrape would see them.

It renders ``generate_latest(registry)`` (its bytes, via
:func:`~controller.observe.render.render_latest`) for every target and feeds the text to the same
parser and window builder as :class:`~controller.observe.scrape.ScrapeSource`; nothing the
simulator knows internally leaks into the window. Time comes from the given clock, so a
virtual-time run gets virtual snapshot times.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from controller.clock import Clock
from controller.core.window import FailureKind, Window
from controller.observe.render import render_latest
from controller.observe.snapshot import FetchError, SnapshotSource
from controller.observe.source import Target

# The current targets and their registries (workers come and go in a simulation).
RegistryProvider = Callable[[], tuple[Sequence[Target], Mapping[str, CollectorRegistry]]]


def sim_cluster_provider(cluster: Any) -> RegistryProvider:
    """Targets of a ``controller.sim`` cluster: its live engines and its routers.

    Read on every window, so a worker lost or added by a scenario event shows up as a scrape
    would show it: a lost worker keeps being reported as ``unreachable``.
    """

    def provide() -> tuple[Sequence[Target], Mapping[str, CollectorRegistry]]:
        targets: list[Target] = []
        registries: dict[str, CollectorRegistry] = {}
        for engine in cluster.engines:
            targets.append(Target(engine.name, engine.role))
            registries[engine.name] = engine.registry
        for router in cluster.routers:
            targets.append(Target(router.router_id, "router"))
            registries[router.router_id] = router.agent.registry
        return targets, registries

    return provide


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
        self._provider: RegistryProvider | None = None
        self._gone: set[str] = set()  # targets the provider no longer lists

    @classmethod
    def following(cls, provider: RegistryProvider, clock: Clock | None = None
                  ) -> InProcessSource:
        """A source whose targets are re-read from ``provider`` before every window."""
        targets, registries = provider()
        source = cls(targets, registries, clock)
        source._provider = provider
        return source

    async def window(self, start: float, end: float) -> Window:
        if self._provider is not None:
            targets, registries = self._provider()
            current = {t.name for t in targets}
            known = {t.name for t in self._targets}
            self._targets += [t for t in targets if t.name not in known]
            self._registries.update(registries)
            self._gone = {t.name for t in self._targets if t.name not in current}
        return await super().window(start, end)

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
            if t.name in self._down or t.name in self._gone:
                out.append(FetchError(FailureKind.UNREACHABLE, "target is down"))
                continue
            try:
                out.append(render_latest(self._registries[t.name]).decode("utf-8"))
            except Exception as e:  # a collector that raises is a broken target, not a crash
                out.append(FetchError(FailureKind.PARSE, f"rendering the registry failed: {e!r}"))
        return out
