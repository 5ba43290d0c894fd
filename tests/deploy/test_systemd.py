"""deploy/systemd: the unit passes ``systemd-analyze verify`` and ``security`` (exposure <= 2.0).

``verify`` fails when the ExecStart binary does not exist on the checking host, so the test
copies the unit into a temporary directory with ExecStart pointing at this environment's
``pdctl`` (the console script next to the running interpreter); nothing else changes.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from controller.config import load_settings
from tests.conftest import require

SYSTEMD = Path(__file__).parents[2] / "deploy" / "systemd"
UNIT = SYSTEMD / "pd-controller.service"
INSTALLED_PDCTL = "/usr/local/bin/pdctl"
MAX_EXPOSURE = 20  # systemd-analyze's 0-100 scale: exposure 2.0


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    require(
        "systemd-analyze",
        shutil.which("systemd-analyze") is not None,
        "apt-get install systemd",
    )
    return subprocess.run(
        ["systemd-analyze", *args], capture_output=True, text=True, timeout=120, check=False
    )


def local_unit(tmp_path: Path, text: str | None = None) -> Path:
    pdctl = Path(sys.executable).parent / "pdctl"
    require("pdctl console script", pdctl.is_file(), "pip install -e .")
    text = UNIT.read_text() if text is None else text
    assert INSTALLED_PDCTL in text
    path = tmp_path / "pd-controller.service"
    path.write_text(text.replace(INSTALLED_PDCTL, str(pdctl)))
    return path


@pytest.mark.integration
def test_unit_verifies(tmp_path: Path) -> None:
    out = analyze("verify", str(local_unit(tmp_path)))
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.integration
def test_verify_catches_a_missing_binary(tmp_path: Path) -> None:
    # (systemd 252 only warns about an unknown Type=; a missing ExecStart binary is fatal.)
    broken = tmp_path / "pd-controller.service"
    broken.write_text(UNIT.read_text().replace(INSTALLED_PDCTL, str(tmp_path / "no" / "pdctl")))
    out = analyze("verify", str(broken))
    assert out.returncode != 0
    assert "not executable" in out.stdout + out.stderr


@pytest.mark.integration
def test_exposure_is_at_most_2(tmp_path: Path) -> None:
    out = analyze(
        "security", "--offline=yes", f"--threshold={MAX_EXPOSURE}", str(local_unit(tmp_path))
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Overall exposure level" in out.stdout


@pytest.mark.integration
def test_exposure_check_fails_without_hardening(tmp_path: Path) -> None:
    bare = "[Service]\nType=notify\nExecStart=/usr/local/bin/pdctl run --config /x.toml\n"
    out = analyze(
        "security", "--offline=yes", f"--threshold={MAX_EXPOSURE}", str(local_unit(tmp_path, bare))
    )
    assert out.returncode != 0


def test_unit_settings_that_the_daemon_relies_on() -> None:
    settings = _unit_settings(UNIT.read_text())
    assert settings["Type"] == ["notify"]
    assert settings["WatchdogSec"] == ["30s"]
    assert settings["DynamicUser"] == ["yes"]
    assert settings["ProtectSystem"] == ["strict"]
    assert settings["StateDirectory"] == ["pd-controller"]
    exec_start = settings["ExecStart"][0].split()
    assert exec_start[:2] == [INSTALLED_PDCTL, "run"]
    config = Path(exec_start[exec_start.index("--config") + 1])
    assert config.is_absolute()
    assert config.parent.name == settings["ConfigurationDirectory"][0]


def test_the_system_call_filter_refuses_calls_instead_of_killing() -> None:
    """``~@resources`` holds ``mbind``, which numpy's OpenBLAS calls at import: with the
    default action (SIGSYS) the daemon died before its first log line, restarted, and died
    again (a seccomp filter of systemd's @resources set, run by hand, showed it)."""
    settings = _unit_settings(UNIT.read_text())
    denied = [f for f in settings.get("SystemCallFilter", []) if f.startswith("~")]
    assert any("@resources" in f for f in denied)  # still hardened
    assert settings.get("SystemCallErrorNumber") == ["EPERM"]


def test_example_config_loads_and_keeps_its_state_in_the_state_directory() -> None:
    settings = load_settings(SYSTEMD / "pd-controller.toml")
    assert settings.store.url.startswith("sqlite:////var/lib/pd-controller/")


def _unit_settings(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            out.setdefault(key, []).append(value)
    return out


def test_every_file_the_example_config_reads_is_readable_by_the_dynamic_user() -> None:
    """DynamicUser runs the daemon as a transient user: a root-only file under /etc (the
    token, installed 0600) must come in as a systemd credential, and the config file itself
    must be world-readable (its install line said 0640: the daemon could not read it)."""
    unit = UNIT.read_text()
    credentials = dict(c.split(":", 1) for c in _unit_settings(unit).get("LoadCredential", []))
    settings = load_settings(SYSTEMD / "pd-controller.toml")
    here = Path("/run/credentials") / UNIT.name
    sec = settings.security
    secrets = [p for p in (sec.token_file, sec.tls_cert, sec.tls_key, sec.tls_ca) if p]
    assert len(secrets) == 4  # mutual TLS and a token: a token alone reaches loopback only
    for path in secrets:
        assert path.parent == here, path
        assert path.name in credentials, (path, credentials)
        assert Path(credentials[path.name]).is_absolute()
    # The documented install commands: root-only secrets, a world-readable config.
    for text in (unit, (SYSTEMD.parents[1] / "docs" / "operations.md").read_text()):
        installs = [line for line in text.splitlines() if "install " in line
                    and "pd-controller.toml /etc/" in line]
        assert installs and all("-m 0644" in line for line in installs), installs
