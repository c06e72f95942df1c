"""``tft-bridge demo``: one real recovery, end to end, on this machine.

A :class:`~bridge.sim.scenario.SimulatedJob` of sixteen ranks: the simulated ClusterD (the
real server's semantics, shorter delays), the stub MindIO controller at
``mindio_ttp.FAST_TIMINGS`` (the intro line says which delays are shortened), and the real
bridge between them with its metrics endpoint. One of :data:`SCENARIOS` injects a fault
and every step of the recovery is printed as it happens, from both sides of the bridge.
Exit code 0 when the scenario ended as it should (a recovery for retry/recover/retry-fails,
the job brought down cleanly for dump/exit) and neither peer saw a protocol violation.
``bridge/cli.py`` finds :func:`cmd_demo` by name and imports this module only for the demo.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import tempfile
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, replace
from pathlib import Path

from bridge.core.interrupts import capture_signals
from bridge.core.logs import setup_logging
from bridge.sim import mindio_ttp
from bridge.sim.clusterd import SimJob
from bridge.sim.clusterd_release import release
from bridge.sim.journal import JournalEntry
from bridge.sim.scenario import SimulatedJob

JOB = "demo-job"
GLOBAL_FAULT_DELAY = 1.0  # the real ClusterD waits ~11 s here
#: The controller's heartbeat loss (real ~8 s), shortened like its other delays, and how
#: long the bridge's stop gives the controller to notice the killed ranks (real: 12 s).
HEARTBEAT_LOSS = 0.3
RANK_LOSS_WAIT = 1.0


@dataclass(frozen=True)
class Scenario:
    """One demo: the job's strategies, the fault injected, and the outcome that makes it a success."""
    description: str
    strategies: tuple[str, ...]
    fault: dict[int, int]
    expect: str  # the ProcessRecoverStatus ClusterD writes, or "exit" for a clean exit
    fail_repair: int | None = None


SCENARIOS = {
    "retry": Scenario("an on-chip memory error (UCE) on rank 5, repaired in place by retry",
                      ("retry", "recover", "dump", "exit"), {5: 0}, "retry-success"),
    "recover": Scenario("rank 5's process dies; its pod's ranks are restarted (recover)",
                        ("retry", "recover", "dump", "exit"), {5: 1}, "recover-success"),
    "retry-fails": Scenario("a UCE on rank 5 whose retry fails (405); ClusterD falls back to recover",
                            ("retry", "recover", "dump", "exit"), {5: 0}, "recover-success",
                            fail_repair=405),
    "dump": Scenario("rank 5's process dies on a job that allows only dump: save a checkpoint, then stop",
                     ("dump", "exit"), {5: 1}, "dump-success"),
    "exit": Scenario("rank 5's process dies on a job that allows only exit: stop cleanly",
                     ("exit",), {5: 1}, "exit"),
}


class Timeline:
    """Prints what happens with the time since the fault, from both sides."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.lines: list[str] = []

    def say(self, who: str, text: str) -> None:
        line = f"  +{time.monotonic() - self.t0:6.2f}s  {who:<9} {text}"
        self.lines.append(line)
        print(line, flush=True)

    def clusterd(self, entry: JournalEntry) -> None:
        if entry.job_id != JOB:
            return
        d = entry.detail
        if entry.kind == "signal" and entry.name != "keep-alive":
            extra = d.get("changeStrategy") or ""
            if d.get("extraParams"):
                extra += f" ({d['extraParams']})"
            faults = ",".join(f"{r}:{t}" for r, t in sorted(d.get("faults", {}).items()))
            self.say("ClusterD", f"sends {entry.name} {d.get('actions')} {extra} {faults}".rstrip())
        elif entry.kind == "rpc" and entry.name.startswith("Report"):
            status = d.get("status") or {}
            what = d.get("strategy") or d.get("strategies") or ""
            if entry.name == "ReportProcessFault":
                what = ",".join(f"{r}:{t}" for r, t in sorted(d.get("faults", {}).items()))
            code = f" code={status.get('code')}" if status else ""
            self.say("ClusterD", f"receives {entry.name}{code} {what}".rstrip())
        elif entry.kind == "fault-centre" and entry.name == "retry-fault":
            self.say("ClusterD", f"fault centre turns the UCE/HCCL report into a retry fault "
                                 f"(stopTrain in {d.get('delay')} s)")
        elif entry.kind == "annotation" and entry.name == "ProcessRecoverStatus":
            self.say("ClusterD", f"writes ProcessRecoverStatus={d.get('value')} on the PodGroup")


async def _wait(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def run_demo(name: str, hold: float, metrics_port: int, release_name: str = "master") -> int:
    scenario = SCENARIOS[name]
    clusterd_release = release(release_name)
    timeline = Timeline()
    print(f"tft-bridge demo: {name} -- {scenario.description} (ClusterD {clusterd_release.version})")
    print(f"  job strategies {list(scenario.strategies)}; 16 ranks, 4 per pod; ClusterD's ~11 s wait before "
          f"globalFault shortened to {GLOBAL_FAULT_DELAY:.0f} s; the controller's own delays (2 s to report "
          f"a fault, ~2.3 s to repair, ~5 s to shut down) shortened to milliseconds\n")
    # The controller's wait is the real default, 30 s: a demo configured with a wait the
    # real ClusterD's 11 s globalFault delay outlasts would teach a configuration that
    # fails every process-fault recovery (the bridge logs a warning for it).
    job = SimulatedJob(SimJob(JOB, world_size=16, devices_per_pod=4, strategies=scenario.strategies),
                       keepalive_interval=1.0, global_fault_delay=GLOBAL_FAULT_DELAY, flush_delay=0.2,
                       dump_exit_repeat=1.0, wait_time=30, metrics_port=metrics_port,
                       observer=lambda line: timeline.say("bridge", line),
                       controller_timings=mindio_ttp.FAST_TIMINGS, release=clusterd_release,
                       heartbeat_loss=HEARTBEAT_LOSS,
                       config_overrides={"recorder": {"enabled": True, "directory": str(demo_state_dir())},
                                         "controller": {"rank_loss_wait": RANK_LOSS_WAIT}})
    job.sim.journal.add_listener(timeline.clusterd)
    repeats = clusterd_release.repeats_retry_cycle and scenario.expect == "retry-success"
    if repeats:
        # v7.3.2's fault centre still holds the repaired fault and runs the cycle again;
        # the controller's device stop fails (499) and ClusterD writes retry-failed.
        scenario = replace(scenario, expect="retry-failed")
        print(f"  ClusterD {clusterd_release.version} repeats a retry cycle that succeeded: expect a second "
              f"cycle, answered 499 and marked retry-failed, which the bridge counts as a repeat, not a failure\n")
    stopping = asyncio.Event()  # set by the first SIGTERM/SIGINT (capture_signals)
    with capture_signals(stopping.set):
        return await _play_and_end(job, scenario, timeline, repeats, hold, stopping)


async def _play_and_end(job: SimulatedJob, scenario: Scenario, timeline: Timeline, repeats: bool, hold: float,
                        stopping: asyncio.Event) -> int:
    """The scenario, the hold, then the job's end. A stop request (Ctrl-C, SIGTERM: the
    way a hold is ended early) cuts the scenario or the hold short, never the end: the
    ranks are killed and the bridge stopped as at the end of any job, so nothing is left
    behind (a controller stopped under connected ranks leaves an orphan marker)."""
    await job.start()
    assert job.bridge is not None
    port = job.bridge.metrics_server.port if job.bridge.metrics_server else None
    ok = False
    play = asyncio.ensure_future(_play(job, scenario, timeline, repeats))
    stop = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({play, stop}, return_when=asyncio.FIRST_COMPLETED)
        if play.done():
            ok = play.result()
    finally:
        interrupted = not play.done()
        for task in (play, stop):
            task.cancel()
        await asyncio.gather(play, stop, return_exceptions=True)  # never raises: the job's end must run
        violations = job.sim.violations + job.training.violations
        summary = _summary(job, scenario, ok and not violations, violations, port, interrupted)
        if hold > 0 and port and not interrupted:
            print(f"\nholding for {hold:.0f} s (Ctrl-C ends it): curl -s http://127.0.0.1:{port}/metrics | "
                  f"grep tft_bridge_", flush=True)
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stopping.wait(), hold)
        # The job ends as jobs do: its ranks are killed, then the bridge is stopped. The
        # controller notices the killed ranks only at its heartbeat loss, which the stop
        # waits for, so the bridge leaves no orphan marker behind.
        timeline.say("training", "the job ends: its ranks are killed, then the bridge is stopped (the controller "
                                 "reports their heartbeat loss as a process fault)")
        job.training.disconnect_ranks(range(job.job.world_size))
        await job.stop()  # also flushes the flight recorder
        print(summary)
        print(_record(job))
    return 0 if ok and not violations else 1


async def _play(job: SimulatedJob, scenario: Scenario, timeline: Timeline, repeats: bool) -> bool:
    """Inject the scenario's fault and wait for its end; whether it ended as expected."""
    await job.subscribed(timeout=10)
    if scenario.fail_repair:
        job.training.fail_next_repair(scenario.fail_repair)
    print("  ---- fault injected: times below are since the fault ----", flush=True)
    timeline.t0 = time.monotonic()
    timeline.say("training", f"rank(s) {scenario.fault} fail (type 0 = on-chip memory error, 1 = process)")
    # A UCE needs nothing else: ClusterD's fault centre turns the bridge's relayed
    # report into a retry cycle by itself, as the real one does.
    job.training.inject_fault(scenario.fault)
    ok = await _wait(lambda: _finished(job, scenario), timeout=30)
    if repeats:
        ok = ok and job.metrics.sample("tft_bridge_recovery_repeated_cycles_total") == 1
    await asyncio.sleep(0.3)  # let the last reports and re-subscription show
    assert job.bridge is not None
    await _wait(job.bridge.session.live.is_set, timeout=5)  # the teardown's report needs the stream
    return ok


def demo_state_dir() -> Path:
    """Where the demo's flight recorder keeps its cycles: kept across demo runs, so
    ``history`` lists them all. Under $STATE_DIRECTORY when that is set (a unit, or the
    test suite, which keeps its runs out of the machine's directories), else per user in
    the temporary directory."""
    given = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    if given:
        return Path(given) / "demo"
    return Path(tempfile.gettempdir()) / f"tft-bridge-demo-{os.getuid()}"


def _record(job: SimulatedJob) -> str:
    """Where this run's cycle was recorded, and the command that shows it."""
    signals = [e for e in job.sim.journal.signals(job_id=JOB) if e.detail.get("uuid")]
    directory = demo_state_dir()
    lines = [f"  flight record: {directory / 'recorder.sqlite3'}",
             f"    all cycles:  tft-bridge history --state-dir {directory}"]
    if signals:
        lines.append(f"    this cycle:  tft-bridge history --state-dir {directory} --cycle {signals[0].detail['uuid']}")
    return "\n".join(lines)


def _finished(job: SimulatedJob, scenario: Scenario) -> bool:
    if scenario.expect == "exit":
        # exit: no result; the controller goes down and ClusterD ends the cycle
        return bool(job.sim.journal.select(kind="stream-end", job_id=JOB)) and \
            job.training.state in ("EXIT", "FINAL")
    return job.sim.podgroup(JOB).get("ProcessRecoverStatus") == scenario.expect


def _summary(job: SimulatedJob, scenario: Scenario, ok: bool, violations: list[str], port: int | None,
             interrupted: bool = False) -> str:
    m = job.metrics
    lines = ["", "summary", "-------"]
    expected = scenario.expect if scenario.expect != "exit" else "clean exit, no result report"
    if interrupted:
        lines.append(f"  outcome:   interrupted before the scenario ended (expected: {expected})")
    else:
        lines.append(f"  outcome:   {'as expected' if ok else 'NOT as expected'} ({expected})")
    lines.append(f"  ClusterD:  ProcessRecoverStatus={job.sim.podgroup(JOB).get('ProcessRecoverStatus', '(none)')}, "
                 f"state {job.sim.state(JOB)}")
    lines.append(f"  controller: state {job.training.state}, training steps continue: {job.training.state == 'NORMAL'}")
    for phase in ("fault_to_stop", "stop_to_strategy", "strategy_to_result"):
        count = m.sample("tft_bridge_recovery_phase_duration_seconds_count", {"phase": phase})
        total = m.sample("tft_bridge_recovery_phase_duration_seconds_sum", {"phase": phase})
        if count:
            lines.append(f"  {phase:<19} {total / count:6.2f} s")
    blocked = [d for _, d in job.training.callback_durations]
    if blocked:
        lines.append(f"  controller blocked per callback: max {max(blocked) * 1e6:.0f} us over {len(blocked)} callbacks")
    refused = sum(v.value for metric in m.registry.collect() if metric.name == "tft_bridge_signals_refused"
                  for v in metric.samples if v.name.endswith("_total"))
    repeated = int(m.sample("tft_bridge_recovery_repeated_cycles_total"))
    if repeated:
        lines.append(f"  repeated cycles: {repeated} (ClusterD ran a succeeded retry again; its result is counted "
                     f"as repeat_after_success, not as a failed repair)")
    lines.append(f"  reports sent {int(sum(m.sample('tft_bridge_reports_sent_total', {'kind': k}) for k in ('fault', 'stop_complete', 'strategy', 'result')))}, "
                 f"signals refused {int(refused)}, protocol violations {len(violations)}")
    for violation in violations:
        lines.append(f"    violation: {violation}")
    if port:
        lines.append(f"  metrics were served at http://127.0.0.1:{port}/metrics (use --hold to keep them up)")
    return "\n".join(lines)


def cmd_demo(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    logging.getLogger("bridge.job.session.node_hooks").setLevel(logging.ERROR)  # the demo has no node hook, on purpose
    try:
        return asyncio.run(run_demo(args.scenario, args.hold, args.metrics_port, args.release))
    except KeyboardInterrupt:
        return 130

