"""SIGTERM and SIGINT, handled the same way by every long-running command.

``capture_signals(stop, others)``, a context manager used inside the running event loop:
the first signal calls ``stop`` (which only sets a flag or an event) and returns, so the
command's own code runs its graceful stop; a second one exits at once with 128 + the
signal number. ``others`` maps further signals (SIGHUP: reload) to handlers. The handlers
run as loop callbacks, between two steps of a task, and are removed on leaving.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

log = logging.getLogger("tft_bridge")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextmanager
def capture_signals(stop: Callable[[], None],
                    others: Mapping[signal.Signals, Callable[[], None]] | None = None) -> Iterator[None]:
    """While inside: the first SIGTERM/SIGINT calls ``stop``; the second exits the
    process now. ``others`` maps further signals (SIGHUP: reload) to their handlers.
    Use inside the running event loop."""
    loop = asyncio.get_running_loop()
    received: list[signal.Signals] = []

    def on_stop(signum: signal.Signals) -> None:
        received.append(signum)
        if len(received) > 1:  # the operator insists
            log.warning("second %s: exiting now, without a graceful stop", signum.name)
            os._exit(128 + signum)
        log.info("%s: stopping gracefully (send it again to exit at once)", signum.name)
        stop()

    handled = [*STOP_SIGNALS, *(others or {})]
    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, on_stop, signum)
    for signum, handler in (others or {}).items():
        loop.add_signal_handler(signum, handler)
    try:
        yield
    finally:
        for signum in handled:
            loop.remove_signal_handler(signum)
