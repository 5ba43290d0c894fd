"""Writing a peer's tuned rule (``[export]``): the I/O around
:mod:`controller.core.peer_export`.

``pdctl export`` prints the fragment; ``pdctl run`` writes it to ``[export] path`` on every
approval. The file is replaced atomically (temporary file, fsync, rename), so a router that
reloads it reads the old fragment or the new one, never half of one. The fit runs on a
background thread: the cycle's write transaction does not wait for it.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controller.rollout.agent import atomic_write_bytes

if TYPE_CHECKING:
    from controller.config import ExportConfig
    from controller.core.calibrate import TableGrid
    from controller.core.latency_model import LatencyModel
    from controller.core.peer_export import PeerExport
    from controller.policy import Policy, Slo

log = logging.getLogger(__name__)


def fragment(model: LatencyModel, grid: TableGrid, policy: Policy, slo: Slo, form: str,
             traffic_chars_per_token: float = 4.0, llmd_chars_per_token: float = 4.0
             ) -> tuple[PeerExport, str]:
    """The fitted rule of ``form`` (dynamo, llm-d) for ``policy`` and its config fragment."""
    from controller.core.peer_export import PeerFormat, export_rule, render

    export = export_rule(model, grid, policy, slo, PeerFormat(form))
    return export, render(export, traffic_chars_per_token, llmd_chars_per_token)


def write_fragment(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


class ApprovalExporter:
    """Called by the cycle with each approved policy and its calibration's basis (the fitted
    model and the grid of its windows); writes the fragment in the background. A failure is
    logged and counted in ``failures``: the approval itself never depends on it."""

    def __init__(self, cfg: ExportConfig, slo: Slo) -> None:
        assert cfg.path is not None and cfg.format is not None
        self.cfg, self.slo, self.path, self.form = cfg, slo, cfg.path, cfg.format
        self.written = 0
        self.failures = 0
        self._lock = threading.Lock()  # one write at a time, in approval order
        self._threads: list[threading.Thread] = []

    def __call__(self, policy: Policy, basis: Any) -> None:
        if basis is None:  # a learner that keeps no model (tests' fakes): nothing to fit
            return
        t = threading.Thread(target=self._write, args=(policy, basis),
                             name=f"export-v{policy.version}", daemon=True)
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def _write(self, policy: Policy, basis: Any) -> None:
        model, grid = basis
        with self._lock:
            try:
                export, text = fragment(model, grid, policy, self.slo, self.form,
                                        self.cfg.traffic_chars_per_token,
                                        self.cfg.llmd_chars_per_token)
                write_fragment(self.path, text)
            except Exception as e:  # a full disk, a fit that cannot run: say so, go on
                self.failures += 1
                log.error("export: cannot write the %s fragment for v%s to %s: %s",
                          self.cfg.format, policy.version, self.path, e)
                return
            self.written += 1
            log.info("export: wrote the %s fragment for v%s to %s (predicted goodput: rule "
                     "%.4f, table %.4f)", self.cfg.format, policy.version, self.path,
                     export.rule.predicted_goodput, export.table_goodput)

    def join(self, timeout_s: float = 30.0) -> None:
        """Wait for the writes started so far (tests, shutdown)."""
        for t in list(self._threads):
            t.join(timeout_s)
