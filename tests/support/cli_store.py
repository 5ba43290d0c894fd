"""The store the CLI tests read: a config naming a SQLite file under the test's directory,
the store upgraded to the newest schema, and a calibration recorded as the daemon records
it (synthetic windows from a known cluster, tests/core/synth.py)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from controller.cli import app
from controller.config import load_settings
from controller.loop.learning import CalibrationOutcome, CoreLearner
from controller.policy import dumps
from controller.store import Store
from tests.core.synth import Mix, Truth, training_windows

ROUTER = "127.0.0.1:1"


def write_config(tmp_path: Path, extra: str = "", *, ttft_s: float = 1.0) -> Path:
    """``tmp_path/pd.toml``: a SQLite store beside it, the SLOs, then ``extra`` sections."""
    path = tmp_path / "pd.toml"
    path.write_text(f"""
[store]
url = "sqlite:///{tmp_path / 'history.db'}"
[slo]
ttft_s = {ttft_s}
tpot_s = 0.05
{extra}
""")
    return path


def upgraded_store(url: str) -> Store:
    """The store at ``url`` at the newest schema (the caller closes it)."""
    store = Store(url)
    store.upgrade()
    return store


def open_store(config: Path) -> Store:
    """The config's store at the newest schema (the caller closes it)."""
    return upgraded_store(load_settings(config).store.url)


def record_calibration(config: Path) -> tuple[int, CalibrationOutcome]:
    """60 training windows, their approved calibration and its policy, desired by
    :data:`ROUTER`, in one transaction as the cycle writes them; the policy's version and
    the outcome."""
    windows = training_windows(Truth(), Mix(), 60, seed=1)
    outcome = CoreLearner(load_settings(config)).calibrate(windows, None, windows[-1].end,
                                                           "test")
    assert outcome.approved
    store = open_store(config)
    try:
        with store.cycle() as tx:
            ids = [tx.add_window(w) for w in windows]
            version = tx.next_version()
            policy = outcome.policy.with_version(version)
            tx.add_policy(version, policy.checksum, dumps(policy), "approved", outcome.reason)
            tx.set_desired(ROUTER, version)
            tx.add_calibration(ids, outcome.heldout_error, outcome.predicted_goodput_new,
                               None, version, {**outcome.details, "approved": True},
                               at=datetime.fromtimestamp(windows[-1].end, tz=UTC))
    finally:
        store.close()
    return version, outcome


def invoke_json(*args: str) -> dict[str, Any]:
    """``pdctl ARGS`` in this process; it must exit 0 and print one JSON document."""
    r = CliRunner().invoke(app, list(args))
    assert r.exit_code == 0, r.output
    doc: dict[str, Any] = json.loads(r.output)
    return doc
