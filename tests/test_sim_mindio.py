"""The MindIO TFT controller stub must be as unforgiving as the real controller.

Each test pins one behaviour of the real controller (docs/mindio-controller.md) and fails
if the stub is made kinder: a duplicated or stale notify must kill the flow, a raising
callback must kill it, a SystemExit must "abort the process", destroy from a callback
must be caught, report_result must wait for a training step, the MindX wait must come
from the environment only, and the default timings must be the real ones.

The stub runs at FAST_TIMINGS here, set explicitly by the fixture; tests of a timing set
the one knob they test to a short, non-zero value and assert the delay as a lower bound
(a loaded machine only makes it longer). One test pins the real default table.
"""

from __future__ import annotations

import importlib
import inspect
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from bridge.sim import mindio_ttp
from bridge.sim.mindio_ttp import FAST_TIMINGS, REAL_TIMINGS, Training, training
from bridge.sim.scenario import free_port
from .conftest import eventually_sync

pytestmark = pytest.mark.timeout(20)

ACTIONS = ("report_fault_ranks", "report_stop_complete", "report_strategies", "report_result")
WAIT_ENV = "1"  # MINDIO_WAIT_MINDX_TIME for these tests (whole seconds, like the real one)
WAIT_SCALE = 0.3  # the stub's clock for MindX waits and pause timeouts: 1 s lasts 0.3 s
WAIT = int(WAIT_ENV) * WAIT_SCALE


def fast() -> None:
    """Reset the stub to the pace these tests use (after a ``training.reset()``)."""
    training.reset()
    training.use_timings(FAST_TIMINGS)
    training.wait_scale = WAIT_SCALE


@pytest.fixture(autouse=True)
def sim(monkeypatch: pytest.MonkeyPatch) -> Iterator[Training]:
    mindio_ttp.install()
    monkeypatch.setenv("MINDIO_WAIT_MINDX_TIME", WAIT_ENV)
    fast()
    yield training
    training.reset()


@pytest.fixture
def m() -> Any:
    return importlib.import_module("mindio_ttp.controller_ttp")


class Bridge:
    """Callbacks that record (args, thread) and can be told to misbehave."""

    def __init__(self, m: Any) -> None:
        self.m = m
        self.calls: list[tuple[str, tuple[Any, ...], threading.Thread]] = []
        self.behaviour: dict[tuple[str, int], Callable[..., Any]] = {}

    def on(self, action: str, nth: int, behaviour: Callable[..., Any]) -> None:
        """Run ``behaviour(*args)`` on the nth (1-based) call of ``action``."""
        self.behaviour[(action, nth)] = behaviour

    def callback(self, action: str) -> Callable[..., int]:
        def relay(*args: Any) -> int:
            self.calls.append((action, args, threading.current_thread()))
            nth = sum(1 for name, _, _ in self.calls if name == action)
            behaviour = self.behaviour.get((action, nth))
            if behaviour is not None:
                behaviour(*args)
            return 0

        return relay

    def register(self, actions: tuple[str, ...] = ACTIONS) -> None:
        for action in actions:
            assert self.m.tft_register_mindx_callback(action, self.callback(action)) == 0

    def names(self) -> list[str]:
        return [name for name, _, _ in self.calls]


def start(m: Any, *, world_size: int = 4, arf: bool = False, zit: bool = False,
          actions: tuple[str, ...] = ACTIONS, ranks: range | None = None) -> Bridge:
    """Register, init, connect the ranks, start: the order the bridge uses."""
    bridge = Bridge(m)
    bridge.register(actions)
    m.tft_init_controller(-1, world_size, False, arf, zit)
    training.connect_ranks(range(world_size) if ranks is None else ranks)
    m.tft_start_controller("127.0.0.1", free_port(), False)
    assert training.state == "NORMAL"
    return bridge


def to_strategies(m: Any, faults: dict[int, int], hccl_time: int = 1) -> list[str]:
    """Inject a fault and answer like ClusterD up to report_strategies; the offered list."""
    training.inject_fault(faults)
    assert training.wait_callback("report_fault_ranks")
    assert m.tft_notify_controller_stop_train(dict(faults)) == 0
    assert training.wait_callback("report_stop_complete")
    assert m.tft_notify_controller_on_global_rank(dict(faults), hccl_time) == 0
    record = training.wait_callback("report_strategies")
    assert record is not None, training.events
    return record.args[1]


def result_calls() -> list[tuple[Any, ...]]:
    return [r.args for r in training.callbacks("report_result")]


def stays_quiet(seconds: float = 0.1) -> int:
    """Callbacks seen after waiting ``seconds``: a fixed delay on purpose, the behaviour
    under test is that nothing happens (at FAST_TIMINGS anything due comes in ms)."""
    time.sleep(seconds)
    return len(training.callbacks())


# ---------------------------------------------------------------------------- import and API


def test_install_makes_the_stub_importable_under_the_real_name() -> None:
    module = importlib.import_module("mindio_ttp.controller_ttp")
    assert module is mindio_ttp.controller_ttp
    import mindio_ttp.controller_ttp as again

    assert again is module
    mindio_ttp.install()  # idempotent


def test_signatures_and_defaults_match_the_real_controller(m: Any) -> None:
    def sig(name: str) -> str:
        return str(inspect.signature(getattr(m, name))).split(" ->")[0]

    params = {name: list(inspect.signature(getattr(m, name)).parameters.values())
              for name in dir(m) if name.startswith("tft_")}
    assert [p.name for p in params["tft_init_controller"]] == [
        "rank", "world_size", "enable_local_copy", "enable_arf", "enable_zit"]
    assert [p.default for p in params["tft_init_controller"][3:]] == [False, False]
    assert [(p.name, p.default) for p in params["tft_start_controller"][2:]] == [("enable_tls", True), ("tls_info", "")]
    assert [(p.name, p.default) for p in params["tft_notify_controller_stop_train"][1:]] == [
        ("stop_type", "stop"), ("timeout", None)]
    assert [(p.name, p.default) for p in params["tft_notify_controller_on_global_rank"][1:]] == [("time", 1)]
    assert [(p.name, p.default) for p in params["tft_notify_controller_change_strategy"][1:]] == [("params", "")]
    assert [(p.name, p.default) for p in params["tft_notify_controller_prepare_action"][1:]] == [("fault_ranks", None)]
    assert sig("tft_notify_controller_dump") == "()"
    assert "tft_init_controller" not in m.__all__ and "tft_register_mindx_callback" in m.__all__


def test_register_refuses_unknown_actions_and_non_callables(m: Any) -> None:
    assert m.tft_register_mindx_callback("report_bogus", lambda *a: 0) == 1
    assert m.tft_register_mindx_callback("report_result", None) == 1
    assert m.tft_register_mindx_callback("report_result", "not callable") == 1
    assert m.tft_register_mindx_callback("report_result", lambda *a: 0) == 0
    assert m.tft_register_mindx_callback("report_result", lambda *a: 1) == 0  # replaces


@pytest.mark.parametrize("args", [(-2, 4), (4, 4), (0, 0), (-1, 100_001)])
def test_init_rejects_bad_arguments_with_exception(m: Any, args: tuple[int, int]) -> None:
    with pytest.raises(Exception, match="init controller failed"):
        m.tft_init_controller(*args, False)


def test_second_init_without_destroy_raises(m: Any) -> None:
    m.tft_init_controller(-1, 4, False)
    with pytest.raises(Exception, match="failed to set register callback"):
        m.tft_init_controller(-1, 4, False)
    m.tft_destroy_controller()
    m.tft_init_controller(-1, 4, False)


@pytest.mark.parametrize(("raw", "read"), [("7", 7), ("3600", 3600), (None, 30), ("", 30), ("0", 30), ("3601", 30),
                                          (" 7", 30), ("+7", 30), ("7.5", 30), ("\uff17", 30), ("ten", 30)])
def test_the_wait_comes_from_the_environment_at_init(m: Any, monkeypatch: pytest.MonkeyPatch,
                                                     raw: str | None, read: int) -> None:
    """Plain ASCII digits in 1..3600, anything else the default 30, like the real one."""
    training.wait_scale = 1.0
    if raw is None:
        monkeypatch.delenv("MINDIO_WAIT_MINDX_TIME")
    else:
        monkeypatch.setenv("MINDIO_WAIT_MINDX_TIME", raw)
    m.tft_init_controller(-1, 4, False)
    assert training.wait_mindx_time == read
    assert training.controller is not None and training.controller.wait_mindx() == float(read)
    assert any(r.kind == "note" and r.args == ("MINDIO_WAIT_MINDX_TIME", read) for r in training.events)


def test_the_wait_is_read_once_at_init_and_from_nowhere_else(m: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bridge that exports the variable after init, or sets something on the stub
    instead of exporting it, gets the wait it really gave the controller: caught."""
    monkeypatch.delenv("MINDIO_WAIT_MINDX_TIME")
    training.wait_scale = 0.01  # 30 s last 0.3 s, 10 s would last 0.1 s
    start(m)
    monkeypatch.setenv("MINDIO_WAIT_MINDX_TIME", "10")  # too late: init has read it
    assert training.wait_mindx_time == 30
    with pytest.raises(AttributeError, match="MINDIO_WAIT_MINDX_TIME"):
        training.wait_time = 10  # the removed override is loud, never a silent no-op
    with pytest.raises(AttributeError, match="environment"):
        _ = training.wait_time
    training.inject_fault({0: 0})
    called = training.wait_callback("report_fault_ranks")
    assert called is not None and training.wait_state("EXIT", 3)
    exited = next(r for r in training.events if r.kind == "state" and r.name == "EXIT")
    assert after(called, exited) >= 0.3 - 0.02  # the 30 s default waited out, not 10 s
    m.tft_destroy_controller()
    monkeypatch.setenv("MINDIO_WAIT_MINDX_TIME", "10")
    m.tft_init_controller(-1, 4, False)  # a new init reads it again
    assert training.wait_mindx_time == 10


async def test_a_bridge_configured_with_a_wait_gives_the_controller_that_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the stub's environment-only read is for: a bridge whose
    TOML says 12 s but that never exports it leaves the real controller at 30 s while its
    own flow gate expects 12 s (seen with 10: a globalFault at ~21 s refused, the job
    killed). Failed until the bridge exported the value before tft_init_controller."""
    import asyncio

    from bridge.core.config import build_config
    from bridge.job.daemon import Bridge
    from bridge.core.systemd import Notifier

    monkeypatch.delenv("MINDIO_WAIT_MINDX_TIME")  # the operator set it in the TOML only
    config = build_config({
        "job_id": "job-wait",
        "clusterd": {"address": f"127.0.0.1:{free_port()}", "startup_wait": 0.2,  # no ClusterD: start anyway
                     "reconnect_max": 1.0},
        "controller": {"module": "stub", "bind_ip": "127.0.0.1", "port": free_port(), "world_size": 4,
                       "wait_mindx_time": 12, "destroy_timeout": 5.0},
        "metrics": {"enabled": False},
    }, env={})
    bridge = Bridge(config, notifier=Notifier({}))
    run = asyncio.create_task(bridge.run())
    try:
        await asyncio.wait_for(bridge.ready.wait(), 15)
        assert training.wait_mindx_time == 12
    finally:
        bridge.request_stop()
        await asyncio.wait_for(run, 30)


# ---------------------------------------------------------------------------- timings


def test_the_default_timings_are_the_real_controllers() -> None:
    """Observed on a real build: report_fault_ranks 2.0 s after a rank raises,
    report_result 2.3 s after change_strategy retry (1-5 s) and 2.9 s after the restarted
    rank of a recover registered, tft_destroy_controller blocking 1-5 s (5 s typical), a
    silent rank lost after about 8 s."""
    assert dict(REAL_TIMINGS) == {"fault_detect_delay": 2.0, "retry_repair_time": 2.3,
                                  "recover_repair_time": 2.9, "destroy_delay": 5.0, "heartbeat_loss_time": 8.0,
                                  "repair_action_timeout": 6.0}
    assert Training().timings() == dict(REAL_TIMINGS)
    training.reset()  # what every fixture starts from
    assert training.timings() == dict(REAL_TIMINGS) and training.wait_scale == 1.0
    assert all(0 < value < REAL_TIMINGS[name] for name, value in FAST_TIMINGS.items())
    with pytest.raises(TypeError):
        REAL_TIMINGS["destroy_delay"] = 0.01  # type: ignore[index]  # shorten on training, never here


@pytest.mark.parametrize("bad", [{"destroy_dely": 0.1}, {"destroy_delay": -1}, {"destroy_delay": float("nan")},
                                 {"destroy_delay": float("inf")}, {"destroy_delay": "0.1"}, {"destroy_delay": True}])
def test_use_timings_refuses_a_bad_knob_and_changes_nothing(bad: dict[str, Any]) -> None:
    before = training.timings()
    with pytest.raises(ValueError, match="destroy_del"):
        training.use_timings({"fault_detect_delay": 0.5, **bad})
    assert training.timings() == before


def after(first: Any, then: Any) -> float:
    return float(then.t - first.t)


def test_report_fault_ranks_comes_fault_detect_delay_after_the_rank_raises(m: Any) -> None:
    start(m)
    training.fault_detect_delay = 0.3
    training.inject_fault({1: 0})
    called = training.wait_callback("report_fault_ranks")
    raised = next(r for r in training.events if r.kind == "training" and r.name == "fault")
    assert called is not None and after(raised, called) >= 0.3


def test_report_result_comes_retry_repair_time_after_change_strategy_retry(m: Any) -> None:
    start(m)
    training.auto_step = True
    training.retry_repair_time = 0.3
    to_strategies(m, {0: 0})
    assert m.tft_notify_controller_change_strategy("retry") == 0
    reported = training.wait_callback("report_result")
    asked = training.notifies("change_strategy")[-1]
    assert reported is not None and reported.args == (0, "Mindio do repair operation ok", {}, "retry")
    assert after(asked, reported) >= 0.3
    assert training.states()[-3:] == ["ENV_CLEAR", "REPAIR", "NORMAL"]


def test_report_result_comes_recover_repair_time_after_the_restarted_rank_registered(m: Any) -> None:
    start(m, arf=True)
    training.auto_step = True
    training.auto_restart = False  # the rank comes back when the test says so
    training.recover_repair_time = 0.3
    to_strategies(m, {2: 1})
    assert m.tft_notify_controller_change_strategy("recover") == 0
    assert training.wait_state("REPAIR")
    assert stays_quiet(0.1) == 4  # no result while the rank is away
    training.connect_ranks([2])
    reported = training.wait_callback("report_result")
    registered = next(r for r in reversed(training.events) if r.kind == "training" and r.name == "connect")
    assert reported is not None and reported.args == (0, "Mindio do repair operation ok", {}, "recover")
    assert after(registered, reported) >= 0.3


# ---------------------------------------------------------------------------- start / destroy


def test_start_before_init_is_systemexit_2(m: Any) -> None:
    with pytest.raises(SystemExit) as info:
        m.tft_start_controller("127.0.0.1", free_port(), False)
    assert info.value.code == 2


@pytest.mark.parametrize(("ip", "port"), [("0.0.0.0", None), ("::", None), ("127.0.0.1", 80), ("127.0.0.1", 70000)])
def test_start_rejects_bad_address_with_systemexit_2(m: Any, ip: str, port: int | None) -> None:
    m.tft_init_controller(-1, 4, False)
    with pytest.raises(SystemExit) as info:
        m.tft_start_controller(ip, port or free_port(), False)
    assert info.value.code == 2


def test_start_on_a_port_in_use_is_systemexit_2(m: Any) -> None:
    training.bind_retry_time = 0.1
    m.tft_init_controller(-1, 4, False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(SystemExit) as info:
            m.tft_start_controller("127.0.0.1", busy.getsockname()[1], False)
    assert info.value.code == 2


def test_start_with_tls_default_and_no_tls_info_fails(m: Any) -> None:
    m.tft_init_controller(-1, 4, False)
    with pytest.raises(SystemExit):
        m.tft_start_controller("127.0.0.1", free_port())  # enable_tls defaults to True


def test_controller_listens_and_ha_switch_follows_connected_ranks(m: Any) -> None:
    assert m.tft_query_high_availability_switch() is False
    Bridge(m).register()
    m.tft_init_controller(-1, 4, False)
    port = free_port()
    m.tft_start_controller("127.0.0.1", port, False)
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    assert m.tft_query_high_availability_switch() is False
    training.connect_ranks([2])
    assert m.tft_query_high_availability_switch() is True
    training.heartbeat_loss_time = 0.3
    training.disconnect_ranks([2])
    assert m.tft_query_high_availability_switch() is True  # until its heartbeats are missed long enough
    eventually_sync(lambda: m.tft_query_high_availability_switch() is False, what="the rank's heartbeat loss")
    training.connect_ranks([9])  # outside world_size: the controller rejects it
    assert m.tft_query_high_availability_switch() is False


def test_destroy_blocks_frees_the_port_and_keeps_the_registry(m: Any) -> None:
    m.tft_destroy_controller()  # not initialised: fine
    bridge = Bridge(m)
    bridge.register()
    m.tft_init_controller(-1, 4, False)
    training.connect_ranks(range(4))
    port = free_port()
    m.tft_start_controller("127.0.0.1", port, False)
    training.destroy_delay = 0.2
    began = time.monotonic()
    m.tft_destroy_controller()
    assert time.monotonic() - began >= 0.2
    m.tft_destroy_controller()  # idempotent
    assert training.state == "UNINIT"
    assert m.tft_notify_controller_dump() == 1
    # same port again, no re-registration: the callbacks still fire
    m.tft_init_controller(-1, 4, False)
    m.tft_start_controller("127.0.0.1", port, False)
    training.inject_fault({1: 0})
    assert training.wait_callback("report_fault_ranks")
    assert bridge.names() == ["report_fault_ranks"]


def test_start_again_after_the_controller_exited_needs_destroy(m: Any) -> None:
    start(m)
    training.inject_fault({0: 0})
    assert training.wait_state("FINAL", 3)  # no stop_train: EXIT, then it destroys itself
    with pytest.raises(SystemExit):
        m.tft_start_controller("127.0.0.1", free_port(), False)
    with pytest.raises(Exception, match="register callback"):
        m.tft_init_controller(-1, 4, False)


def test_destroy_while_waiting_for_a_notify_ends_in_final(m: Any) -> None:
    """The real controller goes NORMAL, ABNORMAL, EXIT, FINAL (the stub used to stop at
    EXIT), and a destroy is the destroyer's business, not a killed job."""
    training.wait_scale = 100.0  # the wait would last 100 s: only the destroy can end it
    start(m)
    training.inject_fault({0: 0})
    assert training.wait_callback("report_fault_ranks")
    training.destroy_delay = 0.05
    m.tft_destroy_controller()
    assert training.states() == ["INIT", "NORMAL", "ABNORMAL", "EXIT", "FINAL", "UNINIT"]
    assert not training.job_killed and not training.processors_exited
    assert [r.name for r in training.callbacks()] == ["report_fault_ranks"]


@pytest.mark.parametrize("waiting_for", ["stop_train", "on_global_rank", "change_strategy"])
def test_destroy_at_every_wait_reaches_final_within_the_destroy(m: Any, waiting_for: str) -> None:
    training.wait_scale = 100.0
    start(m)
    if waiting_for == "change_strategy":
        to_strategies(m, {0: 0})
    else:
        training.inject_fault({0: 0})
        assert training.wait_callback("report_fault_ranks")
        if waiting_for == "on_global_rank":
            assert m.tft_notify_controller_stop_train({0: 0}) == 0
            assert training.wait_callback("report_stop_complete")
    m.tft_destroy_controller()
    assert training.states()[-3:] == ["EXIT", "FINAL", "UNINIT"]
    assert not training.job_killed


def test_destroy_during_a_retry_repair_never_sends_report_result(m: Any) -> None:
    """The real controller stops before NORMAL would send the deferred result; the stub
    used to send report_result(0, "Mindio do repair operation ok", {}, "retry")."""
    start(m)
    training.auto_step = True
    training.retry_repair_time = 0.2
    to_strategies(m, {0: 0})
    assert m.tft_notify_controller_change_strategy("retry") == 0
    assert training.wait_state("REPAIR")
    training.destroy_delay = 0.3  # longer than the repair: the repair ends while destroy blocks
    m.tft_destroy_controller()  # returns once the state machine has ended: nothing can follow
    assert result_calls() == []
    assert "REPAIR" in training.states() and training.states()[-2:] == ["FINAL", "UNINIT"]


def test_destroy_during_a_short_destroy_block_still_sends_no_result(m: Any) -> None:
    start(m)
    training.auto_step = True
    training.retry_repair_time = 0.3
    to_strategies(m, {0: 0})
    assert m.tft_notify_controller_change_strategy("retry") == 0
    assert training.wait_state("REPAIR")
    m.tft_destroy_controller()  # FAST destroy_delay: it waits for the repair to end
    assert result_calls() == []
    assert training.states()[-3:] == ["NORMAL", "FINAL", "UNINIT"]  # NORMAL saw the destroy at once


def test_destroy_during_the_recover_wait_reports_406_while_it_blocks(m: Any) -> None:
    """Seen on the real controller: report_result(406, ...) arrived while the main thread
    sat in destroy; then FINAL."""
    start(m, arf=True)
    training.auto_restart = False
    to_strategies(m, {1: 1})
    assert m.tft_notify_controller_change_strategy("recover") == 0
    assert training.wait_state("REPAIR")
    m.tft_destroy_controller()
    assert result_calls() == [(406, "do repair failed, ret: 1", {1: 1}, "recover")]
    assert training.states()[-3:] == ["EXIT", "FINAL", "UNINIT"]


# ---------------------------------------------------------------------------- notify validation


def test_every_notify_returns_1_before_start(m: Any) -> None:
    for phase in ("uninitialised", "initialised"):
        assert m.tft_notify_controller_stop_train({0: 0}) == 1, phase
        assert m.tft_notify_controller_stop_train({}, "pause", 5) == 1, phase
        assert m.tft_notify_controller_on_global_rank({0: 0}, 1) == 1, phase
        assert m.tft_notify_controller_change_strategy("retry") == 1, phase
        assert m.tft_notify_controller_prepare_action("hot switch", {0: 0}) == 1, phase
        assert m.tft_notify_controller_dump() == 1, phase
        if phase == "uninitialised":
            m.tft_init_controller(-1, 4, False)


def test_notify_validation_returns_1_and_nothing_happens(m: Any) -> None:
    start(m, ranks=range(3))  # rank 3 never connected
    assert m.tft_notify_controller_stop_train({4: 0}) == 1  # outside world_size
    assert m.tft_notify_controller_stop_train({3: 0}) == 1  # not registered
    assert m.tft_notify_controller_stop_train({0: 3}) == 1  # no such fault type
    assert m.tft_notify_controller_stop_train({0: 0}, "halt") == 1
    assert m.tft_notify_controller_on_global_rank({0: 0}, 0) == 1
    assert m.tft_notify_controller_on_global_rank({0: 0}, 3601) == 1
    assert m.tft_notify_controller_change_strategy("bogus") == 1
    assert m.tft_notify_controller_change_strategy("downgrade", "") == 1
    assert m.tft_notify_controller_change_strategy("upgrade", "x" * 1024) == 1
    assert m.tft_notify_controller_prepare_action("migrate") == 1
    with pytest.raises(TypeError):
        m.tft_notify_controller_stop_train({}, "pause")  # timeout=None
    with pytest.raises(TypeError):
        m.tft_notify_controller_stop_train({"0": 0})
    assert stays_quiet() == 0
    assert training.state == "NORMAL"
    assert [r.result for r in training.notifies("stop_train")][:4] == [1, 1, 1, 1]


def test_refused_stop_train_still_merges_the_entries_before_the_bad_one(m: Any) -> None:
    start(m)
    assert m.tft_notify_controller_stop_train({0: 0, 7: 0}) == 1  # rank 7 is out of range
    assert stays_quiet(0.1) == 0
    training.inject_fault({1: 2})
    record = training.wait_callback("report_fault_ranks")
    assert record is not None and record.args == ({0: 0, 1: 2}, {1: ""})


# ---------------------------------------------------------------------------- the fault flow


def test_retry_flow_order_thread_and_deferred_result(m: Any) -> None:
    bridge = start(m, arf=True)
    training.inject_fault({0: 0}, {0: "UCE-0x1"})
    assert training.wait_callback("report_fault_ranks")
    assert m.tft_notify_controller_stop_train({0: 0}) == 0
    assert training.wait_callback("report_stop_complete")
    assert m.tft_notify_controller_on_global_rank({0: 0}, 1) == 0
    assert training.wait_callback("report_strategies")
    assert m.tft_notify_controller_change_strategy("retry") == 0
    assert training.wait_state("NORMAL")
    assert stays_quiet() == 4 and result_calls() == []  # no result before a step
    assert training.step()
    assert training.wait_callback("report_result")
    assert [(name, args) for name, args, _ in bridge.calls] == [
        ("report_fault_ranks", ({0: 0}, {0: "UCE-0x1"})),
        ("report_stop_complete", (0, "stop ok", {0: 0})),
        ("report_fault_ranks", ({0: 0}, {0: "UCE-0x1"})),  # again: same cycle, not a new fault
        ("report_strategies", ({0: 0}, ["exit", "dump", "retry", "recover"])),
        ("report_result", (0, "Mindio do repair operation ok", {}, "retry")),
    ]
    threads = {thread for _, _, thread in bridge.calls}
    assert len(threads) == 1 and threading.main_thread() not in threads
    assert training.states() == ["INIT", "NORMAL", "ABNORMAL", "ENV_CLEAR", "REPAIR", "NORMAL"]
    assert not training.job_killed and not training.violations
    assert [name for name, _ in training.callback_durations] == bridge.names()


def test_auto_step_sends_the_result_without_step_calls(m: Any) -> None:
    start(m)
    training.auto_step = True
    to_strategies(m, {0: 0})
    assert m.tft_notify_controller_change_strategy("retry") == 0
    record = training.wait_callback("report_result")
    assert record is not None and record.args == (0, "Mindio do repair operation ok", {}, "retry")


def test_step_is_refused_while_training_is_stopped(m: Any) -> None:
    start(m)
    training.inject_fault({0: 0})
    assert training.wait_callback("report_fault_ranks")
    assert training.step() is False


def test_notifies_sent_from_inside_callbacks_are_safe(m: Any) -> None:
    bridge = start(m)
    bridge.on("report_fault_ranks", 1, lambda faults, codes: m.tft_notify_controller_stop_train(faults))
    bridge.on("report_stop_complete", 1, lambda code, msg, faults: m.tft_notify_controller_on_global_rank(faults, 1))
    bridge.on("report_strategies", 1, lambda faults, offered: m.tft_notify_controller_change_strategy("retry"))
    training.auto_step = True
    training.inject_fault({2: 0})
    assert training.wait_callback("report_result")
    assert result_calls() == [(0, "Mindio do repair operation ok", {}, "retry")]


def test_clusterd_first_stop_train_still_reports_fault_ranks_then_stops_at_once(m: Any) -> None:
    bridge = start(m)
    assert m.tft_notify_controller_stop_train({1: 0}) == 0
    assert training.wait_callback("report_stop_complete")
    assert [(name, args) for name, args, _ in bridge.calls] == [
        ("report_fault_ranks", ({1: 0}, {})),
        ("report_stop_complete", (0, "stop ok", {1: 0})),
    ]
    assert len(training.notifies("stop_train")) == 1


def test_heartbeat_loss_is_a_process_fault(m: Any) -> None:
    start(m)
    training.heartbeat_loss_time = 0.1
    training.disconnect_ranks([3])
    record = training.wait_callback("report_fault_ranks")
    assert record is not None and record.args == ({3: 1}, {3: ""})


@pytest.mark.timeout(40)
def test_a_rank_killed_in_normal_training_is_reported_about_10_s_later_at_real_timings(m: Any) -> None:
    """Observed on the real controller: a rank process killed during normal training is
    reported about 10 s later (heartbeat loss, ~8 s, then NORMAL's 2 s re-check) as
    report_fault_ranks({rank: 1}). Real timings on purpose: the delay is the behaviour
    under test (a lower bound; a loaded machine only makes it longer)."""
    training.use_timings(REAL_TIMINGS)
    bridge = start(m)
    training.disconnect_ranks([3])
    killed = next(r for r in reversed(training.events) if r.kind == "training" and r.name == "disconnect")
    record = training.wait_callback("report_fault_ranks", timeout=30)
    assert record is not None and record.args == ({3: 1}, {3: ""})
    assert after(killed, record) >= REAL_TIMINGS["heartbeat_loss_time"] + REAL_TIMINGS["fault_detect_delay"] - 0.05
    assert bridge.names() == ["report_fault_ranks"]


def test_a_rank_killed_while_training_is_paused_for_a_recovery_is_never_reported(m: Any) -> None:
    """Observed on the real controller: a rank process killed after stop-complete whose
    heartbeats have not been missing long enough by the second report_fault_ranks is
    reported neither in it nor after the recovery. The stub used to report it right
    after the recovery (a third report_fault_ranks {1: 1})."""
    start(m, arf=True)
    training.heartbeat_loss_time = 1.0  # far longer than this pause: the loss is not due at the second report
    training.auto_step = True
    training.inject_fault({0: 0})
    assert training.wait_callback("report_fault_ranks")
    assert m.tft_notify_controller_stop_train({0: 0}) == 0
    assert training.wait_callback("report_stop_complete")
    training.disconnect_ranks([1])  # paused for the recovery
    assert m.tft_notify_controller_on_global_rank({0: 0}, 1) == 0
    record = training.wait_callback("report_strategies")
    assert record is not None and record.args == ({0: 0}, ["exit", "dump", "retry", "recover"])
    assert training.callbacks("report_fault_ranks")[1].args == ({0: 0}, {0: ""})  # the second: rank 1 not in it
    assert m.tft_notify_controller_change_strategy("retry") == 0
    assert training.wait_callback("report_result")
    assert result_calls() == [(0, "Mindio do repair operation ok", {}, "retry")]
    # a fixed wait on purpose: what is under test is that no report follows (real: none in 15 s)
    assert stays_quiet(2 * training.heartbeat_loss_time) == 5
    assert training.state == "NORMAL"
    training.disconnect_ranks([2])  # a rank killed in normal training is still reported
    record = training.wait_callback("report_fault_ranks", count=3, timeout=10)
    assert record is not None and record.args == ({2: 1}, {2: ""})


def test_a_rank_silent_for_the_heartbeat_loss_during_the_pause_is_in_the_second_fault_report(m: Any) -> None:
    """Observed on the real controller (the differential, tests/conformance): rank 0
    killed at the stop-complete of a type-1 fault, 11 s before ClusterD's globalFault,
    has been silent past the ~8 s heartbeat loss when the controller selects its error
    ranks again, and the second report_fault_ranks names it. The stub used to leave
    every rank killed during the pause out."""
    start(m, arf=True)
    training.heartbeat_loss_time = 0.1
    training.wait_scale = 10.0  # the wait for the globalFault outlasts the silence below
    training.inject_fault({2: 1})
    assert training.wait_callback("report_fault_ranks")
    assert m.tft_notify_controller_stop_train({2: 1}) == 0
    assert training.wait_callback("report_stop_complete")
    training.disconnect_ranks([0])
    time.sleep(3 * training.heartbeat_loss_time)  # the silence before the globalFault is the behaviour under test
    assert m.tft_notify_controller_on_global_rank({2: 1, 3: 1}, 1) == 0
    record = training.wait_callback("report_strategies")
    assert record is not None and record.args[0] == {0: 1, 2: 1, 3: 1}
    assert training.callbacks("report_fault_ranks")[1].args == ({0: 1, 2: 1, 3: 1}, {0: "", 2: ""})


def test_a_recover_whose_repair_reaches_a_dead_rank_fails_with_406(m: Any) -> None:
    """Observed on the real controller: rank 0 killed after the second fault report of
    rank 2's process fault; the node agent restarts ranks 2 and 3, the repair's action
    to rank 0 is never answered ("ActionSend failed", 6 s), and the controller reports
    406; ClusterD then asks for a dump, which succeeds. The stub used to report the
    recover a success."""
    training.devices_per_pod = 2
    start(m, arf=True)
    training.heartbeat_loss_time = 1.0  # the kill below is not due as a heartbeat loss in this test
    training.inject_fault({2: 1})
    assert training.wait_callback("report_fault_ranks")
    assert m.tft_notify_controller_stop_train({2: 1}) == 0
    assert training.wait_callback("report_stop_complete")
    assert m.tft_notify_controller_on_global_rank({2: 1, 3: 1}, 1) == 0
    assert training.wait_callback("report_strategies")
    training.disconnect_ranks([0])
    assert m.tft_notify_controller_change_strategy("recover") == 0
    record = training.wait_callback("report_result")
    assert record is not None and record.args == (406, "do repair failed, ret: 1", {2: 1, 3: 1}, "recover")
    assert m.tft_notify_controller_change_strategy("dump") == 0
    record = training.wait_callback("report_result", count=2)
    assert record is not None and record.args == (0, "do dump success", {2: 1, 3: 1}, "dump")


def recover_with(m: Any, told: dict[int, int]) -> None:
    """Rank 5 of 8 (4 per pod) has a process fault; ClusterD's part played by hand with
    ``told`` as its globalFault's ranks, then recover."""
    training.devices_per_pod = 4
    start(m, world_size=8, arf=True)
    training.auto_step = True
    training.inject_fault({5: 1})
    assert training.wait_callback("report_fault_ranks")
    assert m.tft_notify_controller_stop_train({5: 1}) == 0
    assert training.wait_callback("report_stop_complete")
    assert m.tft_notify_controller_on_global_rank(told, 1) == 0
    assert training.wait_callback("report_strategies")
    assert m.tft_notify_controller_change_strategy("recover") == 0


def test_recover_restarts_the_whole_pod_and_repairs_the_ranks_clusterd_named(m: Any) -> None:
    recover_with(m, {4: 1, 5: 1, 6: 1, 7: 1})  # ClusterD's globalFault: every rank of rank 5's pod
    record = training.wait_callback("report_result")
    assert record is not None and record.args == (0, "Mindio do repair operation ok", {}, "recover")
    restarts = [r.args[0] for r in training.events if r.kind == "training" and r.name == "restart pods"]
    assert restarts == [[4, 5, 6, 7]]  # the node agent's pod, not just the faulty rank
    assert training.repair_hang_ranks == ()


def test_a_controller_told_too_few_ranks_hangs_in_repair_until_clusterd_gives_up(m: Any) -> None:
    """The real controller, told only rank 5 while the node agent restarted the whole pod
    4..7 under its repair, hung in REPAIR; ClusterD then gave up with exit."""
    recover_with(m, {})  # a relay that dropped every rank ClusterD named
    assert training.wait_for(lambda: training.repair_hang_ranks == (4, 6, 7))
    assert stays_quiet(0.2) == 4  # no report_result: the repair never completes
    assert training.state == "REPAIR"
    assert m.tft_notify_controller_change_strategy("exit") == 0  # ClusterD gives up
    assert training.wait_for(lambda: "EXIT" in training.states())
    assert result_calls() == []


@pytest.mark.parametrize(
    ("faults", "arf", "zit", "expected"),
    [
        ({0: 0}, False, False, ["exit", "dump", "retry"]),
        ({0: 2}, True, False, ["exit", "dump", "retry", "recover"]),
        ({0: 1}, False, False, ["exit", "dump"]),
        ({0: 1}, True, False, ["exit", "dump", "recover"]),
        ({0: 1, 1: 0}, True, True, ["exit", "dump", "recover", "downgrade", "upgrade"]),
        ({1: 1}, False, True, ["exit", "dump", "downgrade", "upgrade"]),
    ],
)
def test_strategy_lists(m: Any, faults: dict[int, int], arf: bool, zit: bool, expected: list[str]) -> None:
    start(m, arf=arf, zit=zit)
    assert to_strategies(m, faults) == expected


def test_incomplete_dp_groups_or_no_step_offer_only_exit(m: Any) -> None:
    start(m, arf=True)
    training.replica_info = "partial"
    assert to_strategies(m, {0: 0}) == ["exit"]
    fast()
    start(m, arf=True)
    training.step_count = 0  # no step finished: the pre-lock fails
    assert to_strategies(m, {0: 0}) == ["exit"]


def test_missing_replica_info_reports_404_then_exits(m: Any) -> None:
    start(m)
    training.replica_info_complete = False
    training.inject_fault({0: 0})
    assert training.wait_callback("report_fault_ranks")
    assert m.tft_notify_controller_stop_train({0: 0}) == 0
    record = training.wait_callback("report_stop_complete")
    assert record is not None and record.args == (404, "stop ok", {0: 0})
    assert training.wait_state("EXIT") or training.job_killed
    assert training.job_killed


# ---------------------------------------------------------------------------- unsolicited notifies


def test_duplicated_stop_train_kills_the_flow(m: Any) -> None:
    start(m)
    training.inject_fault({0: 0})
    assert training.wait_callback("report_fault_ranks")
    assert m.tft_notify_controller_stop_train({0: 0}) == 0
    assert training.wait_callback("report_stop_complete")
    assert m.tft_notify_controller_stop_train({0: 0}) == 0  # ClusterD's signal, delivered twice
    assert training.wait_for(lambda: training.job_killed, WAIT / 2)
    assert m.tft_notify_controller_on_global_rank({0: 0}, 1) == 0  # too late
    assert stays_quiet() == 2  # never reached report_strategies
    assert "stop_train while waiting for on_global_rank" in training.exit_reason


@pytest.mark.parametrize(
    "stale",
    [
        lambda m: m.tft_notify_controller_change_strategy("retry"),
        lambda m: m.tft_notify_controller_on_global_rank({}, 1),
        lambda m: m.tft_notify_controller_prepare_action("stop switch"),
    ],
    ids=["change_strategy", "on_global_rank", "stop_switch"],
)
def test_a_stale_notify_in_normal_kills_the_next_fault_flow(m: Any, stale: Callable[[Any], int]) -> None:
    start(m)
    assert stale(m) == 0  # accepted, nothing visible happens...
    assert stays_quiet(0.1) == 0 and training.state == "NORMAL"
    training.inject_fault({0: 0})  # ...until the next fault: its first wait consumes it
    assert training.wait_for(lambda: training.job_killed, WAIT / 2)  # at once, not after a timeout
    assert "while waiting for stop_train" in training.exit_reason
    assert [r.name for r in training.callbacks()] == ["report_fault_ranks"]


def test_pause_racing_a_fault_kills_the_flow(m: Any) -> None:
    bridge = start(m)
    bridge.on("report_fault_ranks", 1, lambda *a: m.tft_notify_controller_stop_train({}, "pause", 5))
    training.inject_fault({0: 0})
    assert training.wait_for(lambda: training.job_killed, WAIT / 2)
    assert training.exit_reason.endswith("got pause_train while waiting for stop_train")
    assert m.tft_notify_controller_stop_train({0: 0}) == 0
    assert stays_quiet() == 1


def test_an_invalid_strategy_returns_0_then_499_and_exit(m: Any) -> None:
    start(m)
    assert to_strategies(m, {0: 0}) == ["exit", "dump", "retry"]
    assert m.tft_notify_controller_change_strategy("recover") == 0  # a real name, not offered
    assert training.wait_callback("report_result")
    assert result_calls() == [(499, "invalid strategy", {0: 0}, "")]
    assert training.wait_for(lambda: training.job_killed)


def test_a_clusterd_only_name_is_invalid_once_a_list_was_offered(m: Any) -> None:
    start(m)
    to_strategies(m, {0: 0})
    assert m.tft_notify_controller_change_strategy("elastic-training") == 0
    assert training.wait_callback("report_result")
    assert result_calls() == [(499, "invalid strategy", {0: 0}, "")]


# ---------------------------------------------------------------------------- raising callbacks


@pytest.mark.parametrize("action", ["report_fault_ranks", "report_stop_complete", "report_strategies"])
def test_an_exception_in_a_flow_callback_kills_the_flow(m: Any, action: str) -> None:
    bridge = start(m)

    def boom(*args: Any) -> None:
        raise ValueError("bridge bug")

    bridge.on(action, 1, boom)
    training.inject_fault({0: 0})
    assert training.wait_callback("report_fault_ranks")
    if action != "report_fault_ranks":
        assert m.tft_notify_controller_stop_train({0: 0}) == 0
        assert training.wait_callback("report_stop_complete")
    if action == "report_strategies":
        assert m.tft_notify_controller_on_global_rank({0: 0}, 1) == 0
        assert training.wait_callback("report_strategies")
    assert training.wait_for(lambda: training.job_killed)
    assert bridge.names()[-1] == action
    assert f"{action} failed" in training.exit_reason
    assert training.wait_state("FINAL", 3) and training.processors_exited


def test_an_exception_in_the_second_report_fault_ranks_is_only_logged(m: Any) -> None:
    bridge = start(m)
    bridge.on("report_fault_ranks", 2, lambda *a: 1 / 0)
    assert to_strategies(m, {0: 0})
    assert not training.job_killed


def test_an_exception_in_report_result_is_only_logged(m: Any) -> None:
    bridge = start(m)
    bridge.on("report_result", 1, lambda *a: [][0])
    training.auto_step = True
    to_strategies(m, {0: 0})
    m.tft_notify_controller_change_strategy("retry")
    assert training.wait_callback("report_result")
    assert stays_quiet(0.1) and training.state == "NORMAL" and not training.job_killed


@pytest.mark.parametrize("exc", [SystemExit, KeyboardInterrupt])
def test_a_base_exception_from_a_callback_aborts_the_process(m: Any, exc: type[BaseException]) -> None:
    bridge = start(m)

    def leave(*args: Any) -> None:
        raise exc()

    bridge.on("report_fault_ranks", 1, leave)
    training.inject_fault({0: 0})
    assert training.wait_for(lambda: training.aborted)
    assert training.state == "ABORTED" and training.violations
    assert m.tft_notify_controller_stop_train({0: 0}) == 0
    assert stays_quiet() == 1


def test_a_one_argument_callback_gets_two_dicts_and_fails(m: Any) -> None:
    m.tft_register_mindx_callback("report_fault_ranks", lambda faults: None)
    Bridge(m).register(ACTIONS[1:])
    m.tft_init_controller(-1, 4, False)
    training.connect_ranks(range(4))
    m.tft_start_controller("127.0.0.1", free_port(), False)
    training.inject_fault({0: 0})
    assert training.wait_for(lambda: training.job_killed)
    assert any(r.kind == "callback_error" and "TypeError" in r.result for r in training.events)


def test_legacy_builds_pass_one_dict(m: Any) -> None:
    training.legacy_fault_report = True
    start(m)
    training.inject_fault({0: 0})
    record = training.wait_callback("report_fault_ranks")
    assert record is not None and record.args == ({0: 0},)


def test_three_of_four_callbacks_means_no_callback_ever(m: Any) -> None:
    bridge = start(m, actions=ACTIONS[:3])
    assert m.tft_register_mindx_callback("report_result", bridge.callback("report_result")) == 0  # too late
    training.inject_fault({0: 0})
    assert training.wait_for(lambda: "ABNORMAL" in training.states())
    assert training.wait_state("NORMAL")  # it repaired on its own
    assert m.tft_notify_controller_stop_train({1: 0}) == 0
    assert stays_quiet() == 0 and bridge.calls == []


def test_a_wait_timeout_exits_then_the_controller_tells_the_ranks_to_exit(m: Any) -> None:
    m_ = start(m)
    training.inject_fault({0: 0})
    assert training.wait_callback("report_fault_ranks")
    assert training.wait_state("EXIT", 2)
    assert training.exit_reason == "timed out waiting for stop_train"
    assert training.wait_state("FINAL", 2)
    assert training.processors_exited and m.tft_query_high_availability_switch() is False
    assert m_.names() == ["report_fault_ranks"]


def test_wait_timeouts_start_after_the_callback_returns(m: Any) -> None:
    bridge = start(m)
    bridge.on("report_fault_ranks", 1, lambda *a: time.sleep(0.4))
    training.inject_fault({0: 0})
    called = training.wait_callback("report_fault_ranks")
    assert called is not None and training.wait_state("EXIT", 3)
    exited = next(r for r in training.events if r.kind == "state" and r.name == "EXIT")
    assert exited.t - called.t >= 0.4 + WAIT - 0.05
    assert training.callback_durations[0][0] == "report_fault_ranks"
    assert training.callback_durations[0][1] >= 0.4


def test_the_strategy_wait_is_max_of_time_and_wait(m: Any) -> None:
    start(m)
    to_strategies(m, {0: 0}, hccl_time=2)  # 2 s > MINDIO_WAIT_MINDX_TIME (1 s), on the scaled clock
    offered = training.callbacks("report_strategies")[0]
    assert training.wait_state("EXIT", 3)
    exited = next(r for r in training.events if r.kind == "state" and r.name == "EXIT")
    assert exited.t - offered.t >= 2 * WAIT_SCALE - 0.02


def test_the_stop_wait_keeps_the_last_pause_timeout(m: Any) -> None:
    """The wait for stop_train is max(last pause timeout, MINDIO_WAIT_MINDX_TIME), and the
    pause timeout is never reset: after one pause, every later cycle waits that long."""
    start(m)
    assert m.tft_notify_controller_stop_train({}, "pause", 3) == 0
    assert training.wait_callback("report_stop_complete")
    assert m.tft_notify_controller_change_strategy("continue") == 0
    assert training.wait_callback("report_result") and training.wait_state("NORMAL")
    training.inject_fault({0: 0})  # no stop_train follows
    called = training.wait_callback("report_fault_ranks")
    assert called is not None and training.wait_state("EXIT", 5)
    exited = next(r for r in training.events if r.kind == "state" and r.name == "EXIT")
    assert after(called, exited) >= 3 * WAIT_SCALE - 0.02  # not the 1 s MINDIO_WAIT_MINDX_TIME


def test_a_notify_during_exit_ends_it_without_telling_the_ranks(m: Any) -> None:
    training.wait_scale = 1.0  # the EXIT wait lasts the whole 1 s
    start(m)
    to_strategies(m, {0: 0})
    assert m.tft_notify_controller_change_strategy("exit") == 0
    assert training.wait_state("EXIT")
    assert m.tft_notify_controller_dump() == 0
    assert training.wait_state("FINAL", 0.5)
    assert not training.processors_exited


# ---------------------------------------------------------------------------- outcomes


def test_exit_gives_no_report_result(m: Any) -> None:
    start(m)
    to_strategies(m, {0: 0})
    assert m.tft_notify_controller_change_strategy("exit") == 0
    assert training.wait_state("FINAL", 3)
    assert result_calls() == [] and training.job_killed


def test_dump_strategy_reports_then_exits(m: Any) -> None:
    start(m)
    to_strategies(m, {0: 1})
    assert m.tft_notify_controller_change_strategy("dump") == 0
    assert training.wait_callback("report_result")
    assert result_calls() == [(0, "do dump success", {0: 1}, "dump")]
    assert training.wait_for(lambda: training.job_killed)


def test_a_failed_dump_reports_499(m: Any) -> None:
    start(m)
    training.fail_next_dump()
    to_strategies(m, {0: 1})
    m.tft_notify_controller_change_strategy("dump")
    assert training.wait_callback("report_result")
    assert result_calls() == [(499, "DumpCallback: save ckpt failed, ret: 1", {0: 1}, "dump")]


def test_save_and_exit_dumps_without_any_other_callback(m: Any) -> None:
    bridge = start(m)
    assert m.tft_notify_controller_dump() == 0
    assert training.wait_callback("report_result")
    assert training.wait_state("FINAL", 3)
    assert [(name, args) for name, args, _ in bridge.calls] == [("report_result", (0, "do dump success", {}, "dump"))]


def test_pause_then_continue(m: Any) -> None:
    bridge = start(m)
    assert m.tft_notify_controller_stop_train({}, "pause", 5) == 0
    assert training.wait_callback("report_stop_complete")
    assert training.state == "PAUSE" and training.step() is False
    assert m.tft_notify_controller_change_strategy("continue") == 0
    assert training.wait_callback("report_result")
    assert training.wait_state("NORMAL")
    assert [(name, args) for name, args, _ in bridge.calls] == [
        ("report_stop_complete", (0, "Controller pause train success!", {})),
        ("report_result", (0, "Controller continue training success.", {}, "continue")),
    ]


def test_a_stop_during_pause_runs_the_fault_flow_without_a_second_stop(m: Any) -> None:
    start(m)
    assert m.tft_notify_controller_stop_train({}, "pause", 5) == 0
    assert training.wait_callback("report_stop_complete")
    assert m.tft_notify_controller_stop_train({2: 0}) == 0
    record = training.wait_callback("report_stop_complete", 2)
    assert record is not None and record.args == (0, "stop ok", {2: 0})
    assert [r.name for r in training.callbacks()] == ["report_stop_complete", "report_fault_ranks", "report_stop_complete"]


def test_a_pause_timeout_reports_406_then_runs_the_fault_flow(m: Any) -> None:
    start(m)
    assert m.tft_notify_controller_stop_train({}, "pause", 1) == 0
    assert training.wait_callback("report_result", timeout=3)
    assert result_calls() == [(406, "Controller do pause wait failed.", {}, "")]
    assert training.wait_callback("report_fault_ranks")


def test_405_waits_for_on_global_rank_again_and_reoffers(m: Any) -> None:
    start(m, arf=True)
    assert to_strategies(m, {0: 0}) == ["exit", "dump", "retry", "recover"]
    training.fail_next_repair(405)
    assert m.tft_notify_controller_change_strategy("retry") == 0
    assert training.wait_callback("report_result")
    assert result_calls() == [(405, "controller:-1 notify device clean failed", {0: 1}, "retry")]
    assert m.tft_notify_controller_on_global_rank({0: 1}, 1) == 0
    record = training.wait_callback("report_strategies", 2)
    assert record is not None and record.args == ({0: 1}, ["exit", "dump", "recover"])
    assert m.tft_notify_controller_change_strategy("recover") == 0
    assert training.wait_state("NORMAL") and training.step()
    assert training.wait_callback("report_result", 2)
    assert result_calls()[-1] == (0, "Mindio do repair operation ok", {}, "recover")


def test_406_allows_dump(m: Any) -> None:
    start(m, arf=True)
    to_strategies(m, {1: 1})
    training.fail_next_repair(406)
    m.tft_notify_controller_change_strategy("recover")
    assert training.wait_callback("report_result")
    m.tft_notify_controller_change_strategy("dump")
    assert training.wait_callback("report_result", 2)
    assert result_calls() == [(406, "do repair failed, ret: 1", {1: 1}, "recover"),
                              (0, "do dump success", {1: 1}, "dump")]


def test_a_failed_retry_repair_reports_499_and_a_device_stop_failure_refuses_dump(m: Any) -> None:
    start(m)
    to_strategies(m, {0: 0})
    training.fail_next_repair("device_stop")
    m.tft_notify_controller_change_strategy("retry")
    assert training.wait_callback("report_result")
    m.tft_notify_controller_change_strategy("dump")
    assert training.wait_callback("report_result", 2)
    assert result_calls() == [(499, "controller:-1 notify device stop failed", {0: 0}, "retry"),
                              (499, "stop & clean failed! not allowed to dump!", {0: 0}, "dump")]
    assert training.wait_for(lambda: training.job_killed)


def test_a_new_fault_before_the_step_fails_the_last_repair(m: Any) -> None:
    start(m)
    to_strategies(m, {0: 0})
    m.tft_notify_controller_change_strategy("retry")
    assert training.wait_state("NORMAL")
    training.inject_fault({1: 0})
    assert training.wait_callback("report_result")
    assert result_calls() == [(406, "do last repair failed!", {1: 0}, "retry")]
    assert len(training.callbacks("report_fault_ranks")) == 2  # none for the new fault


def test_downgrade_isolates_ranks_with_201(m: Any) -> None:
    start(m, zit=True)
    assert to_strategies(m, {1: 1}) == ["exit", "dump", "downgrade", "upgrade"]
    assert m.tft_notify_controller_change_strategy("downgrade", '{"scale-in-strategy": "DP"}') == 0
    assert training.wait_callback("report_result")
    assert result_calls() == [(201, "controller notify isolate ranks.", {1: 1}, "downgrade")]
    assert training.wait_state("DOWNGRADE")


def test_hot_switch_offers_migration(m: Any) -> None:
    start(m)
    assert m.tft_notify_controller_prepare_action("hot switch", {2: 1}) == 0
    assert stays_quiet(0.1) == 0  # waits for the replacement rank to register
    training.connect_ranks([2])
    record = training.wait_callback("report_strategies")
    assert record is not None and record.args == ({}, ["migration"])
    assert m.tft_notify_controller_change_strategy("migration") == 0
    assert training.wait_state("NORMAL") and training.step()
    assert training.wait_callback("report_result")
    assert result_calls() == [(0, "Mindio do repair operation ok", {}, "migration")]


def test_a_hot_switch_whose_pause_fails_offers_exit_and_ends_in_exit(m: Any) -> None:
    """StepFinishCallback: the pause failed, so only ``["exit"]``; ClusterD answers that
    with no signal (it deletes the job's first pod), so the wait runs out into EXIT."""
    start(m)
    training.fail_next_pause()
    assert m.tft_notify_controller_prepare_action("hot switch", {2: 1}) == 0
    training.connect_ranks([2])
    record = training.wait_callback("report_strategies")
    assert record is not None and record.args == ({}, ["exit"])
    assert training.wait_state("EXIT", timeout=10)
    assert result_calls() == []


# ---------------------------------------------------------------------------- calls the real one punishes


def test_destroy_from_inside_a_callback_is_recorded_not_hung(m: Any) -> None:
    bridge = start(m)
    returned = threading.Event()

    def destroy(*args: Any) -> None:
        m.tft_destroy_controller()
        returned.set()

    bridge.on("report_fault_ranks", 1, destroy)
    training.inject_fault({0: 0})
    assert returned.wait(2)
    assert training.wait_for(lambda: training.hung)
    assert any("deadlocks" in v for v in training.violations)
    m.tft_notify_controller_stop_train({0: 0})
    assert stays_quiet() == 1  # the controller is dead after that callback


def test_register_from_inside_a_callback_is_a_violation(m: Any) -> None:
    bridge = start(m)
    answers: list[int] = []
    bridge.on("report_fault_ranks", 1, lambda *a: answers.append(m.tft_register_mindx_callback("report_result", print)))
    training.inject_fault({0: 0})
    assert training.wait_callback("report_fault_ranks")
    assert training.wait_for(lambda: bool(answers))
    assert answers == [1] and training.violations
