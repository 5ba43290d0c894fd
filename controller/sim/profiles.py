"""Worker profiles: the step-time model's coefficients and the KV geometry, as data.

A profile is a JSON file (built-in ones live in ``controller/sim/profiles/``; any path works
too). The step time follows ``docs/simulator.md`` ("Engines")::

    T_step = T_fixed + max(F, a + b * N_new) + c_dec * sum(decode ctx)
             + c_pf * sum(q * (k + q / 2)) + T_comm(N_new)

with ``N_new`` = decode requests in the step + new prefill tokens in the step.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from controller.errors import ConfigError

BUILTIN_DIR = Path(__file__).with_name("profiles")


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    model_name: str
    t_fixed_ms: float
    floor_ms: float
    linear_a_ms: float
    linear_b_ms_per_token: float
    c_dec_ns_per_ctx_token: float
    c_pf_ns_per_qk_pair: float
    kv_bytes_per_token: int
    num_gpu_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_model_len: int = 131072
    t_comm_ms: float = 0.0
    comm_ms_per_token: float = 0.0
    tensor_parallel: int = 1
    gpu: str = ""
    source: str = ""

    # Coefficients in seconds, precomputed for the hot path.
    @property
    def fixed_s(self) -> float:
        return (self.t_fixed_ms + self.t_comm_ms) * 1e-3

    @property
    def floor_s(self) -> float:
        return self.floor_ms * 1e-3

    @property
    def a_s(self) -> float:
        return self.linear_a_ms * 1e-3

    @property
    def b_s(self) -> float:
        return (self.linear_b_ms_per_token + self.comm_ms_per_token) * 1e-3

    @property
    def c_dec_s(self) -> float:
        return self.c_dec_ns_per_ctx_token * 1e-9

    @property
    def c_pf_s(self) -> float:
        return self.c_pf_ns_per_qk_pair * 1e-9

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    def linear_ms(self, n_new: int) -> float:
        """Whole-model linear-layer time (the part Vidur's mlp.csv measures)."""
        return max(self.floor_ms, self.linear_a_ms + self.linear_b_ms_per_token * n_new)

    def step_time_s(self, n_new: int, decode_ctx_sum: float, prefill_pairs: float) -> float:
        """One engine iteration. ``prefill_pairs`` = sum of q * (k + q / 2) over chunks."""
        lin = self.a_s + self.b_s * n_new
        if lin < self.floor_s:
            lin = self.floor_s
        return self.fixed_s + lin + self.c_dec_s * decode_ctx_sum + self.c_pf_s * prefill_pairs

    def prefill_time_s(self, prompt_tokens: int) -> float:
        """A lone prefill of an empty-cache prompt in one step (no chunking)."""
        q = prompt_tokens
        return self.step_time_s(q, 0.0, q * (q / 2))

    def decode_step_s(self, batch: int, ctx: int) -> float:
        return self.step_time_s(batch, float(batch * ctx), 0.0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _from_dict(data: dict[str, Any], where: str) -> Profile:
    known = {f.name for f in fields(Profile)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"profile {where}: unknown key(s) {', '.join(unknown)}")
    try:
        prof = Profile(**data)
    except TypeError as e:
        raise ConfigError(f"profile {where}: {e}") from None
    for key in ("t_fixed_ms", "floor_ms", "linear_b_ms_per_token", "c_dec_ns_per_ctx_token",
                "c_pf_ns_per_qk_pair", "linear_a_ms", "t_comm_ms", "comm_ms_per_token"):
        if not float(getattr(prof, key)) >= 0:
            raise ConfigError(f"profile {where}: {key} must be >= 0")
    for key in ("kv_bytes_per_token", "num_gpu_blocks", "block_size", "max_num_seqs",
                "max_model_len"):
        if int(getattr(prof, key)) <= 0:
            raise ConfigError(f"profile {where}: {key} must be > 0")
    return prof


def builtin_profiles() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.json"))


def load_profile(name_or_path: str | Path) -> Profile:
    """A built-in profile by name, or a JSON file by path."""
    path = Path(name_or_path)
    if path.suffix != ".json":
        path = BUILTIN_DIR / f"{name_or_path}.json"
        if not path.is_file():
            raise ConfigError(
                f"unknown profile {name_or_path!r}: built-in profiles are "
                f"{', '.join(builtin_profiles())} (or give a path to a .json file)"
            )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read profile {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"profile {path}: expected a JSON object")
    return _from_dict(data, str(path))
