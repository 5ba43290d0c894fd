"""An installed package migrates: the wheel carries ``migrations/`` as ``controller/_migrations``.

The wheel is built from a copy of the sources (the checkout is left as it is), with this
environment's setuptools and no index (no network), and installed without dependencies into
a fresh virtual environment whose path also holds this environment's site-packages (for the
dependencies only: a directory named by a ``.pth`` line is not scanned for ``.pth`` files, so
the checkout's editable install stays out). ``pdctl db upgrade`` of that environment then
upgrades an empty SQLite file, from a directory outside the checkout.
"""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from controller.store import migrate

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("controller", "migrations", "pyproject.toml", "setup.py", "MANIFEST.in",
           "README.md", "LICENSE", "NOTICE")


def run(*argv: str | Path, cwd: Path) -> str:
    done = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, f"{argv}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def build_wheel(tmp: Path) -> Path:
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
        "--no-index", "-q", "-w", tmp / "dist", src, cwd=tmp)
    (wheel,) = (tmp / "dist").glob("pd_controller-*.whl")
    return wheel


def fresh_venv(tmp: Path) -> Path:
    venv = tmp / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp)
    python = venv / "bin" / "python"
    purelib = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                  cwd=tmp).strip()
    (Path(purelib) / "project_dependencies.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n")
    return venv


@pytest.mark.slow
def test_the_installed_pdctl_upgrades_an_empty_sqlite_file(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    venv = fresh_venv(tmp_path)
    python = venv / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
        "-q", wheel, cwd=tmp_path)

    where = run(python, "-c", "import controller.store.migrate as m; print(m.MIGRATIONS_DIR)",
                cwd=tmp_path).strip()
    assert Path(where).is_relative_to(venv), where  # the wheel's copy, not the checkout's
    assert Path(where).name == "_migrations"

    db = tmp_path / "empty.db"
    db.touch()
    out = run(venv / "bin" / "pdctl", "db", "upgrade", "--url", f"sqlite:///{db}", cwd=tmp_path)
    with sqlite3.connect(db) as conn:
        (version,) = conn.execute("SELECT version_num FROM alembic_version").fetchone()
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert version == migrate.head_revision(), out
    assert {"policies", "windows"} <= tables, tables
