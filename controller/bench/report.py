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

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
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


# ------------------------------------------------------------------ the evaluation document
# The evaluation's document: the simulator issue's schema plus, per policy,
# ``policy_changes`` and ``adaptation_s`` (adaptive also ``detection_s``: per event, seconds
# to its first drift event or scaling calibration), an ``oracle`` entry and top-level
# ``oracle_ratio``, ``events`` and ``oracle_picks``.


def _phase_entry(start: float, end: float, s: dict[str, Any]) -> dict[str, Any]:
    return {"start_s": start, "end_s": end, "goodput": s["goodput"],
            "turn2_ttft_mean_s": s["turn2_ttft_mean_s"],
            "turn2_ttft_p99_s": s["turn2_ttft_p99_s"], "tpot_mean_s": s["tpot_mean_s"],
            "tpot_p99_s": s["tpot_p99_s"], "kv_bytes": s["kv_bytes"]}


def evaluation_document(bench: Any) -> dict[str, Any]:
    """``pdctl bench run --json`` for a :class:`controller.bench.runner.BenchRun`."""
    from controller.bench.oracle import oracle_records

    scenario = bench.scenario
    policies: dict[str, Any] = {}
    for key, run in bench.runs.items():
        entry = summarize(run.result)
        entry["policy_changes"] = run.policy_changes
        entry["adaptation_s"] = list(run.adaptation_s)
        if run.adaptive is not None:
            a = run.adaptive
            entry["controller"] = {
                "cycles": a.cycles, "failed_cycles": len(a.failed_cycles),
                "windows": a.windows, "calibrations": a.calibrations, "pushes": a.pushes,
                "drift_events": [{"at_s": t, "kind": k} for t, k in a.drift_events],
                "approved_at_s": [t for t, _ in a.approvals],
                "superseded_at_s": list(a.superseded),
                "rolled_back_at_s": [t for t, _ in a.rollbacks],
                "scaling_calibrations_at_s": list(a.scaling_calibrations),
            }
            entry["detection_s"] = list(run.detection_s)
        policies[key] = entry
    doc: dict[str, Any] = {
        "scenario": scenario.name,
        "seed": scenario.seed,
        "duration_s": scenario.duration_s,
        "interval_s": scenario.interval_s,
        "events": [{"at_s": e.at_s, "kind": e.kind} for e in scenario.events],
        "policies": policies,
        "oracle_ratio": None,
        "oracle_picks": None,
        "notes": list(bench.notes),
    }
    if bench.oracle is not None:
        recs = oracle_records(bench.candidates, bench.oracle)
        any_run = next(iter(bench.candidates.values()))
        entry = summarize_records(recs, any_run.ttft_slo_s, any_run.tpot_slo_s)
        entry["phases"] = [
            _phase_entry(start, end, summarize_records(
                (r for r in recs if r.phase == i), any_run.ttft_slo_s, any_run.tpot_slo_s))
            for i, (start, end) in enumerate(any_run.phases)]
        picks = [p.policy for p in bench.oracle]
        entry["policy_changes"] = sum(1 for a, b in itertools.pairwise(picks) if a != b)
        entry["adaptation_s"] = [None] * len(scenario.events)
        policies["oracle"] = entry
        doc["oracle_picks"] = [{"phase": p.phase, "policy": p.policy, "goodput": p.goodput}
                               for p in bench.oracle]
        adaptive = policies.get("adaptive")
        if adaptive is not None and adaptive["goodput"] is not None and entry["goodput"]:
            doc["oracle_ratio"] = adaptive["goodput"] / entry["goodput"]
    adaptive_run = bench.runs.get("adaptive")
    if adaptive_run is not None and adaptive_run.adaptive is not None:
        _add_adapted_goodput(doc, bench, adaptive_run.adaptive, oracle_records)
    return doc


def adapted_from(phases: list[tuple[float, float]], approvals: list[float]) -> list[float]:
    """Per phase, when adaptive had adapted to it: its first approval inside the phase, else
    the phase's start (nothing to adapt, or it kept the policy it had)."""
    return [next((t for t in sorted(approvals) if start <= t < end), start)
            for start, end in phases]


def _add_adapted_goodput(doc: dict[str, Any], bench: Any, outcome: Any,
                         oracle_records: Any) -> None:
    """Issue 7's "in every phase once it has adapted": each policy's goodput over the part of
    each phase from adaptive's first approval in it (``adapted_from_s``), beside the whole
    phase's. The same span for every policy, so the comparison stays like for like."""
    any_run = next(iter(bench.runs.values())).result
    approvals = [t for t, _ in outcome.approvals[1:]]
    starts = adapted_from(list(any_run.phases), approvals)
    doc["adapted_from_s"] = starts
    records = {key: run.result.records for key, run in bench.runs.items()}
    if bench.oracle is not None:
        records["oracle"] = oracle_records(bench.candidates, bench.oracle)
    for key, recs in records.items():
        for i, phase in enumerate(doc["policies"][key]["phases"]):
            phase["adapted_goodput"] = summarize_records(
                (r for r in recs if r.phase == i and r.arrival_s >= starts[i]),
                any_run.ttft_slo_s, any_run.tpot_slo_s)["goodput"]


def _ms(v: Any, digits: int = 1) -> str:
    return "-" if v is None else f"{v * 1e3:.{digits}f}"


def seconds_list(values: Any) -> str:
    """Per-event seconds as ``"510, -"`` (``-``: none; the whole cell ``-`` when absent)."""
    return ", ".join("-" if a is None else f"{a:.0f}" for a in values or []) or "-"


def _num(v: Any, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def markdown_report(doc: dict[str, Any], command: str | None = None) -> str:
    """Per policy: the whole scenario, then each phase (goodput, Turn-2+ TTFT, TPOT, KV,
    policy changes, adaptation and detection time per event)."""
    lines = [f"### Scenario `{doc['scenario']}`", ""]
    if command:
        lines += [f"`{command}`", ""]
    events = doc.get("events") or []
    if events:
        lines += ["Events: " + ", ".join(f"{e['kind']} at {e['at_s']:g} s" for e in events), ""]
    lines += [
        "| policy | phase | goodput | T2+ TTFT mean ms | T2+ TTFT p99 ms | TPOT mean ms "
        "| TPOT p99 ms | KV GiB | policy changes | adaptation s | detection s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, s in doc["policies"].items():
        adapt_txt = seconds_list(s.get("adaptation_s"))
        detect_txt = seconds_list(s.get("detection_s"))
        lines.append(
            f"| {key} | all | {_num(s['goodput'])} | {_ms(s['turn2_ttft_mean_s'])} "
            f"| {_ms(s['turn2_ttft_p99_s'])} | {_ms(s['tpot_mean_s'], 2)} "
            f"| {_ms(s['tpot_p99_s'], 2)} | {_num(s['kv_bytes'] / 2**30, 2)} "
            f"| {s.get('policy_changes', 0)} | {adapt_txt} | {detect_txt} |")
        for i, p in enumerate(s["phases"]):
            lines.append(
                f"| {key} | {i} ({p['start_s']:g}-{p['end_s']:g} s) | {_num(p['goodput'])} "
                f"| {_ms(p['turn2_ttft_mean_s'])} | {_ms(p['turn2_ttft_p99_s'])} "
                f"| {_ms(p['tpot_mean_s'], 2)} | {_ms(p['tpot_p99_s'], 2)} "
                f"| {_num(p['kv_bytes'] / 2**30, 2)} | | | |")
    lines.append("")
    if doc.get("oracle_picks"):
        lines.append("Oracle picks per phase: " + ", ".join(
            f"{p['phase']}: {p['policy']} ({_num(p['goodput'])})" for p in doc["oracle_picks"]))
        lines.append("")
    lines.append(oracle_ratio_line(doc))
    for note in doc.get("notes") or []:
        lines.append(f"- note: {note}")
    lines.append("")
    return "\n".join(lines)


def oracle_ratio_line(doc: Mapping[str, Any]) -> str:
    """The report's adaptive / oracle line: "not run" only when one of them was not (with
    no goodput for either, e.g. no requests, the ratio is undefined)."""
    ratio = doc.get("oracle_ratio")
    if ratio is not None:
        return f"adaptive / oracle goodput: {ratio:.3f}"
    ran = {"adaptive", "oracle"} <= set(doc.get("policies") or {})
    return "adaptive / oracle goodput: " + ("undefined (no oracle goodput)" if ran
                                            else "not run")
