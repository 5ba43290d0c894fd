"""The oracle picks each phase's best candidate; adaptation times per event."""

from __future__ import annotations

from typing import Any

from controller.bench.oracle import oracle_records, pick_per_phase
from controller.bench.report import summarize_records
from controller.bench.runner import times_to_first
from controller.sim.run import RequestRecord, RunResult
from controller.sim.scenario import Event


def record(phase: int, ok: bool, i: int) -> RequestRecord:
    return RequestRecord(
        session=f"s{i}", turn=2, arrival_s=phase * 100.0 + i, prompt_tokens=100, new_tokens=10,
        output_tokens=10, max_tokens=16, route="DECODE_LOCAL", reason="table",
        context_tokens=90, ttft_s=0.1 if ok else 5.0, tpot_s=0.01, finish_s=1.0, kv_bytes=0,
        rejected=False, reject_reason="", prefill_worker=None, decode_worker="decode-0",
        retries=0, phase=phase)


def run(key: str, met_per_phase: list[tuple[int, int]]) -> RunResult:
    recs = []
    for phase, (met, n) in enumerate(met_per_phase):
        recs += [record(phase, i < met, i) for i in range(n)]
    phases = [(p * 100.0, (p + 1) * 100.0) for p in range(len(met_per_phase))]
    cluster: Any = None
    return RunResult("s", key, recs, phases, 1.0, 0.05, 0.0, 0, 300.0, cluster)


def test_oracle_picks_the_best_candidate_of_every_phase() -> None:
    candidates = {
        "pd": run("pd", [(9, 10), (2, 10), (5, 10)]),
        "local": run("local", [(6, 10), (8, 10), (5, 10)]),
        "table-1:1": run("table-1:1", [(7, 10), (7, 10), (12, 20)]),
    }
    picks = pick_per_phase(candidates)
    assert [(p.policy, p.goodput) for p in picks] == [
        ("pd", 0.9), ("local", 0.8), ("table-1:1", 0.6)]
    recs = oracle_records(candidates, picks)
    s = summarize_records(recs, 1.0, 0.05)
    assert s["requests"] == 40
    assert s["goodput"] == (9 + 8 + 12) / 40
    # Not just any candidate's overall: the oracle beats each of them here.
    for res in candidates.values():
        assert s["goodput"] > summarize_records(res.records, 1.0, 0.05)["goodput"]


def test_ties_go_to_the_first_candidate() -> None:
    picks = pick_per_phase({"a": run("a", [(5, 10)]), "b": run("b", [(5, 10)])})
    assert picks[0].policy == "a"


def test_a_phase_without_requests_goes_to_the_first_candidate_with_no_goodput() -> None:
    """A phase nobody's traffic reached (a late event, a sparse trace): the bench ended in
    an AssertionError after all its replays."""
    picks = pick_per_phase({"a": run("a", [(5, 10), (0, 0)]), "b": run("b", [(6, 10), (0, 0)])})
    assert [(p.policy, p.goodput) for p in picks] == [("b", 0.6), ("a", None)]
    recs = oracle_records({"a": run("a", [(5, 10), (0, 0)]), "b": run("b", [(6, 10), (0, 0)])},
                          picks)
    assert len(recs) == 10


def test_adaptation_time_per_event() -> None:
    events = [Event(100.0, "rate_scale", 2.0), Event(200.0, "link_bandwidth", 0.5),
              Event(300.0, "rate_scale", 1.0)]
    # approvals: one before any event, one 45 s after the first, none in (200, 300], one
    # 10 s after the third.
    assert times_to_first(events, [50.0, 145.0, 150.0, 310.0]) == [45.0, None, 10.0]
    # One at an event's own time answers what came before it (its window ends there).
    assert times_to_first(events, [100.0, 200.0, 230.0]) == [100.0, 30.0, None]
    assert times_to_first(events, []) == [None, None, None]
