"""The data the repository ships: present, intact (sha256 as documented), small, and the
ServeGen aggregate derivation reproducible from a tarball."""

from __future__ import annotations

import hashlib
import io
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

from controller.data import DATA_DIR, PERF_PROFILES_DIR, TRACES_DIR

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "derive_servegen_aggregate.py"
LIMIT_BYTES = 5 * 1024 * 1024
SHA_LINE = re.compile(r"^([0-9a-f]{64})  (\S+)$")


def documented_digests() -> dict[str, str]:
    """``path relative to controller/data`` -> sha256, from the data README's sha256 block."""
    text = (DATA_DIR / "README.md").read_text(encoding="utf-8")
    return {m.group(2): m.group(1) for line in text.splitlines() if (m := SHA_LINE.match(line))}


def bundled_files() -> list[Path]:
    return sorted(p for p in DATA_DIR.rglob("*") if p.is_file() and p.suffix in (".csv", ".gz"))


def test_every_bundled_file_has_its_documented_sha256() -> None:
    digests = documented_digests()
    files = {str(p.relative_to(DATA_DIR)): p for p in bundled_files()}
    assert set(files) == set(digests), "data README sha256 block and files differ"
    for name, path in files.items():
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digests[name], name
    assert {p.parent for p in files.values()} >= {TRACES_DIR, PERF_PROFILES_DIR / "vidur"}


def test_bundled_data_stays_under_5_mb() -> None:
    assert sum(p.stat().st_size for p in bundled_files()) <= LIMIT_BYTES


def _member(tar: tarfile.TarFile, name: str, text: str) -> None:
    data = text.encode()
    info = tarfile.TarInfo(f"data/reason/tiny/{name}")
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def test_the_derivation_mixes_clients_weighted_by_their_requests(tmp_path: Path) -> None:
    """Two clients; 6 h length windows at 0 and 21,600 s. Window 0 weights: client 1
    (1 + 1) x 600 = 1,200 requests, client 2 0.5 x 600 = 300 (client 2 has no later data)."""
    one = {"0": {"input_tokens": "{10: 0.5, 20: 0.5}", "output_tokens": "{5: 1.0}",
                 "reason_ratio": "{0.5: 1.0}"},
           "21600": {"input_tokens": "{30: 1.0}", "output_tokens": "{7: 1.0}",
                     "reason_ratio": "{0.2: 1.0}"}}
    two = {"0": {"input_tokens": "{100: 1.0}", "output_tokens": "{50: 1.0}",
                 "reason_ratio": "{0.9: 1.0}"}}
    tarball = tmp_path / "tiny.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        _member(tar, "chunk-1-trace.csv", "0,1.0,1,Gamma,1,1\n600,1.0,1,Gamma,1,1\n"
                                          "21600,2.0,1,Gamma,1,1\n")
        _member(tar, "chunk-2-trace.csv", "0,0.5,1,Gamma,1,1\n600,0,0,,0,0\n21600,0,0,,0,0\n")
        _member(tar, "chunk-1-dataset.json", json.dumps(one))
        _member(tar, "chunk-2-dataset.json", json.dumps(two))
    out = subprocess.run([sys.executable, str(SCRIPT), str(tarball)], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    first_window = "20,100,100,5,50,50,0.5000,0.9000,0.9000,0.5800"
    assert out.splitlines() == [
        "window_start_s,total_rate_rps,len_window_start_s,input_p50,input_p90,input_p99,"
        "output_p50,output_p90,output_p99,reason_ratio_p50,reason_ratio_p90,reason_ratio_p99,"
        "reason_ratio_mean",
        f"0,1.5000,0,{first_window}",
        f"600,1.0000,0,{first_window}",
        "21600,2.0000,21600,30,30,30,7,7,7,0.2000,0.2000,0.2000,0.2000",
    ]
