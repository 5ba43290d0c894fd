"""The composition root: what `pdctl run` builds from a config, and what it logs."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from controller.config import load_settings
from controller.daemon import Daemon, JsonFormatter
from controller.errors import ConfigError

SECRET = "s3cr3t-bearer-token-do-not-log"


async def test_build_wires_everything_and_never_logs_secrets(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = load_settings(
        store={"url": f"sqlite:///{tmp_path / 'h.db'}"},
        routers={"targets": ["127.0.0.1:1", "127.0.0.1:2"],
                 "metrics_targets": ["127.0.0.1:3", "127.0.0.1:4"]},
        prefill_pool={"nodes": ["127.0.0.1:5"]}, decode_pool={"nodes": ["127.0.0.1:6"]},
        metrics={"listen": "127.0.0.1:0"}, security={"token": SECRET},
        controller={"replica_id": "replica-x", "interval_s": 5.0},
    )
    caplog.set_level(logging.DEBUG)
    daemon = Daemon(settings)
    parts = await daemon.build()
    try:
        assert parts.store.dialect == "sqlite"
        parts.store.require_schema()  # the embedded default migrated itself
        assert parts.cycle.routers == ("127.0.0.1:1", "127.0.0.1:2")
        assert parts.cycle.outcome_names == {"127.0.0.1:1": "127.0.0.1:3",
                                             "127.0.0.1:2": "127.0.0.1:4"}
        assert parts.leadership.holder == "replica-x"
        assert parts.health.stalled_after_s == 3 * 5.0 + 30.0
        assert parts.cycle.planner is not None  # [capacity] enabled by default
        assert parts.cycle.config.capacity_interval_s == settings.capacity.interval_s
        assert parts.server is not None and parts.server.port > 0
        formatter = JsonFormatter()
        lines = [formatter.format(r) for r in caplog.records]
        built = [json.loads(line) for line in lines if '"built"' in line]
        assert built and built[0]["routers"] == 2 and built[0]["holder"] == "replica-x"
        assert all(SECRET not in line for line in lines)
    finally:
        await parts.server.stop()
        await parts.transport.close()
        await parts.source.aclose()
        parts.store.close()


async def test_build_refuses_no_routers_and_sidecar_on_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'h.db'}"
    with pytest.raises(ConfigError, match="targets is empty"):
        await Daemon(load_settings(store={"url": url}, metrics={"enable": False})).build()
    with pytest.raises(ConfigError, match="PostgreSQL"):
        await Daemon(load_settings(
            store={"url": url}, metrics={"enable": False}, routers={"targets": ["127.0.0.1:1"]},
            controller={"sidecar_router": "127.0.0.1:1"})).build()



async def test_capacity_planning_can_be_switched_off(tmp_path: Path) -> None:
    settings = load_settings(
        store={"url": f"sqlite:///{tmp_path / 'h.db'}"}, metrics={"enable": False},
        routers={"targets": ["127.0.0.1:1"]}, capacity={"enabled": False},
    )
    parts = await Daemon(settings).build()
    try:
        assert parts.cycle.planner is None
    finally:
        await parts.transport.close()
        await parts.source.aclose()
        parts.store.close()
