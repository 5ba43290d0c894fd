"""What a daemon keeps in memory stays bounded however long it runs (the soak found every
calibration's candidate policy cached for good), and freed heap goes back to the OS."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from controller.heap import _malloc_trim, release_free_heap, resident_mb
from controller.loop.policies import RecentPolicies
from controller.policy import Policy, Route
from tests.support.processes import REPO


def test_recent_policies_keep_only_the_latest_versions() -> None:
    cache = RecentPolicies(capacity=4)
    for v in range(1, 101):
        cache[v] = Policy.uniform(v, Route.PREFILL_NODE)
    assert list(cache) == [97, 98, 99, 100]


def test_a_version_cached_again_is_the_newest() -> None:
    cache = RecentPolicies(capacity=3)
    for v in (1, 2, 3):
        cache[v] = Policy.uniform(v, Route.PREFILL_NODE)
    cache[1] = cache[1]  # read back from the store after an eviction, cached again
    cache[4] = Policy.uniform(4, Route.DECODE_LOCAL)
    assert list(cache) == [3, 1, 4]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_free_heap_goes_back_to_the_os_on_glibc() -> None:
    assert _malloc_trim() is not None  # the CI images are Debian: glibc
    # 64 KiB blocks come from the heap (under the mmap threshold); the last one stays alive
    # and pins the top, so glibc's own trim-on-free cannot give the rest back.
    blocks = [bytearray(b"x" * (64 * 1024)) for _ in range(2000)]
    pin = blocks.pop()
    del blocks
    before = resident_mb()["rss"]
    assert release_free_heap() is True
    assert before - resident_mb()["rss"] > 50  # of the ~125 MB freed
    del pin


def test_reexec_switches_python_to_the_system_allocator() -> None:
    # pymalloc counts its blocks; with PYTHONMALLOC=malloc there are none to count.
    script = ("import os, sys; from controller.heap import reexec_with_system_malloc; "
              "reexec_with_system_malloc(); "
              "print(os.getpid(), os.environ['PYTHONMALLOC'], sys.getallocatedblocks())")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONMALLOC"}
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, check=True,
                         capture_output=True, text=True, timeout=60).stdout.split()
    assert out[1:] == ["malloc", "0"]
    # an operator's explicit choice is kept
    env["PYTHONMALLOC"] = "pymalloc"
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, check=True,
                         capture_output=True, text=True, timeout=60).stdout.split()
    assert out[1] == "pymalloc" and int(out[2]) > 0
