"""`pdctl plan` against a real SQLite store: from stored simulator windows, by hand, and the
errors an operator can hit."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from controller.cli import app
from tests.support.cli_store import open_store, write_config
from tests.test_capacity_planner import measured, sim_run

runner = CliRunner()


def _config(tmp_path: Path, *, with_windows: bool) -> Path:
    path = write_config(tmp_path, "[capacity]\nheadroom = 0.25\ninterval_s = 600", ttft_s=1.5)
    store = open_store(path)
    if with_windows:
        with store.cycle() as tx:
            for w in measured(sim_run()[0]):
                tx.add_window(w)
    store.close()
    return path


def _plan(*args: str) -> dict[str, object]:
    result = runner.invoke(app, ["plan", "--json", *args])
    assert result.exit_code == 0, result.output
    doc: dict[str, object] = json.loads(result.stdout)
    return doc


def test_plan_from_stored_windows_uses_their_load_and_the_config(tmp_path: Path) -> None:
    config = _config(tmp_path, with_windows=True)
    doc = _plan("--config", str(config))
    demand = doc["demand"]
    assert isinstance(demand, dict)
    assert demand["qps"] > 4.0 and demand["output_tokens"] > 100  # the run's 6 req/s x 128
    assert doc["slo_ttft_s"] == 1.5 and doc["slo_tpot_s"] == 0.05 and doc["headroom"] == 0.25
    prefill, decode = doc["prefill"], doc["decode"]
    assert isinstance(prefill, dict) and isinstance(decode, dict)
    assert prefill["current_workers"] == 1 and decode["current_workers"] == 2
    # a flag overrides one input, the rest still comes from the windows
    more = _plan("--config", str(config), "--qps", str(demand["qps"] * 10))
    more_demand, more_decode = more["demand"], more["decode"]
    assert isinstance(more_demand, dict) and isinstance(more_decode, dict)
    assert more_demand["output_tokens"] == demand["output_tokens"]
    assert more_decode["workers"] > decode["workers"]


def test_plan_prints_what_an_operator_needs(tmp_path: Path) -> None:
    config = _config(tmp_path, with_windows=True)
    result = runner.invoke(app, ["plan", "--config", str(config), "--ttft-slo", "0.8"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "recommendation:" in out and "prefill" in out and "decode" in out
    for what in ("binding", "per worker", "utilisation", "p99 TTFT", "p99 TPOT"):
        assert what in out, what
    assert "SLO p99 TTFT 800.0 ms" in out
    assert "physics: fitted on" in out


def test_no_history_and_no_qps_is_a_clear_error(tmp_path: Path) -> None:
    config = _config(tmp_path, with_windows=False)
    result = runner.invoke(app, ["plan", "--config", str(config)])
    assert result.exit_code == 2
    assert "no windows" in result.stderr and "--qps" in result.stderr
    partial = runner.invoke(app, ["plan", "--config", str(config), "--qps", "5"])
    assert partial.exit_code == 2
    assert "--input-tokens" in partial.stderr


def test_a_zero_slo_names_its_flag(tmp_path: Path) -> None:
    """The help said x>=0 and 0 failed on the planner's own field name (slo_ttft_s)."""
    config = _config(tmp_path, with_windows=True)
    for flag in ("--ttft-slo", "--tpot-slo"):
        result = runner.invoke(app, ["plan", "--config", str(config), flag, "0"])
        assert result.exit_code == 2 and f"{flag} 0: must be > 0" in result.stderr, result.stderr
        assert "slo_" not in result.stderr


def test_a_partial_load_without_a_store_names_the_missing_flag(tmp_path: Path) -> None:
    """With part of the load given by hand, a missing store is a warning and the error is
    the flag still needed (not "store unavailable", and no empty database is created)."""
    db = tmp_path / "none.db"
    result = runner.invoke(app, ["plan", "--url", f"sqlite:///{db}", "--qps", "20"])
    assert result.exit_code == 2 and "--input-tokens" in result.stderr
    assert "warning: no history" in result.stderr and not db.exists()


def test_plan_by_hand_moves_with_the_flags(tmp_path: Path) -> None:
    config = _config(tmp_path, with_windows=False)
    base = ["--config", str(config), "--qps", "20", "--input-tokens", "3000",
            "--output-tokens", "300"]
    doc = _plan(*base)
    longer = _plan(*base[:-1], "1200")
    tighter = _plan(*base, "--ttft-slo", "0.4")
    spare = _plan(*base, "--headroom", "1.0")

    def workers(d: dict[str, object], role: str) -> int:
        rec = d[role]
        assert isinstance(rec, dict)
        return int(rec["workers"])

    assert workers(longer, "decode") > workers(doc, "decode")
    assert workers(tighter, "prefill") > workers(doc, "prefill")
    assert workers(spare, "prefill") >= workers(doc, "prefill")
    assert workers(spare, "decode") > workers(doc, "decode")


def test_unavailable_store_without_a_load_exits_3(tmp_path: Path) -> None:
    result = runner.invoke(app, ["plan", "--url", f"sqlite:///{tmp_path / 'none.db'}"])
    assert result.exit_code == 3 and "no database at" in result.stderr
    assert not (tmp_path / "none.db").exists()


def test_spread_and_arrival_flags_reach_the_plan(tmp_path: Path) -> None:
    config = _config(tmp_path, with_windows=False)
    base = ["--config", str(config), "--qps", "20", "--input-tokens", "3000",
            "--output-tokens", "300", "--ttft-slo", "1.0"]
    doc = _plan(*base, "--prefill-scv", "0.5", "--input-scv", "2", "--append-scv", "0")
    demand = doc["demand"]
    assert isinstance(demand, dict)
    assert (demand["prefill_scv"], demand["input_scv"], demand["append_scv"]) == (0.5, 2.0, 0.0)
    # the same mean rate, arriving in one-second bursts: more prefill workers
    steady, bursty = tmp_path / "steady.txt", tmp_path / "bursty.txt"
    steady.write_text("# arrivals per second\n" + "20\n" * 60)
    bursty.write_text("2\n2\n2\n74\n" * 15)
    flat = _plan(*base, "--arrivals", str(steady))
    spiky = _plan(*base, "--arrivals", str(bursty), "--arrivals-interval", "1")
    flat_d, spiky_d = flat["demand"], spiky["demand"]
    assert isinstance(flat_d, dict) and isinstance(spiky_d, dict)
    assert flat_d["profile_window_s"] == 1.0 and len(spiky_d["rate_profile"]) == 60
    p_flat, p_spiky = flat["prefill"], spiky["prefill"]
    assert isinstance(p_flat, dict) and isinstance(p_spiky, dict)
    assert p_spiky["workers"] > p_flat["workers"]
    bad = tmp_path / "bad.txt"
    bad.write_text("3\nmany\n")
    result = runner.invoke(app, ["plan", *base, "--arrivals", str(bad)])
    assert result.exit_code == 2 and "line 2" in result.output


def test_session_gap_flag_reaches_the_plan(tmp_path: Path) -> None:
    config = _config(tmp_path, with_windows=True)
    base = ("--config", str(config), "--kv-tokens", "200000")
    long_wait = _plan(*base, "--session-gap", "100000")
    short_wait = _plan(*base, "--session-gap", "0.01")
    lw, sw = long_wait["demand_at_shape"], short_wait["demand_at_shape"]
    assert isinstance(lw, dict) and isinstance(sw, dict)
    # the run's sessions on fewer decode workers than observed keep less of their KV when
    # they wait long between turns
    assert lw["decode_local_share"] < sw["decode_local_share"]
    prefill = long_wait["prefill"]
    assert isinstance(prefill, dict)
    assert any("session KV working set" in line for line in prefill["explanation"])
