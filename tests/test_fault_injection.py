"""Fault injection: the simulated ClusterD and the stub controller misbehave on purpose,
at every phase of a recovery cycle, and the real bridge between them must keep its rules.

What is injected: ClusterD killed and restarted, the signal stream dropped, ``qps
exceeded`` bursts, keep-alive silence, duplicated / delayed / reordered / foreign
signals, a storm of controller callbacks while ClusterD is down, and SIGTERM mid-cycle.

What every test checks, on top of its own assertions (``check_invariants``; the
fixture's teardown re-checks the journal and the controller's record once the bridge
has stopped, so a report that arrives late is caught too):

* no cycle-bound report (ReportStopComplete, ReportRecoverStrategy, ReportRecoverStatus)
  arrives on a stream, or after a restart, other than the one whose signal it answers
  (read from the simulated ClusterD's journal);
* no notify reached the stub controller when it did not expect one (the stub records an
  "unexpected event" and exits with a reason that says so);
* neither peer recorded a protocol violation;
* no fault rank the controller reported is lost: each one reached ClusterD in a
  ReportProcessFault answered 0;
* the metrics tell the truth: every cycle-bound callback is either a report sent or a
  report dropped with a reason; every ``qps exceeded`` ClusterD answered is counted as
  QPS_EXCEEDED for its method;
* the bridge is back on a live subscription (``tft_bridge_subscription_up == 1``).

A ClusterD restart or a broken stream mid-cycle resets ClusterD's job; the bridge then
restarts the cycle the controller is stopped for (bridge/job/session/resume.py), and the answers it
replays count as reports here. These tests assert that the bridge keeps its rules; that
the job survives is asserted in tests/test_clusterd_restart.py. Phase delays are milliseconds and the controller waits one second, so the
whole file stays well inside CI's budget.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from bridge import faults as codec
from bridge.sim.clusterd import JournalEntry, SimJob
from bridge.sim.scenario import SimulatedJob, free_port

from .chaos.invariants import misdelivered
from .conftest import eventually
from . import simjobs
from .simjobs import start_job

pytestmark = pytest.mark.timeout(30)

JOB = "job-fi"
CYCLE_REPORTS = {  # report RPC -> (the bridge's report kind, the signals it may answer)
    "ReportStopComplete": ("stop_complete", ("stopTrain",)),
    "ReportRecoverStrategy": ("strategy", ("globalFault",)),
    "ReportRecoverStatus": ("result", ("changeStrategy", "saveAndExit")),
}
CALLBACK_KIND = {"report_stop_complete": "stop_complete", "report_strategies": "strategy",
                 "report_result": "result"}


# --------------------------------------------------------------------------- the job

def job_spec(**kwargs: Any) -> SimJob:
    kwargs.setdefault("world_size", 16)
    kwargs.setdefault("devices_per_pod", 4)
    return SimJob(JOB, **kwargs)


@pytest.fixture
async def running() -> AsyncIterator[list[SimulatedJob]]:
    """Tests append their SimulatedJob; teardown re-checks the invariants on the full
    journal (a late report would show up here) and that both peers stayed clean."""
    jobs: list[SimulatedJob] = []
    yield jobs
    for job in jobs:
        controller_problems = controller_violations(job)  # before stop(), which resets the stub
        await job.stop()
        assert_journal_clean(job)
        assert not controller_problems, controller_problems


async def started(running: list[SimulatedJob], **kwargs: Any) -> SimulatedJob:
    """A job with short phases: keep-alives every 50 ms (the bridge declares the stream
    dead after 1 s of silence), globalFault 20 ms after StopComplete, the controller
    waiting 1 s for each answer."""
    overrides = kwargs.pop("config_overrides", {})
    clusterd = {"watchdog_intervals": 20.0, **overrides.pop("clusterd", {})}
    kwargs.setdefault("keepalive_interval", 0.05)
    kwargs.setdefault("global_fault_delay", 0.02)
    kwargs.setdefault("wait_time", 1.0)
    # start_job runs the controller at FAST_TIMINGS: its own delays shortened too
    return await start_job(running, kwargs.pop("job", None) or job_spec(),
                           config_overrides={"clusterd": clusterd, **overrides}, **kwargs)


# --------------------------------------------------------------------------- helpers

def m(job: SimulatedJob, name: str, **labels: str) -> float:
    return job.metrics.sample(f"tft_bridge_{name}", labels)


def dropped(job: SimulatedJob, kind: str) -> dict[str, float]:
    """tft_bridge_reports_dropped_total for one report kind, by reason."""
    out: dict[str, float] = {}
    for family in job.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "tft_bridge_reports_dropped_total" and sample.labels.get("kind") == kind and sample.value:
                out[sample.labels["reason"]] = sample.value
    return out


def reconnects(job: SimulatedJob) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in job.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "tft_bridge_subscription_reconnects_total" and sample.value:
                out[sample.labels["reason"]] = sample.value
    return out


def refused(job: SimulatedJob, reason: str) -> float:
    return m(job, "signals_refused_total", reason=reason)


def on_journal(job: SimulatedJob, predicate: Callable[[JournalEntry], bool],
               action: Callable[[], Awaitable[None] | None]) -> list[asyncio.Task[Any]]:
    """Run ``action`` once, the moment the simulated ClusterD journals a matching entry
    (synchronous actions inline; coroutines as a task, returned so the test can await
    it and see its failure)."""
    tasks: list[asyncio.Task[Any]] = []
    fired = False

    def listener(entry: JournalEntry) -> None:
        nonlocal fired
        if fired or entry.job_id != JOB or not predicate(entry):
            return
        fired = True
        result = action()
        if asyncio.iscoroutine(result):
            tasks.append(asyncio.get_running_loop().create_task(result))

    job.sim.journal.add_listener(listener)
    return tasks


def is_signal(name: str) -> Callable[[JournalEntry], bool]:
    return lambda e: e.kind == "signal" and e.name == name


def is_rpc(name: str, code: int | None = 0) -> Callable[[JournalEntry], bool]:
    return lambda e: e.kind == "rpc" and e.name == name and e.code == code


def last_seq(job: SimulatedJob) -> int:
    return job.sim.journal.entries[-1].seq if job.sim.journal.entries else -1


def after(job: SimulatedJob, seq: int, kind: str, name: str | None = None) -> list[JournalEntry]:
    return [e for e in job.sim.journal.select(kind=kind, name=name) if e.seq > seq]


async def annotation(job: SimulatedJob, value: str, timeout: float = 10) -> None:
    """ClusterD's verdict on the cycle; 10 s, these cycles are short (``started``)."""
    await simjobs.annotation(job, value, timeout)


async def uce_fault(job: SimulatedJob, rank: int = 5) -> None:
    """A UCE: the rank reports it to the controller and the bridge relays it; ClusterD's
    fault centre turns that report alone into a retry cycle (docs/clusterd.md)."""
    job.training.inject_fault({rank: 0})
    await job.sim.wait_for(lambda e: e.kind == "rpc" and e.name == "ReportProcessFault"
                           and e.detail.get("outcome") == "scheduled", timeout=10)


async def kill_clusterd(job: SimulatedJob, down: float = 0.1,
                        while_down: Callable[[], Awaitable[None]] | None = None) -> None:
    """ClusterD dies (every stream breaks, all its memory is gone), stays down a moment,
    and comes back on the same address."""
    await job.sim.stop()
    assert job.bridge is not None and job.bridge.session is not None
    session = job.bridge.session
    await eventually(lambda: not session.live.is_set(), what="the bridge noticing ClusterD is gone")
    if while_down is not None:
        await while_down()
    await asyncio.sleep(down)  # the delay is the behaviour under test: ClusterD stays down this long
    await job.sim.restart()  # journals "clusterd-restarted", then listens on the same port


# --------------------------------------------------------------------------- invariants

def misdelivered_reports(job: SimulatedJob) -> list[str]:
    """Cycle-bound reports that reached ClusterD on a stream (or a server incarnation)
    other than the one that carried the signal they answer, or twice for one signal
    (the chaos runner's invariant, tests/chaos/invariants.py)."""
    return misdelivered(job.sim.journal, JOB)


def assert_journal_clean(job: SimulatedJob) -> None:
    problems = misdelivered_reports(job)
    assert not problems, "reports delivered into the wrong cycle:\n  " + "\n  ".join(problems)
    assert job.sim.violations == [], job.sim.violations
    late = job.sim.journal.select(kind="report-late")
    assert not late, late


def unsolicited_notifies(job: SimulatedJob) -> list[str]:
    """What the stub noted as a notify it did not wait for. A destroy wakes the
    controller's wait too (the real one does the same): notes after the bridge was asked
    to stop (``job.stop_requested_at``, set by the SIGTERM tests) are the destroy's."""
    until = getattr(job, "stop_requested_at", float("inf"))
    notes = [f"{e.name} {e.args}" for e in job.training.events
             if e.kind == "note" and e.name == "unexpected event" and e.t < until]
    if "unexpected" in job.training.exit_reason and until == float("inf"):
        notes.append(job.training.exit_reason)
    return notes


def controller_violations(job: SimulatedJob) -> list[str]:
    problems = list(job.training.violations) + unsolicited_notifies(job)
    if job.training.aborted:
        problems.append("the controller aborted the process")
    return problems


def assert_controller_clean(job: SimulatedJob) -> None:
    assert not controller_violations(job), controller_violations(job)


def live_on_current_stream(job: SimulatedJob) -> bool:
    """ClusterD has a live subscriber for the job, and the bridge is live and has read a
    message on that very stream (so it is not a stream that is about to end)."""
    assert job.bridge is not None and job.bridge.session is not None
    ctl = job.sim.controllers.get(JOB)
    session = job.bridge.session
    if ctl is None or not ctl.live or not session.live.is_set() or session.last_message_at is None:
        return False
    assert ctl.gen.subscriber is not None
    stream = ctl.gen.subscriber.stream_id
    opened = job.sim.journal.first(lambda e: e.kind == "stream-open" and e.job_id == JOB
                                   and e.detail.get("stream") == stream)  # stream ids are never reused
    return opened is not None and session.last_message_at > opened.at


def reported_ranks(job: SimulatedJob) -> dict[int, int]:
    """Every fault the controller reported, merged with ClusterD's rule."""
    return codec.merge_faults(*(record.args[0] for record in job.training.callbacks("report_fault_ranks")))


def delivered_ranks(job: SimulatedJob) -> dict[int, int]:
    """Every fault ClusterD accepted (answered 0) from ReportProcessFault, merged."""
    return codec.merge_faults(*(dict(e.detail["faults"]) for e in job.sim.journal.rpcs("ReportProcessFault", JOB)
                                if e.code == 0))


def faults_all_delivered(job: SimulatedJob, reported: dict[int, int] | None = None) -> bool:
    reported = reported_ranks(job) if reported is None else reported
    delivered = delivered_ranks(job)
    return all(rank in delivered and (delivered[rank] == kind or delivered[rank] == 1)
               for rank, kind in reported.items())


#: Reports the bridge sends on its own when it resumes a cycle after a ClusterD restart
#: (bridge/job/session/resume.py): the controller's earlier answer, sent again to the new cycle.
RESUMED_REPORTS = {"stop_complete": "answered_stop_complete", "strategy": "answered_strategies"}


def reports_accounted(job: SimulatedJob) -> bool:
    """Every cycle-bound callback the bridge handled (and every answer it replayed to a
    resumed cycle) is a report sent or dropped with a reason."""
    for callback, kind in CALLBACK_KIND.items():
        handled = m(job, "controller_callbacks_total", callback=callback)
        if handled != len(job.training.callbacks(callback)):
            return False
        replayed = m(job, "cycle_resumes_total", result=RESUMED_REPORTS[kind]) if kind in RESUMED_REPORTS else 0
        if handled + replayed != m(job, "reports_sent_total", kind=kind) + sum(dropped(job, kind).values()):
            return False
    return True


def qps_refusals(job: SimulatedJob, method: str) -> int:
    return len([e for e in job.sim.journal.rpcs(method, JOB) if e.detail.get("grpc_status") == "UNKNOWN"
                and "qps exceeded" in e.detail.get("error", "")])


async def check_invariants(job: SimulatedJob, timeout: float = 10.0) -> None:
    """Wait for the bridge to settle (live again, every callback accounted for, every
    fault delivered), then check what must always hold."""
    assert job.bridge is not None and job.bridge.session is not None
    await eventually(lambda: live_on_current_stream(job), timeout, "a live subscription on ClusterD's current stream")
    await eventually(lambda: faults_all_delivered(job), timeout, "every reported fault rank delivered")
    await eventually(lambda: reports_accounted(job), timeout, "every cycle-bound report sent or dropped")
    assert m(job, "subscription_up") == 1
    assert job.bridge.session.live.is_set()
    for method in ("Init", "Register", "ReportProcessFault", *CYCLE_REPORTS):
        assert m(job, "clusterd_rpcs_total", method=method, code="QPS_EXCEEDED") == qps_refusals(job, method), method
    assert sum(reconnects(job).values()) >= len(job.sim.journal.select("stream-open", job_id=JOB))
    assert m(job, "bad_inputs_total", kind="signal_dispatch") == 0
    assert m(job, "controller_callback_errors_total") == 0
    assert_journal_clean(job)
    assert_controller_clean(job)


# --------------------------------------------------------------------------- phases

#: Where in a recover cycle (a type-1 fault on rank 5) a fault is injected. Each trigger
#: is a journal entry of the simulated ClusterD that precedes the next step of its
#: cycle, so the injection lands in the phase deterministically.
PHASES = ("before_stop_train", "at_stop_train", "after_stop_complete", "after_global_fault", "after_strategy",
          "after_change_strategy")
TRIGGERS: dict[str, Callable[[JournalEntry], bool]] = {
    # the fault reached ClusterD and started a cycle; stopTrain not written yet
    "before_stop_train": lambda e: e.kind == "state" and e.name == "NotifyStopTrainState",
    # stopTrain written (the bridge may or may not have read it)
    "at_stop_train": is_signal("stopTrain"),
    # StopComplete consumed, flush done, globalFault not written yet
    "after_stop_complete": lambda e: e.kind == "state" and e.name == "NotifyGlobalFaultState",
    "after_global_fault": is_signal("globalFault"),
    # ReportRecoverStrategy consumed, changeStrategy not written yet
    "after_strategy": lambda e: e.kind == "state" and e.name == "NotifyDecidedStrategyState",
}


async def inject_at(job: SimulatedJob, phase: str, action: Callable[[], Awaitable[None]]) -> int:
    """Start a recover cycle and run ``action`` at ``phase``; the journal position the
    action started at. ``after_change_strategy``: the controller has been told the
    strategy and holds its result until training steps (``auto_step`` off), so the
    test decides when the result callback fires."""
    if phase == "after_change_strategy":
        job.training.auto_step = False
        job.training.inject_fault({5: 1})
        await eventually(lambda: bool(job.training.notifies("change_strategy")), what="change_strategy notified")
        seq = last_seq(job)
        await action()
        return seq
    fired_at: list[int] = []

    def fire() -> Awaitable[None]:
        fired_at.append(last_seq(job))
        return action()

    tasks = on_journal(job, TRIGGERS[phase], fire)
    job.training.inject_fault({5: 1})
    await eventually(lambda: bool(tasks), 10, f"phase {phase}")
    await tasks[0]
    return fired_at[0]


async def step_and_wait_result(job: SimulatedJob) -> None:
    """Training steps: the controller reports the held result; wait for the bridge to handle it."""
    # the repair takes the controller's (shortened) repair time: training steps once it is back
    await eventually(lambda: job.training.state == "NORMAL", what="the controller back in NORMAL after its repair")
    assert job.training.step()
    await eventually(lambda: m(job, "controller_callbacks_total", callback="report_result") == 1,
                     what="the report_result callback handled by the bridge")


# --------------------------------------------------------------------------- a clean cycle (the baseline)

async def test_a_clean_cycle_meets_every_invariant(running: list[SimulatedJob]) -> None:
    job = await started(running)
    job.training.inject_fault({5: 1})
    await annotation(job, "recover-success")
    await check_invariants(job)
    assert [n.args[0] for n in job.training.notifies("change_strategy")] == ["recover"]
    for kind in ("stop_complete", "strategy", "result"):
        assert m(job, "reports_sent_total", kind=kind) == 1 and dropped(job, kind) == {}
    assert m(job, "recovery_cycles_total", strategy="recover", outcome="success") == 1


# --------------------------------------------------------------------------- ClusterD killed and restarted

@pytest.mark.parametrize("phase", PHASES)
async def test_clusterd_killed_and_restarted(running: list[SimulatedJob], phase: str) -> None:
    job = await started(running)
    held = phase == "after_change_strategy"

    async def kill() -> None:
        # after changeStrategy: the controller's result comes while ClusterD is down
        await kill_clusterd(job, while_down=(lambda: step_and_wait_result(job)) if held else None)

    await inject_at(job, phase, kill)
    restarted = job.sim.journal.first(lambda e: e.kind == "state" and e.name == "clusterd-restarted")
    assert restarted is not None
    await check_invariants(job)
    # Init and Register again before the new subscription
    opened = after(job, restarted.seq, "stream-open")[0]
    assert [e.name for e in job.sim.journal if restarted.seq < e.seq < opened.seq and e.kind == "rpc"
            and e.code == 0][:2] == ["Init", "Register"]
    # The kill is seen twice: the stream's end, and (when a stop-complete or strategy report
    # was on the wire) that report's failure, which makes the bridge subscribe again on
    # purpose. Whichever the loop handles first names the reconnect; under load either can.
    assert sum(v for r, v in reconnects(job).items()
               if r.startswith("stream_") or r == "report_outcome_unknown") >= 1, reconnects(job)
    if not after(job, restarted.seq, "signal", "stopTrain"):  # no new cycle: nothing may answer the old one
        for name in CYCLE_REPORTS:
            assert not after(job, restarted.seq, "rpc", name), name
    if held:
        assert dropped(job, "result") == {"no_live_cycle": 1}
        assert m(job, "reports_sent_total", kind="result") == 0


async def test_a_fault_reported_while_clusterd_is_down_starts_the_cycle_after_restart(
        running: list[SimulatedJob]) -> None:
    job = await started(running, wait_time=3.0)

    async def fault() -> None:
        job.training.inject_fault({5: 1})
        await eventually(lambda: m(job, "controller_callbacks_total", callback="report_fault_ranks") == 1)

    await kill_clusterd(job, while_down=fault)
    await annotation(job, "recover-success")
    await check_invariants(job)
    assert job.sim.journal.select("fault-lost") == []
    assert m(job, "recovery_cycles_total", strategy="recover", outcome="success") == 1


async def test_the_bridge_reconnects_within_its_own_backoff_after_clusterd_returns(
        running: list[SimulatedJob]) -> None:
    job = await started(running, config_overrides={"clusterd": {"reconnect_max": 0.1}})
    # Down 3 s: long enough for any uncapped backoff to have grown past the bound below.
    await kill_clusterd(job, down=3.0)
    came_back = time.monotonic()  # restart() returned: the server listens again
    await eventually(lambda: live_on_current_stream(job), 10, "live again")
    first = next(e for e in job.sim.journal if e.kind == "rpc" and e.at >= came_back)
    # The wall-time bound is the behaviour under test, measured from the server's side
    # (listening again -> the bridge's first RPC arrives), so neither the handshake nor
    # this test's polling count. Capped at reconnect_max, the first attempt comes within
    # 0.1 s. Broken, it comes >= 1.1 s late: gRPC's own channel backoff (1 s, x1.6, +-20 %)
    # would next try at >= 4.1 s after the break, the config's default cap (10 s) lets the
    # bridge's backoff (0.02 s doubling) reach 1.3 s within 3 s. 1 s leaves 0.9 s for a
    # loaded machine.
    assert first.at - came_back < 1.0, (first, first.at - came_back)


# --------------------------------------------------------------------------- the stream dropped

@pytest.mark.parametrize("phase", PHASES)
async def test_stream_dropped(running: list[SimulatedJob], phase: str) -> None:
    job = await started(running)
    held = phase == "after_change_strategy"
    cut = await inject_at(job, phase, lambda: job.sim.drop_subscriber(JOB))
    if held:  # the result comes after the bridge is on its new stream: it answers a dead cycle
        await eventually(lambda: live_on_current_stream(job), 10, "live again")
        await step_and_wait_result(job)
    await check_invariants(job)
    assert reconnects(job).get("stream_unavailable", 0) >= 1, reconnects(job)
    # the new stream carries no cycle, so nothing may arrive that answers the old one
    new_stream = after(job, cut, "stream-open")[0]
    if not after(job, new_stream.seq, "signal", "stopTrain"):
        for name in CYCLE_REPORTS:
            assert not after(job, new_stream.seq, "rpc", name), name
    if held:
        assert dropped(job, "result") == {"no_live_cycle": 1}


async def test_a_fault_reported_while_the_stream_is_down_is_not_lost(running: list[SimulatedJob]) -> None:
    job = await started(running, wait_time=3.0)
    job.sim.fail_next_unary(3)  # Init bounces a few times: the bridge stays off the stream a moment
    await job.sim.drop_subscriber(JOB)
    assert job.bridge is not None and job.bridge.session is not None
    session = job.bridge.session
    await eventually(lambda: not session.live.is_set(), what="the bridge noticing the broken stream")
    job.training.inject_fault({5: 1})
    await annotation(job, "recover-success")
    await check_invariants(job)
    assert job.sim.journal.select("fault-lost") == []
    assert m(job, "clusterd_rpcs_total", method="Init", code="QPS_EXCEEDED") >= 1


# --------------------------------------------------------------------------- qps exceeded bursts

QPS_PHASES: dict[str, Callable[[JournalEntry], bool] | None] = {
    "fault_report": None,  # armed before the fault
    "stop_complete": is_signal("stopTrain"),
    "strategy": is_signal("globalFault"),
    "result": is_signal("changeStrategy"),
    "resubscribe": lambda e: e.kind == "annotation" and e.name == "ProcessRecoverStatus",  # Init/Register
}


@pytest.mark.parametrize("phase", list(QPS_PHASES))
async def test_qps_exceeded_burst(running: list[SimulatedJob], phase: str) -> None:
    """ClusterD's shared token bucket runs dry for five calls: the bridge backs off and
    retries what provably did not arrive, and the cycle completes."""
    job = await started(running, wait_time=3.0)
    trigger = QPS_PHASES[phase]
    if trigger is None:
        job.sim.fail_next_unary(5)
    else:
        on_journal(job, trigger, lambda: job.sim.fail_next_unary(5))
    job.training.inject_fault({5: 1})
    await annotation(job, "recover-success")
    await check_invariants(job)
    refusals = sum(qps_refusals(job, method) for method in ("Init", "Register", "ReportProcessFault", *CYCLE_REPORTS))
    assert refusals == 5
    assert sum(m(job, "clusterd_rpcs_total", method=method, code="QPS_EXCEEDED")
               for method in ("Init", "Register", "ReportProcessFault", *CYCLE_REPORTS)) == 5
    for kind in ("stop_complete", "strategy", "result"):
        assert m(job, "reports_sent_total", kind=kind) == 1 and dropped(job, kind) == {}, kind
    assert m(job, "recovery_cycles_total", strategy="recover", outcome="success") == 1


# --------------------------------------------------------------------------- keep-alive silence

def keepalives_every(job: SimulatedJob, seconds: float) -> None:
    """The simulated ClusterD's keep-alive cadence, from its next keep-alive on."""
    job.sim.timings = dataclasses.replace(job.sim.timings, keepalive_interval=seconds)


@pytest.mark.parametrize("phase", ["idle", "after_stop_complete"])
async def test_keepalive_silence_is_a_dead_stream(running: list[SimulatedJob], phase: str) -> None:
    """ClusterD stops sending anything: the bridge's watchdog (6 intervals of 50 ms)
    declares the stream dead, cancels it and subscribes again."""
    job = await started(running, global_fault_delay=5.0 if phase != "idle" else 0.02,
                        config_overrides={"clusterd": {"watchdog_intervals": 6.0}})
    silent_at: list[int] = []

    async def silence() -> None:
        silent_at.append(last_seq(job))
        keepalives_every(job, 3600)
        await eventually(lambda: reconnects(job).get("keepalive_timeout", 0) >= 1, 5, "the watchdog firing")
        keepalives_every(job, 0.05)

    if phase == "idle":
        await silence()
    else:
        await inject_at(job, phase, silence)
    await check_invariants(job)
    assert reconnects(job).get("keepalive_timeout", 0) >= 1
    cancelled = [e for e in after(job, silent_at[0], "stream-end") if "cancelled" in e.detail.get("reason", "")]
    assert cancelled, "the bridge must end the silent stream itself"
    if phase != "idle":  # the aborted cycle's globalFault never came; nothing answered it
        assert not job.sim.journal.signals("globalFault", JOB)
        assert not job.training.notifies("on_global_rank")
        assert not job.sim.journal.rpcs("ReportRecoverStrategy", JOB)


# --------------------------------------------------------------------------- duplicated, delayed, foreign signals

#: When to arm a tweak so that it hits the named signal of a recover cycle.
SIGNAL_ARMS: dict[str, Callable[[JournalEntry], bool] | None] = {
    "stopTrain": None,  # before the fault
    "globalFault": lambda e: e.kind == "state" and e.name == "NotifyGlobalFaultState",
    "changeStrategy": lambda e: e.kind == "state" and e.name == "NotifyDecidedStrategyState",
}
FOREIGN = {"stopTrain": ("stopTrain", ["stop_train"]), "globalFault": ("globalFault", ["on_global_rank"]),
           "changeStrategy": ("changeStrategy", ["change_strategy"])}


@pytest.mark.parametrize("tweak", ["duplicate", "delay", "foreign"])
@pytest.mark.parametrize("target", list(SIGNAL_ARMS))
async def test_signal_tweaks_at_every_phase(running: list[SimulatedJob], target: str, tweak: str) -> None:
    """A duplicated, a delayed (0.3 s of the controller's 1 s) or a foreign signal at each
    step: the controller hears each step exactly once and the cycle succeeds."""
    job = await started(running)
    tasks: list[asyncio.Task[Any]] = []

    def arm() -> Awaitable[None] | None:
        if tweak == "duplicate":
            job.sim.duplicate_next_signal()
        elif tweak == "delay":
            job.sim.delay_next_signal(0.3)
        else:  # ahead of the real signal, the same signal for another job
            signal_type, actions = FOREIGN[target]
            return job.sim.send_foreign_signal(JOB, "job-someone-else", signal_type, actions)
        return None

    trigger = SIGNAL_ARMS[target]
    if trigger is None:
        result = arm()
        if result is not None:
            await result
    else:
        tasks = on_journal(job, trigger, arm)
    job.training.inject_fault({5: 1})
    await annotation(job, "recover-success")
    for task in tasks:
        await task
    await check_invariants(job)
    for name in ("stop_train", "on_global_rank", "change_strategy"):
        assert len(job.training.notifies(name)) == 1, name
    sent = job.sim.journal.signals(target, JOB)
    if tweak == "duplicate":
        assert [bool(s.detail.get("duplicate")) for s in sent] == [False, True]
        # a repeat of changeStrategy may arrive after the result (a new round): then the step gate refuses it
        assert refused(job, "duplicate") + refused(job, "unexpected_step") == 1
    elif tweak == "delay":
        assert sent[0].detail.get("delayed") == 0.3
        assert sum(v for r, v in [(r, refused(job, r)) for r in ("duplicate", "unexpected_step", "foreign_job")]) == 0
    else:
        assert sorted(s.detail["jobId"] for s in sent) == sorted(["job-someone-else", JOB])
        await eventually(lambda: refused(job, "foreign_job") == 1)
    assert m(job, "recovery_cycles_total", strategy="recover", outcome="success") == 1


# --------------------------------------------------------------------------- reordered signals

#: A signal of the running cycle (its uuid) arriving where the controller does not
#: expect it: (when to push it, signalType, actions, extra fields).
OUT_OF_PHASE: dict[str, tuple[Callable[[JournalEntry], bool], str, list[str], dict[str, Any]]] = {
    "change_strategy_before_global_fault": (
        is_rpc("ReportStopComplete"), "changeStrategy", ["change_strategy"], {"changeStrategy": "recover"}),
    "stop_train_again_with_other_faults": (
        lambda e: e.kind == "state" and e.name == "WaitReportStopCompleteState", "stopTrain", ["stop_train"],
        {"faultRanks": {6: 1}}),
    "pause_racing_the_fault": (
        is_rpc("ReportStopComplete"), "stopTrain", ["pause_train"], {"timeout": 60}),
    "global_fault_again_while_repairing": (
        is_signal("changeStrategy"), "globalFault", ["on_global_rank"], {"faultRanks": {4: 1, 5: 1}}),
}


@pytest.mark.parametrize("case", list(OUT_OF_PHASE))
async def test_out_of_phase_signal_of_the_running_cycle_is_refused(running: list[SimulatedJob], case: str) -> None:
    job = await started(running)
    trigger, signal_type, actions, extra = OUT_OF_PHASE[case]
    tasks = on_journal(job, trigger, lambda: job.sim.send_signal(JOB, signalType=signal_type, actions=actions,
                                                                  **extra))
    job.training.inject_fault({5: 1})
    await annotation(job, "recover-success")
    await tasks[0]
    await check_invariants(job)
    await eventually(lambda: refused(job, "unexpected_step") == 1, what="the out-of-phase signal refused")
    for name in ("stop_train", "on_global_rank", "change_strategy"):
        assert len(job.training.notifies(name)) == 1, name
    assert m(job, "recovery_cycles_total", strategy="recover", outcome="success") == 1




async def test_a_stop_train_with_the_finished_cycles_uuid_is_refused(running: list[SimulatedJob]) -> None:
    """The cycle succeeded; then a stopTrain with its uuid shows up (reordered, or a
    repeat from a ClusterD that lost track). ClusterD starts no cycle with it: forwarding
    it starts a controller flow nobody will answer, and the job is killed when the
    controller's wait runs out."""
    job = await started(running)
    job.training.inject_fault({5: 1})
    await annotation(job, "recover-success")
    old = job.sim.journal.signals("stopTrain", JOB)[0].detail["uuid"]
    await eventually(lambda: live_on_current_stream(job), 10, "live on the next stream")
    await job.sim.send_signal(JOB, uuid=old, signalType="stopTrain", actions=["stop_train"], faultRanks={6: 1})
    await eventually(lambda: sum(refused(job, r) for r in ("stale_cycle", "duplicate", "unexpected_step")) == 1,
                     what="the stale stopTrain refused")
    assert len(job.training.notifies("stop_train")) == 1



async def test_a_global_fault_of_an_older_cycle_is_refused_mid_cycle(running: list[SimulatedJob]) -> None:
    """Cycle 2 waits for its globalFault; one from cycle 1 arrives first. Forwarded, the
    controller decides on cycle 1's fault set and the bridge ties its answers to cycle 1."""
    job = await started(running, global_fault_delay=0.4, wait_time=2.0)
    job.training.inject_fault({5: 1})
    await annotation(job, "recover-success")
    first = job.sim.journal.signals("globalFault", JOB)[0].detail
    await eventually(lambda: live_on_current_stream(job), 10, "live on the next stream")
    pushed = on_journal(job, is_rpc("ReportStopComplete"), lambda: job.sim.send_signal(
        JOB, uuid=first["uuid"], signalType="globalFault", actions=["on_global_rank"], faultRanks={0: 1}))
    job.training.inject_fault({9: 1})
    await eventually(lambda: bool(pushed), 5)
    await pushed[0]
    await annotation(job, "recover-success")  # (the second one)
    await eventually(lambda: len(job.sim.journal.select("annotation", "ProcessRecoverStatus")) == 2)
    globals_ = job.training.notifies("on_global_rank")
    assert len(globals_) == 2 and 0 not in globals_[1].args[0], globals_
    await eventually(lambda: refused(job, "stale_cycle") + refused(job, "unexpected_step") == 1)


# --------------------------------------------------------------------------- a callback storm while ClusterD is down

async def test_callback_storm_while_clusterd_is_down(running: list[SimulatedJob]) -> None:
    """5 000 report_fault_ranks callbacks from the controller's thread while ClusterD is
    dead: none blocks, none is lost, the outbox holds one merged report, and once
    ClusterD is back every rank arrives (with ClusterD's merge rule) in a few requests."""
    job = await started(running)
    assert job.bridge is not None and job.bridge.controller is not None
    callback = job.training.registry.registered("report_fault_ranks")
    assert callback is not None
    calls = 5000
    maps = [{i % 3000: 2 if i % 2 else 0, (i * 7 + 1) % 3000: 2} for i in range(calls)]  # retry types: no cycle
    blocked: list[float] = []

    def storm() -> None:  # the controller's thread
        for faults in maps:
            start = time.perf_counter()
            callback(dict(faults), {})
            blocked.append(time.perf_counter() - start)

    before = len(job.sim.journal.rpcs("ReportProcessFault", JOB))

    async def while_down() -> None:
        await asyncio.to_thread(storm)
        await eventually(lambda: m(job, "controller_callbacks_total", callback="report_fault_ranks") == calls,
                         10, "every callback handled")
        # Every callback's ranks counted by type, read while ClusterD is down: once it is back,
        # the recovery its faults start has the controller report its own faults as well.
        assert sum(m(job, "faults_reported_total", fault_type=t) for t in ("uce", "hccl", "other")) == \
            sum(len(faults) for faults in maps)
        # everything merged into one pending report (two if a send to the dead server was in flight)
        assert 1 <= m(job, "outbox_depth") <= 2
        assert len(job.sim.journal.rpcs("ReportProcessFault", JOB)) == before  # nothing sent into the void

    await kill_clusterd(job, while_down=while_down)
    expected = codec.merge_faults(*maps)
    assert len(expected) == 3000
    await eventually(lambda: delivered_ranks(job) == expected, 10, "every rank delivered")
    requests = len(job.sim.journal.rpcs("ReportProcessFault", JOB)) - before
    assert requests <= 3, requests
    assert m(job, "fault_reports_merged_total") >= calls - requests
    # Each report ClusterD accepted counted once. Not every request is the storm's: the
    # faults start a recovery on the restarted ClusterD, and the flow's re-report on the
    # new stream (reports.py) is a request of its own unless it merged into the queued one.
    def accepted() -> list[int | None]:
        return [e.code for e in job.sim.journal.rpcs("ReportProcessFault", JOB)[before:]]

    await eventually(lambda: m(job, "reports_sent_total", kind="fault") == accepted().count(0),
                     what="every accepted report counted once")
    # Never waited for ClusterD: a relay that did would block for its RPC deadline (seconds)
    # on every call here. The microsecond figures are the benchmarks' business. The bound
    # is a wall time on purpose (a callback must not block): one call is a dict merge under
    # a lock, microseconds; 1 s is 200 GIL switch intervals, so only a real wait misses it.
    assert max(blocked) < 1.0, max(blocked)
    await check_invariants(job)


# --------------------------------------------------------------------------- SIGTERM mid-cycle

@pytest.mark.parametrize("phase", ["after_stop_complete", "after_strategy", "after_change_strategy"])
async def test_stop_requested_mid_cycle(running: list[SimulatedJob], phase: str) -> None:
    """SIGTERM's handler only calls request_stop(): the bridge drains, ends its stream,
    destroys the controller and exits 0 within a bound, whatever the phase."""
    job = await started(running, global_fault_delay=0.02 if phase != "after_stop_complete" else 0.5)
    bridge = job.bridge
    assert bridge is not None
    stopped_at: list[float] = []

    async def stop() -> None:
        job.stop_requested_at = time.monotonic()  # type: ignore[attr-defined]
        stopped_at.append(time.monotonic())
        bridge.request_stop()

    await inject_at(job, phase, stop)
    assert await job.wait_exit(10) == 0
    # The bound is the behaviour under test: the stop must not wait out destroy_timeout
    # (10 s) nor a drain RPC's deadline twice over; it takes well under 1 s here (the stub's
    # destroy is shortened), so 5 s is a wide margin on a loaded machine.
    assert time.monotonic() - stopped_at[0] < 5.0
    assert job.training.controller is None  # destroyed
    assert [e for e in job.training.events if e.kind == "api" and e.name == "destroy"]
    assert not job.training.job_killed  # the controller went down because it was destroyed
    assert m(job, "subscription_up") == 0
    # the stream is over: cancelled by the bridge (ClusterD may see that as a failed write), or ended
    # by ClusterD because the drain delivered the last report of the cycle; ClusterD learns of a
    # cancel when its side of the connection reads it, which may be after the bridge exited
    await eventually(lambda: not job.sim.controllers[JOB].live, what="ClusterD's side of the stream ended")
    ended = job.sim.journal.select("stream-end", job_id=JOB)[-1].detail["reason"]
    assert any(text in ended for text in ("cancelled", "stream write failed", "reset: recoverSuccess")), ended
    assert_journal_clean(job)
    assert_controller_clean(job)
    assert reports_accounted(job) or phase == "after_change_strategy"


async def test_sigterm_to_a_real_bridge_process_mid_cycle(tmp_path: Path) -> None:
    """``tft-bridge run`` as systemd runs it, SIGTERM while ClusterD's OM pause is in
    flight (StopComplete answered, changeStrategy continue held back): exit 0 within a
    bound, the stream ended by the bridge, nothing reported after it."""
    from bridge.sim.clusterd import SimClusterD

    sim = SimClusterD([job_spec()], keepalive_interval=0.05, global_fault_delay=0.02, flush_delay=0.01)
    address = await sim.start(f"127.0.0.1:{free_port()}")
    config = tmp_path / "job.toml"
    config.write_text(f"""
job_id = "{JOB}"
[clusterd]
address = "{address}"
keepalive_interval = 0.05
watchdog_intervals = 20
reconnect_initial = 0.02
reconnect_max = 0.2
[controller]
module = "stub"
port = {free_port()}
world_size = 16
wait_mindx_time = 1
destroy_timeout = 10
[metrics]
enabled = false
""")
    # The stub in the subprocess runs at the real controller's pace: its destroy blocks 5 s
    # (docs/mindio-controller.md), so destroy_timeout is above that and the bound below too.
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bridge.cli", "run", "--config", str(config), "--log-level", "INFO",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        await sim.wait_for(lambda e: e.kind == "signal" and e.name == "keep-alive", timeout=20)
        sim.journal.add_listener(lambda e: sim.delay_next_signal(10.0)
                                 if e.kind == "rpc" and e.name == "ReportStopComplete" else None)
        await sim.pause(JOB, timeout=2)
        await sim.wait_for(lambda e: e.kind == "rpc" and e.name == "ReportStopComplete" and e.code == 0, 10)
        cut = sim.journal.entries[-1].seq
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        output, _ = await asyncio.wait_for(process.communicate(), 25)
        took = time.monotonic() - signalled
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await sim.stop()
    text = output.decode(errors="replace")
    assert process.returncode == 0, text
    # The bound is the behaviour under test: the stub's destroy blocks 5 s and nothing else
    # should wait, so the stop takes ~5.5 s; 15 s (destroy_timeout + 5 s) fails a stop that
    # also waited out the destroy_timeout or an RPC deadline, with 9 s to spare for load.
    assert took < 15, took
    assert "stopping gracefully" in text
    assert "did not return within" not in text  # the controller was destroyed in time
    ends = [e for e in sim.journal.select("stream-end", job_id=JOB) if e.seq > cut]
    assert ends and "cancelled" in ends[0].detail["reason"]
    assert not [e for e in sim.journal.select("rpc") if e.seq > cut and e.name in CYCLE_REPORTS]
    assert sim.violations == []


async def test_faults_clusterd_forgot_on_a_new_stream_are_reported_again(running: list[SimulatedJob]) -> None:
    """The fault reached ClusterD, then the stream broke before stopTrain: the new
    subscription wiped ClusterD's fault cache while the controller still waits for
    stop_train. Resending a fault report is harmless (ClusterD merges faults), and here
    it is the only way the cycle can ever start."""
    job = await started(running, wait_time=3.0)
    cut = await inject_at(job, "before_stop_train", lambda: job.sim.drop_subscriber(JOB))
    reopened = await job.sim.wait_for(lambda e: e.seq > cut and e.kind == "stream-open", 5)
    assert job.bridge is not None and job.bridge.flow.step.value == "await_stop"  # still waiting for stop_train
    await job.sim.wait_for(lambda e: e.seq > reopened.seq and e.kind == "rpc" and e.name == "ReportProcessFault"
                           and 5 in e.detail.get("faults", {}), timeout=1.5)
    await annotation(job, "recover-success")
    await check_invariants(job)
