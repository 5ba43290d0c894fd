"""build_workload: sources, the bundled traces, the params.path override, clear errors."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from controller.data import TRACES_DIR
from controller.errors import ConfigError
from controller.sim.workloads import SOURCES, Workload, WorkloadConfig, WorkloadError
from controller.sim.workloads import build_workload as build_from_package
from controller.sim.workloads.base import TurnSpec, build_workload, max_tokens_for


def write_tiny_mooncake(directory: Path) -> Path:
    traces = directory / "traces"
    traces.mkdir(parents=True)
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 50, "hash_ids": [0, 1, 2]},
        {"timestamp": 3000, "input_length": 1700, "output_length": 60, "hash_ids": [0, 1, 3, 4]},
        {"timestamp": 3000, "input_length": 600, "output_length": 70, "hash_ids": [0, 5]},
    ]
    path = traces / "mooncake_fast25_conversation_trace.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        fh.write("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_every_trace_source_reads_its_bundled_file_by_default() -> None:
    """No environment, no sibling folder: the package's own data is the default."""
    for source in ("mooncake", "azure-conv", "azure-code", "servegen"):
        workload = build_workload(WorkloadConfig(source, params={"max_sessions": 5}))
        sessions = list(workload.sessions(random.Random(0)))
        assert len(sessions) == 5, source
    assert (TRACES_DIR / "mooncake_fast25_conversation_trace.jsonl.gz").is_file()


def test_a_missing_trace_names_the_file(tmp_path: Path) -> None:
    for source in ("mooncake", "azure-conv", "azure-code", "servegen"):
        missing = tmp_path / f"{source}.csv"
        with pytest.raises(WorkloadError, match="file not found") as e:
            build_workload(WorkloadConfig(source, params={"path": str(missing)}))
        assert str(missing) in str(e.value) and "params.path" in str(e.value)


def test_path_param_overrides_the_default_file(tmp_path: Path) -> None:
    path = write_tiny_mooncake(tmp_path)
    workload = build_workload(WorkloadConfig("mooncake", params={"path": str(path)}))
    assert isinstance(workload, Workload)
    sessions = list(workload.sessions(random.Random(0)))
    assert [len(s.turns) for s in sessions] == [2, 1]
    second = sessions[0].turns[1]
    assert second.context_tokens == 1024 and second.new_tokens == 1700 - 1024


@pytest.mark.parametrize("compressed", [False, True])
def test_an_own_azure_trace_is_read_plain_or_gzipped(tmp_path: Path, compressed: bool) -> None:
    text = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
            "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n")
    path = tmp_path / ("own.csv.gz" if compressed else "own.csv")
    path.write_bytes(gzip.compress(text.encode()) if compressed else text.encode())
    workload = build_workload(
        WorkloadConfig("azure-conv", params={"path": str(path), "sessions": "none"})
    )
    turns = [t for s in workload.sessions(random.Random(0)) for t in s.turns]
    assert sorted((t.prompt_tokens, t.output_tokens) for t in turns) == [(374, 44), (396, 109)]


def test_malformed_trace_line_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n{"x": 1}\n'
    )
    with pytest.raises(WorkloadError, match=r"bad\.jsonl:2"):
        build_workload(WorkloadConfig("mooncake", params={"path": str(path)}))


def test_an_unreadable_trace_is_a_workload_error_naming_the_file(tmp_path: Path) -> None:
    """A damaged or cut gzip, bytes that are not UTF-8, a directory, an empty file: each a
    WorkloadError naming the file (a cut gzip's EOFError printed only "Aborted!")."""
    import gzip

    line = b'{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n'
    cut = gzip.compress(line * 50)
    cases = {
        "plain.jsonl.gz": (line, "cannot read the mooncake trace"),
        "cut.jsonl.gz": (cut[: len(cut) // 2], "cannot read the mooncake trace"),
        "latin1.jsonl": (b'{"x": "\xff"}\n', "not UTF-8 text"),
        "empty.jsonl": (b"", "no requests"),
        "blank.jsonl": (b"\n\n", "no requests"),
    }
    for name, (data, said) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(WorkloadError, match=said) as e:
            build_workload(WorkloadConfig("mooncake", params={"path": str(tmp_path / name)}))
        assert name in str(e.value), name
    (tmp_path / "azure.csv").write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\n\xff,1,1\n")
    with pytest.raises(WorkloadError, match=r"azure\.csv: the Azure trace is not UTF-8"):
        build_workload(WorkloadConfig("azure-conv",
                                      params={"path": str(tmp_path / "azure.csv")}))
    with pytest.raises(WorkloadError, match="is a directory"):
        build_workload(WorkloadConfig("mooncake", params={"path": str(tmp_path)}))


def test_a_synthetic_rate_beyond_ten_thousand_per_second_is_refused() -> None:
    with pytest.raises(WorkloadError, match=r"workload\.params\.qps: at most 10000"):
        build_workload(WorkloadConfig("synthetic", params={"qps": 1e9}))


def test_unknown_source_is_an_error_listing_the_choices() -> None:
    with pytest.raises(WorkloadError, match=r"workload\.source.*'sharegpt'.*mooncake"):
        WorkloadConfig("sharegpt")  # type: ignore[arg-type]
    assert set(SOURCES) == {"mooncake", "azure-conv", "azure-code", "servegen", "synthetic"}


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"rate_scale": 0.0}, "rate_scale"),
        ({"rate_scale": -2.0}, "rate_scale"),
        ({"rate_scale": float("nan")}, "rate_scale"),
        ({"time_slice_s": (10.0, 5.0)}, "time_slice_s"),
        ({"time_slice_s": (-1.0, 5.0)}, "time_slice_s"),
        ({"time_slice_s": (1.0,)}, "time_slice_s"),
    ],
)
def test_bad_config_values_name_the_key(kwargs: dict[str, Any], key: str) -> None:
    with pytest.raises(WorkloadError, match=rf"workload\.{key}"):
        WorkloadConfig("synthetic", **kwargs)


@pytest.mark.parametrize(
    ("source", "params", "key"),
    [
        ("mooncake", {"max_session": 3}, "max_session"),
        ("mooncake", {"max_sessions": 0}, "max_sessions"),
        ("mooncake", {"max_tokens": "exact"}, "max_tokens"),
        ("mooncake", {"max_tokens": 0}, "max_tokens"),
        ("mooncake", {"jitter": "yes"}, "jitter"),
        ("azure-conv", {"sessions": "many"}, "sessions"),
        ("azure-code", {"max_prompt_tokens": 1}, "max_prompt_tokens"),
        ("servegen", {"mean_rate_rps": 0}, "mean_rate_rps"),
        ("servegen", {"time_scale": -1.0}, "time_scale"),
    ],
)
def test_bad_source_params_name_the_key(source: str, params: dict[str, Any], key: str) -> None:
    with pytest.raises(WorkloadError, match=rf"workload\.params\.{key}\b"):
        build_workload(WorkloadConfig(source, params=params))  # type: ignore[arg-type]


def test_workload_errors_are_config_errors_and_value_errors() -> None:
    with pytest.raises(ConfigError):
        WorkloadConfig("synthetic", rate_scale=0)
    with pytest.raises(ValueError, match="rate_scale"):
        WorkloadConfig("synthetic", rate_scale=0)


def test_package_and_base_expose_the_same_builder() -> None:
    cfg = WorkloadConfig("synthetic", params={"qps": 2.0, "duration_s": 30.0})
    a = list(build_from_package(cfg).sessions(random.Random(1)))
    assert a == list(build_workload(cfg).sessions(random.Random(1)))


def test_turn_spec_rejects_inconsistent_tokens() -> None:
    with pytest.raises(WorkloadError, match="new_tokens"):
        TurnSpec("s", 2, 0.0, 100, 101, 10, 16, 1.0, 1)
    with pytest.raises(WorkloadError, match="max_tokens"):
        TurnSpec("s", 1, 0.0, 100, 100, 10, 8, 0.0)
    with pytest.raises(WorkloadError, match="turn 1"):
        TurnSpec("s", 1, 0.0, 100, 50, 10, 16, 0.0)
    with pytest.raises(WorkloadError, match="parent_turn"):
        TurnSpec("s", 3, 0.0, 100, 50, 10, 16, 0.0, 3)


def test_max_tokens_rules() -> None:
    assert max_tokens_for(1, "pow2", 2000) == 32
    assert max_tokens_for(33, "pow2", 2000) == 64
    assert max_tokens_for(64, "pow2", 2000) == 64
    assert max_tokens_for(1999, "pow2", 2000) == 2048
    assert max_tokens_for(10, "cap", 2000) == 2000
    assert max_tokens_for(10, 256, 2000) == 256
    assert max_tokens_for(300, 256, 2000) == 300


def sessions_digest(seed: int) -> str:
    digest = hashlib.sha256()
    for source in ("mooncake", "azure-code", "synthetic"):
        workload = build_workload(WorkloadConfig(source, rate_scale=1.5))
        for session in workload.sessions(random.Random(seed)):
            digest.update(repr(session).encode())
    return digest.hexdigest()


@pytest.mark.slow
def test_same_seed_same_sessions_across_processes() -> None:
    from tests.sim.workloads.test_mooncake import real_trace_path

    real_trace_path()
    code = (
        "import sys; from tests.sim.workloads.test_build import sessions_digest as d; print(d(7))"
    )
    other_process = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        cwd=Path(__file__).resolve().parents[3],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.strip()
    here = sessions_digest(7)
    assert here == other_process
    assert here != sessions_digest(8)
