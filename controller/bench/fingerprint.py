"""What produced a committed result: a fingerprint of the code and the data a bench run read.

A result records, beside its figures, a fingerprint:

- ``modules``: every ``controller.*`` module the run had imported when it ended (taken from
  ``sys.modules``), each as the SHA-256 of its syntax tree with docstrings removed
  (:func:`source_digest`; comments, blank lines and line numbers are not in a syntax tree),
  so that a comment or docstring edit leaves the fingerprint as it was and any change to what
  the code does changes it;
- ``files``: the SHA-256 of the bytes of every data file the run opened under the repository
  (the scenario file, the traces, the worker profile), as recorded by :class:`FileReads`;
- ``command``: the command that regenerates the result.

:func:`fingerprint` and :func:`compare` are pure (their inputs are texts and bytes);
:func:`current_fingerprint` and :func:`stale_results` are the adapters that read the
repository. ``tests/bench/test_freshness.py`` fails when a committed result's fingerprint
differs from the current code, naming the command that regenerates it.

This module is left out of every fingerprint (:data:`CHECKER`): it reads results and takes no
part in a run's figures, so the checker can change without making every result stale.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar

PACKAGE = "controller"
ROOT = Path(__file__).resolve().parents[2]  # the repository (the package's parent)
# Files the run opened that are code, not data: covered by ``modules`` (or irrelevant).
CODE_SUFFIXES = frozenset({".py", ".pyc", ".pyi", ".so", ".pth"})
# Not the run's inputs: environments, outputs, and an install's own metadata (*.egg-info).
SKIPPED_DIRS = frozenset({".venv", ".git", "results", "build", "dist"})
CHECKER = __name__  # imported by every bench run, never part of what it computes


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    """``tree`` with the docstring of every module, class and function removed."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


def source_digest(source: str) -> str:
    """SHA-256 of a module's syntax tree without docstrings and without positions: equal for
    two sources that differ only in comments, docstrings, blank lines or line breaks."""
    tree = _strip_docstrings(ast.parse(source))
    return hashlib.sha256(ast.dump(tree, include_attributes=False).encode()).hexdigest()


def bytes_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fingerprint(module_sources: Mapping[str, str], files: Mapping[str, bytes],
                command: str) -> dict[str, Any]:
    """The fingerprint of a run: ``module_sources`` (module name -> source text) and ``files``
    (path relative to the repository -> content) as digests, sorted by name."""
    return {
        "command": command,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "modules": {name: source_digest(module_sources[name]) for name in sorted(module_sources)},
        "files": {path: bytes_digest(files[path]) for path in sorted(files)},
    }


class Staleness(StrEnum):
    """Why a committed result no longer describes the current code."""

    NO_FINGERPRINT = "no fingerprint"
    MODULE_CHANGED = "module changed"
    MODULE_GONE = "module gone"
    FILE_CHANGED = "file changed"
    FILE_GONE = "file gone"


@dataclass(frozen=True, slots=True)
class Stale:
    result: str  # the result file, relative to the repository
    why: Staleness
    what: str  # the module or file ("" for NO_FINGERPRINT)
    command: str  # what regenerates the result ("" when it recorded none)

    def line(self) -> str:
        target = f" {self.what}" if self.what else ""
        again = f"; regenerate: {self.command}" if self.command else ""
        return f"{self.result}: {self.why.value}{target}{again}"


def compare(result: str, recorded: Mapping[str, Any] | None,
            module_source: Callable[[str], str | None],
            file_bytes: Callable[[str], bytes | None]) -> list[Stale]:
    """Each way ``recorded`` (a result's fingerprint) differs from the code and data now
    (``module_source(name)`` / ``file_bytes(path)``: None when gone). Pure given its
    callables."""
    if not recorded:
        return [Stale(result, Staleness.NO_FINGERPRINT, "", "")]
    command = str(recorded.get("command", ""))
    out = []
    for name, digest in sorted((recorded.get("modules") or {}).items()):
        source = module_source(name)
        if source is None:
            out.append(Stale(result, Staleness.MODULE_GONE, name, command))
        elif source_digest(source) != digest:
            out.append(Stale(result, Staleness.MODULE_CHANGED, name, command))
    for path, digest in sorted((recorded.get("files") or {}).items()):
        data = file_bytes(path)
        if data is None:
            out.append(Stale(result, Staleness.FILE_GONE, path, command))
        elif bytes_digest(data) != digest:
            out.append(Stale(result, Staleness.FILE_CHANGED, path, command))
    return out


# --------------------------------------------------------------------------- adapters


def module_path(name: str, root: Path = ROOT) -> Path | None:
    """The source file of module ``name`` under ``root`` (a package's ``__init__.py``)."""
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _read_module(root: Path) -> Callable[[str], str | None]:
    def read(name: str) -> str | None:
        path = module_path(name, root)
        return None if path is None else path.read_text(encoding="utf-8")

    return read


def _read_file(root: Path) -> Callable[[str], bytes | None]:
    def read(rel: str) -> bytes | None:
        path = root / rel
        return path.read_bytes() if path.is_file() else None

    return read


def imported_modules(modules: Mapping[str, Any] | None = None) -> list[str]:
    """The ``controller.*`` modules in ``modules`` (default ``sys.modules``) that have a
    source file, but for :data:`CHECKER`."""
    mods = sys.modules if modules is None else modules
    return sorted(name for name, mod in list(mods.items())
                  if (name == PACKAGE or name.startswith(PACKAGE + ".")) and name != CHECKER
                  and str(getattr(mod, "__file__", "") or "").endswith(".py"))


class FileReads:
    """Records every data file opened under the repository while it is active (an audit
    hook on ``open``: trace readers, ``Path.read_text``, ``gzip.open`` all pass through it).
    Code files are left out (``modules`` covers them). Use as a context manager; audit hooks
    cannot be removed, so one hook is installed per process and recording toggles."""

    _active: ClassVar[list[FileReads]] = []
    _installed: ClassVar[bool] = False

    def __init__(self, root: Path = ROOT) -> None:
        self.root = root.resolve()
        self.paths: set[str] = set()

    @classmethod
    def _hook(cls, event: str, args: tuple[Any, ...]) -> None:
        if event != "open" or not cls._active or not args or not isinstance(args[0], str | Path):
            return
        mode = args[1] if len(args) > 1 and isinstance(args[1], str) else "r"
        if any(c in mode for c in "wax+"):
            return
        for rec in cls._active:
            rec._note(Path(args[0]))

    def _note(self, path: Path) -> None:
        if path.suffix in CODE_SUFFIXES:
            return
        try:
            rel = path.resolve().relative_to(self.root)
        except (ValueError, OSError):
            return
        if rel.parts and rel.parts[0] not in SKIPPED_DIRS \
                and not any(part.endswith(".egg-info") or part == "__pycache__"
                            for part in rel.parts):
            self.paths.add(rel.as_posix())

    def __enter__(self) -> FileReads:
        if not FileReads._installed:
            sys.addaudithook(FileReads._hook)
            FileReads._installed = True
        FileReads._active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        FileReads._active.remove(self)


def current_fingerprint(command: str, files: Iterable[str], root: Path = ROOT,
                        modules: Iterable[str] | None = None) -> dict[str, Any]:
    """:func:`fingerprint` of the modules imported now (``sys.modules``, or ``modules``) and
    ``files`` (relative to ``root``), read from ``root``."""
    read = _read_module(root)
    sources = {}
    for name in imported_modules() if modules is None else modules:
        text = read(name)
        if text is not None:
            sources[name] = text
    data = {rel: (root / rel).read_bytes() for rel in files if (root / rel).is_file()}
    return fingerprint(sources, data, command)


def package_digests(root: Path = ROOT) -> dict[str, str]:
    """:func:`source_digest` of every module of the package under ``root``, by name."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = source_digest(path.read_text(encoding="utf-8"))
    return out


def changed_during_run(before: Mapping[str, str], fp: Mapping[str, Any]) -> list[str]:
    """The modules of fingerprint ``fp`` whose source differs from ``before`` (taken as the
    run started): the run executed other code than the fingerprint names."""
    return sorted(name for name, digest in (fp.get("modules") or {}).items()
                  if before.get(name) != digest)


def stale_results(paths: Iterable[Path], root: Path = ROOT) -> list[Stale]:
    """Every result among ``paths`` (summary JSON files) whose fingerprint is missing or
    differs from the code and data under ``root`` now, in path order, each with its own
    regeneration command. Each distinct fingerprint is compared once: the evaluation's runs
    share a handful (one per scenario and script), and digesting the modules a run imports
    costs about 0.4 s of CPU."""
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
        differences = compare("", json.loads(key), _read_module(root), _read_file(root))
        found += [(position, replace(s, result=rel, command=command))
                  for position, rel, command in results for s in differences]
    return [s for _, s in sorted(found, key=lambda entry: entry[0])]
