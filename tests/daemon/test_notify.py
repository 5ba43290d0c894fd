"""The daemon's sd_notify wrapper never blocks or raises: a full or missing socket is skipped."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from controller.daemon import notify


def test_a_full_notify_socket_does_not_block_the_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "n.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind(path)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        sent = [notify("WATCHDOG=1") for _ in range(2000)]  # nobody reads: the queue fills
        assert sent[0] is True and sent[-1] is False
        receiver.settimeout(1)
        assert receiver.recv(64) == b"WATCHDOG=1"


def test_a_missing_notify_socket_is_logged_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "absent.sock"))
    assert notify("READY=1") is False
    assert "sd_notify READY=1 failed" in caplog.text
