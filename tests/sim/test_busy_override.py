"""The busy overrides in the simulated cluster: routers see the prefill workers' queue
(``prefill_waiting``) and divert turn 1, or a later turn the table sends to a prefill node,
decode-local while it is long."""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

from controller.policy import Overrides, Policy, Route
from controller.sim.run import RequestRecord, RunResult, run_scenario
from controller.sim.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[2]


def _run(busy_waiting: int, later_busy_waiting: int = 0) -> RunResult:
    # One prefill worker for three decode workers: turn 1 queues on it under this load.
    sc = replace(load_scenario(ROOT / "scenarios" / "ppd-1p3d.toml"), duration_s=60.0)
    policy = Policy.uniform(1, Route.PREFILL_NODE,
                            overrides=Overrides(first_turn_busy_waiting=busy_waiting,
                                                later_turn_busy_waiting=later_busy_waiting))
    return run_scenario(sc, policy)


def test_busy_prefill_pool_sends_turn_1_decode_local_and_cuts_its_ttft() -> None:
    off, on = _run(0), _run(1)
    firsts_off = [r for r in off.records if r.turn == 1 and not r.rejected]
    firsts_on = [r for r in on.records if r.turn == 1 and not r.rejected]
    diverted = [r for r in firsts_on if r.reason == "busy_prefill"]
    assert not any(r.reason == "busy_prefill" for r in off.records)
    # Some, not all, first turns found the prefill worker busy; every one of them ran local.
    assert 0 < len(diverted) < len(firsts_on)
    assert {r.route for r in diverted} == {Route.DECODE_LOCAL.name}
    assert all(r.turn == 1 for r in on.records if r.reason == "busy_prefill")

    def mean_ttft(records: list[RequestRecord]) -> float:
        return statistics.fmean(r.ttft_s for r in records if r.ttft_s is not None)

    assert mean_ttft(firsts_on) < mean_ttft(firsts_off)


def test_busy_prefill_pool_sends_later_turns_decode_local_and_cuts_their_ttft() -> None:
    off, on = _run(0), _run(0, 1)

    def later(result: RunResult) -> list[RequestRecord]:
        return [r for r in result.records if r.turn > 1 and not r.rejected]

    diverted = [r for r in later(on) if r.reason == "busy_later_turn"]
    assert not any(r.reason == "busy_later_turn" for r in off.records)
    assert 0 < len(diverted) < len(later(on))
    assert {r.route for r in diverted} == {Route.DECODE_LOCAL.name}
    assert all(r.turn > 1 for r in on.records if r.reason == "busy_later_turn")
    # Turn 1 is the other override's: off here, so it never diverts.
    assert not any(r.reason == "busy_prefill" for r in on.records)

    def mean_ttft(records: list[RequestRecord]) -> float:
        return statistics.fmean(r.ttft_s for r in records if r.ttft_s is not None)

    assert mean_ttft(later(on)) < mean_ttft(later(off))
