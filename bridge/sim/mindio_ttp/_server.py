"""The controller's TCP listener: a real socket, so "port in use" and "listening for
training ranks" are real. Connections are accepted and held open until the listener
stops; the stub's training ranks are driven through ``Training``, not over the wire.
"""

from __future__ import annotations

import contextlib
import ipaddress
import select
import socket
import threading
import time

_ACCEPT_POLL = 0.05


def is_zero_ip(ip: str) -> bool:
    """0.0.0.0 or :: (any spelling): the real controller refuses to bind them."""
    try:
        return ipaddress.ip_address(ip).is_unspecified
    except ValueError:
        return False


def resolve(ip: str, port: int) -> tuple[int, tuple[object, ...]] | None:
    """(family, sockaddr) for an IPv4/IPv6 literal or a host name; None if it does not resolve."""
    try:
        infos = socket.getaddrinfo(ip, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    family, _, _, _, sockaddr = infos[0]
    return family, sockaddr


class Listener:
    """The controller's listening socket and its daemon accept thread: :meth:`start`
    binds and starts the thread, :meth:`stop` ends both (owned by the controller)."""

    def __init__(self, family: int, sockaddr: tuple[object, ...], retry_for: float) -> None:
        self._family = family
        self._sockaddr = sockaddr
        self._retry_for = retry_for
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self.address: tuple[object, ...] = ()

    def start(self) -> None:
        """Bind, retrying for ``retry_for`` seconds like the real server's ~5 s of
        retries, then accept on a thread; raises OSError when the address stays unavailable."""
        deadline = time.monotonic() + max(0.0, self._retry_for)
        while True:
            sock = socket.socket(self._family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(self._sockaddr)
                sock.listen(128)
                break
            except OSError:
                sock.close()
                if time.monotonic() >= deadline:
                    raise
                time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        sock.setblocking(False)
        self._sock = sock
        self.address = sock.getsockname()
        self._thread = threading.Thread(target=self._accept_loop, args=(sock,), name="mindio-stub-accept",
                                        daemon=True)
        self._thread.start()

    def _accept_loop(self, sock: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([sock], [], [], _ACCEPT_POLL)
            except (OSError, ValueError):
                return
            if not ready:
                continue
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return
            self._conns.append(conn)

    def stop(self) -> None:
        """Stop accepting, close the listening socket and every accepted connection."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.close()
        self._conns.clear()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()
