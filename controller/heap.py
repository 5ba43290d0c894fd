"""Give freed heap memory back to the operating system.

A calibration allocates tens of MB of short-lived arrays, in a worker thread with its own
glibc malloc arena. When it ends Python frees them, but glibc keeps most of those pages
mapped (it only trims the top of the main arena), so the process's RSS ratchets up with every
calibration whose arrays landed a little differently, although nothing is leaked. The soak
benchmark showed this (RSS +22 % over half a simulated week with Python objects flat);
``malloc_trim(0)`` after the work releases the free pages in every arena.

Only glibc has ``malloc_trim``; elsewhere (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)


@functools.cache
def _malloc_trim() -> ctypes._NamedFuncPointer | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Return the free pages of every malloc arena to the OS; True if any were released,
    False if none were or the C library has no ``malloc_trim``."""
    trim = _malloc_trim()
    if trim is None:
        return False
    return bool(trim(0))
