"""Everything the bridge takes from below Python's and gRPC's public surface, in one place.

Each item has a guard test (tests/test_grpc_internals.py) that fails where it is gone, rather
than the bridge silently falling back to a slower way:

* ``libc_function``: C library functions through ctypes; ``sched_getcpu`` and
  ``sched_setaffinity`` for the CPU pin (``affinity``), and ``gil_holding_write``, a
  ``write`` that keeps the GIL inside a controller callback (the controller blocks on
  every callback: docs/mindio-controller.md);
* ``after_send``: gRPC's private ``_channel`` of a synchronous unary callable, the one
  point where the request is written and the caller not yet waiting (the relay's thread
  turns realtime there);
* ``connectivity_check``: a synchronous channel's connectivity read at once, without
  ``Channel.subscribe`` and its polling thread (docs/performance.md).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import grpc

_CPU_SET_WORDS = 16  # glibc's cpu_set_t: 1 024 CPUs in unsigned longs
_CpuSet = ctypes.c_ulong * _CPU_SET_WORDS
_WORD_BITS = ctypes.sizeof(ctypes.c_ulong) * 8

#: ``sched_setaffinity(thread id, mask size, mask address)``, 0 or -1 with errno set.
SetAffinity = Callable[[int, int, int], int]


class CpuMask(NamedTuple):
    """A ``cpu_set_t`` and what ``sched_setaffinity`` takes of it, computed once (the pin
    runs inside a controller callback: no ctypes call there but the pin itself)."""

    words: Any  # the ctypes array, kept alive for ``address``
    size: int
    address: int


def cpu_mask(cpus: set[int] | frozenset[int]) -> CpuMask:
    words = _CpuSet()
    for cpu in cpus:
        if 0 <= cpu < _CPU_SET_WORDS * _WORD_BITS:
            words[cpu // _WORD_BITS] |= 1 << (cpu % _WORD_BITS)
    return CpuMask(words, ctypes.sizeof(words), ctypes.addressof(words))


def last_errno() -> int:
    """The errno a ``libc_function`` call left (they are made with ``use_errno``)."""
    return ctypes.get_errno()


def libc_function(name: str, keep_gil: bool) -> Callable[..., int] | None:
    """``sched_getcpu`` or ``sched_setaffinity`` from the C library, or None where it is
    missing. ``keep_gil``: a ``PyDLL`` function, which keeps the GIL (for the controller's
    thread, inside a callback); else a ``CDLL`` one, which releases it (for a call that may
    migrate the caller, which may then wait for its new CPU)."""
    try:
        library = ctypes.PyDLL(None, use_errno=True) if keep_gil else ctypes.CDLL(None, use_errno=True)
        function = getattr(library, name)
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_int
    function.argtypes = () if name == "sched_getcpu" else (ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p)
    return function  # type: ignore[no-any-return]


#: An eventfd write: one 8-byte counter increment.
EVENTFD_ONE = (1).to_bytes(8, sys.byteorder)


def gil_holding_write() -> Callable[[int, bytes, int], int] | None:
    """libc ``write`` called without releasing the GIL (ctypes ``PyDLL``); None where
    unavailable (no eventfd or no libc)."""
    if not hasattr(os, "eventfd"):
        return None
    try:
        write = ctypes.PyDLL(None).write
    except (OSError, AttributeError):
        return None
    write.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
    write.restype = ctypes.c_ssize_t
    return write  # type: ignore[no-any-return]


def after_send(callable_: Any, sent: Callable[[], None]) -> bool:
    """Make a synchronous gRPC unary callable run ``sent`` on the calling thread right
    after each call has started, which writes the request, and before it waits for the
    answer. False where this grpcio's callable has no ``_channel`` with a
    ``segregated_call`` to wrap (then nothing changes)."""
    inner = getattr(callable_, "_channel", None)
    if not callable(getattr(inner, "segregated_call", None)):
        return False
    callable_._channel = AfterSend(inner, sent)
    return True


class AfterSend:
    """gRPC's channel object as one method's callable sees it, telling ``sent`` once
    ``segregated_call`` has started the call, which writes the request; everything else
    goes to the channel object itself."""

    def __init__(self, channel: Any, sent: Callable[[], None]) -> None:
        self._channel = channel
        self._sent = sent

    def segregated_call(self, *args: Any, **kwargs: Any) -> Any:
        call = self._channel.segregated_call(*args, **kwargs)
        self._sent()
        return call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._channel, name)


#: gRPC core's connectivity numbers (what the private channel answers) as the public enum.
_CONNECTIVITY = {state.value[0]: state for state in grpc.ChannelConnectivity}

#: ``check(try_to_connect)``: a channel's connectivity now; ``try_to_connect`` starts a
#: connection when it is idle. Raises ``ValueError`` once the channel is closed.
ConnectivityCheck = Callable[[bool], grpc.ChannelConnectivity]


def connectivity_check(channel: grpc.Channel) -> ConnectivityCheck | None:
    """A synchronous channel's connectivity, read on the caller's thread with no thread,
    watch or timer of gRPC's (the one C call ``subscribe``'s polling thread makes after
    each watch); None where this grpcio's channel has no ``_channel`` to ask."""
    check = getattr(getattr(channel, "_channel", None), "check_connectivity_state", None)
    if not callable(check):
        return None

    def connectivity(try_to_connect: bool) -> grpc.ChannelConnectivity:
        return _CONNECTIVITY[check(try_to_connect)]
    return connectivity
