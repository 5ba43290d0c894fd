"""Summaries of virtual-time runs: goodput, Turn-2+ TTFT, TPOT, KV bytes, per phase.

- ``goodput``: fraction (0-1) of all requests, rejected ones included, that met both SLOs
  (a request with one output token has no TPOT and meets that SLO).
- ``turn2_ttft_*``: TTFT of turns 2 and later (the turns the routing decision is about).
- ``tpot_*``: per-request TPOT of requests with at least 2 output tokens.
- Percentiles are exact over the per-request records (nearest rank: the smallest value with
  at least p% of the values at or below it); ``null`` when there is no value.
- ``kv_bytes``: bytes of KV pulled over P->D links.
- ``phases``: the same over requests arriving in each phase (phases split at event times).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from controller.sim.run import RequestRecord, RunResult


def percentile(values: Sequence[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100.0 * len(ordered)))
    return ordered[rank - 1]


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _met(r: RequestRecord, ttft_slo: float, tpot_slo: float) -> bool:
    if r.rejected or r.ttft_s is None:
        return False
    return r.ttft_s <= ttft_slo and (r.tpot_s is None or r.tpot_s <= tpot_slo)


def summarize_records(records: Iterable[RequestRecord], ttft_slo: float,
                      tpot_slo: float) -> dict[str, Any]:
    recs = list(records)
    ttft2 = [r.ttft_s for r in recs if r.turn >= 2 and r.ttft_s is not None]
    tpot = [r.tpot_s for r in recs if r.tpot_s is not None]
    met = sum(1 for r in recs if _met(r, ttft_slo, tpot_slo))
    return {
        "goodput": met / len(recs) if recs else None,
        "requests": len(recs),
        "rejected": sum(1 for r in recs if r.rejected),
        "turn2_ttft_mean_s": _mean(ttft2),
        "turn2_ttft_p99_s": percentile(ttft2, 99),
        "tpot_mean_s": _mean(tpot),
        "tpot_p99_s": percentile(tpot, 99),
        "kv_bytes": sum(r.kv_bytes for r in recs),
    }


def summarize(result: RunResult) -> dict[str, Any]:
    """One policy's entry of ``pdctl bench run --json``."""
    out = summarize_records(result.records, result.ttft_slo_s, result.tpot_slo_s)
    phases = []
    for i, (start, end) in enumerate(result.phases):
        s = summarize_records((r for r in result.records if r.phase == i),
                              result.ttft_slo_s, result.tpot_slo_s)
        phases.append({
            "start_s": start, "end_s": end, "goodput": s["goodput"],
            "turn2_ttft_mean_s": s["turn2_ttft_mean_s"],
            "turn2_ttft_p99_s": s["turn2_ttft_p99_s"], "tpot_mean_s": s["tpot_mean_s"],
            "tpot_p99_s": s["tpot_p99_s"], "kv_bytes": s["kv_bytes"],
        })
    out["phases"] = phases
    return out


def bench_document(scenario: str, results: dict[str, RunResult]) -> dict[str, Any]:
    return {"scenario": scenario,
            "policies": {key: summarize(res) for key, res in results.items()}}
