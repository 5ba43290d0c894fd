"""`pdctl db ...` and `pdctl history ...` against a real database (both backends)."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from controller.cli import app
from controller.cli.history_cmd import parse_since
from controller.clock import WallClock
from controller.store import Store, migrate
from tests.store.factories import sample_window

runner = CliRunner()


def _pdctl(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_db_upgrade_and_current_from_any_directory(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no alembic.ini or migrations/ here
    code, out, err = _pdctl("db", "current", "--url", db_url)
    if db_url.startswith("sqlite"):  # no file yet, and looking does not create one
        assert code == 1 and "no database at" in err
        assert not Path(db_url.removeprefix("sqlite:///")).exists()
    else:
        assert code == 1 and "needs `pdctl db upgrade`" in out
    code, out, err = _pdctl("db", "upgrade", "--url", db_url)
    assert code == 0, err
    head = migrate.head_revision()
    assert f"empty -> {head}" in out
    code, out, _ = _pdctl("db", "current", "--url", db_url)
    assert code == 0 and f"revision {head}" in out and "up to date" in out
    code, out, _ = _pdctl("db", "downgrade", "base", "--url", db_url)
    assert code == 0 and "now at base" in out


def test_a_database_from_a_newer_release_is_said_to_be_one(db_url: str) -> None:
    """An old release on an upgraded database was told "run `pdctl db upgrade`", which
    failed ("Can't locate revision"); `pdctl run` on SQLite ended in an alembic traceback."""
    from controller.store import StoreError

    with Store(db_url) as store:
        store.upgrade()
        with store.engine.begin() as conn:
            conn.exec_driver_sql("UPDATE alembic_version SET version_num = '0099'")
        with pytest.raises(StoreError, match="newer than this release"):
            store.require_schema()
        with pytest.raises(StoreError, match="newer than this release"):
            store.upgrade_embedded()  # what `pdctl run` does on SQLite
    code, out, _ = _pdctl("db", "current", "--url", db_url)
    assert code == 1 and "revision 0099" in out and "newer than this release" in out
    assert "pdctl db upgrade" not in out
    code, _, err = _pdctl("db", "upgrade", "--url", db_url)
    assert code == 3 and "newer than this release" in err


def test_the_embedded_store_names_a_file_that_is_not_a_database(tmp_path: Path) -> None:
    from controller.store import StoreUnavailable

    text = tmp_path / "notes.db"
    text.write_text("not a database\n" * 100)
    for url in (f"sqlite:///{text}", f"sqlite:///{tmp_path / 'no-such-dir' / 'pd.db'}"):
        with Store(url) as store, pytest.raises(StoreUnavailable, match="cannot open"):
            store.upgrade_embedded()


def test_bad_urls_and_revisions_are_one_line_errors(tmp_path: Path) -> None:
    """Exit 2 and a reason, not a traceback (a password in the URL is not echoed)."""
    db = f"sqlite:///{tmp_path / 'pd.db'}"
    for args, reason in (
        (("db", "upgrade", "--url", db, "--revision", "9999"), "Can't locate revision"),
        (("db", "downgrade", "zzz", "--url", db), "Can't locate revision"),
        (("db", "upgrade", "--url", "sqlite:///"), "in-memory SQLite"),
        (("db", "current", "--url", "mysql://pdc:hunter2@db/pdc"), "sqlite or postgresql"),
        (("history", "policies", "--url", "pdc:hunter2@db"), "not a database URL"),
        # the retention comes from --config even when --url names the store
        (("db", "compact", "--url", db, "--config", str(tmp_path / "no.toml")),
         "config file not found"),
    ):
        code, out, err = _pdctl(*args)
        assert code == 2 and reason in err and "Traceback" not in err + out, (args, err)
        assert "hunter2" not in err
        if args[:2] == ("db", "upgrade") and args[3] == db:  # the first: migrate for the rest
            assert not (tmp_path / "pd.db").exists()  # refused before connecting
            assert _pdctl("db", "upgrade", "--url", db)[0] == 0


def test_reading_commands_do_not_create_a_database(tmp_path: Path) -> None:
    """A wrong --config or working directory must not leave an empty pd-controller.db
    behind and then report it as unmigrated."""
    db = tmp_path / "nowhere.db"
    for args in (("history", "policies"), ("status",), ("pause",), ("db", "compact")):
        code, _, err = _pdctl(*args, "--url", f"sqlite:///{db}")
        assert code == 3 and f"no database at {db}" in err, (args, err)
    assert not db.exists()


def test_db_compact_keeps_the_newest_windows_whatever_the_age(tmp_path: Path) -> None:
    """--older-than-days 0 while the daemon may be fitting on the newest windows: twice
    [controller] training_windows of them stay."""
    db = tmp_path / "pd.db"
    assert _pdctl("db", "upgrade", "--url", f"sqlite:///{db}")[0] == 0
    rng = random.Random(5)
    old = WallClock().now() - 86_400.0
    with Store(f"sqlite:///{db}") as store:
        ids = [store.add_window(sample_window(rng, old + 60 * i, n_routers=1, cells=2))
               for i in range(7)]
    cfg = tmp_path / "pd.toml"
    cfg.write_text("[controller]\ntraining_windows = 2\n")
    code, out, err = _pdctl("db", "compact", "--url", f"sqlite:///{db}", "--config", str(cfg),
                            "--older-than-days", "0")
    assert code == 0, err
    assert "deleted 3 window(s)" in out and "the newest 4 are always kept" in out
    with Store(f"sqlite:///{db}") as store:
        assert [w.id for w in store.windows()] == ids[3:]


def test_db_upgrade_reads_the_url_from_a_config_file(tmp_path: Path) -> None:
    db = tmp_path / "from-config.db"
    cfg = tmp_path / "pd.toml"
    cfg.write_text(f'[store]\nurl = "sqlite:///{db}"\n')
    code, out, err = _pdctl("db", "upgrade", "--config", str(cfg))
    assert code == 0, err
    assert db.is_file() and str(db) in out


def test_history_lists_what_the_store_holds(migrated_url: str) -> None:
    now = WallClock().utcnow()
    with Store(migrated_url) as store:
        old = now - timedelta(hours=3)
        store.add_policy(1, "aa" * 32, '{"k": 1}', "approved", "bootstrap", at=old)
        store.add_policy(2, "bb" * 32, '{"k": 2}', "candidate", "drift in io_ratio", at=now)
        store.mark_promoted(1, at=old + timedelta(minutes=2))
        wid = store.add_window(sample_window(random.Random(5), now.timestamp() - 30))
        store.add_drift_event("workload", 0.42, 0.2, [wid], {"axis": "io_ratio"}, at=now)
        store.add_calibration([wid], {"ttft_mape": 0.07}, 0.91, 0.88, 2, at=now)
        store.add_push("router-1", 1, "applied", 0.0042, at=now)
        store.add_request("recalibrate", {"force": True}, who="carol", reason="new model", at=now)

    code, out, err = _pdctl("history", "policies", "--url", migrated_url, "--json")
    assert code == 0, err
    listed = json.loads(out)
    assert [p["version"] for p in listed] == [1, 2]
    assert listed[1]["body"] == {"k": 2} and listed[1]["reason"] == "drift in io_ratio"
    assert datetime.fromisoformat(listed[0]["created_at"]) == old
    assert datetime.fromisoformat(listed[0]["promoted_at"]) == old + timedelta(minutes=2)
    assert listed[1]["promoted_at"] is None

    code, out, _ = _pdctl("history", "policies", "--url", migrated_url, "--json", "--since", "-1h")
    assert [p["version"] for p in json.loads(out)] == [2]
    code, out, _ = _pdctl("history", "policies", "--url", migrated_url, "--json", "-n", "1")
    assert [p["version"] for p in json.loads(out)] == [2]

    code, out, _ = _pdctl("history", "windows", "--url", migrated_url, "--json")
    (window,) = json.loads(out)
    assert window["id"] == wid and len(window["outcomes"]) == 4 * 2 * 100

    for kind, key, value in [
        ("drift", "details", {"axis": "io_ratio"}),
        ("calibrations", "heldout_error", {"ttft_mape": 0.07}),
        ("pushes", "router_id", "router-1"),
        ("requests", "who", "carol"),
    ]:
        code, out, err = _pdctl("history", kind, "--url", migrated_url, "--json")
        assert code == 0, err
        (item,) = json.loads(out)
        assert item[key] == value

    for kind in ("windows", "policies", "calibrations", "drift", "pushes", "requests",
                 "recommendations"):
        code, out, err = _pdctl("history", kind, "--url", migrated_url)
        assert code == 0, err
        assert "(0)" in out if kind == "recommendations" else "(1)" in out or "(2)" in out
    assert "drift in io_ratio" in _pdctl("history", "policies", "--url", migrated_url)[1]


def test_history_calibrations_show_a_refused_candidate_kept_without_a_version(
        migrated_url: str) -> None:
    with Store(migrated_url) as store:
        store.add_policy(1, "aa" * 32, '{"k": 1}', "approved", "bootstrap")
        store.add_calibration([], {}, 0.9, 0.88, 1)
        store.add_calibration([], {}, 0.8, 0.88, None, {"approved": False},
                              candidate=('{"k": 2}', "bb" * 32))
        store.add_calibration([], {}, 0.8, 0.88, None, {"dry_run": True})
    code, out, err = _pdctl("history", "calibrations", "--url", migrated_url, "--json")
    assert code == 0, err
    listed = json.loads(out)
    assert [(c["policy_version"], c["candidate"], c["candidate_checksum"]) for c in listed] \
        == [(1, None, None), (None, {"k": 2}, "bb" * 32), (None, None, None)]
    code, out, err = _pdctl("history", "calibrations", "--url", migrated_url)
    assert code == 0, err
    assert out.count("refused, kept") == 1


def test_history_windows_are_read_and_printed_a_chunk_at_a_time(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """5,000 windows as one JSON document took 7.3 GB (benchmarks/history_windows_memory.py):
    every window was read, then the whole document built, before a byte was printed."""
    from controller.cli import history_cmd
    from controller.store.repository import Tx

    now = WallClock().utcnow().timestamp()
    rng = random.Random(11)
    with Store(migrated_url) as store:
        ids = [store.add_window(sample_window(rng, now - 30 * (7 - i))) for i in range(7)]
    reads: list[int] = []
    by_ids = Tx.windows_by_ids

    def counted(tx: Tx, wanted: list[int]) -> list[object]:
        reads.append(len(wanted))
        return by_ids(tx, wanted)

    monkeypatch.setattr(history_cmd, "_WINDOW_CHUNK", 2)
    monkeypatch.setattr(Tx, "windows_by_ids", counted)
    code, out, err = _pdctl("history", "windows", "--url", migrated_url, "--json", "-n", "5")
    assert code == 0, err
    listed = json.loads(out)
    assert [w["id"] for w in listed] == ids[2:]  # the newest five, oldest first
    assert reads == [2, 2, 1]
    assert out == json.dumps(listed, indent=2) + "\n"  # the same text as one json.dumps
    code, out, _ = _pdctl("history", "windows", "--url", migrated_url, "--json",
                          "--since", "2100-01-01T00:00:00Z")
    assert (code, out) == (0, "[]\n")
    code, out, _ = _pdctl("history", "windows", "--url", migrated_url, "-n", "3")
    assert code == 0 and "windows (3)" in out
    assert all(f"│ {i} " in out for i in ids[4:]) and f"│ {ids[3]} " not in out


def test_history_recommendations(migrated_url: str) -> None:
    now = WallClock().utcnow()
    body = {"prefill": {"workers": 3, "explanation": ["p99 TTFT binds at 4.1 req/s"]},
            "decode": {"workers": 5}, "headroom": 0.2}
    with Store(migrated_url) as store:
        old = store.add_recommendation(
            window_ids=[1, 2], workers=(2, 4), current=(2, 4), binding=("p99 TTFT", "p99 TPOT"),
            utilisation=(0.55, 0.61), body={}, at=now - timedelta(hours=2))
        new = store.add_recommendation(
            window_ids=[7, 8, 9], workers=(3, 5), current=(2, 5),
            binding=("p99 TTFT", "KV cache"), utilisation=(0.734, 0.802), body=body, at=now)
        store.mark_recommendation_applied(old, at=now - timedelta(hours=1))

    code, out, err = _pdctl("history", "recommendations", "--url", migrated_url, "--json")
    assert code == 0, err
    listed = json.loads(out)
    assert [r["id"] for r in listed] == [old, new]
    assert listed[1]["body"] == body and listed[1]["window_ids"] == [7, 8, 9]
    assert (listed[1]["prefill_workers"], listed[1]["current_prefill"]) == (3, 2)
    assert listed[1]["applied_at"] is None
    assert datetime.fromisoformat(listed[0]["applied_at"]) == now - timedelta(hours=1)

    code, out, _ = _pdctl("history", "recommendations", "--url", migrated_url, "--json",
                          "--since", "-30m")
    assert [r["id"] for r in json.loads(out)] == [new]
    code, out, _ = _pdctl("history", "recommendations", "--url", migrated_url, "-n", "1")
    assert code == 0
    assert "capacity recommendations (1)" in out
    row = next(line for line in out.splitlines() if line.strip().startswith(f"│ {new} "))
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    # prefill changes (2 -> 3) and says so; decode stays at 5.
    assert cells[2:9] == ["7..9 (3)", "3 (now 2)", "p99 TTFT", "0.73", "5", "KV cache", "0.80"]
    assert cells[9] == "-"  # not reached yet


def test_history_on_an_unmigrated_database_says_what_to_do(db_url: str) -> None:
    code, _, err = _pdctl("history", "windows", "--url", db_url)
    assert code == 3 and "pdctl db upgrade" in err


def test_parse_since() -> None:
    now = datetime(2027, 1, 15, 12, 0, tzinfo=UTC)
    assert parse_since("-1h", now) == now - timedelta(hours=1)
    assert parse_since("30m", now) == now - timedelta(minutes=30)
    assert parse_since("-1.5d", now) == now - timedelta(hours=36)
    assert parse_since("-1w", now) == now - timedelta(days=7)
    assert parse_since("2027-01-01T00:00:00Z", now) == datetime(2027, 1, 1, tzinfo=UTC)
    assert parse_since("2027-01-01 06:00", now) == datetime(2027, 1, 1, 6, tzinfo=UTC)
    with pytest.raises(ValueError, match="expected an ISO time"):
        parse_since("yesterday", now)
    for age in ("-1000000d", "-99999999999d", "-200000w"):  # OverflowError tracebacks before
        with pytest.raises(ValueError, match="beyond the calendar"):
            parse_since(age, now)


def test_a_bad_since_is_bad_input_wherever_the_store_is(tmp_path: Path) -> None:
    """Exit 2 naming --since, whether or not the database exists (not exit 3 for a typo
    on a machine without the store)."""
    missing = f"sqlite:///{tmp_path / 'nowhere.db'}"
    code, _, err = _pdctl("history", "pushes", "--url", missing, "--since", "yesterday")
    assert code == 2 and "--since 'yesterday'" in err, err
    code, _, err = _pdctl("history", "windows", "--url", missing, "--since=-1000000d")
    assert code == 2 and "beyond the calendar" in err, err
    assert not (tmp_path / "nowhere.db").exists()
