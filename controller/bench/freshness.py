"""Which committed results no longer match the code and data under the repository.

:func:`stale_committed` gives exactly what :func:`controller.bench.fingerprint.stale_results`
gives for the same files (``tests/bench/test_freshness.py`` checks that), but compares each
distinct fingerprint once: the evaluation's runs share a handful of fingerprints (one per
scenario and script), and digesting every imported module's syntax tree costs about 0.4 s of
CPU, which over 120 results would make the freshness test one of the suite's slowest. It
lives outside ``fingerprint.py`` because every result's fingerprint digests that module,
and this one takes no part in a run.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from controller.bench.fingerprint import ROOT, Stale, Staleness, compare, module_path


def _source(name: str, root: Path) -> str | None:
    path = module_path(name, root)
    return path.read_text(encoding="utf-8") if path is not None else None


def _data(rel: str, root: Path) -> bytes | None:
    return (root / rel).read_bytes() if (root / rel).is_file() else None


def stale_committed(paths: Iterable[Path], root: Path = ROOT) -> list[Stale]:
    """Every result among ``paths`` (summary JSON files) whose fingerprint is missing or
    differs from the code and data under ``root`` now, in path order, each with its own
    regeneration command."""
    root = root.resolve()
    found: list[tuple[int, Stale]] = []
    sharing: dict[str, list[tuple[int, str, str]]] = {}  # fingerprint -> its results
    for position, path in enumerate(sorted(paths)):
        rel = path.resolve().relative_to(root).as_posix()
        recorded = json.loads(path.read_text(encoding="utf-8")).get("fingerprint")
        if not recorded:
            found.append((position, Stale(rel, Staleness.NO_FINGERPRINT, "", "")))
            continue
        key = json.dumps({"modules": recorded.get("modules") or {},
                          "files": recorded.get("files") or {}}, sort_keys=True)
        sharing.setdefault(key, []).append((position, rel, str(recorded.get("command", ""))))
    for key, results in sharing.items():
        differences = compare("", json.loads(key), lambda name: _source(name, root),
                              lambda rel: _data(rel, root))
        found += [(position, replace(s, result=rel, command=command))
                  for position, rel, command in results for s in differences]
    return [s for _, s in sorted(found, key=lambda entry: entry[0])]
