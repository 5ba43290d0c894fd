"""Predicted goodput of the peers' fitted rules beside the calibrated table, and the fit's cost.

Synthetic windows of a known cluster (tests/core/synth.py, the ground truth the calibration
tests use), calibrated as the daemon does; then ``export_rule`` for llm-d and Dynamo on the
calibration's model and grid. Two mixes: the tests' default (short appends: decode-local wins
everywhere) and a heavy-append mix at 4-8 requests/s per router whose best routing is an
append threshold. For each: the exported threshold, the predicted goodput of the rule, of the
full table and of always disaggregating, and the seconds the fit took.

    .venv/bin/python benchmarks/peer_export_vs_table.py
"""

from __future__ import annotations

import sys
import time  # perf_counter only: benchmark timing, not control logic
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controller.core.calibrate import CalibrationConfig, calibrate
from controller.core.peer_export import PeerFormat, export_rule
from controller.policy.model import Slo
from tests.core.synth import Mix, Truth, training_windows

SLO = Slo(ttft_s=1.0, tpot_s=0.05)
HEAVY = Mix({(2, 2): 0.2, (3, 4): 0.2, (5, 6): 0.15, (4, 7): 0.15, (6, 8): 0.15, (7, 5): 0.15})


def main() -> None:
    print(f"{'mix':<8} {'seed':>4} {'format':<7} {'threshold':>9} {'ratio':>5} "
          f"{'rule':>7} {'table':>7} {'always P':>8} {'fit s':>6}")
    for name, mix, qps in (("default", Mix(), (1.0, 3.0)), ("heavy", HEAVY, (4.0, 8.0))):
        for seed in (5, 6, 7):
            windows = training_windows(Truth(), mix, 120, seed=seed, qps_range=qps, slo=SLO)
            result = calibrate(windows, 1_900_000_000.0, config=CalibrationConfig(slo=SLO))
            for form in PeerFormat:
                started = time.perf_counter()
                e = export_rule(result.model, result.grid, result.policy, SLO, form)
                took = time.perf_counter() - started
                ratio = "-" if e.rule.ratio is None else f"{e.rule.ratio:.1f}"
                print(f"{name:<8} {seed:>4} {form.value:<7} {e.rule.threshold:>9.0f} "
                      f"{ratio:>5} {e.rule.predicted_goodput:>7.4f} {e.table_goodput:>7.4f} "
                      f"{e.always_prefill_goodput:>8.4f} {took:>6.3f}")


if __name__ == "__main__":
    main()
