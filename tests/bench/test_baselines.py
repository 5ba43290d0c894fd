"""The Dynamo-style threshold rule: hand-computed cases, overrides, and the rule as the
simulated routers apply it through the ``decider`` hook."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from controller.bench.baselines import (
    ThresholdConfig,
    install_threshold,
    static_policy,
    threshold_from_options,
    threshold_route,
)
from controller.policy import Policy, Route
from controller.sim.run import run_scenario
from controller.sim.scenario import load_scenario

P, L = Route.PREFILL_NODE, Route.DECODE_LOCAL
DEFAULT = ThresholdConfig()


@pytest.mark.parametrize(
    ("prompt", "uncached", "waiting", "expected"),
    [
        (3000, 1000, 0, L),     # 1000 < 2048 and 1000/3000 = 0.33 < 0.7
        (10000, 2047, 0, L),    # just under the token limit, ratio 0.2
        (10000, 2048, 0, P),    # the token limit itself is not "under"
        (2000, 1400, 0, P),     # 1400/2000 = 0.70: the ratio limit itself is not "under"
        (2000, 1399, 0, L),     # 0.6995
        (2000, 1500, 1, P),     # ratio 0.75, one request waiting: not busy enough
        (2000, 1500, 2, L),     # ratio 0.75 but the least-busy prefill worker has 2 waiting
        (500, 500, 0, P),       # a first turn: nothing cached, ratio 1
        (500, 500, 3, L),       # ... sent decode-local only because prefill is busy
        (500, 500, None, P),    # no prefill worker known: the rule itself says prefill
    ],
)
def test_threshold_rule_by_hand(prompt: int, uncached: int, waiting: int | None,
                                expected: Route) -> None:
    assert threshold_route(DEFAULT, prompt, uncached, waiting) is expected


def test_overrides_change_the_rule() -> None:
    cfg = threshold_from_options({"max_uncached_tokens": 512, "max_uncached_ratio": 0.5,
                                  "prefill_waiting": 0})
    assert cfg == ThresholdConfig(512.0, 0.5, 0)
    assert threshold_route(cfg, 3000, 1000, 0) is P      # 1000 >= 512 now
    assert threshold_route(cfg, 3000, 500, 0) is L       # 500 < 512, ratio 0.17
    assert threshold_route(cfg, 3000, 2000, 50) is P     # busyness clause disabled
    with pytest.raises(ValueError, match="unknown key"):
        threshold_from_options({"max_tokens": 1})
    with pytest.raises(ValueError, match="prefill_waiting must be a whole number"):
        threshold_from_options({"prefill_waiting": 1.5})  # it ran as 1
    with pytest.raises(ValueError, match="max_uncached_tokens must be a number >= 0"):
        threshold_from_options({"max_uncached_tokens": math.nan})
    with pytest.raises(ValueError):
        ThresholdConfig(max_uncached_ratio=1.5)


SCENARIO = """
name = "threshold-in-sim"
seed = 2
duration_s = 60

[cluster]
prefill_workers = 1
decode_workers = 2

[workload]
source = "synthetic"

[workload.params]
qps = 4
turns = 3
turn1_input = 1024
turn1_output = 32
append_input = 1200
append_output = 32
think_s = 0.5
"""


def test_routers_apply_the_rule_through_the_decider_hook(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text(SCENARIO)
    scenario = load_scenario(path)
    # Without the busyness clause the route is a function of what each record shows.
    cfg = ThresholdConfig(max_uncached_tokens=2048, max_uncached_ratio=0.5, prefill_waiting=0)
    res = run_scenario(scenario, Policy.uniform(1, Route.PREFILL_NODE),
                       setup=install_threshold(cfg))
    routed = [r for r in res.records if not r.rejected]
    assert len(routed) > 50
    seen = set()
    for r in routed:
        expected = threshold_route(cfg, r.prompt_tokens, r.prompt_tokens - r.context_tokens,
                                   None)
        assert r.route == expected.name, r
        seen.add(r.route)
    # The workload has both kinds: turn 2 appends 1200 to a 1056-token context (ratio 0.53:
    # prefill), turn 3 appends 1200 to 2288 (ratio 0.34: decode-local).
    assert seen == {"PREFILL_NODE", "DECODE_LOCAL"}


def test_adaptive_starts_from_the_table_with_the_controllers_overrides() -> None:
    """The bench's adaptive loop runs what an operator would deploy: the ppd-static table
    with ``[ppd]``'s overrides (both busy overrides on by default), not the paper's bare
    table; setting both to 0 gives the bare one back."""
    from controller.bench.adaptive import adaptive_start
    from controller.config import load_settings
    from controller.policy import Overrides, Slo

    table = static_policy(Route.PREFILL_NODE, Slo())
    on = adaptive_start(table, load_settings(None))
    assert on.table == table.table
    assert on.overrides == Overrides(Route.PREFILL_NODE, 0, 2, 2)
    off = adaptive_start(table, load_settings(None, ppd={"first_turn_busy_waiting": 0,
                                                         "later_turn_busy_waiting": 0}))
    assert off.overrides == table.overrides


def test_fleet_changes_count_a_promotion_the_watch_rolled_back(tmp_path: Path) -> None:
    from datetime import UTC, datetime

    from controller.bench.adaptive import fleet_changes
    from controller.clock import VirtualClock
    from controller.policy import dumps
    from controller.store import Store

    clock = VirtualClock(1000.0)
    with Store(f"sqlite:///{tmp_path / 'h.db'}", clock) as store:
        store.upgrade()
        for version in (1, 2, 3, 4):
            body = dumps(Policy.uniform(version, Route.PREFILL_NODE))
            store.add_policy(version, f"{version:02x}" * 32, body, "approved", "learned")
            clock.advance(100.0)
        store.set_policy_status(3, "rolled_back", "canary rolled back: worse")  # never fleet
        store.mark_promoted(2, datetime.fromtimestamp(1350.0, UTC))
        store.mark_promoted(4, datetime.fromtimestamp(1450.0, UTC))
        clock.advance(100.0)  # 1500 s: v4's promotion is undone (back to v2), then v2's
        store.set_policy_status(4, "rolled_back", "rolled back after promotion: ...")
        clock.advance(30.0)
        store.set_policy_status(2, "rolled_back", "rolled back after promotion: ...")
        approvals, rollbacks = fleet_changes(store)
    assert [(t, p.version) for t, p in approvals] == [(1000.0, 1), (1100.0, 2), (1300.0, 4)]
    assert [(t, p.version) for t, p in rollbacks] == [(1500.0, 2), (1530.0, 1)]
