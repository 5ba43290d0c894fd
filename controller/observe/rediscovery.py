"""Finding a source's targets again while it runs.

Targets found only at the start go stale in a cluster that changes: new pods behind
``[prometheus] discover_targets`` or a ``dns+NAME:PORT`` (a Kubernetes headless service)
would never be observed, and a replaced pod would be scraped at its old address. Both
sources therefore ask again every ``REDISCOVER_EVERY_S`` of window time (the virtual
clock's in a replay). A failed or empty answer keeps the targets the source had: a DNS or
Prometheus hiccup must not empty the fleet, and the window's own scrapes say what is down.
A source with no targets yet (the daemon started while Prometheus or DNS could not answer)
asks every window until it finds some.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

from controller.errors import ControllerError
from controller.observe.source import NoTargets, Target

REDISCOVER_EVERY_S = 60.0

_log = logging.getLogger(__name__)


class Rediscovery:
    def __init__(
        self,
        find: Callable[[], Awaitable[list[Target]]],
        *,
        what: str,
        every_s: float = REDISCOVER_EVERY_S,
    ) -> None:
        self._find = find
        self.what = what  # for the log: "target discovery", "DNS"
        self._every_s = every_s
        self._found_at: float | None = None
        self.last_problem: str | None = None  # why the last ask found nothing, for the cycle

    def require(self, targets: Sequence[Target]) -> None:
        """Raise :class:`NoTargets` while nothing has been found, saying why (the cycle is
        skipped, not planned on an empty window)."""
        if not targets:
            raise NoTargets(f"no targets to observe yet: {self.what} "
                            f"{self.last_problem or 'has found none'}")

    async def refresh(self, targets: Sequence[Target], now: float) -> list[Target] | None:
        """The targets found again when they are due and differ from ``targets``, else
        None. The first call only starts the clock: ``targets`` were found at the start,
        unless there are none (nothing found yet), when every call asks."""
        if targets:
            if self._found_at is None:
                self._found_at = now
                return None
            if now - self._found_at < self._every_s:
                return None
        try:
            found = await self._find()
        except ControllerError as e:  # Prometheus unavailable, a name that stopped resolving
            _log.warning("%s failed, keeping %d target(s): %s", self.what, len(targets), e)
            self.last_problem = f"failed: {e}"
            return None
        self._found_at = now
        if not found:
            _log.warning("%s found none, keeping %d target(s)", self.what, len(targets))
            self.last_problem = "found none"
            return None
        self.last_problem = None
        if found == list(targets):
            return None
        before, after = {t.name for t in targets}, {t.name for t in found}
        _log.info("%s again: %d target(s) (added %s; gone %s)", self.what, len(found),
                  ", ".join(sorted(after - before)) or "none",
                  ", ".join(sorted(before - after)) or "none")
        return list(found)
