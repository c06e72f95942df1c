"""Ports to listen on that no outgoing connection can take in the meantime.

``free_port`` picks a free port outside the kernel's ephemeral range and never hands it
out twice until ``release``. Used by the simulations and by the node service, which picks
each bridge's loopback metrics port before the bridge binds it.
"""

from __future__ import annotations

import os
import random
import re
import socket
from pathlib import Path

#: Ports this process handed out: never twice, so two listeners chosen before either
#: binds never collide.
_handed_out: set[int] = set()
_pick = random.Random()  # its own generator: seeded schedules must not see these draws

#: Linux's default ephemeral range, where /proc does not say.
_EPHEMERAL_DEFAULT = (32768, 60999)

#: ``K/N`` (1 <= K <= N): this process, and the processes it starts, pick only from the
#: K-th of N equal slices of each span. The test suite gives each of its parallel workers
#: its own slice (tests/conftest.py), so two workers never draw the same port between a
#: probe and the bind. A chain ``K/N,J/M`` is the J-th of M equal parts of that slice, and
#: so on (``child_slice``). Unset: the whole spans.
SLICE_ENV = "TFT_BRIDGE_PORT_SLICE"


def _slice(spans: list[tuple[int, int]], given: str) -> list[tuple[int, int]]:
    for part in given.split(","):
        match = re.fullmatch(r"([0-9]+)/([0-9]+)", part.strip())
        if not match or not 1 <= int(match[1]) <= int(match[2]):
            raise ValueError(f"{SLICE_ENV}={given!r}: expected K/N with 1 <= K <= N (the K-th of N port slices), "
                             "or a chain of them (K/N,J/M: the J-th of M parts of that slice); unset it to pick "
                             "from every free port")
        k, n = int(match[1]), int(match[2])
        sliced = []
        for start, end in spans:
            width = (end - start + 1) // n
            sliced.append((start + (k - 1) * width, start + k * width - 1))
        spans = sliced
    return spans


def child_slice(index: int, count: int) -> str:
    """The ``SLICE_ENV`` value for the ``index``-th (1..``count``) of ``count`` parts of
    this process's slice (of every port where it has none): for a child process that
    picks ports on its own, so that processes which cannot see each other's picks never
    draw the same port. A process that also picks ports itself keeps a part for its own
    picks (``free_port(within=...)``)."""
    if not 1 <= index <= count:
        raise ValueError(f"part {index} of {count}: expected 1 <= part <= count")
    own = os.environ.get(SLICE_ENV, "").strip()
    return f"{own},{index}/{count}" if own else f"{index}/{count}"


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT


def candidate_spans(chosen: str | None) -> list[tuple[int, int]]:
    """The port ranges ``free_port`` picks from: 10000 up to the ephemeral range and above
    it up to 65535, each kept only when it holds 1000 ports or more; then the part of each
    the slice ``chosen`` (a ``SLICE_ENV`` value; None: the whole) names, empty parts dropped."""
    low, high = _ephemeral_range()
    spans = [(10000, low - 1), (high + 1, 65535)]  # 10000: clear of the ports services listen on
    spans = [(start, end) for start, end in spans if end - start >= 1000]
    if spans and chosen:
        spans = [(start, end) for start, end in _slice(spans, chosen) if end >= start]
    return spans


def free_port(within: str | None = None) -> int:
    """A TCP port free now, in the controller's accepted range (1024..65535) and outside
    the kernel's ephemeral range; from the slice ``within`` (a ``SLICE_ENV`` value) when
    given, else from this process's.

    A port the kernel picks for a bind to port 0 comes from the ephemeral range, the one
    every outgoing connection takes its source port from: between this probe and the
    listener's bind, a gRPC channel or a metrics scrape of a busy test run took such a
    port, and the stub controller's bind then failed (SystemExit 2, a start-up failure
    on a loaded machine). Outgoing connections never take a port outside the range, so
    this picks one there at random, every candidate port as likely (in this process's
    slice, ``SLICE_ENV``), checks it binds, and never hands it out twice."""
    spans = candidate_spans(within if within is not None else os.environ.get(SLICE_ENV))
    widths = [end - start + 1 for start, end in spans]
    for _ in range(200 if spans else 0):
        start, end = _pick.choices(spans, weights=widths)[0]  # every candidate port as likely
        port = _pick.randint(start, end)
        if port in _handed_out:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    while True:  # no usable span, or every try was taken: the kernel's pick
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port >= 1024 and port not in _handed_out:
            _handed_out.add(port)
            return port


def release(port: int) -> None:
    """``port`` may be handed out again (its listener is gone): a long-running process
    that picks one port per child (the node service) must not use the ranges up."""
    _handed_out.discard(port)
