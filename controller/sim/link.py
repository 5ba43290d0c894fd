"""P -> D KV links: one NIC per prefill worker, FIFO, with setup cost and bandwidth.

``T_xfer(n) = setup + n * kv_bytes_per_token / bandwidth`` (``docs/simulator.md``
section 9). Transfers leaving the same prefill worker share its NIC one after another
(``kv_link_gbps`` is per NIC, in gigabits per second of effective bandwidth). A bandwidth
change applies to transfers that start after it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class KvLink:
    name: str
    gbps: float
    setup_s: float = 0.001
    factor: float = 1.0
    free_at: float = 0.0
    transfers: int = 0
    bytes_sent: int = 0
    busy_s: float = 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * self.factor * 1e9 / 8.0

    def duration_s(self, nbytes: int) -> float:
        return self.setup_s + nbytes / self.bytes_per_s

    def schedule(self, now: float, nbytes: int) -> tuple[float, float]:
        """Queue a transfer of ``nbytes`` at ``now``: returns (start, end)."""
        start = max(now, self.free_at)
        end = start + self.duration_s(nbytes)
        self.free_at = end
        self.transfers += 1
        self.bytes_sent += nbytes
        self.busy_s += end - start
        return start, end

    def set_factor(self, factor: float) -> None:
        if not factor > 0:
            raise ValueError("link bandwidth factor must be > 0")
        self.factor = factor
