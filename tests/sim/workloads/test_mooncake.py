"""Mooncake linkage rule, session building and the real trace's counts."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest

from controller.data import TRACES_DIR
from controller.sim.workloads.mooncake import (
    TRACE_FILE,
    LinkedTrace,
    MooncakeWorkload,
    TraceRequest,
    link_requests,
)


def req(ts: int, input_tokens: int, ids: list[int], output_tokens: int = 100) -> TraceRequest:
    assert len(ids) == -(-input_tokens // 512), "one hash id per started 512-token block"
    return TraceRequest(ts, input_tokens, output_tokens, tuple(ids))


def real_trace_path() -> Path:
    return TRACES_DIR / TRACE_FILE


# --- the linkage rule on hand-made records ------------------------------------------------------

HAND_MADE = [
    req(0, 1536, [0, 1, 2]),  # 0: 3 full blocks
    req(0, 2560, [0, 1, 2, 3, 4]),  # 1: extends 0 (shares 3)
    req(3000, 3000, [0, 1, 2, 3, 4, 5]),  # 2: extends 1 (5) and 0 (3): longest wins -> 1
    req(3000, 1536, [0, 1, 2]),  # 3: same prompt as 0 -> parent 0, context = input - 1
    req(6000, 2000, [0, 1, 2, 9]),  # 4: contains 0 and 3 (both 3 blocks): latest -> 3
    req(6000, 2560, [0, 1, 2, 3, 7]),  # 5: shares 4 with 1 but lacks 1's block 4 -> 4 (3 shared)
    req(9000, 1024, [0, 20]),  # 6: 2 full blocks
    req(9000, 1400, [0, 20, 21]),  # 7: extends 6 with exactly 2 blocks
    req(9000, 700, [0, 30]),  # 8: only 1 full block: nobody can extend it
    req(12000, 1200, [0, 30, 31]),  # 9: shares 2 blocks with 8, but 8 has 1 full block -> root
    req(12000, 1024, [0, 1]),  # 10: shares 2 with 0 but not 0's whole prefix -> root
    req(12000, 1100, [40, 41, 42], output_tokens=10),  # 11: 2 full blocks + 76 tokens
    req(15000, 1600, [40, 41, 42, 43]),  # 12: shares 11's partial block -> parent in+out caps
]


def test_parent_is_the_longest_contained_prefix_then_the_latest() -> None:
    links = link_requests(HAND_MADE)
    assert [link.parent for link in links] == [-1, 0, 1, 0, 3, 4, -1, 6, -1, -1, -1, -1, 11]
    assert links[2].shared_blocks == 5
    assert links[5].shared_blocks == 3  # request 1 shares 4 blocks but is not contained


def test_context_is_the_min_of_shared_blocks_parent_tokens_and_input_minus_one() -> None:
    links = link_requests(HAND_MADE)
    assert links[1].context_tokens == 512 * 3  # shared blocks bind (parent has 1536 + 100)
    assert links[3].context_tokens == 1536 - 1  # an identical prompt keeps one token to compute
    assert links[12].context_tokens == 1100 + 10  # 3 shared blocks > parent input + output
    assert links[7].context_tokens == 1024


def test_two_full_blocks_are_required() -> None:
    records = [req(0, 1023, [0, 5]), req(3000, 2048, [0, 5, 6, 7])]
    assert link_requests(records)[1].parent == -1  # 1023 tokens: one full block only
    records = [req(0, 1024, [0, 5]), req(3000, 2048, [0, 5, 6, 7])]
    assert link_requests(records)[1].parent == 0


def _reference_links(records: list[TraceRequest]) -> list[tuple[int, int]]:
    """Brute force over all earlier requests, straight from the rule's wording."""
    out = []
    for i, r in enumerate(records):
        best = None
        for p in range(i):
            parent = records[p]
            full_p = parent.input_tokens // 512
            full_r = r.input_tokens // 512
            if full_p < 2 or full_r < full_p or r.hash_ids[:full_p] != parent.hash_ids[:full_p]:
                continue
            shared = 0
            while (
                shared < min(len(r.hash_ids), len(parent.hash_ids))
                and r.hash_ids[shared] == parent.hash_ids[shared]
            ):
                shared += 1
            if best is None or (shared, p) > best:
                best = (shared, p)
        out.append((-1, 0) if best is None else (best[1], best[0]))
    return out


def _random_chained_records(rng: random.Random, n: int) -> list[TraceRequest]:
    """Records with chained block ids: the same block contents after the same prefix get the
    same id, a partial last block (and its length) is part of what the id names."""
    ids_of_prefix: dict[tuple[object, ...], int] = {}
    contents: list[list[int]] = []
    records: list[TraceRequest] = []
    for i in range(n):
        content = [0]
        if contents and rng.random() < 0.7:
            base = rng.choice(contents)
            content = base[: rng.randint(1, len(base))]
        content = content + [rng.randint(1, 6) for _ in range(rng.randint(0, 4))]
        tail = rng.choice([1, 200, 511, 512])
        input_tokens = 512 * (len(content) - 1) + tail
        ids = []
        for k in range(len(content)):
            partial = tail if k == len(content) - 1 and tail < 512 else 512
            key = (*content[: k + 1], partial)
            ids.append(ids_of_prefix.setdefault(key, len(ids_of_prefix)))
        contents.append(content)
        records.append(TraceRequest(i * 1000, input_tokens, rng.randint(1, 600), tuple(ids)))
    return records


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_indexed_linkage_equals_brute_force(seed: int) -> None:
    records = _random_chained_records(random.Random(seed), 300)
    links = link_requests(records)
    expected = _reference_links(records)
    assert sum(p >= 0 for p, _ in expected) > 50, "the generator must produce many links"
    assert [(link.parent, link.shared_blocks) for link in links] == expected


def test_branches_keep_their_own_parent_inside_one_session() -> None:
    records = [
        req(0, 1536, [0, 1, 2]),
        req(3000, 2048, [0, 1, 2, 3]),  # child of 0
        req(6000, 2048, [0, 1, 2, 4]),  # another child of 0 (a branch), later
    ]
    trace = LinkedTrace.from_requests(records)
    assert trace.sessions == ((0, 1, 2),)
    workload = MooncakeWorkload(trace, jitter=False)
    (session,) = list(workload.sessions(random.Random(0)))
    assert [t.parent_turn for t in session.turns] == [0, 1, 1]
    assert session.turns[2].think_s == pytest.approx(3.0)  # from the previous turn in order


# --- the real trace ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def raw_rows() -> list[dict[str, object]]:
    with gzip.open(real_trace_path(), "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


@pytest.fixture(scope="module")
def workload() -> MooncakeWorkload:
    return MooncakeWorkload(real_trace_path())


def test_the_hour_holds_every_request_once(
    workload: MooncakeWorkload, raw_rows: list[dict[str, object]]
) -> None:
    sessions = list(workload.sessions(random.Random(5)))
    turns = [t for s in sessions for t in s.turns]
    assert len(turns) == 12_031  # controller/data/README.md: 12,031 requests
    assert len(sessions) == 8_056  # controller/data/README.md: 8,056 roots
    prompts = sorted(t.prompt_tokens for t in turns)
    assert prompts == sorted(int(r["input_length"]) for r in raw_rows)  # type: ignore[call-overload]
    outputs = sorted(t.output_tokens for t in turns)
    assert outputs == sorted(int(r["output_length"]) for r in raw_rows)  # type: ignore[call-overload]
    starts = [s.start_s for s in sessions]
    assert starts == sorted(starts)


def test_token_bookkeeping_of_every_turn(workload: MooncakeWorkload) -> None:
    for session in workload.sessions(random.Random(5)):
        for turn in session.turns:
            assert turn.context_tokens + turn.new_tokens == turn.prompt_tokens
            if turn.turn == 1:
                assert turn.context_tokens == 0
                continue
            parent = session.turns[turn.parent_turn - 1]
            assert 1023 <= turn.context_tokens <= parent.prompt_tokens + parent.output_tokens
            assert turn.new_tokens >= 1


def test_arrivals_are_spread_inside_the_timestamp_grid(
    workload: MooncakeWorkload, raw_rows: list[dict[str, object]]
) -> None:
    stamp_of = {i: int(r["timestamp"]) / 1000 for i, r in enumerate(raw_rows)}  # type: ignore[call-overload]
    offsets = []
    for session in workload.sessions(random.Random(11)):
        members = [int(session.session_id.split("-")[1])]
        first = session.turns[0]
        offsets.append(first.arrival_s - stamp_of[members[0]])
    assert all(0 <= off < 3.01 for off in offsets)
    # uniform over ~3 s: mean near 1.5, and not clumped at the grid value
    assert 1.4 < sum(offsets) / len(offsets) < 1.6
    assert sum(off < 0.3 for off in offsets) / len(offsets) < 0.15


def test_think_time_is_the_arrival_gap_to_the_previous_turn(workload: MooncakeWorkload) -> None:
    for session in workload.sessions(random.Random(3)):
        for previous, turn in zip(session.turns, session.turns[1:], strict=False):
            assert turn.think_s == pytest.approx(turn.arrival_s - previous.arrival_s)
            assert turn.think_s >= 0


def test_same_seed_same_sessions_other_seed_other_arrivals(workload: MooncakeWorkload) -> None:
    a = list(workload.sessions(random.Random(42)))
    b = list(workload.sessions(random.Random(42)))
    c = list(workload.sessions(random.Random(43)))
    assert a == b
    assert [s.start_s for s in a] != [s.start_s for s in c]
    assert sorted(len(s.turns) for s in a) == sorted(len(s.turns) for s in c)


def test_max_tokens_never_reveals_the_true_output(raw_rows: list[dict[str, object]]) -> None:
    pow2 = MooncakeWorkload(real_trace_path(), max_tokens="pow2")
    turns = [t for s in pow2.sessions(random.Random(1)) for t in s.turns]
    assert all(t.max_tokens >= t.output_tokens for t in turns)
    assert all(t.max_tokens & (t.max_tokens - 1) == 0 and t.max_tokens >= 32 for t in turns)
    assert sum(t.max_tokens == t.output_tokens for t in turns) < 0.01 * len(turns)
    cap = MooncakeWorkload(real_trace_path(), max_tokens="cap")
    largest = max(int(r["output_length"]) for r in raw_rows)  # type: ignore[call-overload]
    assert {t.max_tokens for s in cap.sessions(random.Random(1)) for t in s.turns} == {largest}


def test_max_sessions_keeps_the_earliest(workload: MooncakeWorkload) -> None:
    limited = MooncakeWorkload(real_trace_path(), max_sessions=10)
    assert (
        list(limited.sessions(random.Random(9))) == list(workload.sessions(random.Random(9)))[:10]
    )
