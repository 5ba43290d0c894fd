"""Hostile metrics targets (issue 39, class 1): a real HTTP server on raw asyncio sockets that
trickles a byte a second, never finishes its headers, sends compression bombs (gzip, zlib
and raw deflate, gzip inside gzip), an endless chunked body, or an encoding we never asked
for. Each such target costs at most its total deadline and the size cap; the healthy
targets' observations are the same as without them."""

from __future__ import annotations

import gzip
import time
import tracemalloc
import zlib
from collections.abc import AsyncIterator

import pytest
from prometheus_client import generate_latest

from controller.observe.scrape import MAX_BODY_BYTES, ScrapeSource
from controller.observe.source import Target
from tests.faults.hostile_http import HostileServer
from tests.observe.cluster import VllmWorker

BOMB_DECODED = 256 * 1024 * 1024  # 8 x the cap


def _compress(kind: str, total: int) -> bytes:
    wbits = {"gzip": 31, "zlib": 15, "raw": -15}[kind]
    c = zlib.compressobj(9, zlib.DEFLATED, wbits)
    zeros = b"\0" * (1 << 20)
    parts = [c.compress(zeros) for _ in range(total >> 20)]
    return b"".join(parts) + c.flush()


@pytest.fixture(scope="module")
def bombs() -> dict[str, bytes]:
    g = _compress("gzip", BOMB_DECODED)
    return {"gzip": g, "zlib": _compress("zlib", BOMB_DECODED),
            "raw": _compress("raw", BOMB_DECODED), "gzip2": gzip.compress(g, 9)}


@pytest.fixture
async def hostile(bombs: dict[str, bytes]) -> AsyncIterator[tuple[HostileServer, VllmWorker]]:
    worker = VllmWorker()
    worker.hist["ttft_s"].observe(0.2)
    async with HostileServer(lambda: generate_latest(worker.registry), bombs) as server:
        yield server, worker


EXPECTED = {
    "trickle": ("timeout", "within"), "headers": ("timeout", "within"),
    "endless": ("parse", "larger than"), "gzip": ("parse", "larger than"),
    "zlib": ("parse", "larger than"), "raw": ("parse", "larger than"),
    "gzip2": ("parse", "larger than"), "br": ("parse", "not accepted"),
    "zstd": ("parse", "not accepted"),
}


@pytest.mark.integration
async def test_hostile_targets_cost_their_deadline_and_cap_and_nothing_else(
    hostile: tuple[HostileServer, VllmWorker],
) -> None:
    server, worker = hostile
    base = f"http://127.0.0.1:{server.port}"
    good = [Target("good", "decode", f"{base}/good"),
            Target("good_gzip", "decode", f"{base}/good_gzip")]
    bad = [Target(name, "prefill", f"{base}/{name}") for name in EXPECTED]
    timeout_s = 1.5
    alone = ScrapeSource(good, timeout_s=timeout_s)
    mixed = ScrapeSource(good + bad, timeout_s=timeout_s)
    try:
        await alone.window(0, 30)
        await mixed.window(0, 30)
        worker.hist["ttft_s"].observe(0.4)
        t0 = time.monotonic()
        w = await mixed.window(30, 60)
        elapsed = time.monotonic() - t0
        reference = await alone.window(30, 60)
    finally:
        await alone.aclose()
        await mixed.aclose()
    # the trickling targets would take TRICKLE_MAX_S; each costs its total deadline at most
    assert elapsed < 2 * timeout_s + 1.0, elapsed
    got = {f.target: (f.kind, f.message) for f in w.failures}
    assert set(got) == set(EXPECTED)
    for name, (kind, words) in EXPECTED.items():
        assert got[name][0] == kind and words in got[name][1], (name, got[name])
    assert list(w.answered) == ["good", "good_gzip"]
    assert [s.to_dict() for s in w.workers] == [s.to_dict() for s in reference.workers]
    for stats in w.workers:
        assert stats.ttft_s is not None and stats.ttft_s.count == 1
        assert stats.ttft_s.mean == pytest.approx(0.4)


@pytest.mark.integration
@pytest.mark.parametrize("bomb", ["gzip", "zlib", "raw", "gzip2", "endless"])
async def test_a_compression_bomb_costs_at_most_the_cap_in_memory(
    hostile: tuple[HostileServer, VllmWorker], bomb: str,
) -> None:
    server, _ = hostile
    source = ScrapeSource([Target(bomb, "decode", f"http://127.0.0.1:{server.port}/{bomb}")],
                          timeout_s=20.0)
    tracemalloc.start()
    try:
        w = await source.window(0, 30)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        await source.aclose()
    assert [f.kind for f in w.failures] == ["parse"]
    # decoded 256 MiB before the fix (and twice that while joining); now the cap + a margin
    # (the server's own bomb and chunk buffers in this process included)
    assert peak < MAX_BODY_BYTES + 16 * 1024 * 1024, peak
