"""Hosting the MindIO TFT controller: loading, registration order, start, notify, destroy.

The controller calls its four callbacks on its own thread and is blocked until they
return; an exception escaping one makes it give up the recovery or abort the process
(docs/mindio-controller.md section 3). So each callback installed here (``make_callback``)
only puts its name, its arguments and the time into the report wire's inbox, and returns
0: it never raises, never blocks, never copies a fault map (the
controller builds a fresh one for every call and never touches it again), and runs no
Python frame but its own. Everything after the put is the report path
(``bridge/job/reports/relay.py``, ``ledger.py``).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from bridge.job.host import controller_abi
from bridge.job.sched.affinity import ControllerPin
from bridge.core.config import STUB_CONTROLLER, ControllerConfig
from bridge.job.reports.kinds import CALLBACKS, KINDS, ReportSink

log = logging.getLogger(__name__)

#: The package that plays ``mindio_ttp`` for ``controller.module = "stub"`` (the demo, tests).
STUB_PACKAGE = "bridge.sim.mindio_ttp"


class StartupError(RuntimeError):
    """The controller could not be loaded, initialised or started."""


def load_controller_module(name: str) -> ModuleType:
    """The real ``mindio_ttp.controller_ttp``, or the faithful stub for ``"stub"``. The stub
    is found by name, as the real one is: the product never imports the simulations."""
    if name == STUB_CONTROLLER:
        importlib.import_module(STUB_PACKAGE).install()
        name = "mindio_ttp.controller_ttp"
    try:
        return importlib.import_module(name)
    except ImportError as error:
        # A mindio_ttp built for another CPython fails with a bare "No module named ...":
        # say which Python runs and which build was found (bridge/job/host/controller_abi.py).
        wrong_python = controller_abi.mismatch(controller_abi.package_directory(name.partition(".")[0]))
        if wrong_python:
            raise StartupError(f"cannot import the MindIO TFT controller {name!r}: {error}. {wrong_python}") from error
        raise StartupError(
            f"cannot import the MindIO TFT controller {name!r}: {error} (under {controller_abi.running_python()}). "
            "Install mindio_ttp, or set controller.module = \"stub\" to run against the simulation"
        ) from error


def make_callback(callback: str, sink: ReportSink, on_error: Callable[[], None],
                  pin: ControllerPin | None = None) -> Callable[..., int]:
    """The controller's ``callback``: hands ``(callback, args, time.monotonic())`` to
    ``sink`` and returns 0 at once. Runs on the controller's thread; never raises, never
    blocks, runs no Python frame but its own. Its arguments are named once, by the report
    wire as it takes them (``kinds.report_of``): a plain tuple is the cheapest thing to
    make on a thread that was asleep (docs/performance.md). A sink that fails counts
    through ``on_error``. With ``pin``, a thread's first callback pins that thread to its
    CPU (``bridge/job/sched/affinity.py``)."""
    if callback not in KINDS:
        raise ValueError(f"unknown controller callback {callback!r}")
    monotonic = time.monotonic  # closure cells: no global and attribute look-up per call
    get_ident = threading.get_ident

    def relay(*args: Any) -> int:
        try:
            if pin is not None and pin.enabled and pin.thread != get_ident():
                pin.pin_caller()
            sink((callback, args, monotonic()))
        except BaseException:  # noqa: BLE001 - anything escaping would kill the job or the process
            _callback_failed(callback, on_error)
        return 0

    relay.__name__ = f"relay_{callback}"
    return relay


def _callback_failed(callback: str, on_error: Callable[[], None]) -> None:
    """Count and log a callback that could not hand off (never raises)."""
    try:
        on_error()
        log.exception("controller callback %s could not hand off its report", callback)
    except BaseException:  # noqa: BLE001
        pass


#: The controller's wait for every ClusterD answer, read from the environment only.
WAIT_ENV = "MINDIO_WAIT_MINDX_TIME"


def export_wait_time(seconds: int) -> None:
    """Put the configured wait where the controller reads it: ``MINDIO_WAIT_MINDX_TIME``
    in this process's environment, read once by ``tft_init_controller`` and from nowhere
    else (docs/mindio-controller.md section 6), as plain ASCII digits, the only form it
    accepts. The flow gate (``ControllerFlow(wait_timeout=...)``) assumes the same value.
    The configured value already holds the environment's when the TOML does not set it
    (config.py's precedence), so the operator's word is kept."""
    value = str(int(seconds))
    if os.environ.get(WAIT_ENV) != value:
        log.info("exporting %s=%s for the controller (was %r)", WAIT_ENV, value, os.environ.get(WAIT_ENV))
    os.environ[WAIT_ENV] = value


def wait_time_from_environment() -> int:
    """The wait a controller initialised in this process has read: the variable as plain
    ASCII digits in 1..3600, anything else (unset, empty, blanks, a sign, out of range)
    the controller's default 30 (docs/mindio-controller.md section 6). For a controller
    someone else started (``external=True``), whose wait the bridge did not choose: the
    flow gate must assume the wait the controller really has."""
    raw = os.environ.get(WAIT_ENV, "")
    if raw.isascii() and raw.isdigit() and 1 <= int(raw) <= 3600:
        return int(raw)
    return 30


class ControllerHost:
    """Owns the controller singleton of this process -- or, with ``external=True``, only
    talks to one its caller runs (the seed API, ``bridge.recover_manager``): that one is
    already started, and is never started or destroyed here."""

    def __init__(self, module: ModuleType, config: ControllerConfig, *, external: bool = False) -> None:
        self.module = module
        self.config = config
        self.started = external
        self.owned = not external
        # True once a destroy did not return in time: its thread still runs and may hold
        # the controller's locks, so the process must not run the module's atexit destroy
        # (the daemon ends with os._exit; bridge/job/daemon.py).
        self.destroy_abandoned = False
        self._prepare_action: Callable[..., int] | None = getattr(
            module, "tft_notify_controller_prepare_action", None
        )

    @property
    def world_size(self) -> int | None:
        """The world size the controller was initialised with, or None when unknown: a
        controller the caller started (``external=True``) was initialised by the caller,
        and the real module exposes no way to ask it (docs/mindio-controller.md section
        2), while this host's ``config.world_size`` is only the default 1. A guard that
        needs it skips its check then, never assumes the default."""
        return self.config.world_size if self.owned else None

    @property
    def has_prepare_action(self) -> bool:
        """Some older builds lack ``tft_notify_controller_prepare_action``."""
        return self._prepare_action is not None

    def start(self, sink: ReportSink, on_error: Callable[[], None],
              pin: ControllerPin | None = None) -> None:
        """Register all four callbacks, then init, then start (the controller checks that
        all four are registered once, while starting, and silently never calls any of
        them otherwise). ``pin``: see ``make_callback``."""
        if not self.owned:  # re-registering and re-initialising the caller's controller would break it
            raise StartupError("this controller is run by the caller (external=True): it is never started here")
        m, c = self.module, self.config
        for name in CALLBACKS:
            callback = make_callback(name, sink, on_error, pin)
            if m.tft_register_mindx_callback(name, callback) != 0:
                raise StartupError(f"the controller refused to register callback {name!r}")
        export_wait_time(c.wait_mindx_time)
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
        at most ``timeout``; False when it did not finish in time. A caller-run controller
        (``external=True``) is left alone: its owner destroys it."""
        if not self.started or not self.owned:
            return True
        self.started = False
        worker = threading.Thread(target=self._destroy_quietly, name="tft-destroy", daemon=True)
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            self.destroy_abandoned = True
            log.error("tft_destroy_controller did not return within %.0f s; leaving it behind", timeout)
            return False
        return True

    def _destroy_quietly(self) -> None:
        try:
            self.module.tft_destroy_controller()
        except BaseException:  # noqa: BLE001 - documented never to raise; be sure
            log.exception("tft_destroy_controller raised")
