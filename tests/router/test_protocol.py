"""The P/D protocol's request shaping, session affinity, features and the SSE scan."""

from __future__ import annotations

import json
import random

from controller.router.features import CompletionSessions, chat_shape
from controller.router.protocol import (
    MAX_NAMED_KEY_CHARS,
    MAX_NESTING,
    KeySource,
    body_problem,
    decode_body,
    handle_of,
    nesting_exceeds,
    pick_decode,
    prefill_body,
    session_key,
)
from controller.router.relay import SseScan
from controller.router.tokens import Estimate, TokenCounts

# The reference's field lists (docs/router.md, from vLLM's toy proxy and Ray Serve LLM).
PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}
HANDLE = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2],
          "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "h",
          "remote_port": 5, "tp_size": 1}


def test_prefill_leg_body_follows_the_field_list() -> None:
    client = {"model": "m", "messages": [], "stream": True, "max_tokens": 50,
              "max_completion_tokens": 50, "min_tokens": 3, "min_completion_tokens": 3,
              "stream_options": {"include_usage": True}, "temperature": 0.5}
    body = prefill_body(client)
    assert body == {"model": "m", "messages": [], "stream": False, "max_tokens": 1,
                    "max_completion_tokens": 1, "temperature": 0.5,
                    "kv_transfer_params": PREFILL_KV}
    assert client["max_tokens"] == 50 and "min_tokens" in client  # the client's body untouched
    assert "max_completion_tokens" not in prefill_body({"max_tokens": 9})


def test_decode_leg_carries_the_handle_restores_min_tokens_and_asks_for_usage() -> None:
    client = {"model": "m", "prompt": "p", "stream": True, "max_tokens": 50, "min_tokens": 3,
              "stream_options": {"continuous_usage_stats": False}}
    body = decode_body(client, HANDLE)
    assert body["kv_transfer_params"] == HANDLE
    assert body["min_tokens"] == 3 and body["max_tokens"] == 50 and body["stream"] is True
    assert body["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    local = decode_body({**client, "kv_transfer_params": {"x": 1}}, None)
    assert "kv_transfer_params" not in local  # decode-local: no handle at all
    assert "stream_options" not in decode_body({"prompt": "p", "stream": False}, None)


def test_handle_of_refuses_missing_or_empty_params() -> None:
    assert handle_of({"kv_transfer_params": HANDLE}) == HANDLE
    assert handle_of({"kv_transfer_params": None}) is None
    assert handle_of({"kv_transfer_params": {}}) is None
    assert handle_of({"choices": []}) is None
    assert handle_of([1]) is None


def test_a_long_client_session_name_is_keyed_by_its_digest() -> None:
    """A `user` field may fill a 16 MB body: the key the sessions' LRU keeps stays short,
    and the same name still gives the same key (the same decode worker)."""
    long_user = "a" * 1_000_000
    k, src = session_key({}, {"user": long_user}, chat=False, opening_chars=64)
    again, _ = session_key({}, {"user": long_user}, chat=False, opening_chars=64)
    other, _ = session_key({}, {"user": long_user + "b"}, chat=False, opening_chars=64)
    assert src is KeySource.USER and k == again and k != other and len(k) < 64
    edge = "s" * MAX_NAMED_KEY_CHARS
    assert session_key({"X-Session-Id": edge}, {}, chat=True, opening_chars=64)[0] == f"h:{edge}"
    longer, _ = session_key({"X-Session-Id": edge + "s"}, {}, chat=True, opening_chars=64)
    assert longer.startswith("h#") and len(longer) < 64


def test_session_key_precedence_header_then_user_then_opening() -> None:
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"}]
    later = [*msgs, {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]
    body = {"messages": msgs, "user": "alice"}
    k, src = session_key({"X-Session-Id": "S1"}, body, chat=True, opening_chars=64)
    assert src is KeySource.HEADER and k == "h:S1"
    k, src = session_key({}, body, chat=True, opening_chars=64)
    assert src is KeySource.USER and k == "u:alice"
    k1, src = session_key({}, {"messages": msgs}, chat=True, opening_chars=64)
    k2, _ = session_key({}, {"messages": later}, chat=True, opening_chars=64)
    other, _ = session_key({}, {"messages": [{"role": "user", "content": "q9"}]}, chat=True,
                           opening_chars=64)
    assert src is KeySource.OPENING and k1 == k2 and k1 != other
    c1, _ = session_key({}, {"prompt": "x" * 64 + "turn 1"}, chat=False, opening_chars=64)
    c2, _ = session_key({}, {"prompt": "x" * 64 + "turn 1 ... turn 2"}, chat=False,
                        opening_chars=64)
    assert c1 == c2


def test_rendezvous_hashing_moves_only_the_removed_instances_sessions() -> None:
    ds = [f"http://10.0.0.{i}:8000" for i in range(5)]
    keys = [f"s{i}" for i in range(5000)]
    before = {k: pick_decode(k, ds) for k in keys}
    share = {d: sum(1 for v in before.values() if v == d) / len(keys) for d in ds}
    assert all(0.15 < s < 0.25 for s in share.values()), share
    removed = ds[2]
    after = {k: pick_decode(k, [d for d in ds if d != removed]) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == removed for k in moved)
    shuffled = ds[:]
    random.Random(1).shuffle(shuffled)
    assert all(pick_decode(k, shuffled) == before[k] for k in keys[:500])  # order-free
    assert pick_decode("k", []) is None


def test_chat_features_split_at_the_last_assistant_message() -> None:
    counts = TokenCounts(Estimate(), loaded=False, source="estimate")
    first = [{"role": "user", "content": "a" * 400}]
    s1 = chat_shape(counts, first)
    assert (s1.turn, s1.context_tokens, s1.append_tokens) == (1, 0, 3 + 100 + 4)
    conv = [*first, {"role": "assistant", "content": "b" * 40},
            {"role": "user", "content": "c" * 80}]
    s2 = chat_shape(counts, conv)
    assert s2.turn == 2
    assert s2.context_tokens == 3 + 104 + 14 and s2.append_tokens == 24


def test_completion_sessions_continue_only_a_longer_prompt_and_stay_bounded() -> None:
    s = CompletionSessions(capacity=2)
    assert s.shape("a", 100).turn == 1
    s.record("a", 1, 100, 20)
    got = s.shape("a", 150)
    assert (got.turn, got.context_tokens, got.append_tokens) == (2, 120, 30)
    assert s.shape("a", 90).turn == 1  # shorter: a new conversation under the same key
    s.record("b", 1, 10, 1)
    s.record("c", 1, 10, 1)
    assert len(s) == 2 and s.shape("a", 150).turn == 1  # "a" was the least recent


def _ev(doc: object) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def _chunk(text: str, finish: str | None = None) -> dict[str, object]:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 6}}


def test_scan_times_tokens_strips_unasked_usage_and_handles_split_events() -> None:
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                         "finish_reason": None}]}
    stream = (_ev(role) + _ev(_chunk("ab")) + _ev(_chunk("cd")) + _ev(_chunk("ef", "length"))
              + _ev(USAGE) + b"data: [DONE]\n\n")
    scan = SseScan(chat=True, keep_usage=False)
    out = b""
    a = len(_ev(role)) + 10  # inside the first token's event
    b = len(_ev(role)) + len(_ev(_chunk("ab"))) + len(_ev(_chunk("cd"))) + 5
    for t, piece in enumerate([stream[:a], stream[a:b], stream[b:]]):
        out += scan.feed(piece, float(t))
    assert scan.done and scan.usage == USAGE["usage"]
    assert scan.first_t == 1.0 and scan.last_t == 2.0  # the role chunk is not a token
    assert b'"usage"' not in out and out.endswith(b"data: [DONE]\n\n")
    assert out.count(b"\n\n") == 5
    kept = SseScan(chat=True, keep_usage=True)
    assert kept.feed(stream, 0.0) == stream


def test_scan_counts_a_first_token_that_is_eos() -> None:
    scan = SseScan(chat=False, keep_usage=False)
    scan.feed(_ev({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}), 3.0)
    assert scan.first_t == 3.0


def test_a_first_turns_route_does_not_depend_on_its_length() -> None:
    """Why the router does not count a first turn before routing it (``Router._decide``)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from controller.cli.bench_decide import random_policy
    from controller.policy import Features, Overrides
    from controller.rollout.agent import RouterAgent

    # no decision budget: a loaded machine's TIMEOUT is about time, not about the length
    agents = [RouterAgent(initial_policy=random_policy(seed), decision_timeout_ms=1e6)
              for seed in range(4)]
    busy = random_policy(9)
    busy = type(busy)(version=busy.version, table=busy.table,
                      overrides=Overrides(first_turn_busy_waiting=3))
    agents.append(RouterAgent(initial_policy=busy, decision_timeout_ms=1e6))

    @settings(max_examples=200, deadline=None)
    @given(st.floats(0, 1e6), st.floats(0, 1e6), st.floats(1, 1e4), st.floats(0, 1e3),
           st.one_of(st.none(), st.floats(0, 10)))
    def check(ctx: float, append: float, out: float, qps: float, waiting: float | None) -> None:
        for agent in agents:
            uncounted = agent.decide(Features(1, 0.0, 0.0, out, qps, waiting))
            counted = agent.decide(Features(1, ctx, append, out, qps, waiting))
            assert uncounted.route is counted.route and uncounted.reason is counted.reason

    check()


def test_a_completions_turn_that_extends_the_last_prompt_encodes_only_its_addition() -> None:
    from pathlib import Path

    from controller.router.tokens import load_counts
    from controller.tokenize import bundled_tokenizer_dir

    counts = load_counts(bundled_tokenizer_dir())
    words = (Path(__file__).parents[2] / "docs" / "router.md").read_text().split()
    s = CompletionSessions(capacity=4)
    prompt = " ".join(words[:400])
    s.record("k", 1, counts.text(prompt), 20, prompt)
    longer = prompt + " " + " ".join(words[400:700])
    got = s.extension("k", longer)
    assert got is not None and got[1] == " " + " ".join(words[400:700])
    estimate = got[0] + counts.piece(got[1])
    assert abs(estimate - counts.text(longer)) <= 1  # one boundary, at most one token
    assert s.extension("k", "other " + longer) is None  # not the same conversation
    assert s.extension("k", prompt[:100]) is None  # shorter: a new conversation
    assert s.extension("nobody", longer) is None


def test_nesting_bound_counts_containers_only_and_holds_at_its_limit() -> None:
    def nested(depth: int) -> object:
        doc: object = "leaf"
        for i in range(depth):
            doc = [doc] if i % 2 else {"k": doc}
        return doc

    assert not nesting_exceeds(nested(MAX_NESTING))
    assert nesting_exceeds(nested(MAX_NESTING + 1))
    assert not nesting_exceeds({"a": "x" * 10_000, "b": 5, "c": None})
    deep = {"model": "m", "messages": [nested(MAX_NESTING)]}
    assert body_problem(deep, chat=True) == f"request body nests deeper than {MAX_NESTING} levels"
    ok = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": None}
    assert body_problem(ok, chat=True) is None
    assert body_problem({**ok, "stream": "true"}, chat=True) == "'stream' must be a boolean"
    assert body_problem({**ok, "model": 3}, chat=True) == "'model' must be a string"
