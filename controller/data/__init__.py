"""Data files shipped inside the package, so a clone or an installed wheel needs nothing else.

``traces/`` holds the public request traces (and derived aggregates) the simulator's workloads
replay; ``perf_profiles/`` holds the profiling rows the simulator's step-time model is checked
against. Origin, licence, attribution and sha256 of every file: ``README.md`` in this
directory (and ``NOTICE`` at the repository root).
"""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
TRACES_DIR = DATA_DIR / "traces"
PERF_PROFILES_DIR = DATA_DIR / "perf_profiles"
