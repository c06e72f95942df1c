"""sd_notify(3) in a few lines, no dependency: READY, STATUS, WATCHDOG, STOPPING.

The protocol is one datagram of newline-separated ``KEY=VALUE`` lines to the socket in
``$NOTIFY_SOCKET`` (a leading ``@`` names an abstract socket). Outside systemd the
variable is unset and every call is a cheap no-op, so the daemon calls it
unconditionally.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


class Notifier:
    """The unit's notify socket (``$NOTIFY_SOCKET``) and watchdog interval, read at construction;
    every call is a no-op outside systemd and never raises."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        address = env.get("NOTIFY_SOCKET", "")
        self._address: str | bytes | None = None
        if address.startswith("@"):
            self._address = "\0" + address[1:]
        elif address.startswith("/"):
            self._address = address
        self.watchdog_interval: float | None = None
        usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_interval = int(usec) / 1e6

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, **fields: str | int) -> bool:
        """Send ``KEY=VALUE`` lines (keyword names upper-cased); False when not sent."""
        if self._address is None:
            return False
        message = "\n".join(f"{key.upper()}={value}" for key, value in fields.items()).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(self._address)
                sock.sendall(message)
            return True
        except OSError as error:  # systemd gone or socket unwritable: never fatal
            log.warning("sd_notify failed: %s", error)
            return False

    def ready(self, status: str) -> bool:
        return self.notify(ready=1, status=status)

    def status(self, text: str) -> bool:
        return self.notify(status=text)

    def watchdog(self) -> bool:
        return self.notify(watchdog=1)

    def stopping(self, status: str) -> bool:
        return self.notify(stopping=1, status=status)
