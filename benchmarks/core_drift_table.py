"""Detection delay and false alarms per drift detector, over seeds (ground-truth streams).

A model fitted on 300 exploration-rich windows of a 2P/2D ground-truth cluster
(tests/core/synth.py); a calibration reference of 40 windows of the steady regime; then, per
seed:
- **false alarms**: two hours of steady traffic (240 windows of 30 s), fired detectors counted;
- **delay**: 10 steady windows, then a shift; windows until the named detector fires
  (``-`` = not within 20 windows).

    .venv/bin/python benchmarks/core_drift_table.py            # 5 seeds
    .venv/bin/python benchmarks/core_drift_table.py --seeds 10
"""

from __future__ import annotations

import argparse
import sys
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

SLO = Slo(ttft_s=1.0, tpot_s=0.05)
QPS, LOCAL = 2.0, 0.6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()
    model = fit_latency_model(build_training_set(training_windows(Truth(), Mix(), 300, seed=1,
                                                                  slo=SLO)),
                              SLO.ttft_s, SLO.tpot_s)
    ref = reference_from_windows(stationary(Truth(), Mix(), QPS, LOCAL, 40, seed=100, slo=SLO),
                                 model)

    def flags(windows: list) -> list[dict[str, bool]]:
        state = DriftState()
        out = []
        for w, res in zip(windows, performance_residuals(model, windows), strict=True):
            state, verdicts = assess(state, ref, w, w.end, res)
            out.append({v.kind: v.fired for v in verdicts})
        return out

    false_alarms = {"workload": 0, "performance": 0, "slo": 0}
    for seed in range(args.seeds):
        for f in flags(stationary(Truth(), Mix(), QPS, LOCAL, 240, seed=seed, slo=SLO)):
            for k, v in f.items():
                false_alarms[k] += int(v)
    print(f"false alarms over {args.seeds} x 2 h of steady traffic (240 windows each): "
          f"{false_alarms}")

    shifts = [
        ("context_tokens x3", "workload", Truth(), Mix().scaled_context(3.0), QPS),
        ("QPS x2", "workload", Truth(), Mix(), QPS * 2),
        ("QPS x1.3 (moderate)", "workload", Truth(), Mix(), QPS * 1.3),
        ("KV link bandwidth / 4", "performance", Truth(link_bw=Truth().link_bw / 4), Mix(),
         QPS),
        ("decode step x3 (SLO degradation)", "slo", Truth(floor=0.045, t_fixed=0.006), Mix(),
         QPS),
    ]
    print("| shift | detector | delay per seed (windows) | fired in <= 3 windows |")
    print("|---|---|---|---|")
    for name, kind, truth, mix, qps in shifts:
        delays = []
        for seed in range(args.seeds):
            before = stationary(Truth(), Mix(), QPS, LOCAL, 10, seed=seed, slo=SLO,
                                start=1_760_000_000.0)
            after = stationary(truth, mix, qps, LOCAL, 20, seed=seed + 50, slo=SLO,
                               start=before[-1].end)
            f = flags(before + after)
            early = any(x.get(kind) for x in f[:10])
            d = next((i + 1 for i, x in enumerate(f[10:]) if x.get(kind)), None)
            delays.append("early!" if early else ("-" if d is None else str(d)))
        ok = sum(1 for d in delays if d.isdigit() and int(d) <= 3)
        print(f"| {name} | {kind} | {', '.join(delays)} | {ok}/{args.seeds} |")


if __name__ == "__main__":
    main()
