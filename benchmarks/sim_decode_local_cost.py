"""The decode-local cost in the simulator: a decode batch's step time with an append-prefill
co-scheduled, against the published figures (docs/simulator.md, "The decode-local cost").

    .venv/bin/python benchmarks/sim_decode_local_cost.py            # the tables
    .venv/bin/python benchmarks/sim_decode_local_cost.py --json     # one JSON document

The simulator charges one engine step ``T_fixed + max(F, a + b N_new) + c_dec sum(ctx) +
c_pf sum(q (k + q/2))`` (controller/sim/profiles.py, the arithmetic of
controller/sim/engine.py); an append of up to ``max_batch_tokens`` (8192) new tokens runs in
one step with the decodes. Printed:

1. per-step stretch: (step with B decodes at a 2,048-token context and one append of q new
   tokens on a cached context of 2,048) / (the same step without it), q 128-2048, B 1-64,
   and the same over a PPD-style 64-token decode (one such step among 63 inter-token gaps);
2. the published co-batching rows (docs/simulator.md) recomputed from the built-in profiles;
3. the PPD code's own sensitivity classes (batch 64, context 2,048) beside the simulator;
4. the per-token prefill cost against DistServe's profiled OPT-13B on A100 (scaled by
   parameter count).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controller.sim.profiles import Profile, load_profile  # noqa: E402

NEW_TOKENS = (128, 256, 512, 1024, 2048)
BATCHES = (1, 8, 16, 32, 64)
DECODE_CTX = 2048
APPEND_CTX = 2048
PPD_OUTPUT = 64  # the PPD micro-benchmark's decodes generate 64 tokens: 63 gaps

# the published co-batching figures (copied in docs/simulator.md): baseline 32 decodes at 2,048.
LM7_ROWS: tuple[tuple[str, int, int, int, float, float], ...] = (
    # label, q new tokens, k cached tokens, (unused), H100 ms, A100 ms
    ("full prefill, 1024 tokens", 1024, 0, 0, 30.3, 85.2),
    ("full prefill, 4096 tokens", 4096, 0, 0, 105.0, 313.0),
    ("chunk of 2048, prior ctx 2048", 2048, 2048, 0, 59.4, 170.0),
    ("chunk of 512, prior ctx 2048", 512, 2048, 0, 20.4, 52.9),
    ("append 256 on an 8192 prefix", 256, 8192, 0, 16.3, 38.6),
)
LM7_BASE = {"llama-3.1-8b-h100": 10.7, "llama-3.1-8b-a100": 17.2}

# peers.md §2.2: the PPD code's sensitivity classes (ppd/optimizer/ppd_decision_engine.py
# comments; batch 64 in its sensitivity benchmark) and the README's interference gap.
PPD_CLASSES: tuple[tuple[str, int, float, float], ...] = (
    ("< 128 new tokens", 64, 0.0, 0.02),
    ("128-512 new tokens", 256, 0.02, 0.20),
    ("128-512 new tokens", 512, 0.02, 0.20),
    ("> 512 new tokens", 1024, 0.20, float("inf")),
)
PPD_FULL_PREFILL = 0.48  # "about 48 %" for a full prefill of 1,024 tokens (README)

# DistServe's profiler (LLMServe/DistServe simdistserve/estimators/profile_data,
# profiler-a100-80g.distserve.json, Apache-2.0): OPT-13B TP1, prefill t_ms = a + b*sum(len)
# + c*sum(len^2).
DISTSERVE_OPT13B_PREFILL = (18.10254647486372, 0.1019122572698738, 7.122264314252114e-06)
OPT13B_PARAMS_B = 12.85
LLAMA8B_PARAMS_B = 8.03


def step_ms(p: Profile, batch: int, ctx: int, q: int = 0, k: int = 0) -> float:
    """One step: ``batch`` decodes at ``ctx`` tokens each plus a prefill of ``q`` new tokens
    on ``k`` cached ones (q = 0: none)."""
    return 1e3 * p.step_time_s(batch + q, float(batch * ctx), q * (k + q / 2))


def stretch_table(p: Profile) -> list[dict[str, Any]]:
    rows = []
    for b in BATCHES:
        base = step_ms(p, b, DECODE_CTX)
        for q in NEW_TOKENS:
            with_append = step_ms(p, b, DECODE_CTX, q, APPEND_CTX)
            s = with_append / base
            rows.append({"batch": b, "new_tokens": q, "base_ms": round(base, 2),
                         "with_append_ms": round(with_append, 2), "stretch": round(s, 3),
                         "tpot_one_injection": round((s - 1) / (PPD_OUTPUT - 1), 4)})
    return rows


def lm7_table(p: Profile) -> list[dict[str, Any]]:
    base = step_ms(p, 32, DECODE_CTX)
    published_base = LM7_BASE.get(p.name)
    rows = []
    for label, q, k, _, h100, a100 in LM7_ROWS:
        ours = step_ms(p, 32, DECODE_CTX, q, k)
        published = h100 if "h100" in p.name else a100
        rows.append({"row": label, "sim_ms": round(ours, 1), "published_ms": published,
                     "sim_x": round(ours / base, 2),
                     "published_x": round(published / published_base, 2)
                     if published_base else None,
                     "miss": round(ours / published - 1, 3)})
    rows.insert(0, {"row": "32 decodes at 2048 (baseline)", "sim_ms": round(base, 1),
                    "published_ms": published_base, "sim_x": 1.0, "published_x": 1.0,
                    "miss": round(base / published_base - 1, 3) if published_base else None})
    return rows


def ppd_table(p: Profile) -> list[dict[str, Any]]:
    base = step_ms(p, 64, DECODE_CTX)
    rows = []
    for label, q, low, high in PPD_CLASSES:
        s = step_ms(p, 64, DECODE_CTX, q, APPEND_CTX) / base - 1
        rows.append({"class": label, "new_tokens": q, "ppd_low": low, "ppd_high": high,
                     "sim_every_step": round(s, 3),
                     "sim_one_injection": round(s / (PPD_OUTPUT - 1), 4)})
    s = step_ms(p, 64, DECODE_CTX, 1024, 0) / base - 1
    rows.append({"class": "full prefill, 1024 tokens", "new_tokens": 1024,
                 "ppd_low": PPD_FULL_PREFILL, "ppd_high": PPD_FULL_PREFILL,
                 "sim_every_step": round(s, 3), "sim_one_injection": round(s / 63, 4)})
    return rows


def distserve_row(p: Profile) -> dict[str, Any] | None:
    """Marginal cost of 512 prefill tokens added to 64 others, per billion parameters (A100
    profiles only: DistServe profiled A100-80GB)."""
    if "A100" not in p.gpu:
        return None
    a, b, c = DISTSERVE_OPT13B_PREFILL

    def ds(n: int) -> float:
        return a + b * n + c * n * n

    ds_ms = ds(64 + 512) - ds(64)
    sim_ms = step_ms(p, 64, 0, 512, 0) - step_ms(p, 64, 0)
    return {"distserve_opt13b_a100_ms": round(ds_ms, 2),
            "distserve_per_b_params_ms": round(ds_ms / OPT13B_PARAMS_B, 3),
            "sim_ms": round(sim_ms, 2), "sim_per_b_params_ms": round(sim_ms / LLAMA8B_PARAMS_B, 3),
            "miss": round((sim_ms / LLAMA8B_PARAMS_B) / (ds_ms / OPT13B_PARAMS_B) - 1, 3)}


def _print(doc: dict[str, Any]) -> None:
    for name, part in doc.items():
        print(f"\n## {name}")
        st = part["stretch"]
        print("per-step stretch (one-injection TPOT change over 63 gaps), decodes at 2048, "
              "append on a cached 2048:")
        print("| B \\ new tokens | " + " | ".join(str(q) for q in NEW_TOKENS) + " |")
        print("|---" * (len(NEW_TOKENS) + 1) + "|")
        for b in BATCHES:
            cells = [f"{r['stretch']:.2f}x ({100 * r['tpot_one_injection']:+.1f} %)"
                     for r in st if r["batch"] == b]
            print(f"| {b} | " + " | ".join(cells) + " |")
        print("\nlatency-model.md §7 rows (32 decodes at 2048):")
        print("| row | simulator ms | published ms | simulator x | published x | miss |")
        print("|---|---|---|---|---|---|")
        for r in part["latency_model_7"]:
            miss = "-" if r["miss"] is None else f"{100 * r['miss']:+.1f} %"
            print(f"| {r['row']} | {r['sim_ms']} | {r['published_ms']} | {r['sim_x']} "
                  f"| {r['published_x']} | {miss} |")
        print("\nPPD sensitivity (batch 64, context 2048), TPOT change:")
        print("| class | new tokens | PPD | simulator, every step | simulator, one injection |")
        print("|---|---|---|---|---|")
        for r in part["ppd"]:
            ppd = (f"{100 * r['ppd_low']:.0f} %" if r["ppd_low"] == r["ppd_high"] else
                   f"{100 * r['ppd_low']:.0f}-{100 * r['ppd_high']:.0f} %"
                   .replace("-inf %", " % and more"))
            print(f"| {r['class']} | {r['new_tokens']} | {ppd} | "
                  f"{100 * r['sim_every_step']:+.1f} % | {100 * r['sim_one_injection']:+.2f} % |")
        d = part["distserve"]
        if d is None:
            print("\nDistServe: no comparison (its profiles are A100's)")
            continue
        print(f"\nDistServe OPT-13B A100, 512 prefill tokens added to 64: "
              f"{d['distserve_opt13b_a100_ms']} ms ({d['distserve_per_b_params_ms']} ms per "
              f"B params); simulator {d['sim_ms']} ms ({d['sim_per_b_params_ms']} ms per B "
              f"params), {100 * d['miss']:+.1f} %")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--profile", action="append", default=[],
                    help="profile name or path (default: the 8B H100 and A100 profiles)")
    args = ap.parse_args()
    doc: dict[str, Any] = {}
    for name in args.profile or ["llama-3.1-8b-h100", "llama-3.1-8b-a100"]:
        p = load_profile(name)
        doc[p.name] = {"stretch": stretch_table(p), "latency_model_7": lm7_table(p),
                       "ppd": ppd_table(p), "distserve": distserve_row(p)}
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        _print(doc)


if __name__ == "__main__":
    main()
