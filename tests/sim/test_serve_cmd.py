"""``pdctl sim serve --workers-only --port-base N --write-config FILE`` as real processes: the
documented port layout, a clear error on a taken port, configs that pass ``pdctl config
check`` (and the router's own loader), and a real ``pdctl run`` that records windows."""

from __future__ import annotations

import socket
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import httpx
import pytest

from controller.store import Store, StoreUnavailable
from controller.tokenize import load_tokenizer
from tests.support.processes import (
    PDCTL,
    REPO,
    free_port_base,
    port_free,
    sim_serve,
    start_daemon,
    stop_daemon,
    wait_for,
    write_scenario,
)

pytestmark = pytest.mark.integration


def _scenario(tmp_path: Path) -> Path:
    return write_scenario(tmp_path / "s.toml", "serve-test", 5,
                          extra="[controller]\ninterval_s = 2\n")


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_workers_only_fixed_ports_and_configs(tmp_path: Path) -> None:
    scenario = _scenario(tmp_path)
    base = free_port_base()
    cfg = tmp_path / "conf" / "pdctl.toml"
    with sim_serve(scenario, "--workers-only", "--port-base", str(base),
                   "--write-config", str(cfg)) as (addresses, _):
        ports = {w["name"]: int(w["url"].rsplit(":", 1)[1]) for w in addresses["workers"]}
        assert ports == {"prefill-0": base + 200, "decode-0": base + 300,
                         "decode-1": base + 301}
        assert addresses["routers"] == [] and not _listening(base) and not _listening(base + 100)
        check = subprocess.run([*PDCTL, "config", "check", "--config", str(cfg)], cwd=REPO,
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stderr
        daemon = tomllib.loads(cfg.read_text())
        assert daemon["prefill_pool"]["nodes"] == [f"127.0.0.1:{base + 200}"]
        assert daemon["decode_pool"]["nodes"] == [f"127.0.0.1:{base + 300}",
                                                  f"127.0.0.1:{base + 301}"]
        assert daemon["routers"] == {"targets": [f"127.0.0.1:{base + 100}"],
                                     "metrics_targets": [f"127.0.0.1:{base}"]}
        assert daemon["store"]["url"] == f"sqlite:///{cfg.with_suffix('.db')}"
        assert daemon["controller"]["interval_s"] == 2
        router_path = Path(addresses["configs"]["router"])
        assert router_path == cfg.with_name("pdctl-router.toml")
        _check_router_config(tomllib.loads(router_path.read_text()), addresses, base)
        # the written URLs are the protocol endpoints: a prefill leg answers its own port
        r = httpx.post(f"http://127.0.0.1:{base + 200}/v1/completions", timeout=10, json={
            "model": addresses["model"], "prompt": "hello " * 50, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}})
        assert r.status_code == 200
        assert r.json()["kv_transfer_params"]["remote_port"] == base + 200


def _check_router_config(doc: dict[str, Any], addresses: dict[str, Any], base: int) -> None:
    urls = {w["role"]: [] for w in addresses["workers"]}
    for w in addresses["workers"]:
        urls[w["role"]].append(w["url"])
    assert doc["instances"]["prefill"] == urls["prefill"]
    assert doc["instances"]["decode"] == urls["decode"]
    assert doc["http"]["listen"] == f"127.0.0.1:{base}"
    assert doc["grpc"]["listen"] == f"127.0.0.1:{base + 100}"
    assert doc["model"]["names"] == [addresses["model"]]
    assert load_tokenizer(doc["model"]["tokenizer"]).has_chat_template
    try:  # the router's own loader, where this tree has it
        from controller.router.config import parse_router_config  # type: ignore[import-not-found]
    except ImportError:
        return
    parse_router_config(doc)


def test_a_taken_port_is_a_clear_error(tmp_path: Path) -> None:
    scenario = _scenario(tmp_path)
    base = free_port_base()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", base + 301))
        holder.listen()
        run = subprocess.run([*PDCTL, "sim", "serve", str(scenario), "--workers-only",
                              "--port-base", str(base)], cwd=REPO, capture_output=True,
                             text=True, timeout=60)
    assert run.returncode == 2
    assert f"127.0.0.1:{base + 301}" in run.stderr and "decode-1" in run.stderr
    assert "--port-base" in run.stderr
    assert port_free(base + 200) and port_free(base + 300)  # what it had opened is closed again


@pytest.mark.slow
def test_pdctl_run_on_the_written_config_records_windows(tmp_path: Path) -> None:
    scenario = _scenario(tmp_path)
    base = free_port_base()
    cfg = tmp_path / "pdctl.toml"
    log = tmp_path / "run.log"
    with sim_serve(scenario, "--port-base", str(base), "--write-config", str(cfg)) as (
            addresses, _):
        assert [r["grpc"] for r in addresses["routers"]] == [f"127.0.0.1:{base + 100}"]
        proc = start_daemon(cfg, log)
        try:
            store = Store(f"sqlite:///{cfg.with_suffix('.db')}")

            def three() -> list[Any] | None:
                try:  # the daemon creates the schema when it starts
                    got = store.windows()
                except StoreUnavailable:
                    return None
                return got if len(got) >= 3 else None

            windows = wait_for("3 windows in the written store", three, 90, log)
            want = {f"127.0.0.1:{p}" for p in (base, base + 200, base + 300, base + 301)}
            assert any(want <= set(w.window.answered) for w in windows), [
                w.window.answered for w in windows]
            metrics = httpx.get(f"http://127.0.0.1:{base + 400}/metrics", timeout=5)
            assert metrics.status_code == 200 and "pdctl_" in metrics.text
        finally:
            assert stop_daemon(proc, 20) == 0


def test_a_missing_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    scenario = _scenario(tmp_path)
    run = subprocess.run([*PDCTL, "sim", "serve", str(scenario), "--workers-only",
                          "--tokenizer", str(tmp_path / "nowhere")], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "no tokenizer.json" in run.stderr and str(tmp_path / "nowhere") in run.stderr
