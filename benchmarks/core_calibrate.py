"""How long does a calibration over 10,000 stored windows into a 1,000-cell table take?

Windows come from the ground-truth generator of the tests (tests/core/synth.py): a 2P/2D
cluster, 2 routers, varied QPS and per-cell route shares. Setup (generating the windows and
writing them to a temporary SQLite store) is not timed. Timed, separately and together:

- store read: ``Store.read()`` → ``tx.windows()`` (SQL + JSON + ``Window.from_dict``);
- features: windows → numpy training set;
- calibrate: component fits, held-out error, refit, 17-ratio weight search with a fixed point
  per ratio, exploration, guardrail, policy build (default 10 x 10 x 10 axes = 1,000 cells).

    .venv/bin/python benchmarks/core_calibrate.py                  # 10,000 windows, 8-cell mix
    .venv/bin/python benchmarks/core_calibrate.py --mix-cells 24   # a wider workload mix
    .venv/bin/python benchmarks/core_calibrate.py --no-store       # pure part only

Interpreter start and imports are excluded (imports happen before timing).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time  # perf_counter only: benchmark timing, not control logic
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import scipy.special  # noqa: E402, F401  (imports are excluded from the timing)
import sklearn.linear_model  # noqa: E402, F401

from controller.core.calibrate import CalibrationConfig, calibrate  # noqa: E402
from controller.core.features import N_IO_BINS, build_training_set  # noqa: E402
from controller.policy.model import Slo  # noqa: E402
from tests.core.synth import Mix, Truth, training_windows  # noqa: E402


def wide_mix(n: int, seed: int) -> Mix:
    rng = np.random.default_rng(seed)
    cells: dict[tuple[int, int], float] = {}
    while len(cells) < n:
        cells[(int(rng.integers(0, 9)), int(rng.integers(0, N_IO_BINS - 2)))] = float(
            rng.uniform(0.2, 1.0))
    return Mix(cells)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", type=int, default=10_000)
    ap.add_argument("--mix-cells", type=int, default=8)
    ap.add_argument("--no-store", action="store_true")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()

    slo = Slo(ttft_s=1.0, tpot_s=0.05)
    mix = Mix() if args.mix_cells == 8 else wide_mix(args.mix_cells, 0)
    t0 = time.perf_counter()
    windows = training_windows(Truth(), mix, args.windows, seed=1, slo=slo)
    outcomes = sum(len(w.outcomes) for w in windows)
    print(f"setup: generated {len(windows)} windows ({outcomes} outcome rows, "
          f"{outcomes / len(windows):.0f} per window) in {time.perf_counter() - t0:.1f} s")

    store = None
    if not args.no_store:
        from controller.store import Store

        tmp = tempfile.mkdtemp(prefix="pdctl-bench-")
        store = Store(f"sqlite:///{tmp}/bench.db")
        store.upgrade()
        t0 = time.perf_counter()
        with store.cycle() as tx:
            for w in windows:
                tx.add_window(w)
        print(f"setup: stored in SQLite in {time.perf_counter() - t0:.1f} s")

    cfg = CalibrationConfig(slo=slo)
    for rep in range(args.repeat):
        t_read = 0.0
        if store is not None:
            t0 = time.perf_counter()
            with store.read() as tx:
                loaded = [s.window for s in tx.windows()]
            t_read = time.perf_counter() - t0
        else:
            loaded = windows
        t0 = time.perf_counter()
        ts = build_training_set(loaded)
        t_feat = time.perf_counter() - t0
        t0 = time.perf_counter()
        result = calibrate(loaded, 2e9, config=cfg, training=ts)
        t_cal = time.perf_counter() - t0
        mape = {r: {t: round(v, 3) if v is not None else None for t, v in d.items()}
                for r, d in result.heldout_mape().items()}
        print(f"run {rep + 1}: store read {t_read:.2f} s, features {t_feat:.2f} s, "
              f"calibrate {t_cal:.2f} s, total {t_read + t_feat + t_cal:.2f} s | "
              f"cells {result.policy.table.axes.n_cells}, rounds {len(result.rounds)}, "
              f"ratio {result.weights.ratio:g}, held-out MAPE {mape}")


if __name__ == "__main__":
    main()
