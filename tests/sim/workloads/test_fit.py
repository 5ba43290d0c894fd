"""The session shape fitted to Mooncake, and the sessions it synthesises for turn-less traces."""

from __future__ import annotations

import csv
import json
import random
import statistics
from pathlib import Path

import pytest

from controller.data import TRACES_DIR
from controller.sim.workloads.azure import TRACE_FILES, AzureWorkload
from controller.sim.workloads.base import SessionSpec, TurnSpec, WorkloadError, open_text
from controller.sim.workloads.fit import (
    QUANTILE_STEPS,
    SessionShape,
    SourceRequest,
    fit_from_trace,
    fit_session_shape,
    load_shape,
    main,
    shapes_match,
    synthesize_sessions,
)


def _session(sid: str, prompts_new_think: list[tuple[int, int, float]]) -> SessionSpec:
    turns = []
    for n, (prompt, new, think) in enumerate(prompts_new_think, start=1):
        turns.append(
            TurnSpec(
                sid, n, 10.0 * n, prompt, new, 10, 16, think, parent_turn=n - 1 if n > 1 else 0
            )
        )
    return SessionSpec(sid, 10.0, tuple(turns))


def test_fit_counts_turns_and_tabulates_think_and_append_ratio() -> None:
    sessions = [
        _session("a", [(100, 100, 0.0)]),
        _session("b", [(100, 100, 0.0), (300, 50, 10.0)]),
        _session("c", [(200, 200, 0.0), (500, 20, 30.0), (900, 100, 20.0)]),
    ]
    shape = fit_session_shape(sessions)
    assert shape.turns_counts == (1, 1, 1)
    assert shape.mean_turns == pytest.approx(2.0)
    assert shape.think_percentiles_s[0] == 10.0 and shape.think_percentiles_s[-1] == 30.0
    assert shape.percentile("think_percentiles_s", 0.5) == pytest.approx(20.0)
    # ratios: 50/100, 20/200, 100/200
    assert sorted({shape.append_ratio_percentiles[0], shape.append_ratio_percentiles[-1]}) == [
        0.1,
        0.5,
    ]
    assert len(shape.think_percentiles_s) == QUANTILE_STEPS + 1


def test_fit_needs_later_turns() -> None:
    with pytest.raises(WorkloadError, match="later turns"):
        fit_session_shape([_session("a", [(100, 100, 0.0)])])


def test_refit_on_the_real_trace_matches_the_stored_constants() -> None:
    stored = load_shape()
    refit = fit_from_trace()
    assert shapes_match(refit, stored)
    assert stored.provenance["source_sha256"] == refit.provenance["source_sha256"]
    assert main(["--check"]) == 0


def test_check_reports_a_stale_file(tmp_path: Path) -> None:
    stored = load_shape().to_json()
    stored["turns_counts"][0] += 1
    stale = tmp_path / "shape.json"
    stale.write_text(json.dumps(stored), encoding="utf-8")
    assert main(["--check", "--out", str(stale)]) == 1


def test_draws_follow_the_tables() -> None:
    shape = load_shape()
    rng = random.Random(3)
    turns = [shape.draw_turns(rng) for _ in range(40_000)]
    assert statistics.fmean(turns) == pytest.approx(shape.mean_turns, rel=0.03)
    assert sum(t == 1 for t in turns) / len(turns) == pytest.approx(
        shape.turns_counts[0] / sum(shape.turns_counts), abs=0.01
    )
    assert max(turns) <= shape.max_turns
    thinks = sorted(shape.draw_think_s(rng) for _ in range(20_000))
    assert thinks[len(thinks) // 2] == pytest.approx(shape.summary()["think_p50_s"], rel=0.05)
    assert thinks[int(0.9 * len(thinks))] == pytest.approx(shape.summary()["think_p90_s"], rel=0.05)


# --- synthesis ----------------------------------------------------------------------------------


def _requests(n: int) -> list[SourceRequest]:
    return [SourceRequest(i * 0.5, 400 + i % 7, 20 + i % 11) for i in range(n)]


def test_every_request_is_used_once_and_sessions_grow_their_prompt() -> None:
    requests = _requests(3000)
    sessions = synthesize_sessions(requests, load_shape(), random.Random(1), prefix="x")
    turns = [t for s in sessions for t in s.turns]
    assert len(turns) == len(requests)
    assert sorted(t.output_tokens for t in turns) == sorted(r.output_tokens for r in requests)
    assert any(len(s.turns) > 2 for s in sessions)
    for s in sessions:
        for prev, turn in zip(s.turns, s.turns[1:], strict=False):
            assert turn.context_tokens == prev.prompt_tokens + prev.output_tokens
            assert turn.prompt_tokens == turn.context_tokens + turn.new_tokens
            assert turn.arrival_s == pytest.approx(prev.arrival_s + turn.think_s)


def test_no_shape_means_single_turns() -> None:
    sessions = synthesize_sessions(_requests(50), None, random.Random(1), prefix="x")
    assert len(sessions) == 50 and all(len(s.turns) == 1 for s in sessions)


def test_sessions_end_before_the_prompt_limit() -> None:
    sessions = synthesize_sessions(
        _requests(2000), load_shape(), random.Random(2), prefix="x", max_prompt_tokens=600
    )
    assert all(t.prompt_tokens <= 600 for s in sessions for t in s.turns)
    assert sum(len(s.turns) for s in sessions) == 2000


@pytest.mark.parametrize("source", ["azure-conv", "azure-code"])
def test_azure_sessions_have_the_fitted_shape(source: str) -> None:
    path = TRACES_DIR / TRACE_FILES[source]
    with open_text(str(path)) as fh:
        rows = list(csv.DictReader(fh))
    shape = load_shape()
    stored = shape.summary()
    sessions = list(AzureWorkload.from_params(source, {}).sessions(random.Random(8)))
    turns = [t for s in sessions for t in s.turns]
    later = [t for t in turns if t.turn > 1]
    assert len(turns) == len(rows)
    assert sorted(t.output_tokens for t in turns) == sorted(int(r["GeneratedTokens"]) for r in rows)
    assert len(turns) / len(sessions) == pytest.approx(stored["mean_turns"], rel=0.05)
    single = sum(len(s.turns) == 1 for s in sessions) / len(sessions)
    assert single == pytest.approx(stored["single_turn_share"], abs=0.02)
    thinks = sorted(t.think_s for t in later)
    assert thinks[len(thinks) // 2] == pytest.approx(stored["think_p50_s"], rel=0.1)
    ratios = sorted(t.new_tokens / s.turns[0].prompt_tokens for s in sessions for t in s.turns[1:])
    assert ratios[len(ratios) // 2] == pytest.approx(stored["append_ratio_p50"], rel=0.1)
    assert ratios[int(0.9 * len(ratios))] == pytest.approx(stored["append_ratio_p90"], rel=0.15)
    starts = [s.start_s for s in sessions]
    assert starts == sorted(starts) and starts[0] == 0.0


def test_shape_rejects_bad_tables() -> None:
    good = load_shape()
    with pytest.raises(WorkloadError, match="think_percentiles_s"):
        SessionShape(good.turns_counts, (1.0, 2.0), good.append_ratio_percentiles)
    with pytest.raises(WorkloadError, match="turns_counts"):
        SessionShape((), good.think_percentiles_s, good.append_ratio_percentiles)
