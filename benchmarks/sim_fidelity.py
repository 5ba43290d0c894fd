"""Fidelity of the simulator's step-time model against raw public measurements.

Run from the repository root: ``.venv/bin/python benchmarks/sim_fidelity.py`` (reads the
profiling rows bundled in ``controller/data/perf_profiles``, see the README there). Prints
three tables:

1. Linear-layer time per step, Llama-3-8B on A100 TP1: the profile's ``max(F, a + b*N)`` vs the
   sum of the per-op medians of Vidur's ``mlp.csv`` x 32 layers (target: within 10%).
2. Llama-3.1-8B H100 prefill (one request, empty cache): the profile's whole step vs the BLIS
   fit ``5752.7 us + 17.25 us * L`` (BLIS, ``inference-sim/inference-sim``
   ``coefficients.yaml``, Llama-3.1-8B H100, vLLM 0.8.4) (target: within 20%).
3. Decode step vs batch size: SplitwiseSim's measured TBT (Llama-2-70B, H100, prompt 512) and
   the 8B H100 profile at 512 context tokens, normalised to batch 1 (target: nearly flat up
   to batch ~16, growing after).
"""

from __future__ import annotations

import csv
import statistics
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from controller.data import PERF_PROFILES_DIR  # noqa: E402
from controller.sim.profiles import Profile, load_profile  # noqa: E402

VIDUR_POINTS = (1, 64, 512, 2048, 4096)
BLIS_POINTS = (128, 256, 512, 1024, 2048, 4096)
BATCHES = (1, 8, 16, 32, 64)
LINEAR_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
              "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")


VIDUR_MLP = "vidur/a100_Meta-Llama-3-8B_mlp_tp1.csv"
SPLITWISE_PERF = "splitwise_sim/perf_model_llama2-70b_h100_prompt512.csv"


def perf_profiles_dir() -> Path:
    return PERF_PROFILES_DIR


def vidur_linear_ms(path: Path, layers: int = 32, tp: int = 1) -> dict[int, float]:
    """Whole-model linear-layer time per num_tokens: sum of per-op medians x layers."""
    out: dict[int, float] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            if int(row["num_tensor_parallel_workers"]) != tp:
                continue
            n = int(row["num_tokens"])
            per_layer = 0.0
            for op in LINEAR_OPS:
                v = row.get(f"time_stats.{op}.median", "")
                if v:
                    per_layer += float(v)
            out.setdefault(n, per_layer * layers)
    return out


def vidur_table(profile: Profile, root: Path) -> list[tuple[int, float, float, float]]:
    data = vidur_linear_ms(root / VIDUR_MLP)
    rows = []
    for n in VIDUR_POINTS:
        sim = profile.linear_ms(n)
        rows.append((n, data[n], sim, sim / data[n] - 1.0))
    return rows


def blis_table(profile: Profile) -> list[tuple[int, float, float, float]]:
    rows = []
    for n in BLIS_POINTS:
        blis = (5752.7 + 17.25 * n) / 1000.0
        sim = profile.prefill_time_s(n) * 1000.0
        rows.append((n, blis, sim, sim / blis - 1.0))
    return rows


def splitwise_tbt(root: Path, tp: int, hardware: str = "h100-80gb",
                  prompt: int = 512) -> dict[int, float]:
    groups: dict[int, list[float]] = defaultdict(list)
    with (root / SPLITWISE_PERF).open(newline="") as f:
        for row in csv.DictReader(f):
            if (row["model"] == "llama2-70b" and row["hardware"] == hardware
                    and int(row["tensor_parallel"]) == tp and int(row["prompt_size"]) == prompt):
                groups[int(row["batch_size"])].append(float(row["token_time"]))
    return {b: statistics.median(v) for b, v in groups.items()}


def decode_table(profile: Profile, root: Path) -> dict[str, dict[int, float]]:
    """Step time per batch size, normalised to batch 1."""
    out: dict[str, dict[int, float]] = {}
    for tp in (4, 8):
        tbt = splitwise_tbt(root, tp)
        out[f"SplitwiseSim 70B H100 TP{tp}"] = {b: tbt[b] / tbt[1] for b in BATCHES if b in tbt}
    base = profile.decode_step_s(1, 512)
    out[f"sim {profile.name} ctx 512"] = {b: profile.decode_step_s(b, 512) / base for b in BATCHES}
    return out


def main() -> int:
    root = perf_profiles_dir()
    a100 = load_profile("llama-3.1-8b-a100")
    h100 = load_profile("llama-3.1-8b-h100")
    print("1. Linear layers per step, Llama-3-8B A100 TP1 (ms): Vidur mlp.csv vs sim")
    print(f"{'tokens':>7} {'vidur':>9} {'sim':>9} {'error':>8}")
    for n, ref, sim, err in vidur_table(a100, root):
        print(f"{n:>7} {ref:>9.2f} {sim:>9.2f} {err:>+8.1%}")
    print("\n2. Prefill of one prompt, Llama-3.1-8B H100 (ms): BLIS fit vs sim")
    print(f"{'tokens':>7} {'BLIS':>9} {'sim':>9} {'error':>8}")
    for n, ref, sim, err in blis_table(h100):
        print(f"{n:>7} {ref:>9.2f} {sim:>9.2f} {err:>+8.1%}")
    print("\n3. Decode step time / batch-1 step time")
    print(f"{'source':<34}" + "".join(f"{'B=' + str(b):>8}" for b in BATCHES))
    for name, row in decode_table(h100, root).items():
        print(f"{name:<34}" + "".join(f"{row.get(b, float('nan')):>8.3f}" for b in BATCHES))
    print(f"\nsim absolute decode step, {h100.name}, ctx 512 (ms): "
          + ", ".join(f"B={b}: {h100.decode_step_s(b, 512) * 1e3:.2f}" for b in BATCHES))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
