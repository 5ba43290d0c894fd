"""QpsMeter: the router's sliding-window arrival rate."""

from __future__ import annotations

import threading

import pytest

from controller.clock import VirtualClock
from controller.rollout.qps import QpsMeter


def test_rate_counts_arrivals_inside_the_window_only() -> None:
    clock = VirtualClock()
    meter = QpsMeter(clock, window_s=10.0)
    assert meter.rate() == 0.0
    for _ in range(12):  # 12 arrivals over 3 s (steps exact in binary floating point)
        meter.note_arrival()
        clock.advance(0.25)
    assert meter.rate() == 1.2
    clock.advance(7.0)  # the first arrival is now exactly window_s old: it has left
    assert meter.rate() == 1.1
    clock.advance(0.25)
    assert meter.rate() == 1.0
    clock.advance(10.0)
    assert meter.rate() == 0.0


def test_rate_is_windowed_not_a_cumulative_average() -> None:
    clock = VirtualClock()
    meter = QpsMeter(clock, window_s=5.0)
    for _ in range(1000):  # a long quiet period: 1 request every 10 s
        meter.note_arrival()
        clock.advance(10.0)
    for _ in range(100):  # then a burst: 50 requests/s for 2 s
        meter.note_arrival()
        clock.advance(0.02)
    assert meter.rate() == pytest.approx(100 / 5.0)


def test_memory_stays_bounded_by_the_window() -> None:
    clock = VirtualClock()
    meter = QpsMeter(clock, window_s=1.0)
    for _ in range(10_000):
        meter.note_arrival()
        clock.advance(0.01)
    assert len(meter._arrivals) <= 101
    assert meter.rate() == pytest.approx(99.0, abs=1.0)


def test_concurrent_arrivals_are_all_counted() -> None:
    meter = QpsMeter(VirtualClock(), window_s=60.0)

    def arrive() -> None:
        for _ in range(2000):
            meter.note_arrival()

    threads = [threading.Thread(target=arrive) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert meter.rate() == pytest.approx(8000 / 60.0)


def test_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window_s"):
        QpsMeter(VirtualClock(), window_s=0.0)
