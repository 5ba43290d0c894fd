"""Config numbers at the edges (issue 39, class 5): every numeric key has a finite, bounded
range; ``inf``, ``nan``, ``1e308``, TOML's ``1e400`` and huge integers are refused with the
key's name, by ``load_settings`` for every key, and by the real ``pdctl config check`` and
``pdctl run`` processes (exit 2, no traceback)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from annotated_types import Le, Lt
from pydantic import BaseModel

from controller.config import Settings, load_settings
from controller.errors import ConfigError
from tests.support.processes import PDCTL, REPO


def _numeric_keys() -> list[tuple[str, str, bool]]:
    """(section, key, is_int) of every number in the config."""
    out = []
    for section, field in Settings.model_fields.items():
        model = field.annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        for key, f in model.model_fields.items():
            text = str(f.annotation)
            if "float" in text or "int" in text:
                out.append((section, key, "float" not in text))
    return out


KEYS = _numeric_keys()


def test_every_number_has_an_upper_bound() -> None:
    assert len(KEYS) > 50
    for section, key, _ in KEYS:
        model = Settings.model_fields[section].annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        f = model.model_fields[key]
        assert any(isinstance(m, Le | Lt) for m in f.metadata), f"{section}.{key} unbounded"


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e308", "1e400", "10" + "0" * 30])
def test_every_number_refuses_the_edges_with_its_name(tmp_path: Path, value: str) -> None:
    for section, key, is_int in KEYS:
        path = tmp_path / "c.toml"
        path.write_text(f"[{section}]\n{key} = {value}\n")
        with pytest.raises(ConfigError) as err:
            load_settings(path)
        assert f"{section}.{key}" in str(err.value), (section, key, str(err.value))
        assert is_int or "finite" in str(err.value) or "less than" in str(err.value) \
            or "greater than" in str(err.value), str(err.value)


EDGES = """\
[controller]
interval_s = 1e400
lease_ttl_s = 1e308
shutdown_timeout_s = inf
[rollout]
push_deadline_s = 1e10
[routers]
targets = ["127.0.0.1:1"]
[store]
url = "sqlite:///{db}"
"""


@pytest.mark.integration
@pytest.mark.parametrize("command", [["config", "check"], ["run", "--config"]])
def test_pdctl_refuses_edge_numbers_naming_each_key(tmp_path: Path, command: list[str]) -> None:
    path = tmp_path / "edges.toml"
    path.write_text(EDGES.format(db=tmp_path / "s.db"))
    done = subprocess.run([*PDCTL, *command, str(path)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert "Traceback" not in out and "OverflowError" not in out, out
    for key in ("controller.interval_s", "controller.lease_ttl_s",
                "controller.shutdown_timeout_s", "rollout.push_deadline_s"):
        assert key in out, out
    assert not (tmp_path / "s.db").exists()  # refused before anything was created
