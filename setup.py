"""Build step: the top-level ``migrations/`` goes into the wheel as ``controller/_migrations``.

Everything else about the package is declared in ``pyproject.toml``. The migrations stay a
data directory inside the package (Alembic loads its scripts by path), never a top-level
package named ``migrations``. An editable install skips the copy: ``controller.store.migrate``
then reads ``migrations/`` from the checkout.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


class BuildPyWithMigrations(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib) / "controller" / "_migrations"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(MIGRATIONS, target,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


setup(cmdclass={"build_py": BuildPyWithMigrations})
