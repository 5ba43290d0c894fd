"""Give freed heap memory back to the operating system.

A calibration allocates tens of MB of short-lived arrays, in a worker thread with its own
glibc malloc arena. When it ends Python frees them, but glibc keeps most of those pages
mapped (it only trims the top of the main arena), so without a trim the process's RSS
ratchets up with every calibration whose arrays land a little differently, although nothing
is leaked. ``malloc_trim(0)`` after the work releases the free pages in every arena.

Only glibc has ``malloc_trim``; elsewhere (musl, macOS) this does nothing.

A trim does not reach Python's own small-object allocator (pymalloc): it keeps its 1 MiB
arenas while any object in them lives, and a daemon that mixes long-lived objects (caches,
channels) with each cycle's short-lived ones leaves them ever more sparsely used. With
``PYTHONMALLOC=malloc`` every allocation goes through glibc, whose free pages
``malloc_trim`` does return, for a few per cent more CPU in a calibration. ``pdctl run``
therefore restarts itself with it (same PID) unless ``PYTHONMALLOC`` is already set.
The soak measurements behind this are in CHANGELOG.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys

log = logging.getLogger(__name__)


@functools.cache
def _libc_function(name: str) -> ctypes._NamedFuncPointer | None:
    """``name`` from the C library, None where it has none (looked up once: finding the
    library runs ``ldconfig``)."""
    path = ctypes.util.find_library("c")
    if path is None:
        return None
    try:
        fn: ctypes._NamedFuncPointer = getattr(ctypes.CDLL(path), name)
    except (OSError, AttributeError):  # not glibc
        return None
    return fn


def _malloc_trim() -> ctypes._NamedFuncPointer | None:
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
        trim.restype = ctypes.c_int
    return trim


def reexec_with_system_malloc() -> None:
    """Replace this process (same PID, same arguments) with one whose Python allocates
    through glibc, unless ``PYTHONMALLOC`` is set already (an operator's choice, or this is
    the re-executed process). Call before anything starts: threads and open files die."""
    if "PYTHONMALLOC" in os.environ:
        return
    os.environ["PYTHONMALLOC"] = "malloc"
    try:
        os.execv(sys.executable, sys.orig_argv)  # noqa: S606 (our own interpreter, same argv)
    except OSError as e:  # keep running on pymalloc rather than not at all
        log.warning("could not restart with PYTHONMALLOC=malloc: %s", e)


def resident_mb() -> dict[str, float]:
    """This process's resident memory in MB from ``/proc/self/status``: ``rss`` and its parts
    ``anon`` (heaps, arenas), ``file`` (mapped files) and ``shmem``; empty where there is no
    procfs."""
    keys = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}
    out: dict[str, float] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":", 1)[0] + ":"
                if key in keys:
                    out[keys[key]] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


def release_free_heap() -> bool:
    """Return the free pages of every malloc arena to the OS; True if any were released,
    False if none were or the C library has no ``malloc_trim``."""
    trim = _malloc_trim()
    if trim is None:
        return False
    return bool(trim(0))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def heap_stats() -> dict[str, float] | None:
    """glibc's view of the heap in MB: ``in_use`` (allocated and not freed, by C code and
    Python alike), ``free`` (freed but still held by malloc), ``mmapped`` (large blocks);
    None where the C library has no ``mallinfo2``. Tells a leak (in_use grows) from
    fragmentation (free grows)."""
    fn = _libc_function("mallinfo2")
    if fn is None:
        return None
    fn.restype = _MallInfo2
    info = fn()
    mb = 1024 * 1024
    return {"in_use": (info.uordblks + info.hblkhd) / mb, "free": info.fordblks / mb,
            "mmapped": info.hblkhd / mb}
