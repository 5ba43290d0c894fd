"""How much memory does ``pdctl history windows`` take on a long history?

Fills a SQLite store in a temp dir with N realistic windows (8 workers, 800 route cells
each, as ``store_write_window.py`` builds them), then runs ``pdctl history windows --limit N``
as a subprocess, once with ``--json`` and once as a table, and prints each one's peak
resident memory (the child's ``ru_maxrss``), wall time and output size. Output goes to a
file, as an operator's ``> windows.json`` would.

    .venv/bin/python benchmarks/history_windows_memory.py            # 5000 windows
    .venv/bin/python benchmarks/history_windows_memory.py --n 1000
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from store_write_window import realistic_window  # a sibling: run as a script

from controller.clock import WallClock
from controller.store import Store


def _fill(url: str, n: int) -> None:
    rng = random.Random(7)
    with Store(url, WallClock()) as store:
        store.upgrade()
        for i in range(n):
            with store.cycle() as tx:
                tx.add_window(realistic_window(rng, 1.9e9 + 30 * i))
            if (i + 1) % 1000 == 0:
                print(f"  wrote {i + 1}/{n} windows", file=sys.stderr)


def _run(url: str, n: int, as_json: bool, out: Path) -> tuple[float, float]:
    """(peak RSS MiB, wall s) of one ``pdctl history windows`` subprocess."""
    cmd = [str(Path(sys.executable).with_name("pdctl")), "history", "windows", "--url", url,
           "--limit", str(n), *(["--json"] if as_json else [])]
    clock = WallClock()
    t0 = clock.monotonic()
    with out.open("wb") as f:
        child = subprocess.Popen(cmd, stdout=f)  # noqa: S603 (our own pdctl)
        _, status, usage = os.wait4(child.pid, 0)  # this child's own peak, not the max so far
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {child.returncode}")
    return usage.ru_maxrss / 1024, clock.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=5000, help="windows in the store (default 5000)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'history.db'}"
        print(f"writing {args.n} windows ...", file=sys.stderr)
        _fill(url, args.n)
        print(f"store: {os.path.getsize(Path(tmp) / 'history.db') / 2**20:.0f} MiB, "
              f"{args.n} windows")
        for as_json in (True, False):
            out = Path(tmp) / ("out.json" if as_json else "out.txt")
            peak, wall = _run(url, args.n, as_json, out)
            print(f"history windows --limit {args.n}{' --json' if as_json else ''}: "
                  f"peak RSS {peak:.0f} MiB, {wall:.1f} s, "
                  f"output {out.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
