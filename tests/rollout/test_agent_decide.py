"""RouterAgent.decide(): same answers as controller.policy.decide, and no torn reads."""

from __future__ import annotations

import math
import random
import sys
import threading
import time
from collections.abc import Iterator

from hypothesis import given, settings
from hypothesis import strategies as st

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
    decide,
    locate,
)
from controller.rollout.agent import RouterAgent

NAN, INF = math.nan, math.inf


@st.composite
def edges(draw: st.DrawFn) -> tuple[float, ...]:
    values = draw(
        st.lists(
            st.one_of(st.integers(0, 100_000), st.floats(0.0, 1e5, allow_nan=False)),
            min_size=1, max_size=5, unique_by=float,
        )
    )
    return tuple(sorted(values, key=float))


@st.composite
def policies(draw: st.DrawFn) -> Policy:
    axes = Axes(context_tokens=draw(edges()), io_ratio=draw(edges()), qps=draw(edges()))
    n = axes.n_cells
    routes = tuple(draw(st.lists(st.sampled_from(Route), min_size=n, max_size=n)))
    scores = tuple(draw(st.lists(st.floats(-5, 5), min_size=n, max_size=n)))
    exploration = tuple(
        draw(st.lists(st.one_of(st.just(0.0), st.floats(0.0, 0.2)), min_size=n, max_size=n))
    )
    return Policy(
        version=draw(st.integers(1, 1000)),
        table=LookupTable(axes, routes, scores, exploration),
        overrides=Overrides(draw(st.sampled_from(Route)), draw(st.integers(0, 300)),
                            draw(st.sampled_from([0, 1, 2, 3])),
                            draw(st.sampled_from([0, 1, 2, 3]))),
        default_route=draw(st.sampled_from(Route)),
    )


def feature_value() -> st.SearchStrategy[float]:
    return st.one_of(
        st.floats(-10.0, 2e5),
        st.integers(-3, 200_000).map(float),
        st.sampled_from([0.0, NAN, INF, -INF, 1e300]),
    )


features = st.builds(
    Features,
    turn=st.one_of(st.integers(-1, 6), st.sampled_from([1.0, 2.5, NAN, INF])),
    context_tokens=feature_value(),
    append_tokens=feature_value(),
    expected_output_tokens=feature_value(),
    qps=feature_value(),
    prefill_waiting=st.one_of(st.none(), st.integers(0, 5).map(float),
                              st.sampled_from([1.5, -1.0, NAN, INF])),
)


class ScriptedDraw:
    """Replays one list of uniform draws and counts how many were taken."""

    def __init__(self, values: list[float]) -> None:
        self._values = values
        self.taken = 0

    def __call__(self) -> float:
        value = self._values[self.taken % len(self._values)]
        self.taken += 1
        return value


@settings(max_examples=200, deadline=None)
@given(
    policy=policies(),
    requests=st.lists(features, min_size=1, max_size=20),
    draws=st.lists(st.floats(0.0, 1.0, exclude_max=True), min_size=1, max_size=5),
)
def test_agent_decides_exactly_like_the_policy_contract(
    policy: Policy, requests: list[Features], draws: list[float]
) -> None:
    agent_draw, reference_draw = ScriptedDraw(draws), ScriptedDraw(draws)
    agent = RouterAgent(clock=VirtualClock(), initial_policy=policy, draw=agent_draw)
    for f in requests:
        assert agent.decide(f) == decide(policy, f, reference_draw)
    assert agent_draw.taken == reference_draw.taken


def test_large_tables_give_the_same_answers() -> None:
    rng = random.Random(3)
    axes = Axes(
        context_tokens=tuple(float(32 * (i + 1)) for i in range(40)),
        io_ratio=tuple(0.1 * (i + 1) for i in range(20)),
        qps=tuple(float(i + 1) for i in range(20)),
    )
    n = axes.n_cells
    policy = Policy(
        version=1,
        table=LookupTable(axes, tuple(rng.choice(list(Route)) for _ in range(n)),
                          (0.0,) * n, tuple(rng.choice([0.0, 0.1]) for _ in range(n))),
    )
    reference_rng = random.Random(4)
    agent_rng = random.Random(4)
    agent = RouterAgent(clock=VirtualClock(), initial_policy=policy, draw=agent_rng.random)
    for _ in range(3000):
        f = Features(2, rng.uniform(0, 1500), rng.uniform(0, 300), 100.0, rng.uniform(0, 25))
        assert agent.decide(f) == decide(policy, f, reference_rng.random)


# -- concurrency ----------------------------------------------------------------------------

EVEN_AXES = Axes(context_tokens=(256.0, 1024.0, 4096.0, 16384.0, 65536.0),
                 io_ratio=(0.25, 1.0, 4.0, 16.0), qps=(1.0, 4.0, 16.0, 64.0))  # 5 x 4 x 4
ODD_AXES = Axes(context_tokens=(100.0, 3000.0, 50000.0), io_ratio=(0.3, 3.0, 30.0),
                qps=(3.0, 30.0, 300.0))


def parity_policy(version: int) -> Policy:
    """Even versions: every route DECODE_LOCAL on 5x4x4 axes; odd: PREFILL_NODE on 3x3x3.

    Every field a decision reads differs with the parity, so a decision mixing two
    snapshots (route of one, axes or cells of the other) shows as a route/cell mismatch.
    """
    route, axes = (Route.DECODE_LOCAL, EVEN_AXES) if version % 2 == 0 else (
        Route.PREFILL_NODE, ODD_AXES)
    return Policy(
        version=version,
        table=LookupTable.uniform(route, axes),
        overrides=Overrides(first_turn_route=route),
        default_route=route,
    )


def random_features(rng: random.Random) -> Iterator[Features]:
    while True:
        kind = rng.random()
        if kind < 0.1:
            yield Features(1, 0.0, rng.uniform(1, 4000), 100.0, rng.uniform(0, 50))
        elif kind < 0.2:
            yield Features(3, NAN, 10.0, 10.0, 1.0)
        else:
            yield Features(rng.randint(2, 9), 10 ** rng.uniform(0, 5.5), 10 ** rng.uniform(0, 3),
                           10 ** rng.uniform(0, 3), 10 ** rng.uniform(-1, 2.5))


def expected_reason(f: Features) -> Reason:
    if math.isnan(f.context_tokens):
        return Reason.INVALID_INPUT
    return Reason.FIRST_TURN if f.turn == 1 else Reason.TABLE


def test_decisions_never_mix_two_policies_while_updates_land() -> None:
    policies = {v: parity_policy(v) for v in range(1, 201)}
    checksums = {v: p.checksum for v, p in policies.items()}
    agent = RouterAgent(clock=VirtualClock(), initial_policy=policies[1])
    problems: list[str] = []
    seen_versions: list[set[int]] = []
    writer_done = threading.Event()
    decided = [0] * 4  # each reader's decisions so far
    finished = [False] * 4

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        versions: set[int] = set()
        last_version = 0
        gen = random_features(rng)
        for n in range(200_000):  # bounded; normally ends soon after the writer
            if writer_done.is_set() and n >= 2000:
                break
            f = next(gen)
            d = agent.decide(f)
            parity_route_policy = policies[2] if d.route is Route.DECODE_LOCAL else policies[1]
            want_cell = locate(parity_route_policy, f) if d.reason is Reason.TABLE else None
            if d.reason is not expected_reason(f) or d.cell != want_cell:
                problems.append(f"{f} -> {d}")
            snap = agent.snapshot
            assert snap is not None
            if snap.policy.version != snap.version or checksums[snap.version] != snap.checksum:
                problems.append(f"snapshot v{snap.version} mixes fields")
            if snap.version < last_version:
                problems.append(f"went back from v{last_version} to v{snap.version}")
            last_version = snap.version
            versions.add(snap.version)
            decided[seed] += 1
        finished[seed] = True  # the writer waits for it no more
        seen_versions.append(versions)

    def writer() -> None:
        try:
            for v in range(2, 201):
                assert agent.apply(policies[v]).outcome.value == "applied"
                # Until every reader decided once more (bounded): on a loaded machine the
                # readers were not scheduled before the writer was done, and saw one version.
                mark, until = list(decided), time.monotonic() + 1.0
                while any(d <= m and not f for d, m, f in zip(decided, mark, finished,
                                                              strict=True)) \
                        and time.monotonic() < until:
                    time.sleep(0)
        finally:
            writer_done.set()

    previous_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: more interleavings per run
    try:
        threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(4)]
        threads.append(threading.Thread(target=writer))
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        sys.setswitchinterval(previous_interval)
    assert not any(t.is_alive() for t in threads)
    assert writer_done.is_set() and agent.checksum == checksums[200]
    assert problems == []
    assert len(seen_versions) == 4
    assert all(len(v) > 2 for v in seen_versions)  # the readers really overlapped the writer


def test_decide_reports_the_agents_decision_type() -> None:
    agent = RouterAgent(clock=VirtualClock(), initial_policy=parity_policy(2))
    d = agent.decide(Features(2, 300.0, 10.0, 10.0, 1.0))
    assert isinstance(d, Decision) and d.route is Route.DECODE_LOCAL and d.cell == (1, 1, 0)
