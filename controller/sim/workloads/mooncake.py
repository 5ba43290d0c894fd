"""Mooncake FAST'25 conversation trace as multi-turn sessions.

The trace (``traces/mooncake_fast25_conversation_trace.jsonl.gz``, Apache-2.0) has no session
ids; each request carries the hash ids of its 512-token prefix blocks (chained hashing: equal
ids mean equal prefixes). Linkage rule, applied in arrival (file) order:

- request ``r`` *extends* an earlier request ``p`` when ``p`` has at least 2 full blocks,
  ``r`` contains all of them (``r.hash_ids[:f_p] == p.hash_ids[:f_p]`` with
  ``f_p = p.input // 512`` and ``r`` having at least ``f_p`` full blocks of its own);
- the *parent* is, among those, the one with the longest shared prefix of hash ids
  (``shared``), the latest on ties;
- a linked request is a later turn of its parent's session with
  ``context_tokens = min(512 * shared, parent input + parent output, input - 1)`` and
  ``new_tokens = input - context_tokens``; any other request starts a session.

Arrivals: the trace's timestamps sit on a ~3 s grid; each request is placed uniformly at
random (seeded) between its grid value and the next one. ``think_s`` of a later turn is the
gap between its (jittered) arrival and that of the previous turn of the session: the
simulator adds the previous turn's real service time on top, so with ``think_s`` a session
lasts longer than in the trace; ``arrival_s`` keeps the trace time for a simulator that
replays ``max(arrival_s, previous completion)`` instead.

``max_tokens``: param ``max_tokens`` = ``"pow2"`` (default: next power of two >= the true
output, at least 32), ``"cap"`` (2,000 for every request, the trace's largest output) or an
integer; see :func:`~controller.sim.workloads.base.max_tokens_for`.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controller.data import TRACES_DIR
from controller.sim.workloads.base import (
    MaxTokensRule,
    Params,
    SessionSpec,
    TurnSpec,
    WorkloadError,
    max_tokens_for,
    open_text,
    reading,
    require_file,
)

if TYPE_CHECKING:
    import random

TRACE_FILE = "mooncake_fast25_conversation_trace.jsonl.gz"
BLOCK_TOKENS = 512
MIN_SHARED_BLOCKS = 2
DEFAULT_GRID_S = 3.0


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: int
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Link:
    parent: int  # index of the parent request, -1 for a session start
    shared_blocks: int
    context_tokens: int


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def link_requests(
    requests: Sequence[TraceRequest],
    *,
    block_tokens: int = BLOCK_TOKENS,
    min_shared_blocks: int = MIN_SHARED_BLOCKS,
) -> list[Link]:
    """The parent of every request under the linkage rule of the module docstring."""
    # (position, id) of a request's last full block -> requests whose full prefix ends there
    by_last_full_block: dict[tuple[int, int], list[int]] = defaultdict(list)
    links: list[Link] = []
    for i, req in enumerate(requests):
        ids = req.hash_ids
        full_blocks = min(req.input_tokens // block_tokens, len(ids))
        best: tuple[int, int] | None = None  # (shared blocks, parent index)
        for k in range(min_shared_blocks - 1, full_blocks):
            for p in by_last_full_block.get((k, ids[k]), ()):
                parent_ids = requests[p].hash_ids
                if tuple(ids[: k + 1]) != tuple(parent_ids[: k + 1]):
                    continue  # same id at that position but another prefix (not chained)
                candidate = (_common_prefix(ids, parent_ids), p)
                if best is None or candidate > best:
                    best = candidate
        if best is None:
            links.append(Link(parent=-1, shared_blocks=0, context_tokens=0))
        else:
            shared, p = best
            parent = requests[p]
            context = min(
                block_tokens * shared,
                parent.input_tokens + parent.output_tokens,
                req.input_tokens - 1,
            )
            links.append(Link(parent=p, shared_blocks=shared, context_tokens=context))
        if full_blocks >= min_shared_blocks:
            by_last_full_block[(full_blocks - 1, ids[full_blocks - 1])].append(i)
    return links


@dataclass(frozen=True, slots=True)
class LinkedTrace:
    requests: tuple[TraceRequest, ...]
    links: tuple[Link, ...]
    sessions: tuple[tuple[int, ...], ...]  # request indices per session, arrival order
    grid_width_s: tuple[float, ...]  # per request: span to the next distinct timestamp
    output_cap: int

    @classmethod
    def from_requests(cls, requests: Sequence[TraceRequest]) -> LinkedTrace:
        links = link_requests(requests)
        root = list(range(len(requests)))
        members: dict[int, list[int]] = defaultdict(list)
        for i, link in enumerate(links):
            if link.parent >= 0:
                root[i] = root[link.parent]
            members[root[i]].append(i)
        stamps = sorted({r.timestamp_ms for r in requests})
        steps = [(b - a) / 1000.0 for a, b in itertools.pairwise(stamps)]
        last_step = sorted(steps)[len(steps) // 2] if steps else DEFAULT_GRID_S
        width = {a: s for a, s in zip(stamps, steps, strict=False)}
        return cls(
            requests=tuple(requests),
            links=tuple(links),
            sessions=tuple(tuple(m) for _, m in sorted(members.items())),
            grid_width_s=tuple(width.get(r.timestamp_ms, last_step) for r in requests),
            output_cap=max((r.output_tokens for r in requests), default=1),
        )


def parse_records(lines: Iterator[str], source: str) -> list[TraceRequest]:
    requests = []
    previous_ms = 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            req = TraceRequest(
                timestamp_ms=int(row["timestamp"]),
                input_tokens=int(row["input_length"]),
                output_tokens=int(row["output_length"]),
                hash_ids=tuple(int(h) for h in row["hash_ids"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise WorkloadError(f"{source}:{number}: malformed Mooncake record: {exc}") from exc
        if req.input_tokens < 1 or req.output_tokens < 1 or req.timestamp_ms < previous_ms:
            raise WorkloadError(
                f"{source}:{number}: need input_length >= 1, output_length >= 1 and "
                f"non-decreasing timestamps"
            )
        previous_ms = req.timestamp_ms
        requests.append(req)
    return requests


@functools.lru_cache(maxsize=4)
def _load_cached(path: str, mtime_ns: int, size: int) -> LinkedTrace:
    del mtime_ns, size  # part of the cache key only: a changed file is parsed again
    with reading(path, "mooncake trace"), open_text(path) as fh:
        requests = parse_records(iter(fh), path)
    if not requests:  # refused: an empty file would run a bench of no requests, exit 0
        raise WorkloadError(f"{path}: no requests")
    return LinkedTrace.from_requests(requests)


def load_trace(path: Path) -> LinkedTrace:
    """Parse and link the trace; cached in memory per (path, mtime, size)."""
    require_file(path, "mooncake trace")
    stat = path.stat()
    return _load_cached(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


PARAMS = {"path", "max_sessions", "max_tokens", "jitter"}


class MooncakeWorkload:
    name = "mooncake"

    def __init__(
        self,
        trace: Path | LinkedTrace,
        *,
        max_sessions: int | None = None,
        max_tokens: MaxTokensRule = "pow2",
        jitter: bool = True,
    ) -> None:
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens
        self.jitter = jitter
        self.trace = load_trace(trace) if isinstance(trace, Path) else trace

    @classmethod
    def from_params(
        cls, params: Mapping[str, Any], traces_dir: Path = TRACES_DIR
    ) -> MooncakeWorkload:
        p = Params("mooncake", params, PARAMS)
        return cls(
            p.path("path", traces_dir / TRACE_FILE),
            max_sessions=p.optional_integer("max_sessions"),
            max_tokens=p.max_tokens_rule(),
            jitter=p.boolean("jitter", True),
        )

    def sessions(self, rng: random.Random) -> Iterator[SessionSpec]:
        trace = self.trace
        # one draw per request in file order, so a seed fixes every arrival
        arrival = [
            r.timestamp_ms / 1000.0 + (rng.random() * w if self.jitter else 0.0)
            for r, w in zip(trace.requests, trace.grid_width_s, strict=True)
        ]
        built = [self._session(members, arrival) for members in trace.sessions]
        built.sort(key=lambda s: (s.start_s, s.session_id))
        if self.max_sessions is not None:
            built = built[: self.max_sessions]
        yield from built

    def _session(self, members: Sequence[int], arrival: Sequence[float]) -> SessionSpec:
        trace = self.trace
        sid = f"mooncake-{members[0]}"
        turn_of = {index: n for n, index in enumerate(members, start=1)}
        turns = []
        for n, index in enumerate(members, start=1):
            req, link = trace.requests[index], trace.links[index]
            context = link.context_tokens if n > 1 else 0
            turns.append(
                TurnSpec(
                    session_id=sid,
                    turn=n,
                    arrival_s=arrival[index],
                    prompt_tokens=req.input_tokens,
                    new_tokens=req.input_tokens - context,
                    output_tokens=req.output_tokens,
                    max_tokens=max_tokens_for(req.output_tokens, self.max_tokens, trace.output_cap),
                    think_s=0.0 if n == 1 else max(0.0, arrival[index] - arrival[members[n - 2]]),
                    parent_turn=turn_of[link.parent] if n > 1 else 0,
                )
            )
        return SessionSpec(session_id=sid, start_s=arrival[members[0]], turns=tuple(turns))
