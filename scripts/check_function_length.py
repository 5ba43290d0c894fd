"""Functions a reader can hold: fail when a function is longer than its part of the house allows.

Limits (lines from the ``def`` line to the function's last line, docstring included):

- 60 in the pure layers (``controller/policy``, ``controller/core``), the loop modules, the
  router and the adapters (``observe``, ``store``, ``rollout``);
- 100 everywhere else in ``controller/`` and in ``dashboards/build.py``;
- generated code (``controller/_proto``) and migrations are not checked.

An exception is listed in ``scripts/function_length_exceptions.toml`` with its reason. The
check also fails on a stale exception (the function is gone or back within its limit), so
the list only shrinks.

Usage: ``python scripts/check_function_length.py [--root DIR] [--exceptions FILE] [--top N]``
(``--top N`` also prints the N longest functions).
"""

from __future__ import annotations

import argparse
import ast
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_EXCEPTIONS = REPO / "scripts" / "function_length_exceptions.toml"
STRICT_LIMIT = 60
LOOSE_LIMIT = 100
# Paths relative to the repository root; a prefix ending in "/" is a package.
STRICT_PREFIXES = (
    "controller/policy/", "controller/core/",
    "controller/observe/", "controller/store/", "controller/rollout/", "controller/router/",
    "controller/loop/",
)
SKIPPED_PREFIXES = ("controller/_proto/", "controller/_migrations/")
EXTRA_FILES = ("dashboards/build.py",)


@dataclass(frozen=True, slots=True)
class Function:
    key: str  # "path::Qualified.name"
    lines: int
    limit: int


def limit_for(rel: str) -> int:
    return STRICT_LIMIT if rel.startswith(STRICT_PREFIXES) else LOOSE_LIMIT


def source_files(root: Path) -> Iterator[str]:
    for path in sorted((root / "controller").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if not rel.startswith(SKIPPED_PREFIXES):
            yield rel
    for rel in EXTRA_FILES:
        if (root / rel).is_file():
            yield rel


def functions_in(root: Path, rel: str) -> Iterator[Function]:
    """Every function and method of one file, nested ones included, by qualified name."""
    tree = ast.parse((root / rel).read_text(), filename=rel)
    limit = limit_for(rel)

    def walk(node: ast.AST, prefix: str) -> Iterator[Function]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                end = child.end_lineno or child.lineno
                yield Function(f"{rel}::{name}", end - child.lineno + 1, limit)
                yield from walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def load_exceptions(path: Path) -> dict[str, str]:
    """function key -> reason; a missing file is an empty list."""
    if not path.is_file():
        return {}
    entries = tomllib.loads(path.read_text()).get("exception", [])
    return {str(e["function"]): str(e.get("reason", "")).strip() for e in entries}


def problems(root: Path, exceptions: dict[str, str]) -> list[str]:
    """Everything wrong, one line each: too long and unlisted, listed without a reason, stale."""
    found: dict[str, Function] = {}
    for rel in source_files(root):
        for fn in functions_in(root, rel):
            found.setdefault(fn.key, fn)
    out = []
    for fn in found.values():
        if fn.lines > fn.limit and fn.key not in exceptions:
            out.append(f"{fn.key}: {fn.lines} lines (limit {fn.limit})")
    for key, reason in exceptions.items():
        listed = found.get(key)
        if listed is None:
            out.append(f"{key}: stale exception (no such function): remove it")
        elif listed.lines <= listed.limit:
            out.append(f"{key}: stale exception ({listed.lines} lines, limit {listed.limit}): "
                       "remove it")
        elif not reason:
            out.append(f"{key}: exception without a reason")
    return sorted(out)


def longest(root: Path, n: int) -> list[Function]:
    every = [fn for rel in source_files(root) for fn in functions_in(root, rel)]
    return sorted(every, key=lambda f: (-f.lines, f.key))[:n]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=REPO)
    parser.add_argument("--exceptions", type=Path, default=None)
    parser.add_argument("--top", type=int, default=0, help="also print the N longest functions")
    args = parser.parse_args(argv)
    exceptions_path = args.exceptions or args.root / "scripts" / "function_length_exceptions.toml"
    exceptions = load_exceptions(exceptions_path)
    for fn in longest(args.root, args.top):
        print(f"{fn.lines:5d}  (limit {fn.limit:3d})  {fn.key}")
    found = problems(args.root, exceptions)
    if found:
        print(f"function length: {len(found)} problem(s) "
              f"(split the function, or list it in {exceptions_path.name} with a reason):")
        print("\n".join(f"  {p}" for p in found))
        return 1
    print(f"function length: ok ({len(exceptions)} listed exception(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
