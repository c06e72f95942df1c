"""What must hold after every chaos schedule, read from what the peers recorded.

Each check is a pure function of an :class:`Observation` (the simulated ClusterD's
journal, the stub controller's observation log, the bridge's exit and counts), so the
self-checks (tests/test_chaos.py) can feed each one a known-bad observation and see it
fire. A check returns the violations it found, each one line naming the evidence.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from bridge.sim.clusterd import JournalEntry
from bridge.sim.mindio_ttp import Record

from .schedule import RPC_TIMEOUT, Schedule

#: The exit codes docs/runbook.md ("Exit codes of the unit") and bridge/job/daemon.py document.
DOCUMENTED_EXIT_CODES = frozenset({0, 1, 2, 75, 76})
#: A stop the runner asked for ends with 0, or 76 when the controller had ended first.
REQUESTED_STOP_CODES = frozenset({0, 76})
#: Cycle-bound report RPC -> the signals it may answer (tests/test_fault_injection.py).
CYCLE_REPORTS = {
    "ReportStopComplete": ("stopTrain",),
    "ReportRecoverStrategy": ("globalFault",),
    "ReportRecoverStatus": ("changeStrategy", "saveAndExit"),
}
#: A fault reported this shortly before a requested stop may still be held for a live
#: stream when the stop comes: the bridge's watchdog (10 keep-alive intervals, 1 s here)
#: is how long it may wait for the stream to speak before subscribing again.
PENDING_AT_STOP = 1.0
#: A fault reported while ClusterD was down waits for the bridge to subscribe again and
#: hear the new stream's first keep-alive (1 s here) after ClusterD is back: the reconnect
#: back-off (at most 0.5 s here) and that keep-alive, with a margin for a loaded machine.
#: A stop that comes sooner after ClusterD's return may find such a fault still held.
RESUBSCRIBE_GRACE = 2.0
#: Status.code of a report for a job this ClusterD has no controller for (not registered).
UN_REGISTRY = 400
#: Controller states that mean the job was killed (it tells every rank to exit).
KILLED_STATES = ("EXIT", "FINAL", "ABORTED")


@dataclass
class Observation:
    schedule: Schedule
    job_id: str
    journal: list[JournalEntry]
    records: list[Record]
    sim_violations: list[str] = field(default_factory=list)
    stub_violations: list[str] = field(default_factory=list)
    #: monotonic time the runner asked the bridge to stop (SIGTERM, or the schedule's end)
    stop_requested_at: float | None = None
    #: ``sigterm`` events: monotonic times the schedule stopped the bridge
    bridge_stops: list[float] = field(default_factory=list)
    #: ``sigkill_restart`` events: monotonic times the bridge (and its controller) died
    kills: list[float] = field(default_factory=list)
    #: (exit code or None for the seed API, seconds the stop took, the stop budget)
    exits: list[tuple[int | None, float, float]] = field(default_factory=list)
    #: the job did not come back to training and quiet within the settle time: why
    unsettled: str | None = None
    #: successful cycles by source: "journal" (ClusterD), "metrics", "recorder"
    successes: dict[str, float | None] = field(default_factory=dict)

    @property
    def stop_at(self) -> float:
        """When the runner first asked the bridge to stop (or a ``sigterm`` event did)."""
        return min([t for t in (self.stop_requested_at, *self.bridge_stops) if t is not None], default=float("inf"))

    @property
    def ended_at(self) -> float:
        """When the bridge had stopped. It serves on while it stops (the session and the
        outbox run until the controller is destroyed, after up to ``rank_loss_wait`` for
        connected ranks to go): a result reported meanwhile still reaches ClusterD."""
        if self.stop_requested_at is None or not self.exits:
            return self.stop_at
        return self.stop_requested_at + self.exits[-1][1]


def _killed_at(obs: Observation) -> Record | None:
    until = obs.stop_at
    for record in obs.records:
        if record.kind == "state" and record.name in KILLED_STATES and record.t < until:
            return record
    return None


#: Strategies whose repair a new fault fails before the first training step after it.
REPAIRS = ("retry", "recover")


def repair_hang_by_design(obs: Observation) -> str | None:
    """Why the controller hangs in a repair no client could have prevented, or None.

    Ranks restarted under the repair that ClusterD's globalFault did not name: the node
    agent restarts the whole pod of a rank with a process fault, and the controller,
    told of that fault only by the rank itself, merges it into the repair but not its
    pod's other ranks, so the repair hangs until ClusterD gives up (the real controller
    hangs the same way; docs/mindio-controller.md). ClusterD names a pod's ranks only
    for a process fault it knew of when it sent the globalFault: one that lands after
    it, or one the controller held back for its second report while a cycle was already
    under way (faults found during ABNORMAL go into that report, after the globalFault),
    leaves them unnamed, and no client could have named them. A hang on ranks the
    globalFault *did* name is the bridge's (a dropped rank) and stays a violation
    (``global-ranks-forwarded`` sees the dropped ranks too)."""
    global_faults = _global_faults(obs)
    for record in obs.records:
        if record.kind == "note" and record.name == "repair hangs: ranks restarted under it" and record.args:
            before = [s for s in global_faults if s.at <= record.t]
            named = {int(rank) for rank in before[-1].detail["faults"]} if before else set()
            untold = {int(rank) for rank in record.args[0]}
            if untold and not untold & named:
                return (f"ranks {sorted(untold)} were restarted under the repair at {record.t:.3f}, and ClusterD's "
                        f"globalFault had not named them (it named {sorted(named)}): the repair hangs")
    return None


def _wider_cycle(obs: Observation) -> tuple[JournalEntry, set[int], set[int]] | None:
    """The first globalFault of a new cycle (a uuid other than that of the cycle the
    controller had on_global_rank in) that came after that notify and before
    change_strategy, and named ranks beyond those the controller offered its strategies
    for: (signal, offered, beyond). When it came before the controller's strategies
    (GLOBAL_SENT), those are what it is measured against, once they come. Only the
    bridge's cycle resume answers such a signal (with the controller's strategies); a
    repeat within the told cycle is ClusterD's own, answered by the strategy report it
    already holds. A SIGKILL ends the controller that was told."""
    signals = _global_faults(obs)
    events = sorted([(r.t, "record", r) for r in obs.records if (r.kind, r.name) in (
        ("notify", "on_global_rank"), ("callback", "report_strategies"), ("notify", "change_strategy"))]
        + [(at, "kill", None) for at in obs.kills]
        + [(e.at, "signal", e) for e in signals], key=lambda item: item[0])
    told = False  # the controller had on_global_rank and no change_strategy since
    told_in = ""  # the uuid of the globalFault that notify came from
    offered: set[int] | None = None  # the ranks of its strategies, once they came
    early: JournalEntry | None = None  # a new cycle's globalFault that came before them
    for at, kind, item in events:
        if kind == "record" and item.name == "on_global_rank":
            before = [s for s in signals if s.at <= at]
            told, told_in, offered, early = True, before[-1].detail["uuid"] if before else "", None, None
        elif kind == "record" and item.name == "report_strategies":
            offered = {int(rank) for rank in (item.args[0] if item.args else {})}
            if not told:  # a notify this observation did not record: the latest globalFault's
                before = [s for s in signals if s.at <= at]
                told, told_in = True, before[-1].detail["uuid"] if before else ""
            if early is not None and (beyond := {int(rank) for rank in early.detail["faults"]} - offered):
                return early, offered, beyond
            early = None
        elif kind != "signal":
            told, told_in, offered, early = False, "", None, None
        elif told and item.detail["uuid"] != told_in:
            if offered is None:
                early = early or item
                continue
            beyond = {int(rank) for rank in item.detail["faults"]} - offered
            if beyond:
                return item, offered, beyond
    return None


def cycle_wider_than_offered(obs: Observation) -> str | None:
    """Why a cycle ClusterD restarted could not be repaired, or None: its globalFault came
    while the controller waited for change_strategy (so the bridge answered it from the
    controller's strategies, bridge/job/session/resume.py) and named ranks beyond those the controller
    offered them for. A controller cannot be told more ranks then (a second on_global_rank
    sends it to EXIT; docs/mindio-controller.md), and a repair of fewer ranks than the node
    agent restarts hangs: the job can only end, by dump or exit. The extra ranks joined
    ClusterD's cache while it was away or frozen (a fault the controller held for its
    second report, a whole pod's process fault). ``never_killed`` still checks that the
    bridge offered that cycle no repair (``repair_offered_to_wider_cycle``)."""
    wider = _wider_cycle(obs)
    if wider is None:
        return None
    signal, offered, beyond = wider
    return (f"ClusterD's globalFault #{signal.seq} at {signal.at:.3f} named ranks {sorted(beyond)} beyond those the "
            f"controller offered its strategies for ({sorted(offered)}), while it waited for change_strategy: it "
            f"cannot be told of them, and no repair of its ranks completes")


def repair_offered_to_wider_cycle(obs: Observation) -> list[str]:
    """The bridge's answer to a cycle wider than the controller's offer (``_wider_cycle``)
    must offer no repair: a retry or recover would hang on ranks restarted under it until
    ClusterD's report wait runs out (15 minutes on the real server), then exit."""
    wider = _wider_cycle(obs)
    if wider is None:
        return []
    signal, _, _ = wider
    problems = []
    for rpc in obs.journal:
        if (rpc.kind == "rpc" and rpc.name == "ReportRecoverStrategy" and rpc.job_id == obs.job_id
                and rpc.at >= signal.at and rpc.code == 0):
            repairs = [name for name in rpc.detail.get("strategies", ()) if name in REPAIRS]
            if repairs:
                problems.append(f"ReportRecoverStrategy #{rpc.seq} offered {repairs} for globalFault #{signal.seq}, "
                                f"which names ranks the controller cannot be told of: the repair would hang")
            break
    for notify in obs.records:
        if notify.kind == "notify" and notify.name == "change_strategy" and notify.t >= signal.at \
                and notify.args and notify.args[0] in REPAIRS:
            problems.append(f"change_strategy({notify.args[0]!r}) at {notify.t:.3f} for a cycle wider than the "
                            f"controller's (globalFault #{signal.seq})")
    return problems


def lost_recovery_path(obs: Observation) -> str | None:
    """Why the run, as it happened, left the job no recovery path, or None.

    Decided from the trace because it depends on timing: a rank fault that lands after
    the controller offered its strategies (the second report_fault_ranks, which merges
    faults into the cycle, is behind it) and before it reported the repair's result fails
    that repair by design (docs/mindio-controller.md, "One cycle": a new fault before the
    first step gives ``report_result(406, "do last repair failed!")`` and a wait for dump
    or exit), and ClusterD then ends the job with dump or exit; and a repair that hangs
    by design (``repair_hang_by_design``); and a restarted cycle wider than the one the
    controller offered its strategies for (``cycle_wider_than_offered``)."""
    for judged in (repair_hang_by_design(obs), cycle_wider_than_offered(obs)):
        if judged is not None:
            return judged
    repairing_since: float | None = None
    for record in sorted(obs.records, key=lambda r: r.t):
        if record.kind == "callback" and record.name == "report_strategies":
            repairing_since = record.t
        elif record.kind == "callback" and record.name == "report_result":
            repairing_since = None
        elif record.kind == "training" and record.name == "fault" and repairing_since is not None:
            return (f"a rank fault {record.args[0] if record.args else ''} at {record.t:.3f} landed during a repair "
                    f"(strategies offered at {repairing_since:.3f}, no result yet): the controller fails that repair")
    return None


def never_killed(obs: Observation) -> list[str]:
    """The job is never killed while the schedule leaves a recovery path (the controller
    entering EXIT/FINAL before the bridge was stopped, or a job that never settles). A
    SIGKILLed bridge takes its controller with it (no EXIT is recorded) and the next one
    serves the restarted ranks: checked on both sides of it."""
    if not obs.schedule.recoverable:
        return []
    if lost_recovery_path(obs):
        return repair_offered_to_wider_cycle(obs)
    problems = []
    killed = _killed_at(obs)
    if killed is not None:
        notes = [f"{r.name} {r.args}" for r in obs.records if r.kind == "note" and r.t <= killed.t][-3:]
        problems.append(f"job killed: the controller entered {killed.name} at {killed.t:.3f} (last notes: {notes})")
    if obs.unsettled and killed is None:
        problems.append(f"job hung: {obs.unsettled}")
    return problems


def _global_faults(obs: Observation) -> list[JournalEntry]:
    return [e for e in obs.journal if e.kind == "signal" and e.name == "globalFault" and e.job_id == obs.job_id
            and e.detail.get("jobId") == obs.job_id and e.detail.get("uuid") and e.detail.get("faults")]


def global_ranks_forwarded(obs: Observation) -> list[str]:
    """``on_global_rank`` receives every rank of ClusterD's globalFault: each notify carries
    every rank of the newest globalFault ClusterD wrote before it."""
    problems = []
    signals = _global_faults(obs)
    for notify in (r for r in obs.records if r.kind == "notify" and r.name == "on_global_rank"):
        before = [s for s in signals if s.at <= notify.t]
        if not before:
            continue
        signal = before[-1]
        wanted = {int(rank) for rank in signal.detail["faults"]}
        got = {int(rank) for rank in (notify.args[0] if notify.args else {})}
        missing = sorted(wanted - got)
        if missing:
            problems.append(f"on_global_rank({dict(notify.args[0]) if notify.args else {}}) at {notify.t:.3f} lacks "
                            f"ranks {missing} of ClusterD's globalFault #{signal.seq} uuid={signal.detail['uuid']} "
                            f"faults={dict(signal.detail['faults'])}")
    return problems


def misdelivered(journal: Iterable[JournalEntry], job_id: str) -> list[str]:
    """Cycle-bound reports that reached ClusterD on a stream (or a server incarnation)
    other than the one that carried the signal they answer, or twice for one signal.

    A signal opens one answer of its kind; a stream-open (every subscribe resets
    ClusterD's job and its report slots) or a restart closes every open answer. A report
    refused at the door (``qps exceeded``, or 400: this server has no such job) never
    reached the job and is ignored."""
    problems: list[str] = []
    open_answers: dict[str, JournalEntry] = {}
    for entry in journal:
        if entry.job_id not in (job_id, ""):
            continue
        if entry.kind == "stream-open" or (entry.kind == "state" and entry.name == "clusterd-restarted"):
            open_answers.clear()
        elif entry.kind == "signal" and entry.job_id == job_id and entry.detail.get("jobId") == job_id:
            if entry.detail.get("duplicate"):
                continue
            if entry.name == "changeStrategy" and entry.detail.get("changeStrategy") == "exit":
                continue  # an exit decision or notice: the controller reports nothing
            for rpc, answers in CYCLE_REPORTS.items():
                if entry.name in answers:
                    open_answers[rpc] = entry
        elif entry.kind in ("rpc", "report-late") and entry.name in CYCLE_REPORTS:
            if entry.detail.get("grpc_status") or (entry.kind == "rpc" and entry.code in (None, UN_REGISTRY)):
                # refused at the door, the caller gave up while blocked (journaled again if
                # late), or a server that has no such job (a restarted ClusterD before the
                # bridge registered again): none of them reached a cycle's report slot
                continue
            if open_answers.pop(entry.name, None) is None:
                problems.append(f"#{entry.seq} {entry.kind} {entry.name} code={entry.code} answers no signal of "
                                f"its stream: {format_entry(entry)}")
    return problems


def format_entry(entry: JournalEntry) -> str:
    from bridge.sim.journal import Journal

    return Journal.format(entry)


def reports_in_cycle(obs: Observation) -> list[str]:
    """No report crosses cycles (ClusterD's journal), and every fault the controller
    reported reaches ClusterD (a ReportProcessFault answered 0) after it was reported:
    in its cycle, or re-reported after a reset. Reports made after the bridge was
    stopped, or ``PENDING_AT_STOP`` before, are exempt: nobody is left to send them, or
    the bridge was still holding them for a live stream (ClusterD loses a fault reported
    with no live subscriber) when the stop came. So are faults reported before ClusterD
    came back from a restart less than ``RESUBSCRIBE_GRACE`` before the stop: held for
    the new stream, which was not live yet."""
    problems = misdelivered(obs.journal, obs.job_id)
    problems += [f"ClusterD recorded a protocol violation: {v}" for v in obs.sim_violations]
    until = obs.stop_at
    delivered = [(e.at, {int(r): int(t) for r, t in dict(e.detail.get("faults") or {}).items()})
                 for e in obs.journal if e.kind == "rpc" and e.name == "ReportProcessFault"
                 and e.job_id == obs.job_id and e.code == 0]
    restarted = [e.at for e in obs.journal if e.kind == "state" and e.name == "clusterd-restarted"]
    for record in obs.records:
        if record.kind != "callback" or record.name != "report_fault_ranks" or not record.args \
                or record.t >= until - PENDING_AT_STOP:
            continue
        if any(kill > record.t for kill in obs.kills):
            continue  # lost with the controller that a SIGKILL took: its ranks restart with the next one
        if any(record.t <= back and until - back < RESUBSCRIBE_GRACE for back in restarted):
            continue  # held for a live stream across ClusterD's outage, which ended just before the stop
        for rank, kind in dict(record.args[0]).items():
            if not any(at >= record.t - 0.001 and int(rank) in faults and faults[int(rank)] in (int(kind), 1)
                       for at, faults in delivered):
                problems.append(f"fault {{{rank}: {kind}}} the controller reported at {record.t:.3f} never reached "
                                "ClusterD (no ReportProcessFault answered 0 after it)")
    return problems


def documented_exit(obs: Observation) -> list[str]:
    """The bridge exits only with a documented code, within its stop budget."""
    problems = []
    for code, seconds, budget in obs.exits:
        if code is not None and code not in DOCUMENTED_EXIT_CODES:
            problems.append(f"the bridge exited with undocumented code {code}")
        elif code is not None and code not in REQUESTED_STOP_CODES:
            problems.append(f"a requested stop ended with code {code} (expected 0, or 76 after the controller ended)")
        if seconds > budget:
            problems.append(f"the stop took {seconds:.2f} s, past its budget of {budget:.2f} s")
        if code is None and seconds > budget:
            problems.append("the bridge did not exit at all")
    return problems


def _stream_live(journal: list[JournalEntry], job_id: str, seq: int) -> bool:
    """Whether the job had a live signal stream when journal entry ``seq`` was written. A
    result sent in the moment before its stream's end reached the bridge crosses the
    break on the wire (docs/architecture.md): ClusterD answers it 0 with no cycle to
    give it to, writes no verdict, and the next Subscribe resets the job."""
    live = False
    for entry in journal:
        if entry.seq >= seq:
            break
        if entry.kind == "state" and entry.name == "clusterd-restarted":
            live = False
        elif entry.job_id == job_id and entry.kind in ("stream-open", "stream-end"):
            live = entry.kind == "stream-open"
    return live


def controller_successes(obs: Observation, until: float) -> tuple[int, int]:
    """The controller's successful repairs (``report_result(0, ..., retry|recover)``)
    before ``until``, and how many of them reached ClusterD (a ReportRecoverStatus with
    status 0 for that strategy, answered 0, after it). A result that finds ClusterD
    restarted has no cycle left to answer: the bridge drops it with a reason, training
    goes on repaired, and ClusterD never writes a verdict."""
    results = [r for r in obs.records if r.kind == "callback" and r.name == "report_result" and len(r.args) >= 4
               and r.args[0] == 0 and r.args[3] in REPAIRS and r.t < until]
    answers = [e for e in obs.journal if e.kind == "rpc" and e.name == "ReportRecoverStatus" and e.code == 0
               and e.job_id == obs.job_id and (e.detail.get("status") or {}).get("code") == 0
               and e.detail.get("strategy") in REPAIRS and _stream_live(obs.journal, obs.job_id, e.seq)]
    delivered = 0
    for result in results:
        match = next((e for e in answers if e.at >= result.t - 0.001 and e.detail.get("strategy") == result.args[3]),
                     None)
        if match is not None:
            answers.remove(match)
            delivered += 1
    return len(results), delivered


def cycles_agree(obs: Observation) -> list[str]:
    """The flight recorder's cycles and the metrics' cycle counts agree with ClusterD's
    journal: ClusterD annotated ``retry-success`` / ``recover-success`` once per
    successful repair result that reached it, and the bridge's metrics and recorder count
    every successful repair the controller reported (those ClusterD never saw, because it
    restarted under them, included). A SIGKILL may take the last cycle's count with it
    (the metrics are read before the kill, the recorder writes every poll): at most one
    per kill."""
    journal = obs.successes.get("journal")
    problems = []
    # A SIGKILL takes the stub's records of its last ~20 ms with it (tests/chaos/
    # bridge_process.py flushes them at that cadence): a result reported just before it
    # may reach ClusterD and the metrics with no record of it, at most one per kill.
    lost = len(obs.kills)
    # Counted until the bridge had stopped: it serves on while it stops. The metrics of a
    # bridge process are scraped when its stop is asked for, so they may miss the results
    # reported after that, and those whose report call was still under way (the bridge
    # counts a result once its call ended; ClusterD away, the call waits up to its
    # deadline): at least those reported a report deadline before the stop, at most all.
    reported, delivered = controller_successes(obs, obs.ended_at)
    before_stop, _ = controller_successes(obs, obs.stop_at - RPC_TIMEOUT)
    if journal is not None and not delivered <= journal <= delivered + lost:
        problems.append(f"ClusterD's journal has {journal:g} successful cycles, but {delivered} successful "
                        f"result(s) of the controller reached it")
    for source, count in obs.successes.items():
        if source == "journal" or count is None:
            continue
        if not before_stop - lost <= count <= reported + lost:
            problems.append(f"{source} counts {count:g} successful cycles; the controller reported {reported} "
                            f"({delivered} reached ClusterD, whose journal counts {journal:g})")
    return problems


def journal_successes(journal: Iterable[JournalEntry], job_id: str) -> int:
    """Successful repairs by ClusterD's verdict (PodGroup annotation ProcessRecoverStatus)."""
    return sum(1 for e in journal if e.kind == "annotation" and e.name == "ProcessRecoverStatus"
               and e.job_id == job_id and e.detail.get("value") in ("retry-success", "recover-success"))


def stub_clean(obs: Observation) -> list[str]:
    """Neither the stub noted a violation (a notify the real controller punishes)."""
    return [f"the controller recorded a violation: {v}" for v in obs.stub_violations]


def no_silent_wait(obs: Observation) -> list[str]:
    """Every fault the controller reported leads to a recovery or a clean exit, never to
    a silent wait: while the schedule leaves a recovery path and the bridge runs, the
    controller never waits out its MindX wait for the stop_train of a fault it reported
    (ClusterD answered the report and started nothing: a fault its fault centre skipped,
    or one lost to a Subscribe's reset, that the bridge did not report again)."""
    if not obs.schedule.recoverable:
        return []
    problems = []
    for record in obs.records:
        if record.kind == "note" and record.name == "wait timed out" and record.args[:1] == ("stop_train",) \
                and record.t < obs.stop_at and not any(kill <= record.t for kill in obs.kills):
            reported = [r.t for r in obs.records if r.kind == "callback" and r.name == "report_fault_ranks"
                        and r.t <= record.t]
            since = f"{record.t - reported[-1]:.3f} s after its report_fault_ranks" if reported else "with no report"
            problems.append(f"silent wait: the controller waited out its wait for stop_train at {record.t:.3f}, "
                            f"{since}")
    return problems


#: Every per-schedule invariant, by the name a report prints.
CHECKS = {
    "never-killed": never_killed,
    "no-silent-wait": no_silent_wait,
    "global-ranks-forwarded": global_ranks_forwarded,
    "reports-in-cycle": reports_in_cycle,
    "documented-exit": documented_exit,
    "cycles-agree": cycles_agree,
    "stub-clean": stub_clean,
}


def check(obs: Observation) -> dict[str, list[str]]:
    found = {name: fn(obs) for name, fn in CHECKS.items()}
    return {name: problems for name, problems in found.items() if problems}


@dataclass
class Resources:
    threads: int
    fds: int
    rss_kb: int


def resources() -> Resources:
    import os
    import threading

    rss = 0
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return Resources(threading.active_count(), len(os.listdir("/proc/self/fd")), rss)


#: Resource growth allowed between the mark after the warm-up and the end of a run:
#: threads and descriptors not at all (a slack of 2 for gRPC's pollers and a schedule's
#: last closing socket), RSS by this much (allocator and interpreter caches).
RSS_GROWTH_KB = 40 * 1024
SLACK = 2


def resource_growth(marks: Mapping[str, Resources]) -> list[str]:
    """Threads, file descriptors and RSS do not grow across schedules (``warm`` -> ``end``)."""
    if "warm" not in marks or "end" not in marks:
        return []
    warm, end = marks["warm"], marks["end"]
    problems = []
    if end.threads > warm.threads + SLACK:
        problems.append(f"threads grew from {warm.threads} to {end.threads} across schedules")
    if end.fds > warm.fds + SLACK:
        problems.append(f"file descriptors grew from {warm.fds} to {end.fds} across schedules")
    if end.rss_kb > warm.rss_kb + RSS_GROWTH_KB:
        problems.append(f"RSS grew from {warm.rss_kb} kB to {end.rss_kb} kB across schedules")
    return problems
