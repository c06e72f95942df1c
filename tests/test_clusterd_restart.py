"""A recovery survives ClusterD restarting or freezing mid-cycle, and a malformed signal does not take over the cycle.

Restart or freeze. Every new subscription resets ClusterD's job (docs/clusterd.md section 4): a
ClusterD killed and restarted, or frozen long enough that the bridge declares the stream
dead and subscribes again, forgets the cycle the controller is stopped for. Without the
bridge's resume (bridge/job/session/resume.py) nothing ever moves again, the controller waits out
``MINDIO_WAIT_MINDX_TIME`` and goes to EXIT: the job is killed. Each test here stops the
controller at one step of a type-1 cycle, restarts or freezes ClusterD, and asserts that
the controller ends the cycle successfully (report_result 0, NORMAL, never killed, never
notified twice) and that the new ClusterD saw a complete cycle.

The freeze is a TCP proxy between the bridge and the simulated ClusterD that stops
forwarding bytes both ways (what SIGSTOP looks like from the network: connections stay
open, nothing is answered) for longer than the RPC deadline and the stream watchdog, then
forwards everything it held.

"Before stop-complete" and "after globalFault" need the controller's own answer to be
still to come when ClusterD goes away: the test holds that callback inside the bridge's
hand-off (``HeldCallback``) and lets it through once the new ClusterD's cycle reached the
same step, which is the controller answering late.

Malformed signals. A malformed signal with a new uuid during a repair must not become the running
cycle: the real result must still reach ClusterD.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from bridge.job.reports.controller_flow import Step
from bridge.sim.mindio_ttp import Training
from bridge.sim.mindio_ttp import FAST_TIMINGS
from bridge.sim.scenario import SimulatedJob

from .conftest import eventually
from .test_fault_injection import (JOB, TRIGGERS, after, annotation, check_invariants, controller_violations,
                                   dropped, job_spec, kill_clusterd, last_seq, m, on_journal, running,
                                   step_and_wait_result)

pytestmark = pytest.mark.timeout(60)

__all__ = ["running"]  # the fixture, shared with test_fault_injection

#: The controller's MindX wait in these tests: long enough for a freeze plus a new cycle on
#: a loaded machine, short enough that a job the bridge fails to rescue ends the test soon.
WAIT = 8.0
#: How long a freeze lasts: past the RPC deadline (2 s in SimulatedJob) and the stream
#: watchdog (20 keep-alives of 50 ms), so the bridge gives up on the stream and re-subscribes.
FREEZE = 2.6


# --------------------------------------------------------------------------- a freezable ClusterD

class FreezableProxy:
    """TCP proxy ``listen`` -> ``upstream``; ``freeze()`` holds every byte in both
    directions (new connections are accepted but carry nothing) until ``thaw()``."""

    def __init__(self, listen: str, upstream: str) -> None:
        self.listen = listen
        self.upstream = upstream
        self.thawed = asyncio.Event()
        self.thawed.set()
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        host, port = self.listen.rsplit(":", 1)
        self._server = await asyncio.start_server(self._accept, host, int(port))

    def freeze(self) -> None:
        self.thawed.clear()

    def thaw(self) -> None:
        self.thawed.set()

    async def close(self) -> None:
        self.thaw()
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = self.upstream.rsplit(":", 1)
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.get_running_loop().create_task(self._pump(source, sink, (writer, up_writer)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter,
                    both: tuple[asyncio.StreamWriter, asyncio.StreamWriter]) -> None:
        try:
            while True:
                data = await source.read(65536)
                await self.thawed.wait()  # frozen: whatever arrived waits here, in order
                if not data:
                    break
                sink.write(data)
                await sink.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            for writer in both:
                writer.close()
                self._writers.discard(writer)


@pytest.fixture
async def proxies() -> AsyncIterator[list[FreezableProxy]]:
    """Closed after the jobs (request it before ``running``): the bridge's shutdown still
    talks to ClusterD through it."""
    made: list[FreezableProxy] = []
    yield made
    for proxy in made:
        await proxy.close()


async def launch(running: list[SimulatedJob], proxies: list[FreezableProxy] | None = None,
                 **kwargs: Any) -> SimulatedJob:
    """The fault-injection job (short phases, fast controller) with a ``WAIT`` s MindX
    wait; behind a FreezableProxy when ``proxies`` is given."""
    kwargs.setdefault("auto_step", True)
    overrides = kwargs.pop("config_overrides", {})
    clusterd = {"watchdog_intervals": 20.0, **overrides.pop("clusterd", {})}
    job = SimulatedJob(job_spec(), keepalive_interval=0.05, global_fault_delay=0.02, wait_time=WAIT,
                       controller_timings=FAST_TIMINGS, start_clusterd=proxies is None,
                       config_overrides={"clusterd": clusterd, **overrides}, **kwargs)
    running.append(job)
    if proxies is not None:
        upstream = await job.sim.start("127.0.0.1:0")
        proxy = FreezableProxy(job.config.clusterd.address, upstream)
        proxies.append(proxy)
        await proxy.start()
    await job.start()
    await job.subscribed()
    return job


def begin(disruption: str, job: SimulatedJob, proxies: list[FreezableProxy]) -> None:
    """The instant a phase is reached (inside the journal listener, before ClusterD's next
    signal is written): a freeze starts now; a ClusterD about to be killed sends nothing
    more (its next signal waits, and dies with it)."""
    if disruption == "freeze":
        proxies[0].freeze()
    else:
        job.sim.delay_next_signal(30.0)


async def finish(disruption: str, job: SimulatedJob, proxies: list[FreezableProxy]) -> None:
    """ClusterD killed and back 0.1 s later, or the freeze held ``FREEZE`` s and lifted."""
    if disruption == "freeze":
        await asyncio.sleep(FREEZE)  # the delay is the behaviour under test: ClusterD answers nothing this long
        proxies[0].thaw()
    else:
        async def forget_held_signal() -> None:
            job.sim.take_tweaks()  # a delay nothing consumed must not hold the new server's first signal

        await kill_clusterd(job, down=0.1, while_down=forget_held_signal)


async def disrupt(disruption: str, job: SimulatedJob, proxies: list[FreezableProxy]) -> None:
    """Both at once, for a phase held by the bridge (``HeldCallback``): ClusterD is
    waiting for a report then, and sends nothing meanwhile."""
    if disruption == "freeze":
        proxies[0].freeze()
    await finish(disruption, job, proxies)


DISRUPTIONS = ("restart", "freeze")


# --------------------------------------------------------------------------- holding a controller answer

class HeldCallback:
    """Keep the controller's ``callback`` from the bridge until ``release``: the stub
    controller calls a function that keeps its arguments in place of the bridge's (its
    registry looks the function up at every call), which to the bridge is the controller
    answering late (the flow stays at the step before it)."""

    def __init__(self, training: Training, callback: str) -> None:
        self.training = training
        self.callback = callback
        original = training.registry.registered(callback)
        assert original is not None, f"no {callback} registered"
        self.original: Callable[..., Any] = original
        self.held: list[tuple[Any, ...]] = []
        self.released = False
        assert training.registry.register(callback, self._call) == 0

    def _call(self, *args: Any) -> Any:  # on the controller's thread
        if self.released:
            return self.original(*args)
        self.held.append(args)
        return 0

    def release(self) -> None:
        """The held answers to the bridge, as the controller's callback gives them."""
        self.released = True
        held, self.held = self.held, []
        for args in held:
            self.original(*args)


# --------------------------------------------------------------------------- what a rescued cycle looks like

async def assert_rescued(job: SimulatedJob, since: int, invariants: bool = True) -> None:
    """The controller finished the cycle it was stopped for, notified once per step, and
    the new ClusterD (journal after ``since``) ran one complete cycle."""
    await annotation(job, "recover-success", timeout=20)
    await eventually(lambda: [r.args[0] for r in job.training.callbacks("report_result")] == [0], 10,
                     "the controller's report_result 0")
    await eventually(lambda: job.training.state == "NORMAL", 10, "the controller back in NORMAL")
    assert not job.training.job_killed
    for action in ("stop_train", "on_global_rank", "change_strategy"):
        assert len(job.training.notifies(action)) == 1, (action, job.training.notifies(action))
    names = [(e.kind, e.name) for e in job.sim.journal if e.seq > since and e.job_id == JOB
             and ((e.kind == "signal" and e.name != "keep-alive") or (e.kind == "rpc" and e.code == 0 and e.name in (
                 "ReportStopComplete", "ReportRecoverStrategy", "ReportRecoverStatus")))]
    cycle = [("signal", "stopTrain"), ("rpc", "ReportStopComplete"), ("signal", "globalFault"),
             ("rpc", "ReportRecoverStrategy"), ("signal", "changeStrategy"), ("rpc", "ReportRecoverStatus")]
    assert names[-6:] == cycle, names
    # once per new stream the controller waited on: one more when ClusterD sent an orphaned
    # globalFault first and the bridge reset the job again (signals.py; a timing race)
    assert m(job, "cycle_resumes_total", result="re_reported") == 1 + m(
        job, "subscription_reconnects_total", reason="orphaned_global_fault")
    assert m(job, "cycle_resumes_total", result="too_late") == 0
    assert dropped(job, "result") == {}
    if invariants:
        await check_invariants(job)


async def new_stream_seq(job: SimulatedJob, since: int) -> int:
    """The journal position where the bridge's new subscription opened after ``since``."""
    opened = await eventually(lambda: [e for e in after(job, since, "stream-open") if e.job_id == JOB], 15,
                              "the bridge's new subscription")
    return opened[0].seq


async def fault_and_hold(job: SimulatedJob, callback: str) -> HeldCallback:
    """A type-1 fault on rank 5, the controller's ``callback`` answer held in the hand-off
    once it came: the bridge's flow stays at the step before it."""
    assert job.bridge is not None
    hold = HeldCallback(job.training, callback)
    job.training.inject_fault({5: 1})
    await eventually(lambda: hold.held, 10, f"the controller's {callback} (held from the bridge)")
    return hold


async def disrupted_while_held(job: SimulatedJob, proxies: list[FreezableProxy], disruption: str,
                               callback: str, step: Step, rebound: str) -> int:
    """ClusterD disrupted while the controller's ``callback`` answer is held at ``step``;
    the answer released once the new cycle's signal was rebound to the controller (the
    metric says so: ``rebound`` names that signal). Returns where the new stream opened."""
    assert job.bridge is not None
    hold = await fault_and_hold(job, callback)
    assert job.bridge.flow.step is step
    mark = last_seq(job)
    await disrupt(disruption, job, proxies)
    await eventually(lambda: m(job, "cycle_resumes_total", result="rebound") == 1, 15, rebound)
    hold.release()
    return await new_stream_seq(job, mark)


async def disrupted_at(job: SimulatedJob, proxies: list[FreezableProxy], disruption: str,
                       trigger: str, what: str) -> int:
    """A type-1 fault on rank 5, ClusterD disrupted the instant its journal reaches
    ``TRIGGERS[trigger]`` (``what``). Returns where the bridge's new stream opened."""
    marks: list[int] = []
    on_journal(job, TRIGGERS[trigger], lambda: (marks.append(last_seq(job)), begin(disruption, job, proxies)))
    job.training.inject_fault({5: 1})
    await eventually(lambda: marks, 10, what)
    await finish(disruption, job, proxies)
    return await new_stream_seq(job, marks[0])


# ----------------------------------------------------------- restart or freeze, each phase

@pytest.mark.parametrize("disruption", DISRUPTIONS)
async def test_before_stop_complete_the_controllers_own_answer_goes_to_the_new_cycle(
        proxies: list[FreezableProxy], running: list[SimulatedJob], disruption: str) -> None:
    """STOP_SENT: the controller is stopping; its stop-complete answers the new cycle."""
    job = await launch(running, proxies if disruption == "freeze" else None)
    since = await disrupted_while_held(job, proxies, disruption, "report_stop_complete", Step.STOP_SENT,
                                       "the new cycle's stopTrain rebound to the stopping controller")
    await assert_rescued(job, since)
    assert m(job, "cycle_resumes_total", result="answered_stop_complete") == 0


@pytest.mark.parametrize("disruption", DISRUPTIONS)
async def test_between_stop_complete_and_global_fault_the_bridge_answers_the_new_stop(
        proxies: list[FreezableProxy], running: list[SimulatedJob], disruption: str) -> None:
    """AWAIT_GLOBAL: the new stopTrain is answered with the controller's stop-complete."""
    job = await launch(running, proxies if disruption == "freeze" else None)
    since = await disrupted_at(job, proxies, disruption, "after_stop_complete",
                               "ClusterD past StopComplete, before globalFault")
    await assert_rescued(job, since)
    assert m(job, "cycle_resumes_total", result="answered_stop_complete") == 1


@pytest.mark.parametrize("disruption", DISRUPTIONS)
async def test_after_global_fault_the_controllers_strategies_go_to_the_new_cycle(
        proxies: list[FreezableProxy], running: list[SimulatedJob], disruption: str) -> None:
    """GLOBAL_SENT: the controller had on_global_rank; its strategies answer the new cycle's
    globalFault, which does not reach it again."""
    job = await launch(running, proxies if disruption == "freeze" else None)
    since = await disrupted_while_held(job, proxies, disruption, "report_strategies", Step.GLOBAL_SENT,
                                       "the new cycle's globalFault rebound to the controller")
    await assert_rescued(job, since)
    assert m(job, "cycle_resumes_total", result="answered_stop_complete") == 1


@pytest.mark.parametrize("disruption", DISRUPTIONS)
async def test_between_strategy_and_change_strategy_the_bridge_answers_both_steps(
        proxies: list[FreezableProxy], running: list[SimulatedJob], disruption: str) -> None:
    """AWAIT_STRATEGY: stop-complete and strategies replayed; the new changeStrategy is
    the controller's one notify of the new cycle."""
    job = await launch(running, proxies if disruption == "freeze" else None)
    since = await disrupted_at(job, proxies, disruption, "after_strategy",
                               "ClusterD past RecoverStrategy, before changeStrategy")
    await assert_rescued(job, since)
    assert m(job, "cycle_resumes_total", result="answered_stop_complete") == 1
    assert m(job, "cycle_resumes_total", result="answered_strategies") == 1


class Rank9Joins:
    """A process fault on rank 9 from the fault centre, started the moment the new cycle's
    stopTrain (after journal position ``since``) is written: the controller never hears of
    it, and the new globalFault names rank 9's pod, which the node agent restarts."""

    def __init__(self, job: SimulatedJob, since: int) -> None:
        self.outcome: list[str] = []

        async def fault_from_the_fault_centre() -> None:
            self.outcome.append(await job.sim.start_clusterd_fault(JOB, {9: 1}))

        self.tasks = on_journal(job, lambda e: e.seq > since and TRIGGERS["at_stop_train"](e),
                                fault_from_the_fault_centre)

    async def joined(self) -> None:
        await eventually(lambda: self.outcome, 15, "rank 9's fault joining the new cycle")
        await asyncio.gather(*self.tasks)
        assert self.outcome == ["joined"]


async def assert_offered_no_repair(job: SimulatedJob, since: int) -> None:
    """The wider cycle (after journal position ``since``) was offered exit and dump only,
    dumped, and the controller was told once and never sent into a hung repair."""
    offered = [e.detail["strategies"] for e in after(job, since, "rpc", "ReportRecoverStrategy") if e.code == 0]
    assert offered == [["exit", "dump"]], offered
    global_faults = [set(map(int, e.detail["faults"])) for e in after(job, since, "signal", "globalFault")
                     if e.detail.get("uuid")]
    assert global_faults and global_faults[-1] >= {8, 9, 10, 11}, global_faults
    # dump, then ClusterD's exit notice after it (dump_exit)
    await eventually(lambda: [n.args[0] for n in job.training.notifies("change_strategy")] == ["dump", "exit"], 10,
                     "the dump and ClusterD's exit notice")
    assert len(job.training.notifies("on_global_rank")) == 1  # never told twice
    assert job.training.repair_hang_ranks == ()


@pytest.mark.parametrize("disruption", DISRUPTIONS)
async def test_a_resumed_cycle_wider_than_the_controllers_ends_with_a_dump_not_a_hung_repair(
        proxies: list[FreezableProxy], running: list[SimulatedJob], disruption: str) -> None:
    """AWAIT_STRATEGY, and while ClusterD is away a process fault on rank 9 joins the new
    cycle from the fault centre (the controller never hears of it): the new globalFault
    names rank 9's pod too, which the node agent restarts. A recover of the controller's
    ranks 4-7 would hang on ranks restarted under it; the bridge offers exit and dump, and
    the job saves its checkpoint and ends as ClusterD decides."""
    job = await launch(running, proxies if disruption == "freeze" else None, auto_step=False)
    marks: list[int] = []
    on_journal(job, TRIGGERS["after_strategy"], lambda: (marks.append(last_seq(job)), begin(disruption, job, proxies)))
    job.training.inject_fault({5: 1})
    await eventually(lambda: marks, 10, "ClusterD past RecoverStrategy, before changeStrategy")
    rank_9 = Rank9Joins(job, marks[0])
    await finish(disruption, job, proxies)
    await rank_9.joined()
    await annotation(job, "dump-success", timeout=20)
    await eventually(lambda: m(job, "cycle_resumes_total", result="answered_without_repair") == 1, 10,
                     "the wider cycle counted")
    await assert_offered_no_repair(job, marks[0])
    assert [r.args[0] for r in job.training.callbacks("report_result")] == [0]
    assert m(job, "cycle_resumes_total", result="answered_strategies") == 0


@pytest.mark.parametrize("disruption", DISRUPTIONS)
async def test_a_cycle_rebound_wider_than_the_controllers_coming_strategies_is_offered_no_repair(
        proxies: list[FreezableProxy], running: list[SimulatedJob], disruption: str) -> None:
    """GLOBAL_SENT: the controller had on_global_rank and its strategies are still to
    come when ClusterD is disrupted; rank 9's process fault joins the new cycle from the
    fault centre, so the new globalFault names rank 9's pod beyond the controller's ranks.
    The controller's strategies, when they come, answer that cycle with exit and dump
    only: a recover of ranks 4-7 would hang on the pod restarted under it."""
    job = await launch(running, proxies if disruption == "freeze" else None, auto_step=False)
    assert job.bridge is not None
    hold = await fault_and_hold(job, "report_strategies")
    assert job.bridge.flow.step is Step.GLOBAL_SENT
    mark = last_seq(job)
    rank_9 = Rank9Joins(job, mark)
    await disrupt(disruption, job, proxies)
    await rank_9.joined()
    await eventually(lambda: m(job, "cycle_resumes_total", result="rebound") == 1, 15,
                     "the new cycle's globalFault rebound to the controller")
    hold.release()
    await annotation(job, "dump-success", timeout=20)
    assert m(job, "cycle_resumes_total", result="answered_without_repair") == 1
    await assert_offered_no_repair(job, mark)


async def test_a_controller_already_repairing_is_not_re_reported(running: list[SimulatedJob]) -> None:
    """REPAIRING: the new ClusterD would restart at stopTrain, which the controller is past.
    Counted as too_late; the result is dropped (no cycle to answer) and training goes on."""
    job = await launch(running, auto_step=False)
    job.training.inject_fault({5: 1})
    await eventually(lambda: bool(job.training.notifies("change_strategy")), 10, "change_strategy notified")
    mark = last_seq(job)
    await kill_clusterd(job)
    await eventually(lambda: m(job, "cycle_resumes_total", result="too_late") == 1, 10, "too_late counted")
    await step_and_wait_result(job)
    await check_invariants(job)
    assert dropped(job, "result") == {"no_live_cycle": 1}
    assert m(job, "cycle_resumes_total", result="re_reported") == 0
    assert not after(job, mark, "signal", "stopTrain")
    assert job.training.state == "NORMAL" and not job.training.job_killed


# --------------------------------------------------------------------------- malformed signals

GARBAGE: dict[str, dict[str, Any]] = {
    "fault_ranks": {"signalType": "globalFault", "actions": ["on_global_rank"], "faultRanks": [("x", "1")]},
    "signal_type": {"signalType": "globalFaultt", "actions": ["on_global_rank"], "faultRanks": {5: 1}},
    "no_actions": {"signalType": "globalFault", "actions": [], "faultRanks": {5: 1}},
    "unknown_actions": {"signalType": "globalFault", "actions": ["on_global_rankk"], "faultRanks": {5: 1}},
}


@pytest.mark.parametrize("garbage", GARBAGE)
async def test_a_malformed_signal_with_a_new_uuid_does_not_end_the_running_cycle(
        running: list[SimulatedJob], garbage: str) -> None:
    job = await launch(running, auto_step=False)
    assert job.bridge is not None
    session = job.bridge.session
    job.training.inject_fault({5: 1})
    await eventually(lambda: bool(job.training.notifies("change_strategy")), 10, "change_strategy notified")
    cycle = session.current_uuid
    assert cycle
    refused_before = sum(m(job, "signals_refused_total", reason=r)
                         for r in ("malformed", "no_actions", "unknown_action"))
    await job.sim.send_signal(JOB, uuid="0000-garbage", **GARBAGE[garbage])
    await eventually(lambda: sum(m(job, "signals_refused_total", reason=r)
                                 for r in ("malformed", "no_actions", "unknown_action")) > refused_before,
                     10, "the garbage signal refused")
    assert session.current_uuid == cycle
    await step_and_wait_result(job)
    await annotation(job, "recover-success")
    # ClusterD writes the annotation on receipt; the bridge counts the report once its answer is back
    await eventually(lambda: m(job, "reports_sent_total", kind="result") == 1, 10, "the result report answered")
    assert dropped(job, "result") == {}
    await check_invariants(job)


# --------------------------------------------------------------------------- CycleResume on its own

class RecordingRelay:
    """What CycleResume hands the outbox, recorded."""

    def __init__(self) -> None:
        self.faults: list[dict[int, int]] = []
        self.cycle_reports: list[tuple[str, str | None]] = []
        self.payloads: list[bytes] = []

    def submit_faults(self, faults: dict[int, int], waiter: object = None) -> None:
        self.faults.append(faults)

    def submit_cycle_report(self, kind: str, cycle: str | None, payload: bytes, waiter: object = None) -> None:
        assert payload
        self.cycle_reports.append((kind, cycle))
        self.payloads.append(payload)


def resume_at(step: Step, published: list[Any] | None = None) -> tuple[Any, RecordingRelay, Any]:
    """A resume whose flow is at ``step``; what it publishes (the rebound cycle, with the
    flow's answering one) appended to ``published``."""
    from bridge.job.reports.controller_flow import ControllerFlow
    from bridge.job.metrics import BridgeMetrics
    from bridge.job.session.resume import CycleResume

    flow = ControllerFlow()
    flow.step = step
    flow.answering = "old"
    relay = RecordingRelay()
    sink = published if published is not None else []
    resume = CycleResume(JOB, flow, relay, BridgeMetrics(), resubscribe=lambda reason: None,  # type: ignore[arg-type]
                         publish=lambda rebound: sink.append((flow.answering, rebound)))
    resume.remember_stop(0, "stopped", {5: 1})
    resume.remember_strategies({5: 1}, ["recover", "dump", "exit"])
    return resume, relay, flow


def test_a_new_stream_outside_a_stopped_flow_re_reports_nothing() -> None:
    for step in (Step.IDLE, Step.AWAIT_STOP, Step.PAUSED, Step.EXITING, Step.REPAIRING):
        resume, relay, _ = resume_at(step)
        resume.on_subscribed({5: 1})
        assert relay.faults == [] and resume.pending is None, step
    assert resume.metrics.sample("tft_bridge_cycle_resumes_total", {"result": "too_late"}) == 1  # REPAIRING


def test_an_on_global_rank_before_the_new_stop_train_is_refused() -> None:
    """Not the new cycle's (it starts with stopTrain): a strategy report in answer would
    sit in ClusterD's slot and be consumed by the new cycle."""
    resume, relay, flow = resume_at(Step.AWAIT_GLOBAL)
    resume.on_subscribed({5: 1})
    assert relay.faults == [{5: 1}] and resume.pending == "stop"
    assert resume.intercept("on_global_rank", {5: 1}, "stray") == "unexpected_step"
    assert resume.intercept("stop_train", {5: 1}, "new") == "resumed"
    assert relay.cycle_reports == [("stop_complete", "new")] and flow.answering == "new"
    assert resume.intercept("on_global_rank", {5: 1}, "new") is None  # the controller's, as usual


def test_awaiting_the_strategy_both_steps_are_answered_and_the_flow_rebound() -> None:
    resume, relay, flow = resume_at(Step.AWAIT_STRATEGY)
    resume.on_subscribed({})  # no report_fault_ranks in this flow: the stop_train's ranks
    assert relay.faults == [] and resume.pending is None  # nothing known to re-report
    resume.stop_faults = {7: 1}
    resume.on_subscribed({})
    assert relay.faults == [{7: 1}]
    assert resume.intercept("stop_train", {7: 1}, "new") == "resumed" and resume.pending == "global"
    assert flow.answering == "old"  # a late report_strategies of the old cycle must not answer the new one yet
    assert resume.intercept("on_global_rank", {7: 1}, "new") == "resumed"
    assert relay.cycle_reports == [("stop_complete", "new"), ("strategy", "new")]
    assert flow.answering == "new" and resume.pending is None
    assert resume.intercept("change_strategy", {}, "new") is None


def test_a_resumed_global_fault_naming_more_ranks_is_offered_no_repair() -> None:
    """The controller repairs the ranks it offered its strategies for and cannot be told
    more (a second on_global_rank sends it to EXIT): a new globalFault naming other ranks
    gets the controller's exit and dump only, never its retry or recover."""
    from bridge._proto import recover_pb2 as pb

    resume, relay, flow = resume_at(Step.AWAIT_STRATEGY)
    resume.on_subscribed({5: 1})
    assert resume.intercept("stop_train", {5: 1, 9: 1}, "new") == "resumed"
    assert resume.intercept("on_global_rank", {4: 1, 5: 1, 8: 1, 9: 1}, "new") == "resumed"
    strategy = pb.RecoverStrategyRequest.FromString(relay.payloads[-1])
    assert list(strategy.strategies) == ["dump", "exit"]
    assert flow.answering == "new"
    counts = {result: resume.metrics.sample("tft_bridge_cycle_resumes_total", {"result": result})
              for result in ("answered_strategies", "answered_without_repair")}
    assert counts == {"answered_strategies": 0, "answered_without_repair": 1}
    # the same ranks, or fewer: the controller's list as it offered it
    resume, relay, flow = resume_at(Step.AWAIT_STRATEGY)
    resume.on_subscribed({5: 1})
    resume.intercept("stop_train", {5: 1}, "new")
    assert resume.intercept("on_global_rank", {5: 1}, "new") == "resumed"
    assert list(pb.RecoverStrategyRequest.FromString(relay.payloads[-1]).strategies) == ["recover", "dump", "exit"]


def test_without_repair_narrows_only_for_ranks_beyond_the_offer() -> None:
    from bridge.job.session.resume import without_repair

    offer = ["retry", "recover", "dump", "exit"]
    assert without_repair({4: 1, 5: 1, 8: 1, 9: 1}, {4: 1, 5: 1}, offer) == (["dump", "exit"], {8, 9})
    assert without_repair(frozenset({5}), {4: 1, 5: 1}, offer) == (offer, frozenset())
    assert without_repair(frozenset(), {}, offer) == (offer, frozenset())
    assert without_repair(frozenset({9}), {5: 1}, ["retry", "recover"]) == (["exit"], {9})  # neither offered


def test_a_rebound_global_fault_is_published_with_its_cycle_and_cleared_once_answered() -> None:
    """GLOBAL_SENT: the new globalFault is rebound to the controller's coming strategies,
    published together with the answering cycle (the wire binds and narrows from that one
    publication); the loop, told what the wire sent, clears it and counts a narrowed one.
    A new stream clears it too: its cycle ended with the stream."""
    from bridge.job.cycle_state import Rebound

    published: list[Any] = []
    resume, relay, flow = resume_at(Step.GLOBAL_SENT, published)
    resume.on_subscribed({5: 1})
    assert resume.intercept("stop_train", {5: 1}, "new") == "resumed" and resume.pending == "global"
    assert resume.intercept("on_global_rank", {4: 1, 5: 1, 8: 1, 9: 1}, "new") == "resumed"
    assert published == [("new", Rebound("new", frozenset({4, 5, 8, 9})))]
    resume.strategies_sent("new", ["dump", "exit"], frozenset({4, 8, 9}))
    assert published[1:] == [("new", None)] and resume.rebound_global is None
    assert resume.metrics.sample("tft_bridge_cycle_resumes_total", {"result": "answered_without_repair"}) == 1
    resume.strategies_sent("new", ["recover", "dump", "exit"], frozenset())  # a second one: nothing to clear or count
    assert published[2:] == []
    assert resume.metrics.sample("tft_bridge_cycle_resumes_total", {"result": "answered_without_repair"}) == 1

    published.clear()
    resume, relay, flow = resume_at(Step.GLOBAL_SENT, published)
    resume.on_subscribed({5: 1})
    resume.intercept("stop_train", {5: 1}, "new")
    resume.intercept("on_global_rank", {5: 1, 9: 1}, "new")
    resume.on_subscribed({5: 1})  # the stream ended again before the controller answered
    assert published == [("new", Rebound("new", frozenset({5, 9}))), ("new", None)]
    assert resume.rebound_global is None


# --------------------------------------------------------------------------- a freeze shorter than the watchdog

@pytest.mark.parametrize("callback", ["report_stop_complete", "report_strategies"])
async def test_a_report_lost_in_a_short_freeze_restarts_the_cycle(
        proxies: list[FreezableProxy], running: list[SimulatedJob], callback: str) -> None:
    """The controller's report goes out into a freeze shorter than the stream watchdog but
    past the RPC deadline: its outcome is unknown, it is never resent, and the stream
    survives, so nothing would ever show whether ClusterD got it. The bridge subscribes
    again on purpose, and the new cycle is resumed from the controller's answers."""
    job = await launch(running, proxies, config_overrides={"clusterd": {"watchdog_intervals": 100.0}})
    assert job.bridge is not None
    hold = await fault_and_hold(job, callback)
    # the controller's second fault report (before its strategies) delivered: nothing ahead in
    # the outbox, nor in the wire's inbox (a report put but not yet taken is in neither count)
    await eventually(lambda: len(job.bridge.wire) == 0 and job.bridge.wire.handed_all(), 10,
                     "an empty outbox and inbox")
    mark = last_seq(job)
    proxies[0].freeze()
    hold.release()  # the report goes out into the freeze
    kind = "stop_complete" if callback == "report_stop_complete" else "strategy"
    await eventually(lambda: dropped(job, kind).get("outcome_unknown_deadline_exceeded") == 1, 10,
                     "the report's deadline passing")
    proxies[0].thaw()
    await assert_rescued(job, await new_stream_seq(job, mark), invariants=False)
    assert sum(v for r, v in dropped(job, kind).items()) == 1
    # The swallowed report itself may still reach ClusterD after the thaw (the proxy
    # forwards what it held, as a kernel does for a SIGCONTed process): at most that one,
    # late. Everything else the fault-injection invariants check must hold.
    rpc = {"stop_complete": "ReportStopComplete", "strategy": "ReportRecoverStrategy"}[kind]
    late = job.sim.journal.select(kind="report-late")
    assert [e.name for e in late] in ([], [rpc]), late
    assert job.sim.violations == [] and controller_violations(job) == []
    running.remove(job)  # the fixture's journal check would count that late report
    await job.stop()


# --------------------------------------------------------------------------- a real SIGSTOP

async def test_a_clusterd_process_stopped_with_sigstop_after_stop_complete(running: list[SimulatedJob]) -> None:
    """A frozen ClusterD as operators meet it, a real process: ClusterD (the simulation in a child
    process, bench/remote_sim.py) gets SIGSTOP right after it consumed the StopComplete,
    SIGCONT 2.6 s later. The kernel keeps its sockets open and queues whatever arrives;
    its timers are overdue when it wakes."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from remote_sim import RemoteSim  # the benchmarks' child-process ClusterD

    job = SimulatedJob(job_spec(), keepalive_interval=0.05, wait_time=WAIT, controller_timings=FAST_TIMINGS,
                       start_clusterd=False, config_overrides={"clusterd": {"watchdog_intervals": 20.0}})
    # globalFault 1 s after StopComplete: the SIGSTOP lands before it, on a loaded machine too
    remote = RemoteSim(job.config.clusterd.address, JOB, world_size=16, devices_per_pod=4, keepalive=0.05,
                       phase_delay=1.0)
    await remote.start()
    process = remote._process
    assert process is not None
    try:
        running.append(job)
        await job.start()
        await job.subscribed()
        job.training.inject_fault({5: 1})
        consumed = await remote.wait_for(lambda e: e.kind == "rpc" and e.name == "ReportStopComplete")
        os.kill(process.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(FREEZE)  # the delay is the behaviour under test: ClusterD is stopped this long
        finally:
            os.kill(process.pid, signal.SIGCONT)
        await remote.wait_for(lambda e: e.kind == "annotation" and e.name == "ProcessRecoverStatus"
                              and e.detail.get("value") == "recover-success", timeout=20, after=consumed.seq)
        await eventually(lambda: [r.args[0] for r in job.training.callbacks("report_result")] == [0], 10,
                         "the controller's report_result 0")
        await eventually(lambda: job.training.state == "NORMAL", 10, "the controller back in NORMAL")
        assert not job.training.job_killed
        for action in ("stop_train", "on_global_rank", "change_strategy"):
            assert len(job.training.notifies(action)) == 1, action
        assert m(job, "cycle_resumes_total", result="re_reported") >= 1
        assert m(job, "cycle_resumes_total", result="answered_stop_complete") == 1
        assert remote.violations == []
    finally:
        await job.stop()
        running.remove(job)
        await remote.stop()


def test_a_clusterd_first_stop_re_reports_its_own_ranks_not_the_previous_flows() -> None:
    """ClusterD stopped the controller before it reported anything: the return path's
    flow faults are still the last flow's, the stopTrain's ranks are this one's."""
    resume, relay, flow = resume_at(Step.IDLE)
    assert resume.intercept("stop_train", {9: 1}, "first") is None  # forwarded: the flow moves on
    flow.step = Step.STOP_SENT
    resume.on_subscribed({5: 1})  # the previous flow's faults
    assert relay.faults == [{9: 1}]
    resume.new_flow()  # the controller's own report of this flow arrived
    resume.on_subscribed({9: 1, 10: 1})
    assert relay.faults[-1] == {9: 1, 10: 1}
