"""The event loop a router process runs on: uvloop where it is installed, else asyncio's.

uvloop (libuv) runs the router's per-request work (accepting, reading and writing sockets,
timers) in C; ``docs/router.md`` (*Performance*) has the figures with each loop. The choice
is ``[http] event_loop``: ``auto`` takes uvloop when it can be imported, ``uvloop`` requires
it, ``asyncio`` never uses it.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable, Coroutine
from enum import StrEnum
from typing import Any, TypeVar

from controller.errors import ConfigError

T = TypeVar("T")


class EventLoop(StrEnum):
    AUTO = "auto"
    UVLOOP = "uvloop"
    ASYNCIO = "asyncio"


def loop_factory(choice: EventLoop) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop constructor, or None for asyncio's default loop.

    Raises ConfigError when ``uvloop`` is asked for and cannot be imported."""
    if choice is EventLoop.ASYNCIO:
        return None
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:
        if choice is EventLoop.UVLOOP:
            raise ConfigError("http.event_loop = \"uvloop\" but uvloop is not installed "
                              "(pip install uvloop)") from None
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def loop_name(choice: EventLoop) -> str:
    """What ``choice`` runs on here: "uvloop" or "asyncio"."""
    return "asyncio" if loop_factory(choice) is None else "uvloop"


def run(main: Coroutine[Any, Any, T], choice: EventLoop) -> T:
    """``asyncio.run(main)`` on the loop ``choice`` selects."""
    with asyncio.Runner(loop_factory=loop_factory(choice)) as runner:
        return runner.run(main)
