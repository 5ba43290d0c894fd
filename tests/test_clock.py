from __future__ import annotations

import asyncio

import pytest

from controller.clock import Clock, VirtualClock, WallClock


def test_both_clocks_satisfy_the_protocol() -> None:
    assert isinstance(WallClock(), Clock) and isinstance(VirtualClock(), Clock)


async def test_virtual_sleepers_wake_in_deadline_order() -> None:
    clock = VirtualClock(start=100.0)
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, dt: float) -> None:
        await clock.sleep(dt)
        woke.append((name, clock.now()))

    tasks = [asyncio.create_task(sleeper("b", 5)), asyncio.create_task(sleeper("a", 2))]
    await asyncio.sleep(0)
    assert clock.pending_sleepers == 2
    clock.advance(1)
    await asyncio.sleep(0)
    assert woke == []
    clock.advance(10)
    await asyncio.gather(*tasks)
    assert [n for n, _ in woke] == ["a", "b"]
    assert clock.utcnow().timestamp() == 111.0


def test_virtual_clock_never_runs_backwards() -> None:
    clock = VirtualClock(start=10)
    with pytest.raises(ValueError):
        clock.set(5)
    with pytest.raises(ValueError):
        clock.advance(-1)
