"""ClusterD signal -> controller notify: argument checks, flow restore, the cost of one
signal, the orphaned globalFault, and the controller's wait reaching the controller.

The unit tests drive a real ``SignalDispatcher`` and ``ControllerFlow`` against a recording fake
controller module (it can raise or refuse on demand); the end-to-end tests run the
bridge between the simulated ClusterD and the stub controller, which reads
MINDIO_WAIT_MINDX_TIME from its environment at init exactly like the real one and
raises OverflowError for a pause timeout outside 0..2^32-1 like the real SWIG wrapper.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

import pytest

from bridge._proto import recover_pb2 as pb
from bridge.core.config import ControllerConfig, load_config
from bridge.job.host.controller import ControllerHost
from bridge.job.reports.controller_flow import ControllerFlow, Step
from bridge.job.session.node_hooks import HookSignal
from bridge.job.metrics import BridgeMetrics
from bridge.sim.clusterd import SimJob
from bridge.sim.scenario import SimulatedJob
from bridge.job.session.signals import (MAX_ACTIONS, PAUSE_TIMEOUT_MAX, BadArgument, SignalDispatcher,
                                        notify_arguments, screen_signal, signal_problem)

from .conftest import eventually
from .simjobs import annotation, start_job

JOB = "job-signals"
UUID = "18EA87DEEF733F9C-1d6921e4f328ea701dc1816a94be179a"
WORLD = 16


# --------------------------------------------------------------------------- notify_arguments

def args(action: str, faults: dict[int, int] | None = None, timeout: int = 0, strategy: str = "",
         params: str = "") -> Any:
    return notify_arguments(action, faults or {}, timeout, strategy, params, world_size=WORLD, pause_default=600)


@pytest.mark.parametrize("timeout", [-1, -(2 ** 40)])
def test_a_negative_pause_timeout_is_refused(timeout: int) -> None:
    with pytest.raises(BadArgument, match="negative"):
        args("pause_train", timeout=timeout)


@pytest.mark.parametrize("timeout, sent", [(0, 600), (900, 900), (2 ** 32, PAUSE_TIMEOUT_MAX),
                                           (2 ** 63 - 1, PAUSE_TIMEOUT_MAX)])
def test_a_pause_timeout_is_the_default_for_0_and_clamped_above_the_limit(timeout: int, sent: int) -> None:
    checked = args("pause_train", {3: 1}, timeout=timeout)
    assert checked.timeout == sent
    assert checked.faults == {}  # the controller ignores a pause's ranks
    assert bool(checked.notes) == (timeout > PAUSE_TIMEOUT_MAX)


@pytest.mark.parametrize("timeout, sent, noted", [(0, 1, False), (33, 33, False), (3600, 3600, False),
                                                  (3601, 3600, True), (-5, 1, True), (2 ** 40, 3600, True)])
def test_the_on_global_rank_time_is_clamped_to_what_the_controller_takes(timeout: int, sent: int,
                                                                           noted: bool) -> None:
    checked = args("on_global_rank", {1: 1}, timeout=timeout)
    assert checked.timeout == sent
    assert bool(checked.notes) == noted


@pytest.mark.parametrize("action", ["stop_train", "on_global_rank", "hot switch"])
def test_fault_ranks_outside_the_world_are_dropped_and_the_rest_kept(action: str) -> None:
    checked = args(action, {2: 0, WORLD: 1, 10 ** 9: 1, 15: 2})
    assert checked.faults == {2: 0, 15: 2}
    assert "outside 0..15" in checked.notes[0]


@pytest.mark.parametrize("action", ["stop_train", "on_global_rank", "hot switch"])
def test_an_unknown_world_size_drops_no_rank(action: str) -> None:
    checked = notify_arguments(action, {4: 1, 5: 1, 6: 1, 7: 1, 10 ** 9: 1}, 0, "", "", world_size=None,
                               pause_default=600)
    assert checked.faults == {4: 1, 5: 1, 6: 1, 7: 1, 10 ** 9: 1}
    assert checked.notes == ()
    assert notify_arguments("change_strategy", {4: 1}, 0, "retry", "", world_size=None,
                            pause_default=600).faults == {}  # a strategy takes no ranks, known size or not


def test_fault_ranks_inside_the_world_pass_untouched() -> None:
    assert args("stop_train", {0: 1, WORLD - 1: 0}).faults == {0: 1, WORLD - 1: 0}
    assert args("stop_train", {0: 1}).notes == ()


@pytest.mark.parametrize("strategy", ["downgrade", "upgrade"])
@pytest.mark.parametrize("params", ["", "x" * 1024, "\u00e9" * 512])
def test_zit_strategies_need_params_of_1_to_1023_bytes(strategy: str, params: str) -> None:
    with pytest.raises(BadArgument, match="1..1023 bytes"):
        args("change_strategy", strategy=strategy, params=params)


def test_zit_params_inside_the_limit_and_other_strategies_pass() -> None:
    assert args("change_strategy", strategy="downgrade", params='{"scale-in-strategy": "DP"}').params
    assert args("change_strategy", strategy="downgrade", params="x" * 1023).notes == ()
    assert args("change_strategy", strategy="retry").strategy == "retry"


# --------------------------------------------------------------------------- signal_problem

def signal(signal_type: str = "stopTrain", actions: Sequence[str] = ("stop_train",), uuid: str = UUID,
           faults: dict[int, int] | None = None, node_ranks: Sequence[str] = (), **fields: Any) -> pb.ProcessManageSignal:
    ranks = [pb.FaultRank(rankId=str(r), faultType=str(t)) for r, t in (faults or {}).items()]
    return pb.ProcessManageSignal(uuid=uuid, jobId=JOB, signalType=signal_type, actions=list(actions),
                                  faultRanks=ranks, nodeRankIds=list(node_ranks), **fields)


def test_the_orphaned_global_fault_is_a_problem_and_legitimate_uuidless_signals_are_not() -> None:
    orphan = signal("globalFault", ["on_global_rank", "fault_nodes_exit"], uuid="")
    assert signal_problem(orphan) is not None and signal_problem(orphan)[0] == "orphaned_global_fault"
    # saveAndExit and preExitProcess may come without a uuid; a real globalFault has one.
    assert signal_problem(signal("saveAndExit", ["save_and_exit"], uuid="", node_ranks=["1"])) is None
    assert signal_problem(signal("preExitProcess", ["pre exit process"], uuid="", faults={5: 1},
                                 node_ranks=["1"])) is None
    assert signal_problem(signal("globalFault", ["on_global_rank", "fault_nodes_exit"], faults={4: 1},
                                 node_ranks=["1"])) is None
    assert signal_problem(signal("globalFault", ["on_global_rank"])) is None  # a retry cycle's, with its uuid


def test_too_many_actions_and_no_actions_are_problems() -> None:
    assert signal_problem(signal(actions=["stop_train"] * MAX_ACTIONS)) is None
    assert signal_problem(signal(actions=["stop_train"] * (MAX_ACTIONS + 1)))[0] == "too_many_actions"
    assert signal_problem(signal(actions=[]))[0] == "no_actions"
    assert signal_problem(signal("keep-alive", [])) is None
    assert signal_problem(signal("killMaster", [])) is None


# --------------------------------------------------------------------------- the dispatcher

class FakeController:
    """The controller module's notify functions, recorded; ``fail`` makes the next
    notify raise (an exception class) or return a code (an int)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.fail: type[BaseException] | int | None = None

    def _call(self, name: str, *args: Any) -> int:
        self.calls.append((name, args))
        fail, self.fail = self.fail, None
        if isinstance(fail, type):
            raise fail(f"{name} failed on purpose")
        return 0 if fail is None else fail

    def tft_notify_controller_stop_train(self, faults: dict[int, int], stop_type: str = "stop",
                                         timeout: int | None = None) -> int:
        if stop_type == "pause" and not 0 <= int(timeout) < 2 ** 32:  # type: ignore[arg-type]
            raise OverflowError("in method 'tft_notify_controller_stop_train', argument 3 of type 'uint32_t'")
        return self._call("stop_train", dict(faults), stop_type, timeout)

    def tft_notify_controller_on_global_rank(self, faults: dict[int, int], time: int = 1) -> int:
        return self._call("on_global_rank", dict(faults), time)

    def tft_notify_controller_change_strategy(self, strategy: str, params: str = "") -> int:
        return self._call("change_strategy", strategy, params)

    def tft_notify_controller_dump(self) -> int:
        return self._call("dump")

    def tft_notify_controller_prepare_action(self, action: str, fault_ranks: dict[int, int] | None = None) -> int:
        return self._call("prepare_action", action, dict(fault_ranks or {}))

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


class FakeHooks:
    def __init__(self) -> None:
        self.runs: list[tuple[str, list[object]]] = []
        self.signals: list[HookSignal | None] = []

    async def run(self, action: str, node_rank_ids: Sequence[object], signal: HookSignal | None = None) -> str:
        self.runs.append((action, list(node_rank_ids)))
        self.signals.append(signal)
        return "ok"


class RecordingCycles:
    """The cycle state as the dispatcher tells it: each publication with the cycle the
    flow answered at that moment, and each request for a new subscription."""

    def __init__(self, rig: Rig) -> None:
        self._rig = rig
        self.published: list[str | None] = []
        self.resubscribed: list[str] = []

    def answering_changed(self) -> None:
        self.published.append(self._rig.flow.answering)

    def request_resubscribe(self, reason: str) -> None:
        self.resubscribed.append(reason)


class Rig:
    """A dispatcher around a fake controller module. By default the host owns the
    controller and knows its world size, as the daemon's does; ``external=True`` is the
    seed API's host around a controller its caller initialised, whose world size the
    host never learns (its config keeps the default 1)."""

    def __init__(self, *, external: bool = False) -> None:
        self.module = FakeController()
        self.metrics = BridgeMetrics()
        self.flow = ControllerFlow(wait_timeout=30.0)
        self.hooks = FakeHooks()
        config = ControllerConfig() if external else ControllerConfig(world_size=WORLD)
        host = ControllerHost(self.module, config, external=external)  # type: ignore[arg-type]
        self.cycles = RecordingCycles(self)
        self.dispatcher = SignalDispatcher(JOB, self.flow, host, self.hooks, self.metrics,  # type: ignore[arg-type]
                                           self.cycles, None, on_kill_master=lambda: None, pause_timeout=600)
        self.handled = 0
        self._task: asyncio.Task[None] | None = None

    def send(self, message: pb.ProcessManageSignal) -> None:
        self.dispatcher.submit(screen_signal(message, message.SerializeToString(), message.uuid or "stream:1"))

    def refused(self, reason: str) -> float:
        return self.metrics.sample("tft_bridge_signals_refused_total", {"reason": reason})

    def notifies(self, action: str, result: str) -> float:
        return self.metrics.sample("tft_bridge_controller_notifies_total", {"action": action, "result": result})


AnyRig = TypeVar("AnyRig", bound=Rig)


@contextlib.asynccontextmanager
async def dispatching(rig: AnyRig) -> AsyncIterator[AnyRig]:
    """``rig``'s dispatcher running on the test's loop; stopped (within 5 s, or the test
    fails: every loop can be stopped) and closed after."""
    task = asyncio.create_task(rig.dispatcher.run())
    try:
        yield rig
    finally:
        rig.dispatcher.stop()
        await asyncio.wait_for(task, 5)
        rig.dispatcher.close()


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    async with dispatching(Rig()) as running:
        yield running


def stop_train(uuid: str = UUID) -> pb.ProcessManageSignal:
    return signal("stopTrain", ["stop_train"], uuid=uuid, faults={5: 1})


@pytest.mark.parametrize("timeout", [2 ** 32, 2 ** 40])
async def test_a_huge_pause_timeout_is_clamped_and_never_reaches_the_controller_raw(rig: Rig, timeout: int) -> None:
    """Before: OverflowError after the flow had moved to PAUSE_SENT, never restored."""
    rig.send(signal("stopTrain", ["pause_train"], timeout=timeout))
    await eventually(lambda: rig.module.calls, what="the pause forwarded")
    assert rig.module.calls == [("stop_train", ({}, "pause", PAUSE_TIMEOUT_MAX))]
    assert rig.flow.step is Step.PAUSE_SENT
    assert rig.metrics.sample("tft_bridge_bad_inputs_total", {"kind": "signal_argument"}) == 1


async def test_a_negative_pause_timeout_is_refused_before_the_flow_moves(rig: Rig) -> None:
    """Before: OverflowError, flow stuck at PAUSE_SENT, the next real stopTrain refused."""
    rig.send(signal("stopTrain", ["pause_train"], uuid="", timeout=-1))
    await eventually(lambda: rig.refused("bad_argument") == 1, what="the pause refused")
    assert rig.flow.step is Step.IDLE and rig.module.calls == []
    rig.send(stop_train())
    await eventually(lambda: rig.module.names() == ["stop_train"], what="the real stopTrain forwarded")
    assert rig.flow.step is Step.STOP_SENT


@pytest.mark.parametrize("failure", [RuntimeError, OverflowError, TypeError, 1])
async def test_every_notify_failure_puts_the_flow_back(rig: Rig, failure: type[BaseException] | int) -> None:
    """An exception from the notify call, or a refusal (1): the flow returns to where it
    was, so the next real signal is still forwarded."""
    rig.module.fail = failure
    rig.send(stop_train())
    await eventually(lambda: rig.module.calls, what="the first stopTrain tried")
    result = "refused" if failure == 1 else "error"
    await eventually(lambda: rig.notifies("stop_train", result) == 1, what=f"the failure counted as {result}")
    assert rig.flow.step is Step.IDLE
    rig.send(stop_train("18EA87DEEF733F9D-00000000000000000000000000000001"))
    await eventually(lambda: len(rig.module.calls) == 2, what="the next stopTrain forwarded")
    assert rig.flow.step is Step.STOP_SENT
    assert rig.notifies("stop_train", "ok") == 1


async def test_a_failed_on_global_rank_puts_the_flow_back_to_await_global(rig: Rig) -> None:
    rig.flow.on_callback("report_fault_ranks")
    rig.send(stop_train())
    await eventually(lambda: rig.flow.step is Step.STOP_SENT)
    rig.flow.on_callback("report_stop_complete", 0)
    rig.module.fail = ValueError
    rig.send(signal("globalFault", ["on_global_rank"], faults={5: 1}, timeout=2 ** 40))
    await eventually(lambda: rig.notifies("on_global_rank", "error") == 1, what="the raising notify counted")
    assert rig.flow.step is Step.AWAIT_GLOBAL
    assert rig.module.calls[-1] == ("on_global_rank", ({5: 1}, 3600))  # clamped, not 2**40


async def test_fault_ranks_outside_the_world_do_not_make_the_controller_half_merge(rig: Rig) -> None:
    rig.send(signal("stopTrain", ["stop_train"], faults={3: 1, 99: 1}))
    await eventually(lambda: rig.module.calls, what="the stopTrain forwarded")
    assert rig.module.calls == [("stop_train", ({3: 1}, "stop", None))]


async def test_a_host_that_does_not_know_the_world_size_forwards_every_rank_clusterd_named() -> None:
    """The seed API hosts a controller its caller initialised: the host's config keeps the
    default world size 1, and the range check dropped every fault rank but 0 of a
    globalFault (ClusterD's {2: 1, 3: 1} became on_global_rank({})); the controller then
    repaired too few ranks and hung. Unknown world size: no range check, nothing dropped."""
    async with dispatching(Rig(external=True)) as rig:
        rig.send(signal("stopTrain", ["stop_train"], faults={5: 1}))
        await eventually(lambda: rig.module.calls, what="the stopTrain forwarded")
        rig.flow.on_callback("report_stop_complete", 0)
        rig.send(signal("globalFault", ["on_global_rank", "fault_nodes_exit"], faults={4: 1, 5: 1, 6: 1, 7: 1},
                        node_ranks=["1"]))
        await eventually(lambda: len(rig.module.calls) == 2, what="the globalFault forwarded")
        assert rig.module.calls == [("stop_train", ({5: 1}, "stop", None)),
                                    ("on_global_rank", ({4: 1, 5: 1, 6: 1, 7: 1}, 1))]
        assert rig.metrics.sample("tft_bridge_bad_inputs_total", {"kind": "signal_argument"}) == 0


async def test_unknown_actions_are_counted_as_unknown_in_one_line(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    """Before: each unknown action was refused as unexpected_step, one warning each."""
    caplog.set_level(logging.WARNING, logger="bridge.job.session.signals")
    rig.send(signal("stopTrain", ["bogus-1", "stop_train", "bogus-2", "bogus-3"], faults={5: 1}))
    await eventually(lambda: rig.refused("unknown_action") == 3, what="three unknown actions counted")
    assert rig.module.names() == ["stop_train"]  # the known action still acted on
    assert rig.refused("unexpected_step") == 0
    lines = [r for r in caplog.records if r.name == "bridge.job.session.signals"]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert "3 of 4" in lines[0].getMessage()


async def test_a_10000_action_signal_costs_one_line_and_the_next_stop_train_is_forwarded(
        rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    """Before: 10 000 unknown actions wrote 428 MB of log and held the next real stopTrain
    back by > 8 s. The cost is bounded by bytes of log, and the stopTrain right behind
    it is forwarded (waited for, not timed)."""
    caplog.set_level(logging.DEBUG)
    rig.send(signal("stopTrain", [f"bogus-{i}" for i in range(10_000)], uuid="flood"))
    rig.send(signal("stopTrain", ["stop_train"] * 10_000, uuid="flood-2"))
    rig.send(stop_train())
    await eventually(lambda: rig.module.names() == ["stop_train"], what="the real stopTrain forwarded")
    assert rig.refused("too_many_actions") == 2
    assert rig.refused("unknown_action") == 0 and rig.refused("unexpected_step") == 0
    logged = sum(len(r.getMessage()) for r in caplog.records)
    assert logged < 2_000, logged


async def test_refusal_lines_are_budgeted_across_signals(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    """1 000 signals of unknown actions: every action counted, a handful of lines."""
    caplog.set_level(logging.WARNING, logger="bridge.job.session.signals")
    for i in range(1_000):
        rig.send(signal("stopTrain", ["bogus"] * MAX_ACTIONS, uuid=f"storm-{i}"))
    await eventually(lambda: rig.refused("unknown_action") == 1_000 * MAX_ACTIONS, 30, "every action counted")
    lines = [r for r in caplog.records if r.name == "bridge.job.session.signals"]
    assert 1 <= len(lines) <= 10, len(lines)


async def test_the_orphaned_global_fault_is_refused_and_runs_no_node_hook(rig: Rig) -> None:
    """Controller waiting for on_global_rank of a cycle a stream reset aborted: the
    uuid-less, rank-less globalFault ClusterD sends on the new stream reaches neither
    the controller nor the node hook."""
    rig.flow.on_callback("report_fault_ranks")
    rig.send(stop_train())
    await eventually(lambda: rig.flow.step is Step.STOP_SENT)
    rig.flow.on_callback("report_stop_complete", 0)
    rig.send(signal("globalFault", ["on_global_rank", "fault_nodes_exit"], uuid=""))
    await eventually(lambda: rig.refused("orphaned_global_fault") == 1, what="the orphan refused")
    assert rig.module.names() == ["stop_train"] and rig.hooks.runs == []
    assert rig.flow.step is Step.AWAIT_GLOBAL
    assert rig.cycles.resubscribed == ["orphaned_global_fault"]  # ClusterD's job is reset: it waits no more
    # the real globalFault of a cycle is still forwarded, and its node hook run
    rig.send(signal("globalFault", ["on_global_rank", "fault_nodes_exit"], faults={4: 1, 5: 1}, node_ranks=["1"]))
    await eventually(lambda: rig.module.names() == ["stop_train", "on_global_rank"], what="the real one forwarded")
    await eventually(lambda: rig.hooks.runs == [("fault_nodes_exit", ["1"])], what="its hook run")


async def test_a_uuidless_save_and_exit_is_still_forwarded(rig: Rig) -> None:
    rig.send(signal("saveAndExit", ["save_and_exit"], uuid="", node_ranks=["0"]))
    await eventually(lambda: rig.module.names() == ["dump"], what="the dump forwarded")


# --------------------------------------------------------------------------- end to end

def job_spec() -> SimJob:
    return SimJob(JOB, world_size=WORLD, devices_per_pod=4)


async def started(jobs: list[SimulatedJob], **kwargs: Any) -> SimulatedJob:
    return await start_job(jobs, job_spec(), **kwargs)


def refused(job: SimulatedJob, reason: str) -> float:
    return job.metrics.sample("tft_bridge_signals_refused_total", {"reason": reason})


@pytest.mark.parametrize("timeout", [2 ** 32, -1])
async def test_a_bad_pause_timeout_leaves_the_next_fault_recoverable(jobs: list[SimulatedJob],
                                                                      timeout: int) -> None:
    """Out-of-range pause timeouts, end to end: the stub controller raises OverflowError for these
    timeouts like the real SWIG wrapper. Before: flow stuck at PAUSE_SENT, the real
    stopTrain refused, the controller went to EXIT."""
    job = await started(jobs, wait_time=3.0)
    if timeout < 0:
        await job.sim.send_signal(JOB, uuid="", signalType="stopTrain", actions=["pause_train"], timeout=timeout)
        await eventually(lambda: refused(job, "bad_argument") == 1, what="the negative pause refused")
    else:  # clamped and forwarded: ClusterD's OM pause runs to its end (continue and its result)
        await job.sim.pause(JOB, timeout=timeout)
        await job.sim.wait_for(lambda e: e.kind == "rpc" and e.name == "ReportRecoverStatus", timeout=10)
        assert [n.args[2] for n in job.training.notifies("stop_train")] == [PAUSE_TIMEOUT_MAX]
        await job.sim.wait_for(lambda e: e.kind == "stream-end", timeout=10)  # the pause's stream ends
        await job.subscribed()
    job.training.inject_fault({5: 1})
    await annotation(job, timeout=20)
    assert "EXIT" not in job.training.states()
    assert [n.result for n in job.training.notifies("stop_train")][-1] == 0


async def test_a_10000_action_signal_does_not_delay_the_next_cycle(jobs: list[SimulatedJob],
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A flood of unknown actions, end to end: the flood goes over the wire right before a fault;
    the cycle still completes inside the controller's 3 s waits and the log stays small."""
    caplog.set_level(logging.INFO)
    job = await started(jobs, wait_time=3.0)
    await job.sim.send_signal(JOB, uuid="", signalType="stopTrain", actions=[f"x{i}" for i in range(10_000)])
    job.training.inject_fault({5: 1})
    await annotation(job, timeout=20)
    assert refused(job, "too_many_actions") == 1
    assert "EXIT" not in job.training.states()
    signal_lines = sum(len(r.getMessage()) for r in caplog.records if r.name == "bridge.job.session.signals")
    assert signal_lines < 2_000, signal_lines


async def test_the_toml_wait_reaches_the_controller_and_the_flow_gate(jobs: list[SimulatedJob],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait set only in the TOML: only the TOML sets wait_mindx_time (1 s); nothing in the
    environment. The stub reads its wait from the environment at init like the real
    controller, so it waits 1 s only if the bridge exported it. Before: it waited its
    default 30 s while the bridge's gate assumed 1 s."""
    monkeypatch.delenv("MINDIO_WAIT_MINDX_TIME", raising=False)
    job = await started(jobs, wait_time=1.0, global_fault_delay=60.0)  # globalFault never comes in time
    assert job.training.wait_mindx_time == 1
    job.training.inject_fault({5: 1})
    await eventually(lambda: job.training.callbacks("report_stop_complete"), 10, "the stop done")
    # The controller gives ClusterD its (exported) 1 s and goes to EXIT, well before 30 s.
    await eventually(lambda: "EXIT" in job.training.states(), 15, "the controller gave up after its 1 s wait")


def test_check_config_shows_the_wait_the_controller_gets(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The environment sets the wait when the TOML does not; the TOML wins when it does
    (config.py's precedence); check-config prints that effective value, and it is the
    value ControllerHost.start exports (both read config.controller.wait_mindx_time)."""
    from bridge.cli import main

    path = tmp_path / "job.toml"
    path.write_text('job_id = "j"\n[clusterd]\naddress = "127.0.0.1:8899"\nreconnect_max = 1.0\n')
    assert load_config(path, env={"MINDIO_WAIT_MINDX_TIME": "7"}).controller.wait_mindx_time == 7
    path.write_text(path.read_text() + "[controller]\nwait_mindx_time = 12\n")
    assert load_config(path, env={"MINDIO_WAIT_MINDX_TIME": "7"}).controller.wait_mindx_time == 12
    monkeypatch.setenv("MINDIO_WAIT_MINDX_TIME", "7")
    assert main(["check-config", str(path)]) == 0
    assert '"wait_mindx_time": 12' in capsys.readouterr().out


def test_start_exports_the_configured_wait_before_init(monkeypatch: pytest.MonkeyPatch) -> None:
    """The order matters: the controller reads the variable in tft_init_controller."""
    monkeypatch.setenv("MINDIO_WAIT_MINDX_TIME", "30")
    seen: list[str | None] = []

    class Module:
        def tft_register_mindx_callback(self, name: str, func: Any) -> int:
            return 0

        def tft_init_controller(self, *args: Any) -> None:
            import os
            seen.append(os.environ.get("MINDIO_WAIT_MINDX_TIME"))

        def tft_start_controller(self, *args: Any) -> None:
            pass

    host = ControllerHost(Module(), ControllerConfig(wait_mindx_time=10))  # type: ignore[arg-type]
    host.start(lambda fields: None, lambda: None)
    assert seen == ["10"]


@pytest.mark.parametrize("raw, read", [("10", 10), ("3600", 3600), (" 10", 30), ("+10", 30), ("0", 30),
                                       ("3601", 30), ("", 30), ("\uff11\uff10", 30)])
def test_an_external_controllers_wait_is_read_as_the_controller_reads_it(monkeypatch: pytest.MonkeyPatch,
                                                                         raw: str, read: int) -> None:
    """The seed API's controller is started by its caller, who never exported the bridge's
    config: its flow gate takes the wait the controller itself read at init."""
    from bridge.job.host.controller import wait_time_from_environment

    monkeypatch.setenv("MINDIO_WAIT_MINDX_TIME", raw)
    assert wait_time_from_environment() == read


async def test_bad_argument_lines_are_budgeted_too(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    """Every refused or corrected argument is counted; their log lines share the budget."""
    caplog.set_level(logging.WARNING, logger="bridge.job.session.signals")
    for i in range(200):
        rig.send(signal("stopTrain", ["pause_train"] * MAX_ACTIONS, uuid=f"bad-{i}", timeout=-1))
    await eventually(lambda: rig.refused("bad_argument") == 200 * MAX_ACTIONS, 30, "every bad pause counted")
    assert rig.metrics.sample("tft_bridge_bad_inputs_total", {"kind": "signal_argument"}) == 200 * MAX_ACTIONS
    lines = [r for r in caplog.records if r.name == "bridge.job.session.signals"]
    assert 1 <= len(lines) <= 10, len(lines)
    assert rig.module.calls == []


# --------------------------------------------------------------------------- node hooks get the whole signal

async def test_recover_in_place_restarts_only_the_fault_ranks_and_exits_no_node(rig: Rig) -> None:
    """ClusterD's in-place recover: changeStrategy recover with extraParams
    recover-in-place and fault_nodes_restart. The controller gets recover; the hook gets
    the fault ranks with their types (not widened to the pod) and the strategy; the
    change_strategy itself asks no node to exit (TaskD restarts, it does not exit)."""
    rig.flow.on_callback("report_fault_ranks")
    rig.send(stop_train())
    await eventually(lambda: rig.flow.step is Step.STOP_SENT)
    rig.flow.on_callback("report_stop_complete", 0)
    rig.send(signal("globalFault", ["on_global_rank", "fault_nodes_exit"], faults={5: 1}))
    await eventually(lambda: rig.flow.step is Step.GLOBAL_SENT)
    rig.flow.on_callback("report_strategies", strategies=("exit", "recover"))
    rig.send(signal("changeStrategy", ["change_strategy", "fault_nodes_restart"], faults={5: 1}, node_ranks=["2"],
                    changeStrategy="recover", extraParams="recover-in-place"))
    await eventually(lambda: [run[0] for run in rig.hooks.runs] == ["fault_nodes_exit", "fault_nodes_restart"],
                     what="the restart hook")
    assert rig.module.calls[-1] == ("change_strategy", ("recover", "recover-in-place"))
    restart = rig.hooks.signals[-1]
    assert restart is not None and rig.hooks.runs[-1] == ("fault_nodes_restart", ["2"])
    assert dict(restart.fault_ranks) == {5: 1}
    assert (restart.strategy, restart.extra_params, restart.uuid) == ("recover", "recover-in-place", UUID)
    assert restart.actions == ("change_strategy", "fault_nodes_restart")


@pytest.mark.parametrize("extra, hooked", [("", True), ("recover-in-place", False)])
async def test_a_recover_asks_its_nodes_to_exit_unless_it_is_in_place(rig: Rig, extra: str, hooked: bool) -> None:
    """TaskD's recover plugin exits the agents of a recover's nodeRankIds (the pods
    ClusterD still wants restarted, filterRecoverPodsNodeRankIds), after the notify."""
    rig.flow.on_callback("report_fault_ranks")
    rig.send(stop_train())
    await eventually(lambda: rig.flow.step is Step.STOP_SENT)
    rig.flow.on_callback("report_stop_complete", 0)
    rig.send(signal("globalFault", ["on_global_rank"], faults={4: 1, 5: 1}))
    await eventually(lambda: rig.flow.step is Step.GLOBAL_SENT)
    rig.flow.on_callback("report_strategies", strategies=("exit", "recover"))
    rig.send(signal("changeStrategy", ["change_strategy"], faults={4: 1, 5: 1}, node_ranks=["1", "2"],
                    changeStrategy="recover", extraParams=extra))
    await eventually(lambda: rig.module.names()[-1] == "change_strategy", what="the strategy forwarded")
    if hooked:
        await eventually(lambda: rig.hooks.runs == [("change_strategy", ["1", "2"])], what="the exit hook")
        context = rig.hooks.signals[-1]
        assert context is not None and context.strategy == "recover" and dict(context.fault_ranks) == {4: 1, 5: 1}
    else:
        rig.send(stop_train(uuid="later"))  # handled after: a hook would have run before its refusal
        await eventually(lambda: rig.refused("unexpected_step") == 1, what="the later signal handled")
        assert rig.hooks.runs == []


async def test_save_and_exit_asks_its_nodes_to_exit_after_the_dump(rig: Rig) -> None:
    rig.send(signal("saveAndExit", ["save_and_exit"], uuid="", node_ranks=["0", "3"]))
    await eventually(lambda: rig.hooks.runs == [("save_and_exit", ["0", "3"])], what="the exit hook")
    assert rig.module.names() == ["dump"]


# --------------------------------------------------------------------------- hot switch

async def test_stop_switch_ends_the_switch_but_never_reaches_the_controller(rig: Rig) -> None:
    """Told in NORMAL, the controller latches it for the next fault flow's first wait
    (signals.STOP_SWITCH); the flow still leaves SWITCHING."""
    rig.send(signal("hot-switch", ["hot switch"], uuid="", faults={4: 1, 5: 1}))
    await eventually(lambda: rig.flow.step is Step.SWITCHING, what="the switch forwarded")
    assert rig.module.calls == [("prepare_action", ("hot switch", {4: 1, 5: 1}))]
    rig.send(signal("hot-switch", ["stop switch"], uuid=""))
    await eventually(lambda: rig.notifies("stop switch", "withheld") == 1, what="stop switch withheld")
    assert rig.flow.step is Step.IDLE and rig.module.names() == ["prepare_action"]
    rig.send(signal("hot-switch", ["stop switch"], uuid="", faults={9: 1}))  # no switch now
    await eventually(lambda: rig.refused("unexpected_step") == 1, what="a stop switch outside a switch refused")
    assert rig.module.names() == ["prepare_action"]


async def test_new_pod_running_is_only_logged(rig: Rig) -> None:
    rig.send(signal("hot-switch", ["hot switch"], uuid="", faults={4: 1}))
    rig.send(signal("hot-switch", ["new pod running"], uuid=""))
    rig.send(stop_train(uuid="later"))  # a fault before the migration: forwarded, the switch is over
    await eventually(lambda: rig.module.names() == ["prepare_action", "stop_train"], what="the stop forwarded")
    assert rig.refused("unexpected_step") == 0 and rig.refused("unknown_action") == 0


async def test_the_cycle_the_controller_answers_is_published_before_the_notify_and_again_when_undone(
        rig: Rig) -> None:
    """The controller answers only after a notify, and its answer is bound to the cycle
    published before then (bridge/job/cycle_state.py): the dispatcher tells the cycle state
    after it moved the flow and before the call, and again after a refused notify put
    the flow back."""
    published_at_notify: list[list[str | None]] = []
    notify = rig.module.tft_notify_controller_stop_train

    def recording_notify(*args: Any, **kwargs: Any) -> int:
        published_at_notify.append(list(rig.cycles.published))
        return notify(*args, **kwargs)

    rig.module.tft_notify_controller_stop_train = recording_notify  # type: ignore[method-assign]
    rig.flow.on_callback("report_fault_ranks")
    rig.module.fail = 1  # the controller refuses the first stop_train
    rig.send(stop_train("uuid-refused"))
    await eventually(lambda: rig.notifies("stop_train", "refused") == 1, what="the refused notify")
    assert published_at_notify == [["uuid-refused"]]
    assert rig.cycles.published == ["uuid-refused", None]  # undone: the flow answers no cycle again
    rig.send(stop_train("uuid-2"))
    await eventually(lambda: rig.notifies("stop_train", "ok") == 1, what="the accepted notify")
    assert published_at_notify[-1] == ["uuid-refused", None, "uuid-2"]
    assert rig.cycles.published == ["uuid-refused", None, "uuid-2"]


def test_a_signal_is_screened_once_and_its_faults_travel_with_it() -> None:
    """The session's reader screens a signal once: the fault ranks decoded there are the
    ones the dispatcher hands the controller; nothing keeps them on the side."""
    import bridge.job.session.signals as signals_module

    message = signal("stopTrain", ["stop_train"], uuid="uuid-1", faults={5: 1, 6: 2})
    screened = screen_signal(message, message.SerializeToString(), "uuid-1")
    assert screened.faults == {5: 1, 6: 2} and screened.refusal is None and screened.token == "uuid-1"
    assert not hasattr(signals_module, "_screened") and not hasattr(signals_module, "decode_faults")
    garbage = screen_signal(message, b"\x0a\xff", "uuid-1")  # the signal's bytes do not decode
    assert garbage.refusal is not None and garbage.refusal[0] == "malformed"
    unknown = signal("stopTrain", ["dance"], uuid="uuid-2")
    assert screen_signal(unknown, unknown.SerializeToString(), "uuid-2").refusal[0] == "unknown_action"
