"""The hand-off thread on the controller's CPU: woken there, it runs when the callback ends.

The controller's callbacks wake the hand-off thread (``reports.Handoff``, THREAD mode),
which runs under ``SCHED_BATCH`` so that the wake-up never preempts the controller's
thread inside the callback (``realtime.py`` says why no other policy will do). Where a
batch thread runs is the scheduler's choice, and issue 16's end-to-end runs showed that
choice is the whole of the remaining gap to the synchronous client under load: with two
busy processes on a 2-core node, the controller's second ``report_fault_ranks`` reached
the event loop 2.1 ms later at the median (4.4 ms p99) whenever the hand-off thread
was queued behind a busy process on the *other* CPU, where it waits out that process's
slice. On the controller's own CPU it runs the moment the controller's thread goes back
to waiting, which it does right after its callbacks (``bench/bench_wakeup.py``, two and
four busy processes: hand-off p99 0.12-0.19 ms pinned against 4-8 ms unpinned, put p99
unchanged).

So each callback notes the CPU its thread runs on (``sched_getcpu``, a vDSO read
through a ``PyDLL`` call that keeps the GIL: well under a microsecond), and the hand-off
thread, after delivering a batch, pins itself to that CPU when it changed. The pin is
made with the GIL released: pinning a running thread migrates it, and it may then wait
for its new CPU; holding the GIL meanwhile would stall the event loop and the next
callback. The thread starts unpinned and is put back on its original CPUs when it ends.

Nothing here needs privilege. Where ``sched_getcpu`` or ``sched_setaffinity`` is
missing or refused, the hand-off thread keeps its CPUs, logs once and works as before.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

_CPU_SET_WORDS = 16  # glibc's cpu_set_t: 1 024 CPUs in unsigned longs
_CpuSet = ctypes.c_ulong * _CPU_SET_WORDS
_WORD_BITS = ctypes.sizeof(ctypes.c_ulong) * 8


def cpu_reader() -> Callable[[], int] | None:
    """``sched_getcpu`` called without releasing the GIL (for the controller's thread,
    inside a callback); None where the C library lacks it."""
    try:
        getcpu = ctypes.PyDLL(None).sched_getcpu
    except (OSError, AttributeError):
        return None
    getcpu.argtypes = ()
    getcpu.restype = ctypes.c_int
    return getcpu  # type: ignore[no-any-return]


def _setaffinity() -> Callable[[int, int, object], int] | None:
    """``sched_setaffinity`` called with the GIL released (``CDLL``)."""
    try:
        setaffinity = ctypes.CDLL(None, use_errno=True).sched_setaffinity
    except (OSError, AttributeError):
        return None
    setaffinity.argtypes = (ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p)
    setaffinity.restype = ctypes.c_int
    return setaffinity  # type: ignore[no-any-return]


def _mask(cpus: set[int] | frozenset[int]) -> _CpuSet:
    words = _CpuSet()
    for cpu in cpus:
        if 0 <= cpu < _CPU_SET_WORDS * _WORD_BITS:
            words[cpu // _WORD_BITS] |= 1 << (cpu % _WORD_BITS)
    return words


class CpuFollower:
    """One thread pinned to the CPU it is told: created on that thread (the hand-off
    thread), which calls ``follow``; ``release`` may come from any thread."""

    def __init__(self) -> None:
        self._setaffinity = _setaffinity()
        self.thread = threading.get_native_id()
        try:
            self.allowed = frozenset(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.allowed = frozenset()
        self.enabled = self._setaffinity is not None and len(self.allowed) > 1
        self.pinned = -1  # the CPU the thread is pinned to; -1: its original CPUs
        self.pins = 0  # how many times it moved (tests, benchmarks)

    def follow(self, cpu: int) -> None:
        """Pin the thread to ``cpu`` unless it already is (or following is off)."""
        if not self.enabled or cpu == self.pinned or cpu not in self.allowed:
            return
        if self._set({cpu}):
            self.pinned = cpu
            self.pins += 1
        else:
            self.enabled = False

    def release(self) -> None:
        """Back on the thread's original CPUs (idempotent)."""
        if self.pinned >= 0 and self._set(self.allowed):
            self.pinned = -1

    def _set(self, cpus: set[int] | frozenset[int]) -> bool:
        assert self._setaffinity is not None
        mask = _mask(cpus)
        if self._setaffinity(self.thread, ctypes.sizeof(mask), ctypes.addressof(mask)) == 0:
            return True
        error = ctypes.get_errno()
        log.warning("the controller hand-off thread cannot follow the controller's CPU (sched_setaffinity: "
                    "%s): callbacks then reach the event loop later when the node's cores are busy",
                    os.strerror(error))
        return False
