"""The hand-off thread on the controller's CPU: woken there, it runs when the callback ends.

The controller's callbacks wake the hand-off thread (``reports.Handoff``, THREAD mode),
which runs under ``SCHED_BATCH`` so that the wake-up never preempts the controller's
thread inside the callback (``realtime.py`` says why no other policy will do). Where a
batch thread runs is the scheduler's choice, and issue 16's end-to-end runs showed that
choice is the whole of the remaining gap to the synchronous client under load: with two
busy processes on a 2-core node, the controller's second ``report_fault_ranks`` reached
the event loop 1.4-2.1 ms later at the median (4.4-4.8 ms p99) whenever the hand-off
thread was queued behind a busy process on the *other* CPU, where it waits out that
process's slice. On the controller's own CPU it runs the moment the controller's thread
goes back to waiting, which it does right after its callbacks (``bench/bench_wakeup.py``,
two and four busy processes: hand-off p99 0.12-0.19 ms pinned against 4-8 ms unpinned).

So a callback pins the hand-off thread to the CPU its own thread runs on, *before* it
wakes it, whenever that CPU is not the one it pinned it to last time. Pinning after the
fact (the hand-off thread following the CPU the last callback noted) was measured too
and lost: the controller's thread had often moved since, and the wake-up then went to
its old CPU, behind a busy process (callback -> loop p99 4-5 ms at two and four busy).

The callback's cost stays a few C calls: ``sched_getcpu`` (a vDSO read) every time, and
``sched_setaffinity`` on the hand-off thread's id only when the CPU changed, both through
``ctypes.PyDLL``, which keeps the GIL: a call that released it would let another thread
take the GIL and keep the controller's thread waiting for it up to the switch interval
(5 ms). The hand-off thread is asleep in its queue nearly always, so the pin only
rewrites its CPU mask; pinned to one CPU of the set it started with, it never leaves the
node's cpuset.

Nothing here needs privilege. Where ``sched_getcpu`` or ``sched_setaffinity`` is
missing, filtered (the unit allows it back from ``@resources``) or refused, the bridge
logs once and the hand-off thread keeps all its CPUs: slower under load, never wrong.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
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


def _setaffinity() -> Callable[..., int] | None:
    """``sched_setaffinity`` called without releasing the GIL; None where missing."""
    try:
        setaffinity = ctypes.PyDLL(None, use_errno=True).sched_setaffinity
    except (OSError, AttributeError):
        return None
    setaffinity.argtypes = (ctypes.c_int, ctypes.c_size_t, ctypes.POINTER(_CpuSet))
    setaffinity.restype = ctypes.c_int
    return setaffinity  # type: ignore[no-any-return]


def _mask(cpus: frozenset[int]) -> _CpuSet:
    words = _CpuSet()
    for cpu in cpus:
        if 0 <= cpu < _CPU_SET_WORDS * _WORD_BITS:
            words[cpu // _WORD_BITS] |= 1 << (cpu % _WORD_BITS)
    return words


class HandoffPin:
    """What the callbacks need to pin one thread (the hand-off thread) to their CPU.

    ``make_callback`` reads the fields directly, so that the callback makes C calls
    only: ``masks`` (one CPU mask per CPU the thread may use; empty when pinning is off
    or refused), ``pinned`` (the CPU the callbacks last pinned it to, one slot),
    ``result`` (that pin's return code, -1 when the kernel refused it) and ``call`` (the
    pin itself, given a mask). A refusal at run time (a cpuset that changed) is logged by
    ``check``, from the hand-off thread."""

    def __init__(self, thread: int) -> None:
        self.thread = thread
        setaffinity = _setaffinity()
        try:
            self.allowed = frozenset(os.sched_getaffinity(thread))
        except (AttributeError, OSError):
            self.allowed = frozenset()
        self.pinned = [-1]
        self.result = [0]
        self.masks: dict[int, _CpuSet] = {}
        self._all = _mask(self.allowed)
        self.call: Callable[[_CpuSet], int] | None = None
        if setaffinity is None or len(self.allowed) < 2:
            return
        self.call = functools.partial(setaffinity, thread, ctypes.sizeof(_CpuSet))
        if self.call(self._all) != 0:  # a no-op pin: filtered or refused shows now, with the reason
            self._refused(os.strerror(ctypes.get_errno()))
            return
        self.enable(True)

    @property
    def enabled(self) -> bool:
        return bool(self.masks)

    def enable(self, on: bool) -> None:
        """Pin from the next callback on, or put the thread back on all its CPUs now."""
        if on and self.call is not None:
            self.masks.update({cpu: _mask(frozenset({cpu})) for cpu in self.allowed})
            return
        self.masks.clear()
        if self.call is not None and self.pinned[0] >= 0:
            self.call(self._all)
        self.pinned[0] = -1

    def check(self) -> None:
        """On the hand-off thread after a batch: a refused pin turns pinning off, once."""
        if self.result[0] != 0:
            self.result[0] = 0
            self._refused("the kernel refused it (has the cpuset changed?)")
            self.enable(False)

    def _refused(self, reason: str) -> None:
        log.warning("the controller hand-off thread keeps all its CPUs: pinning it to the controller's CPU "
                    "(sched_setaffinity) failed: %s. Callbacks then reach the event loop later when the node's "
                    "cores are busy; allow sched_setaffinity in the unit's SystemCallFilter=", reason)
