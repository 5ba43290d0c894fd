"""RouterAgent: update semantics, persistence, decisions, SLO outcomes and metrics."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import random
import resource
import signal
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from controller.clock import VirtualClock
from controller.policy import (
    Axes,
    Decision,
    Features,
    LookupTable,
    Overrides,
    Policy,
    Reason,
    Route,
    Slo,
    dumps,
    loads,
    policy_from_dict,
)
from controller.rollout.agent import ApplyOutcome, RouterAgent, atomic_write_bytes
from tests.policy.vectors import case_features, cases

SMALL_AXES = Axes(context_tokens=(1000.0, 8000.0), io_ratio=(1.0, 4.0), qps=(2.0, 8.0))

# Assert on this logger explicitly: a command run in-process elsewhere in the suite may have
# raised its level (e.g. the bench quiets the agent), and caplog only lowers what it is told to.
AGENT_LOGGER = "controller.rollout.agent"


def checkerboard(version: int, *, shift: int = 0, exploration: float = 0.0) -> Policy:
    """A policy whose routes alternate by cell index, so a wrong cell gives a wrong route."""
    n = SMALL_AXES.n_cells
    routes = tuple(
        Route.DECODE_LOCAL if (i + shift) % 2 else Route.PREFILL_NODE for i in range(n)
    )
    table = LookupTable(SMALL_AXES, routes, tuple(float(i) for i in range(n)), (exploration,) * n)
    return Policy(version=version, table=table, slo=Slo(ttft_s=1.0, tpot_s=0.05))


def later_turn(ctx: float = 500.0, append: float = 100.0, out: float = 200.0, qps: float = 1.0
               ) -> Features:
    return Features(turn=3, context_tokens=ctx, append_tokens=append,
                    expected_output_tokens=out, qps=qps)


def samples(agent: RouterAgent) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every exposed sample, keyed by (sample name, sorted labels), parsed from the text format."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    text = generate_latest(agent.registry).decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(agent: RouterAgent, name: str, **labels: str) -> float:
    return samples(agent)[(name, tuple(sorted(labels.items())))]


# -- apply semantics ------------------------------------------------------------------------


def test_apply_then_same_version_same_checksum_is_noop() -> None:
    agent = RouterAgent(clock=VirtualClock())
    first = agent.apply(checkerboard(3))
    again = agent.apply(checkerboard(3))
    assert first.outcome is ApplyOutcome.APPLIED
    assert again.outcome is ApplyOutcome.NOOP
    assert (again.applied_version, again.checksum) == (3, checkerboard(3).checksum)
    assert sample(agent, "pdrouter_updates_total", result="applied") == 1
    assert sample(agent, "pdrouter_updates_total", result="noop") == 1


def test_same_version_other_checksum_is_a_conflict_and_keeps_the_running_policy() -> None:
    agent = RouterAgent(clock=VirtualClock())
    agent.apply(checkerboard(3))
    result = agent.apply(checkerboard(3, shift=1))
    assert result.outcome is ApplyOutcome.CONFLICT
    assert result.checksum == checkerboard(3).checksum == agent.checksum
    assert agent.policy == checkerboard(3)
    assert "checksum" in result.message


def test_lower_version_is_stale_unless_rollback() -> None:
    agent = RouterAgent(clock=VirtualClock())
    agent.apply(checkerboard(5))
    stale = agent.apply(checkerboard(4, shift=1))
    assert stale.outcome is ApplyOutcome.STALE
    assert stale.applied_version == 5
    rolled = agent.apply(checkerboard(4, shift=1), rollback=True)
    assert rolled.outcome is ApplyOutcome.APPLIED
    assert rolled.applied_version == 4
    assert agent.checksum == checkerboard(4, shift=1).checksum
    assert sample(agent, "pdrouter_policy_version") == 4


def test_invalid_update_is_refused_with_every_problem_and_last_good_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    agent = RouterAgent(clock=VirtualClock())
    agent.apply(checkerboard(1))
    good = checkerboard(2)
    bad = dataclasses.replace(
        good,
        table=dataclasses.replace(good.table, exploration=(0.9,) * SMALL_AXES.n_cells),
        slo=Slo(ttft_s=-1.0, tpot_s=0.1),
    )
    with caplog.at_level(logging.WARNING, logger=AGENT_LOGGER):
        result = agent.apply(bad)
    assert result.outcome is ApplyOutcome.INVALID
    assert "exploration[0]" in result.message and "slo.ttft_s" in result.message
    assert agent.policy == checkerboard(1)
    assert result.applied_version == 1
    assert any("slo.ttft_s" in r.getMessage() for r in caplog.records)
    assert sample(agent, "pdrouter_updates_total", result="invalid") == 1


def test_an_update_that_is_not_a_policy_is_refused_not_raised() -> None:
    agent = RouterAgent(clock=VirtualClock(), initial_policy=checkerboard(1))
    result = agent.apply(None)  # type: ignore[arg-type]
    assert result.outcome is ApplyOutcome.INVALID
    assert "cannot be validated" in result.message
    assert agent.policy == checkerboard(1)


def test_first_apply_on_an_empty_agent_reports_what_runs() -> None:
    agent = RouterAgent(clock=VirtualClock())
    assert (agent.policy, agent.checksum, agent.applied_at) == (None, "", None)
    bad = dataclasses.replace(checkerboard(1), version=0)
    refused = agent.apply(bad)
    assert (refused.outcome, refused.applied_version, refused.checksum) == (
        ApplyOutcome.INVALID, 0, "")


def test_applied_at_follows_the_clock() -> None:
    clock = VirtualClock(start=1000.0)
    agent = RouterAgent(clock=clock)
    agent.apply(checkerboard(1))
    clock.advance(42.0)
    agent.apply(checkerboard(2))
    assert agent.applied_at == 1042.0


# -- persistence ----------------------------------------------------------------------------


def test_applied_policy_survives_a_restart(tmp_path: Path) -> None:
    state = tmp_path / "router.json"
    first = RouterAgent(clock=VirtualClock(), state_file=state)
    first.apply(checkerboard(7, shift=1))
    assert loads(state.read_text()) == checkerboard(7, shift=1)
    restarted = RouterAgent(clock=VirtualClock(), state_file=state,
                            initial_policy=checkerboard(1))
    assert restarted.policy == checkerboard(7, shift=1)
    assert restarted.checksum == checkerboard(7, shift=1).checksum
    assert restarted.apply(checkerboard(6)).outcome is ApplyOutcome.STALE


def test_initial_policy_is_used_without_a_state_file(tmp_path: Path) -> None:
    agent = RouterAgent(clock=VirtualClock(), state_file=tmp_path / "none.json",
                        initial_policy=checkerboard(2))
    assert agent.policy == checkerboard(2)
    assert sample(agent, "pdrouter_policy_version") == 2


def test_corrupt_state_file_is_set_aside_and_the_initial_policy_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "router.json"
    (tmp_path / "router.json.corrupt-1").write_text("an older corpse")
    text = json.loads(dumps(checkerboard(9)))
    text["scores"][0] = 123.0  # the checksum no longer matches: tampered or bit-rotted
    state.write_text(json.dumps(text))
    with caplog.at_level(logging.ERROR, logger=AGENT_LOGGER):
        agent = RouterAgent(clock=VirtualClock(), state_file=state,
                            initial_policy=checkerboard(1))
    assert agent.policy == checkerboard(1)
    assert not state.exists()
    kept = tmp_path / "router.json.corrupt-2"
    assert json.loads(kept.read_text())["scores"][0] == 123.0
    assert (tmp_path / "router.json.corrupt-1").read_text() == "an older corpse"
    assert any("corrupt" in r.getMessage() for r in caplog.records)


def test_a_state_file_that_is_a_pipe_is_neither_read_nor_renamed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A FIFO blocked the start for good; a device (``/dev/null`` to mean "no state", as
    root) was renamed to ``.corrupt-1``. Neither is read or moved now."""
    import os
    import threading
    import time

    fifo = tmp_path / "router.json"
    os.mkfifo(fifo)
    stop = threading.Event()

    def unblock() -> None:  # were the agent to open it: its read ends (bounded, 10 s)
        until = time.monotonic() + 10.0
        while not stop.is_set() and time.monotonic() < until:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                time.sleep(0.01)  # no reader (ENXIO): the agent did not open it

    writer = threading.Thread(target=unblock)
    writer.start()
    try:
        with caplog.at_level(logging.ERROR, logger=AGENT_LOGGER):
            agent = RouterAgent(clock=VirtualClock(), state_file=fifo,
                                initial_policy=checkerboard(1))
    finally:
        stop.set()
        writer.join()
    assert agent.policy == checkerboard(1)
    assert fifo.exists() and not (tmp_path / "router.json.corrupt-1").exists()
    assert any("not a regular file" in r.getMessage() for r in caplog.records)


def test_temporary_files_of_an_interrupted_write_are_removed_at_start(tmp_path: Path) -> None:
    state = tmp_path / "router.json"
    RouterAgent(clock=VirtualClock(), state_file=state).apply(checkerboard(7))
    left = tmp_path / ".router.json.abc123.tmp"  # as atomic_write_bytes names them
    left.write_bytes(b'{"cut off')
    other = tmp_path / ".other.json.abc123.tmp"  # another file's: not ours to remove
    other.write_bytes(b"x")
    restarted = RouterAgent(clock=VirtualClock(), state_file=state)
    assert restarted.policy == checkerboard(7)
    assert not left.exists() and other.exists()


def test_garbage_state_file_without_initial_policy_starts_empty(tmp_path: Path) -> None:
    state = tmp_path / "router.json"
    state.write_bytes(b"\xff\xfe not json")
    agent = RouterAgent(clock=VirtualClock(), state_file=state)
    assert agent.policy is None
    assert agent.decide(later_turn()) == Decision(Route.PREFILL_NODE, None, Reason.NO_POLICY)
    assert (tmp_path / "router.json.corrupt-1").read_bytes() == b"\xff\xfe not json"


def test_unwritable_state_file_refuses_the_update_and_keeps_the_old_policy(
    tmp_path: Path,
) -> None:
    blocker = tmp_path / "not-a-dir"
    agent = RouterAgent(clock=VirtualClock(), state_file=blocker / "router.json",
                        initial_policy=checkerboard(1))
    blocker.write_text("a file where the state directory should be")  # writes now fail
    result = agent.apply(checkerboard(2))
    assert result.outcome is ApplyOutcome.PERSIST_FAILED
    assert result.applied_version == 1
    assert agent.policy == checkerboard(1)
    assert sample(agent, "pdrouter_updates_total", result="persist_failed") == 1


def test_full_disk_at_the_writer_seam_applies_nothing(tmp_path: Path) -> None:
    state = tmp_path / "router.json"
    atomic_write_bytes(state, dumps(checkerboard(1)).encode())
    attempts: list[bytes] = []

    def full_disk(path: Path, data: bytes) -> None:
        attempts.append(data)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    agent = RouterAgent(clock=VirtualClock(), state_file=state, writer=full_disk)
    result = agent.apply(checkerboard(2))
    assert result.outcome is ApplyOutcome.PERSIST_FAILED
    assert "No space left" in result.message
    assert loads(attempts[0]) == checkerboard(2)
    assert agent.policy == checkerboard(1)
    assert loads(state.read_text()) == checkerboard(1)


def test_atomic_write_keeps_the_old_file_and_no_temp_file_when_the_disk_refuses(
    tmp_path: Path,
) -> None:
    state = tmp_path / "router.json"
    atomic_write_bytes(state, b"old")
    # A real write failure: the file-size limit makes write() fail with EFBIG, like a full
    # disk makes it fail with ENOSPC (chmod cannot stop root, a size limit can).
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))
    try:
        with pytest.raises(OSError) as failure:
            atomic_write_bytes(state, b"x" * 4096)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert failure.value.errno == errno.EFBIG
    assert state.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["router.json"]
    atomic_write_bytes(state, b"new")
    assert state.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["router.json"]


# -- decisions ------------------------------------------------------------------------------


def test_decide_without_a_policy_counts_no_policy() -> None:
    agent = RouterAgent(clock=VirtualClock())
    assert agent.decide(later_turn()).reason is Reason.NO_POLICY
    assert sample(agent, "pdrouter_decisions_total", route="PREFILL_NODE",
                  reason="no_policy") == 1


def test_decide_reads_the_right_cell_and_counts_by_route_and_reason() -> None:
    agent = RouterAgent(clock=VirtualClock(), initial_policy=checkerboard(1))
    # ctx 5000 -> bin 1, io 8.0 -> bin 1 (last, beyond), qps 2.0 -> bin 0 (edge inclusive)
    d = agent.decide(later_turn(ctx=5000.0, append=1600.0, out=200.0, qps=2.0))
    index = SMALL_AXES.cell_index(1, 1, 0)
    assert d == Decision(checkerboard(1).table.routes[index], (1, 1, 0), Reason.TABLE)
    for _ in range(3):
        agent.decide(Features(1, 0.0, 10.0, 10.0, 1.0))
    agent.decide(Features(2, float("nan"), 10.0, 10.0, 1.0))
    assert sample(agent, "pdrouter_decisions_total", route=d.route.name, reason="table") == 1
    assert sample(agent, "pdrouter_decisions_total", route="PREFILL_NODE",
                  reason="first_turn") == 3
    assert sample(agent, "pdrouter_decisions_total", route="PREFILL_NODE",
                  reason="invalid_input") == 1


def test_exploration_takes_the_other_route_when_the_draw_is_below_the_fraction() -> None:
    draws = iter([0.05, 0.5])
    agent = RouterAgent(clock=VirtualClock(), initial_policy=checkerboard(1, exploration=0.1),
                        draw=lambda: next(draws))
    explored = agent.decide(later_turn())
    kept = agent.decide(later_turn())
    assert explored.explored and explored.reason is Reason.EXPLORE
    assert explored.route is kept.route.other
    assert kept.reason is Reason.TABLE and not kept.explored


def test_bypass_override_routes_short_appends_decode_local() -> None:
    policy = dataclasses.replace(checkerboard(1), overrides=Overrides(bypass_append_tokens=64))
    agent = RouterAgent(clock=VirtualClock(), initial_policy=policy)
    assert agent.decide(later_turn(append=63.0)) == Decision(Route.DECODE_LOCAL, None,
                                                             Reason.BYPASS)
    assert agent.decide(later_turn(append=64.0)).reason is Reason.TABLE


def test_busy_override_sends_turn_1_decode_local_while_every_prefill_worker_is_busy() -> None:
    policy = dataclasses.replace(checkerboard(1), overrides=Overrides(first_turn_busy_waiting=2))
    agent = RouterAgent(clock=VirtualClock(), initial_policy=policy)

    def turn_1(waiting: float | None) -> Features:
        return Features(1, 0.0, 800.0, 100.0, 1.0, prefill_waiting=waiting)

    busy = Decision(Route.DECODE_LOCAL, None, Reason.BUSY_PREFILL)
    assert agent.decide(turn_1(2.0)) == busy
    assert agent.decide(turn_1(7.0)) == busy
    for calm in (1.0, None, float("nan")):  # below the bar, or unknown
        assert agent.decide(turn_1(calm)).reason is Reason.FIRST_TURN
    # Later turns follow the table whatever the prefill pool's queue.
    assert agent.decide(dataclasses.replace(later_turn(), prefill_waiting=9.0)).reason \
        is Reason.TABLE
    assert agent.metrics.decisions(Route.DECODE_LOCAL, Reason.BUSY_PREFILL) == 2
    # Turn 1 already decode-local: nothing to divert.
    local_first = dataclasses.replace(
        policy, version=2,
        overrides=Overrides(first_turn_route=Route.DECODE_LOCAL, first_turn_busy_waiting=2))
    agent.apply(local_first)
    assert agent.decide(turn_1(5.0)).reason is Reason.FIRST_TURN


def test_later_turn_busy_override_diverts_prefill_cells_only_and_reads_the_watch() -> None:
    policy = dataclasses.replace(checkerboard(1), overrides=Overrides(later_turn_busy_waiting=3))
    waiting: list[float | None] = [None]
    agent = RouterAgent(clock=VirtualClock(), initial_policy=policy,
                        prefill_waiting=lambda: waiting[0])
    prefill_cell = later_turn()
    assert agent.decide(prefill_cell).route is Route.PREFILL_NODE  # the checkerboard's cell
    cell = agent.decide(prefill_cell).cell
    busy = Decision(Route.DECODE_LOCAL, cell, Reason.BUSY_LATER_TURN)
    assert agent.decide(dataclasses.replace(prefill_cell, prefill_waiting=3.0)) == busy
    waiting[0] = 4.0  # no count in the request: the agent's prefill watch answers
    assert agent.decide(prefill_cell) == busy
    waiting[0] = 2.0
    assert agent.decide(prefill_cell).reason is Reason.TABLE
    # A decode-local cell has nothing to divert; turn 1 is the other override's.
    local_cell = later_turn(qps=3.0)
    assert agent.decide(local_cell).route is Route.DECODE_LOCAL
    waiting[0] = 9.0
    assert agent.decide(local_cell).reason is Reason.TABLE
    assert agent.decide(Features(1, 0.0, 800.0, 100.0, 1.0)).reason is Reason.FIRST_TURN
    assert agent.metrics.decisions(Route.DECODE_LOCAL, Reason.BUSY_LATER_TURN) == 2


def test_the_agent_returns_every_published_conformance_vector() -> None:
    """``decide()`` is written twice (the reference and the agent's flat hot path): the
    vectors every router must return hold for both."""
    checked = 0
    for name, policy_dict, case in cases():
        agent = RouterAgent(clock=VirtualClock(), initial_policy=policy_from_dict(policy_dict),
                            draw=lambda case=case: float(case["draw"]))
        d, exp = agent.decide(case_features(case)), case["expect"]
        assert (d.route.name, list(d.cell) if d.cell else None, d.reason.value,
                d.explored) == (exp["route"], exp["cell"], exp["reason"], exp["explored"]), name
        checked += 1
    assert checked >= 20


class SlowClock(VirtualClock):
    """Every perf_counter_ns() read moves time on by ``step_ms``: each decision looks slow."""

    def __init__(self, step_ms: float) -> None:
        super().__init__()
        self._step_ns = int(step_ms * 1e6)
        self._perf_ns = 0

    def perf_counter_ns(self) -> int:
        self._perf_ns += self._step_ns
        return self._perf_ns


def test_a_decision_slower_than_the_timeout_falls_back_to_the_default_route() -> None:
    policy = dataclasses.replace(checkerboard(1), default_route=Route.DECODE_LOCAL)
    slow = RouterAgent(clock=SlowClock(step_ms=2.0), decision_timeout_ms=1.0,
                       initial_policy=policy)
    fast = RouterAgent(clock=SlowClock(step_ms=0.5), decision_timeout_ms=1.0,
                       initial_policy=policy)
    assert slow.decide(later_turn()) == Decision(Route.DECODE_LOCAL, None, Reason.TIMEOUT)
    assert fast.decide(later_turn()).reason is Reason.TABLE
    assert sample(slow, "pdrouter_decisions_total", route="DECODE_LOCAL", reason="timeout") == 1
    assert sample(slow, "pdrouter_decisions_total", route="PREFILL_NODE", reason="table") == 0


def test_decide_never_raises_and_logs_unexpected_errors_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = VirtualClock()

    def broken_draw() -> float:
        raise RuntimeError("entropy ran out")

    agent = RouterAgent(clock=clock, initial_policy=checkerboard(1, exploration=0.2),
                        draw=broken_draw)
    with caplog.at_level(logging.ERROR, logger=AGENT_LOGGER):
        first = agent.decide(later_turn())
        agent.decide(later_turn())
        clock.advance(61.0)
        agent.decide(later_turn())
        not_features = agent.decide("not features")  # type: ignore[arg-type]
    assert first == Decision(Route.PREFILL_NODE, None, Reason.INVALID_INPUT)
    assert not_features.reason is Reason.INVALID_INPUT
    logged = [r for r in caplog.records if "decide() failed" in r.getMessage()]
    assert len(logged) == 2
    assert sample(agent, "pdrouter_decisions_total", route="PREFILL_NODE",
                  reason="invalid_input") == 4


def test_qps_gauge_shows_the_last_valid_rate() -> None:
    agent = RouterAgent(clock=VirtualClock(), initial_policy=checkerboard(1))
    agent.decide(later_turn(qps=12.5))
    agent.decide(later_turn(qps=float("nan")))
    assert sample(agent, "pdrouter_qps") == 12.5


# -- outcomes and metrics -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ttft", "tpot", "label"),
    [
        (0.5, 0.01, "met"),
        (1.0, 0.05, "met"),  # both exactly at the SLO
        (1.5, 0.01, "ttft_miss"),
        (0.5, 0.2, "tpot_miss"),
        (1.5, 0.2, "both_miss"),
        (0.5, None, "met"),  # one output token: no TPOT, meets it
        (float("nan"), None, "ttft_miss"),
    ],
)
def test_observe_judges_against_the_running_policys_slos(
    ttft: float, tpot: float | None, label: str
) -> None:
    agent = RouterAgent(clock=VirtualClock(), initial_policy=checkerboard(1))  # 1 s / 50 ms
    assert agent.observe(agent.decide(later_turn()), ttft, tpot) == label


def test_observe_without_a_policy_uses_the_default_slos() -> None:
    agent = RouterAgent(clock=VirtualClock())
    d = agent.decide(later_turn())
    assert agent.observe(d, Slo().ttft_s, Slo().tpot_s) == "met"
    assert agent.observe(d, Slo().ttft_s * 1.01, None) == "ttft_miss"


def test_observe_exports_outcomes_by_fixed_bins() -> None:
    agent = RouterAgent(clock=VirtualClock(), initial_policy=checkerboard(1))
    f = Features(turn=2, context_tokens=3000.0, append_tokens=300.0,
                 expected_output_tokens=100.0, qps=1.0)  # ctx bin 4096, io 3.0 -> bin 4
    d = agent.decide(f)
    agent.observe(d, 0.3, 0.02, f)
    agent.observe(d, 3.0, None, f)
    huge = Features(2, 1e6, 1e5, 1.0, 1.0)  # beyond the last edges
    agent.observe(d, 0.1, 0.01, huge)
    agent.observe(d, 0.1, 0.01)  # no features

    route = d.route.name
    got = samples(agent)

    def count(ctx: str, io: str, slo: str) -> float:
        key = tuple(sorted({"route": route, "ctx_bin": ctx, "io_bin": io, "slo": slo}.items()))
        return got[("pdrouter_requests_total", key)]

    assert count("4096", "4", "met") == 1
    assert count("4096", "4", "ttft_miss") == 1
    assert count("+Inf", "+Inf", "met") == 1
    assert count("unknown", "unknown", "met") == 1
    ttft = tuple(sorted({"route": route, "ctx_bin": "4096"}.items()))
    assert got[("pdrouter_ttft_seconds_count", ttft)] == 2
    assert got[("pdrouter_ttft_seconds_sum", ttft)] == pytest.approx(3.3)
    assert got[("pdrouter_tpot_seconds_count", ttft)] == 1  # the one-token request has none
    le_05 = tuple(sorted({"route": route, "ctx_bin": "4096", "le": "0.5"}.items()))
    assert got[("pdrouter_ttft_seconds_bucket", le_05)] == 1
    assert got[("pdrouter_context_tokens_bucket", (("le", "2048.0"),))] == 0
    assert got[("pdrouter_context_tokens_bucket", (("le", "4096.0"),))] == 2
    assert got[("pdrouter_context_tokens_count", ())] == 3
    assert got[("pdrouter_io_ratio_bucket", (("le", "4.0"),))] == 2
    assert got[("pdrouter_io_ratio_bucket", (("le", "+Inf"),))] == 3


def test_feature_bins_do_not_depend_on_the_policy() -> None:
    f = Features(2, 3000.0, 300.0, 100.0, 1.0)
    labels = []
    for policy in (checkerboard(1), Policy.uniform(1, Route.PREFILL_NODE)):
        agent = RouterAgent(clock=VirtualClock(), initial_policy=policy)
        agent.observe(agent.decide(f), 0.1, 0.01, f)
        labels.append({
            (dict(k[1])["ctx_bin"], dict(k[1])["io_bin"])
            for k, v in samples(agent).items() if k[0] == "pdrouter_requests_total" and v
        })
    assert labels[0] == labels[1] == {("4096", "4")}


def test_policy_age_and_staleness_follow_the_clock(caplog: pytest.LogCaptureFixture) -> None:
    clock = VirtualClock()
    agent = RouterAgent(clock=clock, stale_after_s=100.0)
    assert agent.policy_age_s() is None and not agent.is_stale()
    assert sample(agent, "pdrouter_policy_age_seconds") == -1
    agent.apply(checkerboard(1))
    clock.advance(60.0)
    assert agent.policy_age_s() == 60.0
    assert sample(agent, "pdrouter_policy_stale") == 0
    with caplog.at_level(logging.WARNING, logger=AGENT_LOGGER):
        clock.advance(41.0)
        assert agent.is_stale()
        assert sample(agent, "pdrouter_policy_stale") == 1
        assert sample(agent, "pdrouter_policy_age_seconds") == 101.0
        agent.is_stale()
    stale_lines = [r for r in caplog.records if "stale" in r.getMessage()]
    assert len(stale_lines) == 1
    agent.apply(checkerboard(2))
    assert not agent.is_stale()
    assert sample(agent, "pdrouter_policy_age_seconds") == 0
    with caplog.at_level(logging.WARNING, logger=AGENT_LOGGER):
        clock.advance(150.0)
        agent.observe(agent.decide(later_turn()), 0.1, 0.01)  # observe() notices it too
    stale_lines = [r for r in caplog.records if "stale" in r.getMessage()]
    assert len(stale_lines) == 2 and "v2" in stale_lines[1].getMessage()


def test_every_agent_has_its_own_registry() -> None:
    a = RouterAgent(clock=VirtualClock(), initial_policy=checkerboard(1))
    b = RouterAgent(clock=VirtualClock(), initial_policy=checkerboard(1))
    a.decide(later_turn())
    assert a.registry is not b.registry
    total_b = sum(v for (name, _), v in samples(b).items() if name == "pdrouter_decisions_total")
    assert total_b == 0


def test_decision_counts_add_up_to_the_decisions_made() -> None:
    rng = random.Random(7)
    agent = RouterAgent(clock=VirtualClock(), initial_policy=checkerboard(1, exploration=0.2),
                        draw=rng.random)
    made: dict[tuple[str, str], int] = {}
    for _ in range(500):
        f = Features(rng.choice([1, 2, 3]), rng.uniform(0, 20000), rng.uniform(0, 800),
                     rng.choice([0.0, 100.0]), rng.uniform(0, 20))
        d = agent.decide(f)
        made[(d.route.name, d.reason.value)] = made.get((d.route.name, d.reason.value), 0) + 1
    got = {
        (dict(labels)["route"], dict(labels)["reason"]): value
        for (name, labels), value in samples(agent).items() if name == "pdrouter_decisions_total"
    }
    assert {k: v for k, v in got.items() if v} == made
    assert len(got) == len(Route) * len(Reason)  # every series exists from the start


@pytest.mark.parametrize("kwargs", [{"decision_timeout_ms": 0.0}, {"stale_after_s": -1.0},
                                    {"decision_timeout_ms": float("nan")}])
def test_nonsense_limits_are_refused_at_construction(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        RouterAgent(clock=VirtualClock(), **kwargs)  # type: ignore[arg-type]
