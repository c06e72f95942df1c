"""Hosting the MindIO TFT controller: loading, registration order, start, notify, destroy.

The controller calls its four callbacks on its own C++ state-machine thread and is
blocked until they return; an exception escaping one makes it abandon recovery and kill
the job's ranks, a SystemExit aborts the whole process. So the callbacks installed here
do exactly one thing: hand the arguments to the event loop and return 0. They never
raise, never block and never copy a fault map on the controller's thread (copying
100 000 ranks would block it for half a millisecond); the controller builds a fresh dict
for every call and never touches it again, and the loop validates and copies it.

Every instruction on the controller's thread counts: the thread has just woken, so
its caches are cold and each bytecode costs several times its warm price. The callback
builds one plain tuple and calls a C-level queue put (about 0.3 us warm, against 1.1 us
for a dataclass and a Python-level put); the hand-off thread turns the tuple into a
``ControllerReport``.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from types import ModuleType
from typing import Any, NamedTuple

from .config import STUB_CONTROLLER, ControllerConfig

log = logging.getLogger(__name__)

CALLBACKS = ("report_fault_ranks", "report_stop_complete", "report_strategies", "report_result")


class StartupError(RuntimeError):
    """The controller could not be loaded, initialised or started."""


class ControllerReport(NamedTuple):
    """One callback invocation, as handed to the event loop."""

    callback: str
    args: tuple[Any, ...]
    at: float  # time.monotonic() on the controller's thread
    waiter: Future[int] | None = None  # resolved with the delivery outcome (seed API callers)


# What a callback puts on the hand-off queue: a ControllerReport's fields as a plain
# tuple (a ControllerReport itself is one too).
ReportFields = tuple[str, tuple[Any, ...], float, "Future[int] | None"]


class Handoff:
    """Controller thread -> event loop, without giving up the GIL inside the callback.

    Waking the event loop directly (``call_soon_threadsafe``) writes to its self-pipe: a
    syscall that releases the GIL, after which the woken loop takes the GIL and the
    controller's thread waits, up to the interpreter's switch interval, to get it back
    and return. A ``SimpleQueue.put`` keeps the GIL; this thread, blocked in ``get``
    until then, does the waking once the callback has returned, and hands over every
    report queued meanwhile in one batch.

    The put still wakes this thread (a futex syscall). Under the normal scheduling
    policy Linux may preempt the controller's thread right there to run the woken one,
    which then only waits for the GIL: that doubled the callback's median block time and
    put most of its tail above 40 us. This thread therefore runs as ``SCHED_BATCH``,
    which never preempts on wake-up and keeps its normal CPU share.
    """

    _STOP = object()

    def __init__(self, loop: asyncio.AbstractEventLoop, handle: Callable[[list[ControllerReport]], None]) -> None:
        self._loop = loop
        self._handle = handle
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        # The callbacks' sink: the C method itself, no Python frame on the controller's thread.
        self.put: Callable[[ReportFields], None] = self._queue.put
        self.batch_policy = False  # True once this thread runs under SCHED_BATCH
        self._thread = threading.Thread(target=self._run, name="tft-handoff", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.batch_policy = _no_wakeup_preemption()
        while True:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(item is self._STOP for item in batch)
            reports = [ControllerReport._make(item) for item in batch if item is not self._STOP]
            if reports:
                try:
                    self._loop.call_soon_threadsafe(self._handle, reports)
                except RuntimeError:  # the loop is closed: the bridge is gone
                    log.error("dropped %d controller report(s): the event loop is closed", len(reports))
            if stop:
                return

    def close(self, timeout: float = 2.0) -> None:
        self._queue.put(self._STOP)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def _no_wakeup_preemption() -> bool:
    """Put the calling thread under SCHED_BATCH (Linux, no privilege needed); False
    where that is not available, which costs latency, not correctness."""
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None or not hasattr(os, "sched_setscheduler"):
        return False
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))  # 0: this thread, on Linux
    except OSError as error:
        log.warning("hand-off thread keeps the default scheduling policy (%s): controller callbacks "
                    "may block longer when they wake it", error)
        return False
    return True


def load_controller_module(name: str) -> ModuleType:
    """The real ``mindio_ttp.controller_ttp``, or the faithful stub for ``"stub"``."""
    if name == STUB_CONTROLLER:
        from .sim import mindio_ttp as stub

        stub.install()
        name = "mindio_ttp.controller_ttp"
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise StartupError(
            f"cannot import the MindIO TFT controller {name!r}: {error}. Install mindio_ttp, "
            "or set controller.module = \"stub\" to run against the simulation"
        ) from error


def make_callback(callback: str, sink: Callable[[ReportFields], None], on_error: Callable[[], None]) -> Callable[..., int]:
    """A controller callback that hands its arguments to ``sink`` and returns at once."""
    monotonic = time.monotonic  # a closure cell: no global and attribute look-up per call

    def relay_callback(*args: Any) -> int:
        try:
            sink((callback, args, monotonic(), None))
        except BaseException:  # noqa: BLE001 - anything escaping would kill the job or the process
            try:
                on_error()
                log.exception("controller callback %s could not hand off its report", callback)
            except BaseException:  # noqa: BLE001
                pass
        return 0

    relay_callback.__name__ = f"relay_{callback}"
    return relay_callback


class ControllerHost:
    """Owns the controller singleton of this process."""

    def __init__(self, module: ModuleType, config: ControllerConfig) -> None:
        self.module = module
        self.config = config
        self.started = False
        self.owned = True  # False when the caller runs the controller (seed API): never destroyed here
        self.callbacks: dict[str, Callable[..., int]] = {}  # as registered (benchmarks call them directly)
        self._destroyed = threading.Event()
        self._prepare_action: Callable[..., int] | None = getattr(
            module, "tft_notify_controller_prepare_action", None
        )

    @property
    def has_prepare_action(self) -> bool:
        """Some older builds lack ``tft_notify_controller_prepare_action``."""
        return self._prepare_action is not None

    def start(self, sink: Callable[[ReportFields], None], on_error: Callable[[], None]) -> None:
        """Register all four callbacks, then init, then start (the controller checks that
        all four are registered once, while starting, and silently never calls any of
        them otherwise)."""
        m, c = self.module, self.config
        self.callbacks = {name: make_callback(name, sink, on_error) for name in CALLBACKS}
        for name, callback in self.callbacks.items():
            if m.tft_register_mindx_callback(name, callback) != 0:
                raise StartupError(f"the controller refused to register callback {name!r}")
        try:
            m.tft_init_controller(-1, c.world_size, c.enable_local_copy, c.enable_arf, c.enable_zit)
        except Exception as error:
            raise StartupError(f"tft_init_controller(world_size={c.world_size}) failed: {error}") from error
        try:
            m.tft_start_controller(c.bind_ip, c.port, c.enable_tls, c.tls_info)
        except BaseException as error:  # the real one raises SystemExit(2), not Exception
            self._destroy_quietly()
            raise StartupError(
                f"tft_start_controller({c.bind_ip}:{c.port}) failed ({type(error).__name__}: {error}); "
                "check that the port is free, in 1024..65535, and the address is not 0.0.0.0"
            ) from error
        self.started = True
        self._destroyed.clear()

    def connected(self) -> bool:
        """True while at least one training rank is connected (the HA switch)."""
        return bool(self.module.tft_query_high_availability_switch()) if self.started else False

    # Notify calls: each returns the controller's 0/1. Called from the notify thread.
    def stop_train(self, faults: dict[int, int], stop_type: str = "stop", timeout: int | None = None) -> int:
        if stop_type == "pause":
            return self.module.tft_notify_controller_stop_train(faults, "pause", timeout)
        return self.module.tft_notify_controller_stop_train(faults, stop_type)

    def on_global_rank(self, faults: dict[int, int], wait: int) -> int:
        return self.module.tft_notify_controller_on_global_rank(faults, wait)

    def change_strategy(self, strategy: str, params: str) -> int:
        return self.module.tft_notify_controller_change_strategy(strategy, params)

    def dump(self) -> int:
        return self.module.tft_notify_controller_dump()

    def prepare_action(self, action: str, faults: dict[int, int]) -> int:
        if self._prepare_action is None:
            return 1
        return self._prepare_action(action, faults)

    def destroy(self, timeout: float) -> bool:
        """Destroy from a fresh thread (never the controller's own: that deadlocks) and wait
        at most ``timeout``; False when it did not finish in time."""
        if not self.started:
            return True
        self.started = False
        worker = threading.Thread(target=self._destroy_quietly, name="tft-destroy", daemon=True)
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            log.error("tft_destroy_controller did not return within %.0f s; leaving it behind", timeout)
            return False
        return True

    def _destroy_quietly(self) -> None:
        try:
            self.module.tft_destroy_controller()
        except BaseException:  # noqa: BLE001 - documented never to raise; be sure
            log.exception("tft_destroy_controller raised")
        finally:
            self._destroyed.set()
