"""Committed results cannot go stale: each records a fingerprint of the code and data that
produced it (``controller.bench.fingerprint``), and a result whose fingerprint differs from
the current code fails here, naming the command that regenerates it."""

from __future__ import annotations

import json
from pathlib import Path

from controller.bench.fingerprint import (
    FileReads,
    Staleness,
    changed_during_run,
    current_fingerprint,
    imported_modules,
    package_digests,
    source_digest,
    stale_results,
)

ROOT = Path(__file__).resolve().parents[2]
REGENERATE = ".venv/bin/python benchmarks/eval_all.py --jobs 2"

MODULE = '''"""A module."""

def f(x):
    """Twice x."""
    return 2 * x  # doubled
'''


def committed_results() -> list[Path]:
    return sorted(ROOT.glob("results/**/summary.json"))


def test_comments_docstrings_and_layout_do_not_change_a_modules_digest() -> None:
    same = ('"""Another docstring, longer."""\n\n\n# a comment\ndef f(x):\n'
            '    """Two times x, said otherwise."""\n\n    return 2 * x\n')
    assert source_digest(MODULE) == source_digest(same)
    assert source_digest(MODULE) != source_digest(MODULE.replace("2 * x", "3 * x"))
    # A function that is only a docstring still has a body: not equal to one with code.
    assert source_digest('def g():\n    """Doc."""\n') == source_digest("def g():\n    pass\n")
    assert source_digest("def g():\n    pass\n") != source_digest("def g():\n    return 1\n")


def _repo(tmp_path: Path) -> Path:
    (tmp_path / "controller").mkdir()
    (tmp_path / "controller" / "__init__.py").write_text("")
    (tmp_path / "controller" / "mod.py").write_text(MODULE)
    (tmp_path / "scenarios").mkdir()
    (tmp_path / "scenarios" / "s.toml").write_text("seed = 1\n")
    return tmp_path


def _result(root: Path, fingerprint: object) -> Path:
    out = root / "results" / "x" / "summary.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"scenario": "s", "policies": {}}
    if fingerprint is not None:
        doc["fingerprint"] = fingerprint
    out.write_text(json.dumps(doc))
    return out


def test_a_result_is_stale_exactly_when_its_code_or_data_changed(tmp_path: Path) -> None:
    root = _repo(tmp_path)
    fp = current_fingerprint("regen s", ["scenarios/s.toml"], root,
                             modules=["controller", "controller.mod"])
    assert set(fp["modules"]) == {"controller", "controller.mod"}
    assert set(fp["files"]) == {"scenarios/s.toml"}
    result = _result(root, fp)
    assert stale_results([result], root) == []
    mod = root / "controller" / "mod.py"
    mod.write_text(MODULE.replace("# doubled", "# a new comment").replace("Twice", "Double"))
    assert stale_results([result], root) == []  # a comment or docstring edit
    mod.write_text(MODULE.replace("2 * x", "x + x"))
    [stale] = stale_results([result], root)
    assert (stale.why, stale.what, stale.result) == (
        Staleness.MODULE_CHANGED, "controller.mod", "results/x/summary.json")
    assert stale.line().endswith("regenerate: regen s")
    mod.unlink()
    (root / "scenarios" / "s.toml").write_text("seed = 2\n")
    assert [(s.why, s.what) for s in stale_results([result], root)] == [
        (Staleness.MODULE_GONE, "controller.mod"), (Staleness.FILE_CHANGED, "scenarios/s.toml")]
    assert [s.why for s in stale_results([_result(root, None)], root)] == [
        Staleness.NO_FINGERPRINT]


def test_a_module_edited_while_the_run_ran_is_named(tmp_path: Path) -> None:
    """The fingerprint reads the sources when the run ends; an edit made while it ran would
    be recorded as the code that produced it. ``run_job`` compares with the sources as the
    run started and writes nothing then."""
    root = _repo(tmp_path)
    before = package_digests(root)
    assert set(before) == {"controller", "controller.mod"}
    (root / "controller" / "mod.py").write_text(MODULE.replace("2 * x", "x + x"))
    fp = current_fingerprint("regen", [], root, modules=["controller", "controller.mod"])
    assert changed_during_run(before, fp) == ["controller.mod"]
    assert changed_during_run(package_digests(root), fp) == []


def test_the_runs_file_reads_are_its_data_files_under_the_repository(tmp_path: Path) -> None:
    root = _repo(tmp_path)
    (root / "data.csv").write_text("a\n")
    outside = tmp_path.parent / f"{tmp_path.name}-outside.txt"
    outside.write_text("x")
    try:
        with FileReads(root) as reads:
            (root / "data.csv").read_text()
            meta = root / "pd_controller.egg-info" / "entry_points.txt"
            meta.parent.mkdir()
            meta.write_text("[x]\n")
            meta.read_text()  # an install's metadata, not an input
            (root / "controller" / "mod.py").read_text()  # code: in the modules instead
            (root / "written.txt").write_text("y")  # written, not read
            outside.read_text()
        (root / "scenarios" / "s.toml").read_text()  # after the run
    finally:
        outside.unlink()
    assert reads.paths == {"data.csv"}


def test_the_imported_modules_are_the_packages_own_but_the_checker() -> None:
    """The checker reads results and takes no part in a run's figures: leaving it out lets
    it change without making every result stale."""
    names = imported_modules()
    assert "controller.bench" in names and "controller.bench.fingerprint" not in names
    assert all(n == "controller" or n.startswith("controller.") for n in names)


def test_results_sharing_a_fingerprint_are_each_named_with_their_command(
        tmp_path: Path) -> None:
    """Each distinct fingerprint is compared once; every result that shares it is reported,
    in path order, with its own command."""
    root = _repo(tmp_path)
    fp = current_fingerprint("regen s", ["scenarios/s.toml"], root,
                             modules=["controller", "controller.mod"])
    results = []
    for name, fingerprint in (("a", fp), ("b", None), ("c", {**fp, "command": "regen c"}),
                              ("d", {**fp, "files": {}})):
        out = root / "results" / name / "summary.json"
        out.parent.mkdir(parents=True)
        out.write_text(json.dumps({"policies": {}, **(
            {"fingerprint": fingerprint} if fingerprint else {})}))
        results.append(out)
    assert [s.why for s in stale_results(results, root)] == [Staleness.NO_FINGERPRINT]
    (root / "controller" / "mod.py").write_text(MODULE.replace("2 * x", "x + x"))
    (root / "scenarios" / "s.toml").write_text("seed = 2\n")
    stale = stale_results(results[::-1], root)
    assert [(s.result.split("/")[1], s.why, s.command) for s in stale] == [
        ("a", Staleness.MODULE_CHANGED, "regen s"), ("a", Staleness.FILE_CHANGED, "regen s"),
        ("b", Staleness.NO_FINGERPRINT, ""),
        ("c", Staleness.MODULE_CHANGED, "regen c"), ("c", Staleness.FILE_CHANGED, "regen c"),
        ("d", Staleness.MODULE_CHANGED, "regen s")]


def test_committed_results_are_fresh() -> None:
    results = committed_results()
    assert len(results) >= 120, "results/**/summary.json: the committed results are missing"
    problems = stale_results(results, ROOT)
    assert not problems, (
        f"{len({p.result for p in problems})} committed result(s) no longer match the "
        "code; regenerate them (each line names its command; the evaluation's all at once: "
        f"{REGENERATE}):\n" + "\n".join(p.line() for p in problems[:40]))
