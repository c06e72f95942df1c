"""Realtime scheduling for the event loop, and for the report relay's thread only while a call is out.

``promote`` puts the calling thread under ``SCHED_FIFO`` priority 1 with
``SCHED_RESET_ON_FORK`` (no thread or process it starts inherits it); ``batch_policy``
under ``SCHED_BATCH``, which the relay's thread takes while it waits for callbacks (woken
realtime, it would preempt the controller's thread inside the callback); it is realtime
only from a request's write until it waits again (``grpc_internals.after_send``).
``LoopPriority`` holds the loop's thread realtime while a bridge runs on it and puts it
back afterwards. Where Linux refuses (no CAP_SYS_NICE and ``RLIMIT_RTPRIO`` below 1,
``RestrictRealtime=yes``) the threads keep the normal policy, one log line says how to
allow it, and ``tft_bridge_realtime_thread{thread}`` shows 0: slower under load, never
wrong. Why: docs/architecture.md, "The threads and the loop"; figures in
docs/performance.md.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import NamedTuple

log = logging.getLogger(__name__)

#: ``tft_bridge_realtime_thread``'s label values, one per thread this module promotes.
LOOP = "loop"
REPORT = "report"

_FIFO = getattr(os, "SCHED_FIFO", None)
_RESET_ON_FORK = getattr(os, "SCHED_RESET_ON_FORK", 0)

_refused_logged = False
_batch_refused_logged = False
_lock = threading.Lock()


class _Saved(NamedTuple):
    """A thread's scheduling before its first promotion, and how many holders it has."""

    policy: int
    priority: int
    holders: int


_saved: dict[int, _Saved] = {}  # native thread id -> what to restore when the last holder lets go


def promote(priority: int, thread: str) -> bool:
    """Put the calling thread under ``SCHED_FIFO`` at ``priority`` (0: leave it as it is).

    True when it now runs realtime. A refusal is logged once per process, with the fix;
    it never raises: the thread then runs as before."""
    if priority <= 0 or _FIFO is None:
        return False
    try:
        os.sched_setscheduler(0, _FIFO | _RESET_ON_FORK, os.sched_param(priority))
    except OSError as error:
        _log_refusal(priority, thread, error)
        return False
    return True


def batch_policy() -> bool:
    """Put the calling thread under ``SCHED_BATCH``: woken, it never preempts the running
    thread (Linux, no privilege needed). False where that is not available, which costs
    latency, not correctness; said once per process."""
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None or not hasattr(os, "sched_setscheduler"):
        return False
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))  # 0: this thread, on Linux
    except OSError as error:
        global _batch_refused_logged
        if not _batch_refused_logged:
            _batch_refused_logged = True
            log.warning("the report wire's thread keeps the default scheduling policy (%s): controller callbacks "
                        "may block longer when they wake it", error)
        return False
    return True


def _log_refusal(priority: int, thread: str, error: OSError) -> None:
    global _refused_logged
    with _lock:
        if _refused_logged:
            return
        _refused_logged = True
    log.warning("the %s thread (and the bridge's other realtime thread) keeps the normal scheduling "
                "policy: SCHED_FIFO priority %d refused (%s). Reports and signals then wait for a core "
                "when the node's cores are busy. Allow it with LimitRTPRIO=%d and RestrictRealtime=no (the "
                "shipped unit does), or set controller.realtime_priority = 0 to silence this",
                thread, priority, error.strerror or error, priority)


class LoopPriority:
    """The event loop's thread realtime while a bridge runs on it, as it was afterwards.

    The loop thread is not the bridge's own (in the daemon it is the main thread; in a
    test it is the test runner's), so what ``hold`` changed ``release`` restores. Two
    bridges on one loop (tests) share the promotion: the last ``release`` restores."""

    def __init__(self, priority: int) -> None:
        self.priority = priority
        self._tid: int | None = None  # the loop's thread while this holds its promotion

    @property
    def realtime(self) -> bool:
        return self._tid is not None

    def hold(self) -> bool:
        """On the loop's thread. True when it runs realtime afterwards."""
        if self._tid is not None or self.priority <= 0 or _FIFO is None:
            return self.realtime
        tid = threading.get_native_id()
        with _lock:
            saved = _saved.get(tid)
            if saved is not None:
                _saved[tid] = saved._replace(holders=saved.holders + 1)
                self._tid = tid
                return True
        try:
            before = _Saved(os.sched_getscheduler(0), os.sched_getparam(0).sched_priority, 1)
        except OSError:
            return False
        if not promote(self.priority, LOOP):
            return False
        with _lock:
            _saved[tid] = before
        self._tid = tid
        return True

    def release(self) -> None:
        """On the same thread as ``hold``; idempotent."""
        tid, self._tid = self._tid, None
        if tid is None:
            return
        with _lock:
            saved = _saved.pop(tid)
            if saved.holders > 1:
                _saved[tid] = saved._replace(holders=saved.holders - 1)
                return
        try:
            os.sched_setscheduler(0, saved.policy, os.sched_param(saved.priority))
        except OSError as error:  # lowering one's own policy is always allowed; say so if not
            log.warning("could not restore the event loop thread's scheduling policy: %s", error)
