"""A Prometheus that trickles its answer or never finishes its headers (issue 39, the query
path's side of class 1): the real HostileServer stands in for the HTTP API. One window's
queries cost at most the total deadline (``[prometheus] timeout_s``), whatever the server
sends and however slowly; the window fails with the deadline named (a transient error: the
cycle skips with that reason) and the next window is bounded the same way."""

from __future__ import annotations

import time

import pytest

from controller.errors import TransientError
from controller.observe.prometheus import (
    PrometheusClient,
    PrometheusSource,
    PrometheusUnavailable,
    WindowMode,
)
from controller.observe.source import Target
from tests.faults.hostile_http import TRICKLE_MAX_S, HostileServer

TARGETS = [Target("127.0.0.1:9101", "prefill"), Target("127.0.0.1:9201", "decode")]
EMPTY = b'{"status":"success","data":{"resultType":"vector","result":[]}}'
DEADLINE_S = 1.5
END = 1_800_000_000.0


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["edges", "increase"])
@pytest.mark.parametrize("behaviour", ["trickle", "headers"])
async def test_a_slow_prometheus_costs_a_window_its_total_deadline(
        behaviour: str, mode: WindowMode) -> None:
    async with HostileServer(lambda: EMPTY, {}) as server:
        client = PrometheusClient(f"http://127.0.0.1:{server.port}/{behaviour}",
                                  timeout_s=DEADLINE_S, retries=2, backoff_s=0.1)
        source = PrometheusSource(client, TARGETS, mode=mode)
        try:
            for k in range(2):  # the next window is bounded the same way
                t0 = time.monotonic()
                with pytest.raises(PrometheusUnavailable, match=f"within {DEADLINE_S:g} s") \
                        as caught:
                    await source.window(END - 30 * (2 - k), END - 30 * (1 - k))
                elapsed = time.monotonic() - t0
                assert isinstance(caught.value, TransientError)
                # a read timeout restarting on every byte took the trickle's whole length
                # (TRICKLE_MAX_S and more) for one query
                assert elapsed < DEADLINE_S + 1.0 < TRICKLE_MAX_S, elapsed
            t0 = time.monotonic()  # target discovery's call too
            with pytest.raises(PrometheusUnavailable, match=f"within {DEADLINE_S:g} s"):
                await client.targets()
            assert time.monotonic() - t0 < DEADLINE_S + 1.0
        finally:
            await source.aclose()
