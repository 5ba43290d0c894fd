"""A first policy — the routers ran none, so nothing was adopted — that explores nowhere is
stored and pushed with ``adopted_exploration`` in every cell: otherwise the route it never
takes stays unmeasured and every later candidate is an extrapolation (issue 38, seen with
`pdctl router serve` started without an initial policy)."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.policy import loads
from tests.daemon.fakes import make_rig


async def _first_approved(tmp_path: Path, share: float, explores: float
                          ) -> tuple[tuple[float, ...], str, float | None]:
    rig = make_rig(tmp_path, routers=2, adopted_exploration=share)
    rig.learner.exploration = explores
    for _ in range(6):
        if (await rig.step()).approved_version == 1:
            break
    record = rig.store.policy(1)
    assert record is not None and record.status == "approved"
    stored = loads(record.body_json)
    assert {rig.agents[r].policy.version for r in rig.agents} == {1}  # pushed as stored
    return stored.table.exploration, record.reason, record.seeded_exploration


async def test_a_first_policy_that_explores_nowhere_is_seeded(tmp_path: Path) -> None:
    exploration, reason, seeded = await _first_approved(tmp_path, share=0.05, explores=0.0)
    assert set(exploration) == {0.05}
    assert seeded == 0.05
    assert "the first policy explored nowhere" in reason


@pytest.mark.parametrize(("share", "explores"), [(0.0, 0.0), (0.05, 0.1)])
async def test_it_is_left_as_calibrated_when_opted_out_or_already_exploring(
        tmp_path: Path, share: float, explores: float) -> None:
    exploration, reason, seeded = await _first_approved(tmp_path, share, explores)
    assert set(exploration) == {explores}
    assert seeded is None
    assert "explored nowhere" not in reason
