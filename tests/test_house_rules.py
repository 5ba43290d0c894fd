"""House rules from DESIGN §3 that a linter cannot see."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parents[1] / "controller"
# Reading time anywhere but clock.py breaks virtual-time runs and replays.
TIME_READS = re.compile(
    r"\btime\.(time|monotonic|perf_counter|perf_counter_ns|time_ns|monotonic_ns)\(|"
    r"\bdatetime\.(now|utcnow|today)\(|\bdate\.today\("
)


def test_time_is_read_only_through_clock_py() -> None:
    offenders = []
    for path in ROOT.rglob("*.py"):
        if path.name == "clock.py" or "_proto" in path.parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if TIME_READS.search(line) and "# clock-ok" not in line:
                offenders.append(f"{path.relative_to(ROOT.parent)}:{n}: {line.strip()}")
    assert not offenders, "read time through controller.clock:\n" + "\n".join(offenders)


# A private name is private to its module; another module that needs it gets a public name.
# These belong to the CLI, which a parallel change of issue 40 reworks.
PRIVATE_IMPORT_EXCEPTIONS = {
    ("controller.cli.ops_cmd", "_open_store"),
    ("controller.cli.explain_cmd", "learned_or_exit"),
    ("controller.cli.explain_cmd", "settings_and_store"),
}


def private_imports(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        if "_proto" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "controller")):
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and (node.module, alias.name) not in PRIVATE_IMPORT_EXCEPTIONS:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}: "
                                 f"from {node.module} import {alias.name}")
    return found


def test_no_private_name_is_imported_across_modules() -> None:
    offenders = private_imports(ROOT)
    assert not offenders, "make these names public where they are defined:\n" + "\n".join(
        offenders)


def test_the_private_import_rule_sees_an_offender(tmp_path: Path) -> None:
    pkg = tmp_path / "controller"
    pkg.mkdir()
    (pkg / "a.py").write_text("from controller.b import _hidden, public\n")
    assert private_imports(pkg) == ["controller/a.py:1: from controller.b import _hidden"]
