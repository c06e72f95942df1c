"""The public controller functions, with the real names, signatures, defaults, return
codes and exceptions (ttp_controller.py, ttp_mindx_api.py and the SWIG layer under them).

Argument types are checked the way the SWIG wrappers check them: a wrong type raises
TypeError (a pause without ``timeout`` included), a negative number for an unsigned
parameter raises OverflowError, and the notify functions otherwise only ever return 0
or 1. Every notify call is recorded with its arguments and return value.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from bridge.sim.mindio_ttp import _log
from bridge.sim.mindio_ttp._constants import INT32_MAX, INT32_MIN, MAX_WORLD_SIZE, PORT_MAX, PORT_MIN, UINT32_MAX, WAIT_MINDX_DEFAULT, WAIT_MINDX_MAX, WAIT_MINDX_MIN, State
from bridge.sim.mindio_ttp._controller import Controller
from bridge.sim.mindio_ttp._server import Listener, is_zero_ip, resolve
from bridge.sim.mindio_ttp._training import training

RET_OK = 0
RET_ERROR = 1
RET_K8S = 2  # the SystemExit code of a failed start

#: initOrDestroyMutex_: init, start and destroy never overlap.
_lifecycle = threading.RLock()


# ---------------------------------------------------------------------- SWIG-style conversions

def _int(value: Any, func: str, argn: int, ctype: str, low: int, high: int) -> int:
    if not isinstance(value, int):
        raise TypeError(f"in method '{func}', argument {argn} of type '{ctype}'")
    if not low <= value <= high:
        raise OverflowError(f"in method '{func}', argument {argn} of type '{ctype}'")
    return int(value)


def _bool(value: Any, func: str, argn: int) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"in method '{func}', argument {argn} of type 'bool'")
    return value


def _str(value: Any, func: str, argn: int) -> str:
    if not isinstance(value, str):
        raise TypeError(f"in method '{func}', argument {argn} of type 'std::string'")
    return value


def _rank_map(value: Any, func: str, argn: int) -> dict[int, int]:
    """std::map<int32_t, int32_t>: a dict of ints, copied."""
    ctype = "std::map< int32_t,int32_t,std::less< int32_t > >"
    if not isinstance(value, dict):
        raise TypeError(f"in method '{func}', argument {argn} of type '{ctype}'")
    out: dict[int, int] = {}
    for key, val in value.items():
        if not (isinstance(key, int) and isinstance(val, int)
                and INT32_MIN <= key <= INT32_MAX and INT32_MIN <= val <= INT32_MAX):
            raise TypeError(f"in method '{func}', argument {argn} of type '{ctype}'")
        out[int(key)] = int(val)
    return out


def _notify(name: str, args: tuple[Any, ...], call: Callable[[], int]) -> int:
    """Run one notify, record it with its result (or the exception it raised)."""
    try:
        ret = call()
    except (TypeError, OverflowError) as exc:
        training.record(_log.NOTIFY, name, args, repr(exc))
        raise
    ret = RET_OK if ret == RET_OK else RET_ERROR
    training.record(_log.NOTIFY, name, args, ret)
    return ret


def _controller() -> Controller | None:
    with training.cond:
        return training.controller


# ---------------------------------------------------------------------- lifecycle

def _wait_env() -> int:
    """MINDIO_WAIT_MINDX_TIME from the process environment, read once per init as the
    real Controller::Initialize does: 1..3600 in ASCII digits only, anything else (unset,
    empty, spaces or a sign, out of range) the default 30. There is deliberately no other
    source: the bridge has to export its configured wait before tft_init_controller."""
    raw = os.environ.get("MINDIO_WAIT_MINDX_TIME", "")
    if not (raw.isascii() and raw.isdigit()):
        return WAIT_MINDX_DEFAULT
    value = int(raw)
    return value if WAIT_MINDX_MIN <= value <= WAIT_MINDX_MAX else WAIT_MINDX_DEFAULT


def _mindspore() -> bool:
    return os.environ.get("MINDIO_FOR_MINDSPORE", "").strip().lower() in ("1", "true", "on", "yes")


def tft_init_controller(rank: int, world_size: int, enable_local_copy: bool,
                        enable_arf: bool = False, enable_zit: bool = False) -> None:
    """Initialise the controller singleton; raises Exception on bad arguments or when it
    is already initialised (only tft_destroy_controller undoes an init)."""
    func = "init_controller"
    rank = _int(rank, func, 1, "int32_t", INT32_MIN, INT32_MAX)
    world_size = _int(world_size, func, 2, "int32_t", INT32_MIN, INT32_MAX)
    enable_local_copy = _bool(enable_local_copy, func, 3)
    enable_arf = _bool(enable_arf, func, 4)
    enable_zit = _bool(enable_zit, func, 5)
    args = (rank, world_size, enable_local_copy, enable_arf, enable_zit)
    with _lifecycle, training.cond:
        valid = -1 <= rank < world_size <= MAX_WORLD_SIZE and world_size > 0
        if valid and _mindspore() and (enable_local_copy or enable_zit):
            valid = False
        if not valid:
            message = "init controller failed, error num:1"
        elif training.controller is not None:
            message = "init controller failed to set register callback, error num:1"
        else:
            wait = _wait_env()
            training.controller = Controller(training, rank, world_size, enable_local_copy,
                                             enable_arf, enable_zit, wait)
            training.state = State.INIT
            training.wait_mindx_time = wait
            training.record(_log.API, "init", args, None)
            training.record(_log.NOTE, "env", ("MINDIO_WAIT_MINDX_TIME", wait))
            training.record(_log.STATE, State.INIT.value)
            return
        training.record(_log.API, "init", args, message)
    raise Exception(message)  # the real one raises a bare Exception


def tft_start_controller(bind_ip: str, port: int, enable_tls: bool = True, tls_info: str = "") -> None:
    """Bind (bind_ip, port) and start the state machine. Every failure raises SystemExit(2)."""
    func = "start_controller"
    bind_ip = _str(bind_ip, func, 1)
    port = _int(port, func, 2, "int32_t", INT32_MIN, INT32_MAX)
    enable_tls = _bool(enable_tls, func, 3)
    tls_info = _str(tls_info, func, 4)
    args = (bind_ip, port, enable_tls, tls_info)

    def fail(reason: str) -> SystemExit:
        training.record(_log.API, "start", args, f"SystemExit(2): {reason}")
        return SystemExit(RET_K8S)

    if is_zero_ip(bind_ip):
        raise fail("all-zero ip is not supported")
    resolved = resolve(bind_ip, 0)
    if resolved is None:
        raise fail(f"cannot resolve {bind_ip!r}")
    family, sockaddr = resolved
    with _lifecycle:
        controller = _controller()
        if controller is None or not controller.inited:
            raise fail("controller not init")
        if controller.thread is not None:
            training.record(_log.API, "start", args, "already started")
            return
        if not PORT_MIN <= port <= PORT_MAX:
            raise fail(f"port {port} outside {PORT_MIN}..{PORT_MAX}")
        if enable_tls and not tls_info:
            raise fail("TLS is on but tls_info names no TLS library to load")
        try:
            listener = Listener(family, (sockaddr[0], port, *sockaddr[2:]), training.bind_retry_time)
            listener.start()
        except OSError as exc:
            raise fail(f"start server failed: {exc}") from None
        controller.start(listener)
        training.record(_log.API, "start", args, None)


def tft_destroy_controller() -> None:
    """Stop and forget the controller. Never raises; blocks ``training.destroy_delay``
    and then until the state machine finishes its current action. The callback
    registry survives. From inside a callback the real one deadlocks forever: here it
    records a violation, returns, and the controller is dead from then on."""
    controller = _controller()
    if training.registry.held_by_current_thread() or (controller is not None and controller.on_controller_thread()):
        with training.cond:
            training.hung = True
            if controller is not None:
                controller.hung = True
        training.violation(controller, "tft_destroy_controller called from inside a callback: the real "
                                       "controller deadlocks here forever (destroy waits for the very "
                                       "thread it runs on)")
        training.record(_log.API, "destroy", (), "deadlock (from a callback)")
        return
    with _lifecycle:
        controller = _controller()
        if controller is None:
            training.record(_log.API, "destroy", (), "not initialised")
            return
        try:
            controller.destroy(training.destroy_delay, training.destroy_join_timeout)
        except Exception as exc:  # noqa: BLE001 - the real destroy only logs its errors
            training.record(_log.NOTE, "destroy error", (repr(exc),))
        with training.cond:
            if training.controller is controller:
                training.controller = None
                training.state = State.UNINIT
        training.record(_log.API, "destroy", (), None)
        training.record(_log.STATE, State.UNINIT.value)


def tft_query_high_availability_switch() -> bool:
    """True iff at least one training rank is connected to a running controller."""
    controller = _controller()
    return False if controller is None else controller.high_availability()


def tft_register_mindx_callback(action: str, func: Callable[..., Any]) -> int:
    """0 ok; 1 for an unknown action or a non-callable. Must precede start: the
    controller checks "all four registered" once, while starting."""
    if training.registry.held_by_current_thread():
        training.violation(_controller(), f"tft_register_mindx_callback({action!r}) called from inside a "
                                          "callback: the real registry lock is held, it deadlocks")
        return RET_ERROR
    ret = training.registry.register(action, func)
    training.record(_log.API, "register", (action,), ret)
    return ret


# ---------------------------------------------------------------------- notify

def tft_notify_controller_stop_train(fault_ranks: dict[int, int], stop_type: str = "stop",
                                     timeout: int | None = None) -> int:
    """"stop": the faulty ranks (each in [0, world_size), registered, type 0/1/2);
    "pause": pause training for ``timeout`` seconds (required). 0 accepted, 1 refused."""

    def call() -> int:
        controller = _controller()
        if stop_type == "stop":
            faults = _rank_map(fault_ranks, "mindx_stop_train_callback", 1)
            return RET_ERROR if controller is None else controller.notify_stop_train(faults)
        if stop_type == "pause":
            seconds = _int(timeout, "mindx_pause_train_callback", 1, "uint32_t", 0, UINT32_MAX)
            return RET_ERROR if controller is None else controller.notify_pause_train(seconds)
        return RET_ERROR

    return _notify("stop_train", (_copy(fault_ranks), stop_type, timeout), call)


def tft_notify_controller_on_global_rank(fault_ranks: dict[int, int], time: int = 1) -> int:
    """The final fault ranks of this cycle; ``time`` (1..3600) is the minimum wait for
    the strategy decision."""

    def call() -> int:
        faults = _rank_map(fault_ranks, "mindx_notify_fault_callback", 1)
        seconds = _int(time, "mindx_notify_fault_callback", 2, "uint32_t", 0, UINT32_MAX)
        controller = _controller()
        return RET_ERROR if controller is None else controller.notify_fault_ranks(faults, seconds)

    return _notify("on_global_rank", (_copy(fault_ranks), time), call)


def tft_notify_controller_prepare_action(action: str, fault_ranks: dict[int, int] | None = None) -> int:
    """"hot switch" (ranks to migrate) or "stop switch"; anything else returns 1."""

    def call() -> int:
        name = _str(action, "mindx_prepare_action_callback", 1)
        faults = _rank_map(fault_ranks or {}, "mindx_prepare_action_callback", 2)
        controller = _controller()
        return RET_ERROR if controller is None else controller.notify_prepare_action(name, faults)

    return _notify("prepare_action", (action, _copy(fault_ranks)), call)


def tft_notify_controller_change_strategy(strategy: str, params: str = "") -> int:
    """A strategy from the last offered list. A known name that was not offered returns
    0 and then fails the flow with report_result(499, "invalid strategy")."""

    def call() -> int:
        name = _str(strategy, "mindx_change_strategy_callback", 1)
        extra = _str(params, "mindx_change_strategy_callback", 2)
        controller = _controller()
        if controller is None:
            return RET_ERROR
        return controller.notify_change_strategy(name, extra)

    return _notify("change_strategy", (strategy, params), call)


def tft_notify_controller_dump() -> int:
    """Graceful dump, then exit (ClusterD's save_and_exit)."""

    def call() -> int:
        controller = _controller()
        return RET_ERROR if controller is None else controller.notify_dump()

    return _notify("dump", (), call)


def _copy(value: Any) -> Any:
    return dict(value) if isinstance(value, dict) else value


def _destroy_at_exit() -> None:
    """The real module registers tft_destroy_controller with atexit; bound the join so
    a callback stuck forever cannot hang interpreter shutdown."""
    if training.destroy_join_timeout is None:
        training.destroy_join_timeout = 5.0
    tft_destroy_controller()
