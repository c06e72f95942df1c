"""sd_notify against a real datagram socket, path and abstract."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from bridge.core.systemd import Notifier


def test_notify_to_path_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(path)
        server.settimeout(2)
        notifier = Notifier({"NOTIFY_SOCKET": path})
        assert notifier.enabled
        assert notifier.ready("controller listening")
        assert server.recv(4096) == b"READY=1\nSTATUS=controller listening"
        assert notifier.watchdog()
        assert server.recv(4096) == b"WATCHDOG=1"
        assert notifier.stopping("bye")
        assert server.recv(4096) == b"STOPPING=1\nSTATUS=bye"


def test_notify_to_abstract_socket() -> None:
    name = f"tft-bridge-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind("\0" + name)
        server.settimeout(2)
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).status("hello")
        assert server.recv(4096) == b"STATUS=hello"


def test_without_systemd_it_is_a_no_op() -> None:
    notifier = Notifier({})
    assert not notifier.enabled
    assert notifier.ready("x") is False
    assert notifier.watchdog_interval is None


def test_vanished_socket_is_not_fatal(tmp_path: Path) -> None:
    assert Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone")}).status("x") is False


def test_watchdog_interval_only_for_this_process() -> None:
    assert Notifier({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": str(os.getpid())}).watchdog_interval == 20.0
    assert Notifier({"WATCHDOG_USEC": "20000000"}).watchdog_interval == 20.0
    assert Notifier({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "1"}).watchdog_interval is None
