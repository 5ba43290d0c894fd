"""PrefillQueueWatch: the prefill workers' waiting gauges as the router's prefill_waiting.

Unit tests go through an ``httpx.MockTransport``; the contract test polls a real loopback
HTTP server exposing the simulator's vLLM worker metrics (the exposition vLLM serves).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import start_http_server

from controller.clock import VirtualClock, WallClock
from controller.policy import Features, Overrides, Reason, Route
from controller.rollout.agent import RouterAgent
from controller.rollout.prefill_watch import PrefillQueueWatch, waiting_in
from controller.sim.vllm_metrics import WorkerMetrics
from tests.rollout.test_agent import checkerboard

VLLM = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} {a}
vllm:num_requests_waiting{{engine="1",model_name="m"}} {b}
"""
SGLANG = """# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{model_name="m"}} {a}
"""


def test_waiting_is_the_engines_gauge_summed_over_its_series() -> None:
    assert waiting_in(VLLM.format(a=2, b=3), "p0") == 5.0
    assert waiting_in(SGLANG.format(a=4), "p0") == 4.0
    assert waiting_in("# TYPE other gauge\nother 1\n", "p0") is None


def test_sglang_rank_replicas_are_one_queue_and_dp_ranks_are_summed() -> None:
    # --enable-metrics-for-all-schedulers: every TP rank of a scheduler reports its queue.
    tp4 = "# TYPE sglang:num_queue_reqs gauge\n" + "".join(
        f'sglang:num_queue_reqs{{model_name="m",tp_rank="{r}"}} {q}\n'
        for r, q in enumerate((3, 3, 4, 3)))
    assert waiting_in(tp4, "p0") == 4.0
    dp2 = "# TYPE sglang:num_queue_reqs gauge\n" + "".join(
        f'sglang:num_queue_reqs{{dp_rank="{d}",model_name="m",tp_rank="{r}"}} {q}\n'
        for d, r, q in ((0, 0, 2), (0, 1, 2), (1, 2, 5), (1, 3, 5)))
    assert waiting_in(dp2, "p0") == 7.0


class Workers:
    """Answers each URL with its queue; a URL in ``down`` refuses the connection."""

    def __init__(self, queues: dict[str, float]) -> None:
        self.queues = queues
        self.down: set[str] = set()
        self.calls = 0

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        url = str(request.url)
        if url in self.down:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, text=VLLM.format(a=self.queues[url], b=0))


URLS = ["http://p0:8000/metrics", "http://p1:8000/metrics"]


def watch_of(workers: Workers, clock: VirtualClock) -> PrefillQueueWatch:
    return PrefillQueueWatch(URLS, clock, interval_s=1.0, stale_after_s=5.0,
                             transport=httpx.MockTransport(workers.handler))


async def test_the_least_busy_fresh_worker_counts_and_stale_ones_drop_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = VirtualClock()
    workers = Workers({URLS[0]: 4, URLS[1]: 2})
    watch = watch_of(workers, clock)
    assert watch.value() is None  # nothing polled yet: unknown, never "busy"
    await watch.poll_once()
    assert watch.value() == 2.0

    workers.down.add(URLS[1])
    clock.advance(3.0)
    with caplog.at_level(logging.WARNING):
        await watch.poll_once()
        await watch.poll_once()
    assert watch.value() == 2.0  # p1's last answer is 3 s old: still fresh
    assert sum("p1:8000" in r.getMessage() for r in caplog.records) == 1  # logged once
    clock.advance(3.0)
    await watch.poll_once()
    assert watch.value() == 4.0  # p1 is stale now; p0 answered just now

    workers.down.add(URLS[0])
    clock.advance(6.0)
    assert watch.value() is None  # no fresh worker: the override must not fire
    await watch.aclose()


async def test_run_polls_until_stopped() -> None:
    workers = Workers({URLS[0]: 1, URLS[1]: 1})
    watch = PrefillQueueWatch(URLS, WallClock(), interval_s=0.01,
                              transport=httpx.MockTransport(workers.handler))
    stop = asyncio.Event()
    task = asyncio.create_task(watch.run(stop))
    for _ in range(200):  # bounded: 2 s at most
        if workers.calls >= 6:
            break
        await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(task, 5.0)
    assert workers.calls >= 6 and watch.value() == 1.0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        PrefillQueueWatch(URLS, VirtualClock(), interval_s=0.0)


@pytest.fixture
def vllm_worker() -> Iterator[tuple[WorkerMetrics, str]]:
    """A real HTTP server on loopback serving one simulated vLLM prefill worker's metrics."""
    worker = WorkerMetrics(model_name="m", kv_role="kv_producer", num_gpu_blocks=1000,
                           block_size=16, max_model_len=8192)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=worker.registry)
    try:
        yield worker, f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        thread.join(5.0)


async def test_contract_a_vllm_exposition_over_http(vllm_worker: tuple[WorkerMetrics, str]
                                                    ) -> None:
    worker, url = vllm_worker
    worker.waiting_capacity, worker.waiting_deferred = 2, 1
    watch = PrefillQueueWatch([url], WallClock(), timeout_s=2.0)
    await watch.poll_once()
    assert watch.value() == 3.0
    worker.waiting_capacity, worker.waiting_deferred = 0, 0
    await watch.poll_once()
    assert watch.value() == 0.0
    await watch.aclose()


def test_the_agent_fills_a_missing_prefill_waiting_from_its_source() -> None:
    queue: list[float | None] = [3.0]
    policy = dataclasses.replace(checkerboard(1), overrides=Overrides(first_turn_busy_waiting=2))
    agent = RouterAgent(clock=VirtualClock(), initial_policy=policy,
                        prefill_waiting=lambda: queue[0])
    turn_1 = Features(1, 0.0, 500.0, 100.0, 1.0)
    busy = agent.decide(turn_1)
    assert (busy.route, busy.reason) == (Route.DECODE_LOCAL, Reason.BUSY_PREFILL)
    # What the router reports wins over the watch.
    reported = agent.decide(dataclasses.replace(turn_1, prefill_waiting=0.0))
    assert reported.reason is Reason.FIRST_TURN
    queue[0] = None  # the watch knows nothing: turn 1 follows first_turn_route
    assert agent.decide(turn_1).reason is Reason.FIRST_TURN
