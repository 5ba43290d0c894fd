"""scripts/check_function_length.py: long functions, listed exceptions and stale ones."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "check_function_length", REPO / "scripts" / "check_function_length.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


check = load_check()


def function(name: str, lines: int) -> str:
    body = "".join("    x = 1\n" for _ in range(lines - 1))
    return f"def {name}():\n{body}"


def tree(tmp: Path, files: dict[str, str], exceptions: str = "") -> Path:
    for rel, text in files.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text(text)
    (tmp / "scripts").mkdir(exist_ok=True)
    (tmp / "scripts" / "function_length_exceptions.toml").write_text(exceptions)
    return tmp


def test_the_repository_passes() -> None:
    assert check.main(["--root", str(REPO)]) == 0


def test_limits_depend_on_the_layer(tmp_path: Path) -> None:
    root = tree(tmp_path, {
        "controller/core/a.py": function("pure", 61),
        "controller/cli/b.py": function("entry", 100) + "\n\n" + function("too_long", 101),
        "controller/_proto/c_pb2.py": function("generated", 500),
    })
    assert check.problems(root, {}) == [
        "controller/cli/b.py::too_long: 101 lines (limit 100)",
        "controller/core/a.py::pure: 61 lines (limit 60)",
    ]


def test_methods_and_nested_functions_are_named_and_counted(tmp_path: Path) -> None:
    nested = "class K:\n    def m(self):\n" + "".join("        y = 2\n" for _ in range(60))
    root = tree(tmp_path, {"controller/loop/metrics.py": nested})
    assert check.problems(root, {}) == ["controller/loop/metrics.py::K.m: 61 lines (limit 60)"]


def test_an_exception_needs_a_reason_and_goes_stale(tmp_path: Path) -> None:
    listed = ('[[exception]]\nfunction = "controller/core/a.py::long"\nreason = "why"\n'
              '[[exception]]\nfunction = "controller/core/a.py::short"\nreason = "why"\n'
              '[[exception]]\nfunction = "controller/core/a.py::gone"\nreason = "why"\n'
              '[[exception]]\nfunction = "controller/core/a.py::bare"\n')
    root = tree(tmp_path, {"controller/core/a.py": "\n".join(
        [function("long", 70), function("short", 10), function("bare", 61)])}, listed)
    exceptions = check.load_exceptions(root / "scripts" / "function_length_exceptions.toml")
    assert check.problems(root, exceptions) == [
        "controller/core/a.py::bare: exception without a reason",
        "controller/core/a.py::gone: stale exception (no such function): remove it",
        "controller/core/a.py::short: stale exception (10 lines, limit 60): remove it",
    ]
    assert check.main(["--root", str(root)]) == 1
