"""The controller's callback thread and the report relay's thread pinned to one CPU.

``ControllerPin``: the controller's first callback on a thread pins that thread to the
CPU it runs on (``pin_caller``, on the controller's thread, keeping the GIL: nothing
migrates); the relay's thread pins itself to the same CPU once it has sent what that
callback woke it for (``follow``, GIL released: never before a send). From then on the
callback pays a thread-id comparison. The pin stays within the CPUs the bridge is
allowed; ``controller.pin_cpu = false`` turns it off; ``tft_bridge_controller_cpu`` shows
it (-1: not pinned). Where the system refuses, nothing is pinned and the relay's thread
logs it once (never the callback). ``release`` puts every pinned thread back. Why:
docs/architecture.md, "The threads and the loop"; figures in docs/performance.md.
"""

from __future__ import annotations

import logging
import os
import threading

from bridge.job.sched.grpc_internals import SetAffinity, cpu_mask, last_errno, libc_function

log = logging.getLogger(__name__)


def allowed_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its unit's ``CPUAffinity=``, its cpuset)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset()


class ControllerPin:
    """Pins the thread the controller calls back on, and the wire's thread after it,
    to the one CPU that thread first called back on. ``pin_caller`` runs on the
    controller's thread inside its first callback; ``follow`` on the wire's thread
    whenever it has nothing left to send; ``release`` on any thread."""

    def __init__(self, enabled: bool = True) -> None:
        self.allowed = allowed_cpus()
        self.getcpu = libc_function("sched_getcpu", keep_gil=True)
        self.pin_here: SetAffinity | None = libc_function("sched_setaffinity", keep_gil=True)
        self.pin_moving: SetAffinity | None = libc_function("sched_setaffinity", keep_gil=False)
        self.masks = {cpu: cpu_mask({cpu}) for cpu in self.allowed}
        self._everywhere = cpu_mask(self.allowed)
        #: Off where there is nothing to choose between or no way to pin.
        self.enabled = (enabled and len(self.allowed) > 1 and None not in
                        (self.getcpu, self.pin_here, self.pin_moving))
        self.cpu = -1  # where the controller's thread is pinned; -1: not (yet)
        self.handoff_cpu = -1  # where the wire's thread is pinned
        self.thread: int | None = None  # threading.get_ident() of the pinned controller thread
        self._pinned: set[int] = set()  # native ids of every thread pinned here (release puts them back)
        self._refusal = ""  # what refused the controller's pin: said by the wire's thread, not the callback
        self._lock = threading.Lock()  # follow and release, never the callback

    # ------------------------------------------------------------------ the controller's thread
    def pin_caller(self) -> None:
        """Pin the calling thread where it runs. The callback calls it only when
        ``enabled`` and its thread is not ``thread`` (``controller.make_callback`` makes
        that check inline: no Python frame on the controller's thread once pinned)."""
        if not self.enabled:
            return
        assert self.getcpu is not None and self.pin_here is not None
        cpu = self.getcpu()
        mask = self.masks.get(cpu)
        if mask is None:  # running outside the set it was allowed at start (a cpuset changed)
            self._refuse(f"the controller's thread runs on CPU {cpu}, outside the bridge's CPUs")
            return
        if self.pin_here(0, mask.size, mask.address) != 0:
            self._refuse(f"sched_setaffinity: {os.strerror(last_errno())}")
            return
        self._pinned.add(threading.get_native_id())
        self.thread = threading.get_ident()
        self.cpu = cpu

    def _refuse(self, why: str) -> None:
        self.enabled = False
        self._refusal = why

    # ------------------------------------------------------------------ the wire's thread
    def follow(self) -> None:
        """With nothing left to send: onto the controller's CPU when that changed; says
        once (here, off the controller's thread) when pinning was refused, and then
        unpins. Never raises: the wire's thread must outlive any trouble with its CPU."""
        try:
            self._follow()
        except Exception as error:  # noqa: BLE001 - pinning is an optimisation; delivery is not
            self._give_up(f"{type(error).__name__}: {error}")

    def _follow(self) -> None:
        if self._refusal:
            self._give_up(self._refusal)
            return
        cpu = self.cpu
        if cpu < 0 or cpu == self.handoff_cpu or not self.enabled:
            return
        assert self.pin_moving is not None
        mask = self.masks[cpu]
        with self._lock:
            if self.pin_moving(0, mask.size, mask.address) != 0:
                why = f"sched_setaffinity: {os.strerror(last_errno())}"
            else:
                self._pinned.add(threading.get_native_id())
                self.handoff_cpu = cpu
                return
        self._give_up(why)

    def _give_up(self, why: str) -> None:
        self._refusal = ""
        self.enabled = False
        log.warning("the controller's thread and the wire's thread stay unpinned (%s; the unit's "
                    "SystemCallFilter= must allow sched_setaffinity): callbacks then reach the event loop "
                    "later when the node's cores are busy", why)
        self.release()

    # ------------------------------------------------------------------ any thread
    def release(self) -> None:
        """Every thread pinned here back on the bridge's CPUs, and no pin after it
        (idempotent; a thread that has ended is skipped)."""
        with self._lock:
            self.enabled = False  # no pin after a release: the wire is closing or gave up
            pinned, self._pinned = self._pinned, set()
            self.cpu = self.handoff_cpu = -1
            self.thread = None
            if self.pin_moving is None:
                return
            for thread in pinned:
                self.pin_moving(thread, self._everywhere.size, self._everywhere.address)
