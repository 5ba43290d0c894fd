"""sd_notify against a real AF_UNIX datagram socket, path and abstract forms."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.sdnotify import notify, watchdog_interval_s


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(5)
        yield sock, str(path)


def test_lines_arrive_as_one_datagram(receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    assert notify("READY=1", "STATUS=cycle 3 ok", env={"NOTIFY_SOCKET": path})
    assert sock.recv(4096) == b"READY=1\nSTATUS=cycle 3 ok"
    assert notify("STATUS=état ✓", env={"NOTIFY_SOCKET": path})
    assert sock.recv(4096).decode("utf-8") == "STATUS=état ✓"


def test_abstract_namespace_address() -> None:
    name = f"pdctl-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        assert notify("WATCHDOG=1", env={"NOTIFY_SOCKET": "@" + name})
        assert sock.recv(4096) == b"WATCHDOG=1"


def test_without_notify_socket_nothing_is_sent() -> None:
    assert notify("READY=1", env={}) is False
    assert notify("READY=1", env={"NOTIFY_SOCKET": ""}) is False


def test_a_missing_socket_is_an_error_not_silence(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        notify("READY=1", env={"NOTIFY_SOCKET": str(tmp_path / "absent.sock")})


def test_reads_the_process_environment(
    receiver: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, path = receiver
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert notify("STOPPING=1")
    assert sock.recv(4096) == b"STOPPING=1"


def test_watchdog_interval_is_half_the_timeout_for_this_pid() -> None:
    me = os.getpid()
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(me)}) == 15.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, pid=2) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "7"}, pid=7) == 0.5
    assert watchdog_interval_s({}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "abc"}) is None
