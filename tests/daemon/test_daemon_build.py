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
        assert parts.leadership.holder.startswith("replica-x/")
        assert parts.health.stalled_after_s == 3 * 5.0 + 30.0
        assert parts.cycle.planner is not None  # [capacity] enabled by default
        assert parts.cycle.config.capacity_interval_s == settings.capacity.interval_s
        assert parts.server is not None and parts.server.port > 0
        formatter = JsonFormatter()
        lines = [formatter.format(r) for r in caplog.records]
        built = [json.loads(line) for line in lines if '"built"' in line]
        assert built and built[0]["routers"] == 2 and built[0]["holder"] == parts.leadership.holder
        assert all(SECRET not in line for line in lines)
    finally:
        await parts.server.stop()
        await parts.transport.close()
        await parts.source.aclose()
        parts.store.close()


async def test_replicas_given_one_replica_id_do_not_both_lead(tmp_path: Path) -> None:
    """One ConfigMap value for every replica: both renewed one lease (same holder, same
    term) and both passed the fence."""
    settings = load_settings(
        store={"url": f"sqlite:///{tmp_path / 'h.db'}"}, metrics={"enable": False},
        routers={"targets": ["127.0.0.1:1"]}, controller={"replica_id": "shared"},
    )
    first, second = [await Daemon(settings).build() for _ in range(2)]
    try:
        leading = [await p.leadership.ensure() for p in (first, second)]
        assert leading == [True, False]
        with first.store.cycle() as tx:
            assert first.leadership.fence(tx)
        with second.store.cycle() as tx:
            assert not second.leadership.fence(tx)
    finally:
        for p in (first, second):
            await p.transport.close()
            await p.source.aclose()
            p.store.close()


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
