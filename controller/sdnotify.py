"""sd_notify(3) by hand: a few ``KEY=VALUE`` lines in one datagram to ``$NOTIFY_SOCKET``.

No library: ``sdnotify`` hides every error and has no watchdog support, ``systemd-python``
needs libsystemd headers. Without ``NOTIFY_SOCKET`` (not run by systemd) every call is a no-op.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


def notify(*lines: str, env: Mapping[str, str] | None = None) -> bool:
    """Send ``READY=1``, ``WATCHDOG=1``, ``STOPPING=1``, ``STATUS=...``; False if not systemd."""
    address = (os.environ if env is None else env).get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        # Never block the caller (an event loop): a full receiver queue raises
        # BlockingIOError instead of hanging until systemd reads.
        sock.setblocking(False)
        sock.connect(address)
        sock.sendall("\n".join(lines).encode("utf-8"))
    return True


def watchdog_interval_s(
    env: Mapping[str, str] | None = None, pid: int | None = None
) -> float | None:
    """How often to send ``WATCHDOG=1`` (half of ``WATCHDOG_USEC``), or None when not asked."""
    env = os.environ if env is None else env
    usec = env.get("WATCHDOG_USEC", "")
    watchdog_pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if watchdog_pid and watchdog_pid != str(os.getpid() if pid is None else pid):
        return None  # the watchdog belongs to another process (e.g. our parent)
    return int(usec) / 2e6
