"""How long does a calibration over 10,000 stored windows into a 1,000-cell table take?

Windows come from the ground-truth generator of the tests (tests/core/synth.py): a 2P/2D
cluster, 2 routers, varied QPS and per-cell route shares. Setup (generating the windows and
writing them to a temporary SQLite store) is not timed; the generated windows are dropped
afterwards, so the process holds what a daemon holds when it calibrates (the windows it
read), not a second copy. Timed, separately and together, wall and CPU time of this
process (wall minus CPU is time lost to other processes on a shared machine):

- store read: ``Store.read()`` → ``tx.windows()`` (SQL + JSON + ``Window.from_dict``);
- features: windows → numpy training set;
- calibrate: component fits, held-out error, refit, 17-ratio weight search with a fixed point
  per ratio, exploration, guardrail, policy build (default 10 x 10 x 10 axes = 1,000 cells).

    .venv/bin/python benchmarks/core_calibrate.py                  # 10,000 windows, 8-cell mix
    .venv/bin/python benchmarks/core_calibrate.py --mix-cells 24   # a wider workload mix
    .venv/bin/python benchmarks/core_calibrate.py --no-store       # pure part only

Interpreter start and imports are excluded (imports happen before timing). The load
average is printed before the first and after the last run.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time  # perf_counter/process_time only: benchmark timing, not control logic
from collections.abc import Iterator
from contextlib import contextmanager
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
        del windows
        gc.collect()

    cfg = CalibrationConfig(slo=slo)
    print(f"load average before: {_load()}")
    for rep in range(args.repeat):
        loaded = None  # the previous run's windows are not kept while this one reads
        wall, cpu = {}, {}
        with _timed("read", wall, cpu):
            if store is not None:
                with store.read() as tx:
                    loaded = [s.window for s in tx.windows()]
            else:
                loaded = windows
        with _timed("features", wall, cpu):
            ts = build_training_set(loaded)
        with _timed("calibrate", wall, cpu):
            result = calibrate(loaded, 2e9, config=cfg, training=ts)
        mape = {r: {t: round(v, 3) if v is not None else None for t, v in d.items()}
                for r, d in result.heldout_mape().items()}
        print(f"run {rep + 1}: store read {wall['read']:.2f} s, features "
              f"{wall['features']:.2f} s, calibrate {wall['calibrate']:.2f} s, "
              f"total {sum(wall.values()):.2f} s (CPU {cpu['read']:.2f} + "
              f"{cpu['features']:.2f} + {cpu['calibrate']:.2f} = {sum(cpu.values()):.2f} s) | "
              f"cells {result.policy.table.axes.n_cells}, rounds {len(result.rounds)}, "
              f"ratio {result.weights.ratio:g}, held-out MAPE {mape}")
    print(f"load average after: {_load()}")


@contextmanager
def _timed(name: str, wall: dict[str, float], cpu: dict[str, float]) -> Iterator[None]:
    t0, c0 = time.perf_counter(), time.process_time()
    yield
    wall[name] = time.perf_counter() - t0
    cpu[name] = time.process_time() - c0


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
