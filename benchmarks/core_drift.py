"""How long does one drift check (all three detectors) take per window?

A ground-truth stream (tests/core/synth.py), a model fitted on 300 windows and a reference
of 40 calibration windows. Timed per window: performance residuals (the model's predictions
for the window) + workload PSI/qps + CUSUM + SLO band, i.e. what the daemon runs after each
observe. Prints mean, p50, p99 and max in ms.

    .venv/bin/python benchmarks/core_drift.py
"""

from __future__ import annotations

import statistics
import sys
import time  # perf_counter only: benchmark timing, not control logic
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controller.core.drift import (  # noqa: E402
    DriftState,
    assess,
    performance_residuals,
    reference_from_windows,
)
from controller.core.features import build_training_set  # noqa: E402
from controller.core.latency_model import fit_latency_model  # noqa: E402
from controller.policy.model import Slo  # noqa: E402
from tests.core.synth import Mix, Truth, stationary, training_windows  # noqa: E402


def main() -> None:
    slo = Slo(ttft_s=1.0, tpot_s=0.05)
    model = fit_latency_model(
        build_training_set(training_windows(Truth(), Mix(), 300, seed=1, slo=slo)),
        slo.ttft_s, slo.tpot_s)
    ref = reference_from_windows(stationary(Truth(), Mix(), 2.0, 0.6, 40, seed=2, slo=slo),
                                 model)
    stream = stationary(Truth(), Mix(), 2.0, 0.6, 500, seed=3, slo=slo)
    state = DriftState()
    times = []
    for w in stream:
        t0 = time.perf_counter()
        residuals = performance_residuals(model, [w])[0]
        state, _ = assess(state, ref, w, w.end, residuals)
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    print(f"drift check per window over {len(times)} windows: mean {statistics.fmean(times):.2f} "
          f"ms, p50 {times[len(times) // 2]:.2f} ms, p99 {times[int(len(times) * 0.99)]:.2f} "
          f"ms, max {times[-1]:.2f} ms")


if __name__ == "__main__":
    main()
