"""The chaos runner (tests/chaos/) in the suite: a fixed set of seeds on every entry
point, and for every invariant a known-bad behaviour that it must report.

The seeds are fixed so a failure here is a schedule anyone can replay with the command
the assertion prints; the long randomized runs are ``python -m tests.chaos --schedules N``
(docs/chaos.md). The self-checks break one thing on purpose -- a bridge that
drops globalFault ranks, one that never forwards the strategy, a report answered into the
wrong cycle, an undocumented exit code, a leaking thread -- and assert that the matching
invariant names it: an invariant that cannot fail proves nothing.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from bridge.sim.clusterd import JournalEntry
from bridge.sim.mindio_ttp import Record

from .chaos import invariants, runner
from .chaos.harness import Harness
from .chaos.runner import replay_command, run_schedule, shrink
from .chaos.schedule import Event, Schedule, generate, judged, recovery_path
from .chaos.workers import ChaosWorkers
from .processes import ROOT

pytestmark = pytest.mark.timeout(180)

#: The seeds CI runs, per entry point: about two and a half minutes of schedules on the
#: 2-core machine, run by ``WORKERS`` processes side by side (tests/chaos/workers.py). A
#: seed here is a schedule as drawn by ``generate(seed, entry)``: changing the generator
#: changes what they cover, so the set is wide rather than hand-picked.
DAEMON_SEEDS = list(range(1, 29))
SEED_API_SEEDS = list(range(1, 13))
PROCESS_SEEDS = list(range(1, 9))
NODE_SEEDS = list(range(1, 5))  # the node service (tests/chaos/node.py): 5-15 s each
FIXED = ([("daemon", s) for s in DAEMON_SEEDS] + [("seed", s) for s in SEED_API_SEEDS]
         + [("process", s) for s in PROCESS_SEEDS] + [("node", s) for s in NODE_SEEDS])


@pytest.fixture(scope="module")
def fixed_runs() -> Iterator[ChaosWorkers]:
    workers = ChaosWorkers(FIXED, ROOT)
    try:
        yield workers
    finally:
        workers.close()


# One xdist worker takes them all: ``fixed_runs`` runs every schedule (in its own worker
# processes) once per pytest process that asks for it.
@pytest.mark.xdist_group("chaos-fixed-schedules")
@pytest.mark.parametrize(("entry", "seed"), FIXED, ids=[f"{e}-{s}" for e, s in FIXED])
def test_fixed_schedule_keeps_every_invariant(fixed_runs: ChaosWorkers, entry: str, seed: int) -> None:
    outcome = fixed_runs.outcome(entry, seed, timeout=170)
    assert not outcome["violations"], (f"seed {seed} on {entry}: {outcome['violations']}\nreplay with:\n"
                                       f"  {outcome['replay']}")


def test_a_chaos_worker_that_ends_without_an_outcome_fails_the_schedules_test_with_its_stderr() -> None:
    workers = ChaosWorkers([("moon", 1)], ROOT)
    try:
        with pytest.raises(AssertionError, match=r"(?s)ended without its outcome \(exit 2\).*'moon:1' is not ENTRY:SEED"):
            workers.outcome("moon", 1, timeout=60)
    finally:
        workers.close()


async def test_a_pod_sized_fault_off_rank_0_reaches_on_global_rank_whole_on_both_entry_points() -> None:
    """ClusterD's globalFault names the faulty pod's ranks (4..7 for rank 5); a bridge
    that passes on fewer leaves the controller repairing too few ranks."""
    for entry in ("daemon", "seed"):
        schedule = judged(Schedule(0, entry, (Event("fault", 0.1, "start", {"ranks": {"5": 1}}),)))
        outcome = await run_schedule(schedule)
        assert not outcome.failed, f"{entry}: {outcome.violations}"
        assert outcome.injected == {"fault": 1}


# --------------------------------------------------------------------------- the schedules

def test_a_schedule_round_trips_through_its_replay_json() -> None:
    for seed in range(40):
        schedule = generate(seed)
        assert Schedule.from_json(schedule.to_json()) == schedule
        assert any(e.kind in ("fault", "pod_fault", "burst") and e.trigger == "start" for e in schedule.events)


def test_the_generator_covers_every_event_kind_and_entry_point() -> None:
    from .chaos.schedule import ENTRIES, KINDS

    drawn = [generate(seed) for seed in range(300)] + [generate(seed, "node") for seed in range(40)]
    assert {s.entry for s in drawn} == set(ENTRIES)
    assert {e.kind for s in drawn for e in s.events} == set(KINDS)
    assert any(not s.recoverable for s in drawn) and any(s.recoverable for s in drawn)


def test_a_clusterd_down_past_half_the_wait_leaves_no_recovery_path() -> None:
    assert recovery_path([Event("clusterd_restart", 0, args={"down": 0.5})]) == (True, "")
    ok, why = recovery_path([Event("clusterd_freeze", 0, args={"seconds": 3.0})])
    assert not ok and "frozen 3.0 s" in why


def test_a_bad_replay_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown chaos event kind 'nap'"):
        Schedule.from_json('{"entry": "daemon", "events": [{"kind": "nap", "at": 0}]}')
    with pytest.raises(ValueError, match="needs the process entry point"):
        Schedule.from_json('{"entry": "daemon", "events": [{"kind": "sigkill_restart", "at": 0}]}')
    done = subprocess.run([sys.executable, "-m", "tests.chaos", "--replay", '{"entry": "moon", "events": []}'],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unknown entry point 'moon'" in done.stderr


# --------------------------------------------------------------------------- every invariant can fail

def patch_notify(name: str, replacement: Any) -> Any:
    """A sabotage: the stub's ``tft_notify_controller_<name>`` replaced while the schedule
    runs (the harness puts the original back when it closes)."""
    from bridge.sim.mindio_ttp import controller_ttp as ttp

    def sabotage(harness: Harness) -> None:
        original = getattr(ttp, f"tft_notify_controller_{name}")
        setattr(ttp, f"tft_notify_controller_{name}", lambda *args, **kwargs: replacement(original, *args, **kwargs))

    return sabotage


ONE_POD_FAULT = judged(Schedule(0, "daemon", (Event("fault", 0.1, "start", {"ranks": {"5": 1}}),)))


async def test_global_ranks_forwarded_fails_when_the_bridge_drops_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seed API's failure, made on the daemon: on_global_rank gets ``{}``. The stub
    punishes it as the real controller does: the node agent restarts the pod under a
    repair told none of its ranks, and the repair hangs (never-killed sees a job that
    does not settle; a short settle time is enough to see it)."""
    monkeypatch.setattr(runner, "SETTLE", 5.0)
    outcome = await run_schedule(ONE_POD_FAULT, patch_notify("on_global_rank", lambda f, ranks, *a: f({}, *a)))
    assert "global-ranks-forwarded" in outcome.violations
    assert "lacks ranks [4, 5, 6, 7]" in outcome.violations["global-ranks-forwarded"][0]
    assert "the controller is in REPAIR" in outcome.violations["never-killed"][0]


async def test_never_killed_fails_when_the_strategy_never_reaches_the_controller() -> None:
    outcome = await run_schedule(ONE_POD_FAULT, patch_notify("change_strategy", lambda f, strategy, *a: 0))
    assert "never-killed" in outcome.violations
    assert "the controller entered EXIT" in outcome.violations["never-killed"][0]


async def test_a_failure_shrinks_to_the_event_that_matters_and_replays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "SETTLE", 5.0)  # the sabotaged job never settles: no need to wait 30 s each try
    noisy = judged(Schedule(3, "daemon", (
        Event("rank_table", 0.0, "start", {"version": 1}),
        Event("fault", 0.1, "start", {"ranks": {"5": 1}}),
        Event("duplicate_signal", 0.0, "start"),
    )))
    sabotage = patch_notify("on_global_rank", lambda f, ranks, *a: f({}, *a))
    failed = await run_schedule(noisy, sabotage)
    assert "global-ranks-forwarded" in failed.violations
    shrunk = await shrink(failed, sabotage)
    assert [e.kind for e in shrunk.schedule.events] == ["fault"]
    assert "global-ranks-forwarded" in shrunk.violations
    assert Schedule.from_json(replay_command(shrunk.schedule).split("'")[1]) == shrunk.schedule


def entry(kind: str, name: str, seq: int, at: float = 0.0, code: int | None = None, **detail: Any) -> JournalEntry:
    return JournalEntry(seq, at, kind, name, "j", code, {"jobId": "j", **detail})


def observation(**kwargs: Any) -> invariants.Observation:
    kwargs.setdefault("journal", [])
    kwargs.setdefault("records", [])
    return invariants.Observation(schedule=ONE_POD_FAULT, job_id="j", **kwargs)


def test_reports_in_cycle_fails_on_a_report_answering_another_stream() -> None:
    journal = [entry("stream-open", "Subscribe", 0), entry("signal", "stopTrain", 1, uuid="u1"),
               entry("stream-open", "Subscribe", 2),
               entry("rpc", "ReportStopComplete", 3, code=0)]  # answers the first stream's stopTrain
    problems = invariants.reports_in_cycle(observation(journal=journal))
    assert problems and "ReportStopComplete" in problems[0] and "answers no signal of its stream" in problems[0]
    # a restarted ClusterD that has no such job yet answers 400: no cycle's slot took it
    unregistered = [*journal[:3], entry("rpc", "ReportStopComplete", 3, code=400)]
    assert invariants.reports_in_cycle(observation(journal=unregistered)) == []
    journal.insert(3, entry("signal", "stopTrain", 3, uuid="u2"))
    assert invariants.reports_in_cycle(observation(journal=journal)) == []


def test_reports_in_cycle_fails_on_a_fault_that_never_reached_clusterd() -> None:
    reported = Record(5.0, "callback", "report_fault_ranks", ({5: 1}, {5: ""}))
    before = entry("rpc", "ReportProcessFault", 1, at=4.0, code=0, faults={5: 1})
    problems = invariants.reports_in_cycle(observation(journal=[before], records=[reported]))
    assert problems and "fault {5: 1}" in problems[0]
    after = entry("rpc", "ReportProcessFault", 2, at=5.5, code=0, faults={5: 1, 4: 1})
    assert invariants.reports_in_cycle(observation(journal=[before, after], records=[reported])) == []
    assert invariants.reports_in_cycle(observation(journal=[before], records=[reported], kills=[6.0])) == []
    # held for a live stream when a requested stop came a moment later: nobody left to send it
    assert invariants.reports_in_cycle(observation(journal=[before], records=[reported], stop_requested_at=5.5)) == []
    assert invariants.reports_in_cycle(observation(journal=[before], records=[reported], stop_requested_at=9.0))
    # reported while ClusterD was down, which came back just before the stop: held for a stream
    # not live yet; back long enough before the stop, the bridge had its chance
    back = entry("state", "clusterd-restarted", 2, at=8.0)
    assert invariants.reports_in_cycle(observation(journal=[before, back], records=[reported],
                                                   stop_requested_at=9.0)) == []
    assert invariants.reports_in_cycle(observation(journal=[before, back], records=[reported],
                                                   stop_requested_at=8.0 + invariants.RESUBSCRIBE_GRACE + 0.1))
    early = entry("state", "clusterd-restarted", 0, at=4.5)  # back before the fault was reported
    assert invariants.reports_in_cycle(observation(journal=[early, before], records=[reported],
                                                   stop_requested_at=6.0 + invariants.PENDING_AT_STOP))


def test_documented_exit_fails_on_an_unknown_code_or_a_stop_past_its_budget() -> None:
    assert invariants.documented_exit(observation(exits=[(0, 1.0, 10.0), (76, 2.0, 10.0), (None, 1.0, 10.0)])) == []
    assert "undocumented code 3" in invariants.documented_exit(observation(exits=[(3, 1.0, 10.0)]))[0]
    assert "expected 0" in invariants.documented_exit(observation(exits=[(1, 1.0, 10.0)]))[0]
    assert "past its budget" in invariants.documented_exit(observation(exits=[(0, 12.5, 10.0)]))[0]


def test_cycles_agree_fails_when_a_count_differs_from_clusterds_journal() -> None:
    result = Record(1.0, "callback", "report_result", (0, "Mindio do repair operation ok", {}, "recover"))
    opened = entry("stream-open", "SubscribeProcessManageSignal", 0, at=0.5)
    answered = entry("rpc", "ReportRecoverStatus", 1, at=1.1, code=0, status={"code": 0, "info": "ok"},
                     strategy="recover")
    same = {"journal": 1.0, "metrics": 1.0, "recorder": 1.0}
    assert invariants.cycles_agree(observation(records=[result], journal=[opened, answered], successes=same)) == []
    problems = invariants.cycles_agree(observation(records=[result], journal=[opened, answered],
                                                   successes={**same, "recorder": 0.0}))
    assert problems and problems[0].startswith("recorder counts 0 successful cycles; the controller reported 1")
    # ClusterD restarted under the result: it never saw it, the bridge still counts the repair
    lost = {"journal": 0.0, "metrics": 1.0, "recorder": 1.0}
    assert invariants.cycles_agree(observation(records=[result], successes=lost)) == []
    # the result crossed its stream's end on the wire: ClusterD answered 0, had no cycle
    # for it and wrote no verdict; the bridge still counts the repair
    ended = entry("stream-end", "SubscribeProcessManageSignal", 1, at=1.05)
    crossed = entry("rpc", "ReportRecoverStatus", 2, at=1.1, code=0, status={"code": 0, "info": "ok"},
                    strategy="recover")
    assert invariants.cycles_agree(observation(records=[result], journal=[opened, ended, crossed],
                                               successes=lost)) == []
    assert invariants.cycles_agree(observation(records=[result], journal=[opened, answered], successes=lost))
    # a verdict without a result that reached it: the journal disagrees
    assert "ClusterD's journal has 1 successful cycles, but 0" in invariants.cycles_agree(
        observation(records=[result], successes=same))[0]
    # ... unless a SIGKILL took the stub's last records with it: one result per kill
    assert invariants.cycles_agree(observation(records=[result], journal=[opened, answered], kills=[1.2],
                                               successes={**same, "journal": 2.0, "metrics": 2.0})) == []
    assert invariants.cycles_agree(observation(records=[result], journal=[opened, answered], kills=[1.2],
                                               successes={**same, "journal": 3.0, "metrics": 2.0}))


def test_stub_clean_and_never_killed_read_the_stubs_log() -> None:
    assert invariants.stub_clean(observation(stub_violations=["destroy from a callback"]))
    killed = [Record(3.0, "state", "EXIT")]
    assert invariants.never_killed(observation(records=killed))
    assert invariants.never_killed(observation(records=killed, stop_requested_at=2.0)) == []
    assert "job hung" in invariants.never_killed(observation(unsettled="the controller is in REPAIR"))[0]
    # a fault landing while a repair runs fails it by design: no recovery path left
    during_repair = [Record(1.0, "callback", "report_strategies", ({5: 1}, ["recover"])),
                     Record(1.5, "training", "fault", ({9: 1}, {})), *killed]
    assert invariants.lost_recovery_path(observation(records=during_repair))
    assert invariants.never_killed(observation(records=during_repair)) == []


def test_never_killed_judges_a_restarted_cycle_wider_than_the_controllers_offer() -> None:
    """A globalFault naming ranks beyond those the controller offered its strategies for,
    while it waits for change_strategy: no repair can complete, the job may end (dump or
    exit), but the bridge must not have offered that cycle a repair."""
    offered = Record(1.0, "callback", "report_strategies", ({4: 1, 5: 1, 6: 1, 7: 1}, ["exit", "dump", "recover"]))
    wider = entry("signal", "globalFault", 10, at=2.0, uuid="u2", faults={r: 1 for r in range(4, 12)})
    killed = Record(4.0, "state", "EXIT")

    def answer(*strategies: str) -> JournalEntry:
        return entry("rpc", "ReportRecoverStrategy", 11, at=2.1, code=0, strategies=list(strategies))

    dumped = observation(records=[offered, Record(2.5, "notify", "change_strategy", ("dump", "")), killed],
                         journal=[wider, answer("exit", "dump")])
    assert "beyond those the controller offered" in (invariants.lost_recovery_path(dumped) or "")
    assert invariants.never_killed(dumped) == []
    repaired = observation(records=[offered, Record(2.5, "notify", "change_strategy", ("recover", ""))],
                           journal=[wider, answer("exit", "dump", "recover")], unsettled="the controller is in REPAIR")
    problems = invariants.never_killed(repaired)
    assert len(problems) == 2 and "offered ['recover']" in problems[0] and "change_strategy('recover')" in problems[1]
    # not a restarted cycle: the same ranks as offered, a repeat of the offered cycle's
    # globalFault (ClusterD answers it with the strategy report it holds), a globalFault
    # before the offer, or one for the next controller after a SIGKILL
    first = entry("signal", "globalFault", 9, at=0.5, uuid="u1", faults={r: 1 for r in range(4, 8)})
    same = entry("signal", "globalFault", 10, at=2.0, uuid="u2", faults={r: 1 for r in range(4, 8)})
    repeat = entry("signal", "globalFault", 10, at=2.0, uuid="u1", faults={r: 1 for r in range(4, 12)})
    early = entry("signal", "globalFault", 9, at=0.5, uuid="u1", faults={r: 1 for r in range(4, 12)})
    for journal, kills in (([same], []), ([first, repeat], []), ([early], []), ([first, wider], [1.5])):
        judged = observation(records=[offered, killed], journal=journal, kills=kills)
        assert invariants.lost_recovery_path(judged) is None, journal
        assert invariants.never_killed(judged), journal
    # the new cycle's globalFault before the controller's strategies (GLOBAL_SENT): judged
    # against them once they come
    told = Record(0.6, "notify", "on_global_rank", ({r: 1 for r in range(4, 8)}, 30))
    rebound = entry("signal", "globalFault", 10, at=0.8, uuid="u2", faults={r: 1 for r in range(4, 12)})
    late = Record(1.0, "callback", "report_strategies", ({r: 1 for r in range(4, 8)}, ["exit", "dump", "recover"]))
    dumped_late = observation(records=[told, late, Record(2.5, "notify", "change_strategy", ("dump", "")), killed],
                              journal=[first, rebound, answer("exit", "dump")])
    assert "beyond those the controller offered" in (invariants.lost_recovery_path(dumped_late) or "")
    assert invariants.never_killed(dumped_late) == []
    covering = Record(1.0, "callback", "report_strategies", ({r: 1 for r in range(4, 12)}, ["exit", "recover"]))
    judged = observation(records=[told, covering, killed], journal=[first, rebound])
    assert invariants.lost_recovery_path(judged) is None
    assert invariants.never_killed(judged)


def test_resource_growth_fails_on_a_leaked_thread() -> None:
    before = invariants.resources()
    release = threading.Event()
    leaked = [threading.Thread(target=release.wait, daemon=True) for _ in range(invariants.SLACK + 1)]
    for thread in leaked:
        thread.start()
    try:
        problems = invariants.resource_growth({"warm": before, "end": invariants.resources()})
        assert problems and problems[0].startswith("threads grew")
    finally:
        release.set()
        for thread in leaked:
            thread.join(5)
    assert invariants.resource_growth({"warm": before, "end": invariants.resources()}) == []
    grown = invariants.Resources(before.threads, before.fds, before.rss_kb + invariants.RSS_GROWTH_KB + 1)
    assert "RSS grew" in invariants.resource_growth({"warm": before, "end": grown})[0]


# --------------------------------------------------------------------------- a fault right after a recovery

@pytest.mark.parametrize("entry", ["daemon", "seed"])
@pytest.mark.parametrize("of", ["same", "other"])
async def test_a_second_uce_right_after_a_recovery_is_recovered(entry: str, of: str) -> None:
    """The chaos vocabulary's ``refault``: a UCE on rank 5, retried; the same fault again
    (ClusterD's fault centre still holds its record and skips it) or one on rank 9,
    moments after ClusterD wrote the first result. Every invariant holds, ``no-silent-wait``
    among them: the job recovers both."""
    rank = "5" if of == "same" else "9"
    schedule = judged(Schedule(0, entry, (
        Event("fault", 0.1, "start", {"ranks": {"5": 0}}),
        Event("refault", 0.02, "annotation:ProcessRecoverStatus", {"ranks": {rank: 0}, "of": of}))))
    outcome = await run_schedule(schedule)
    assert not outcome.failed, f"{entry}/{of}: {outcome.violations}"
    assert outcome.injected == {"fault": 1, "refault": 1}


def test_the_ci_seeds_draw_a_second_fault_after_a_recovery_on_both_ranks() -> None:
    drawn = [e for entry, seed in FIXED if entry != "node" for e in generate(seed, entry).events if e.kind == "refault"]
    assert {e.args["of"] for e in drawn} == {"same", "other"}
    assert all(e.trigger == "annotation:ProcessRecoverStatus" for e in drawn)


def test_no_silent_wait_fails_on_a_wait_for_stop_train_run_out() -> None:
    waited = [Record(1.0, "callback", "report_fault_ranks", ({5: 0}, {})),
              Record(5.0, "note", "wait timed out", ("stop_train", 4.0))]
    problems = invariants.no_silent_wait(observation(records=waited))
    assert problems and "silent wait" in problems[0] and "4.000 s after its report_fault_ranks" in problems[0]
    assert invariants.no_silent_wait(observation(records=waited, stop_requested_at=3.0)) == []
    other_wait = [Record(5.0, "note", "wait timed out", ("change_strategy", 4.0))]
    assert invariants.no_silent_wait(observation(records=other_wait)) == []


async def test_no_silent_wait_names_a_bridge_that_does_not_report_a_skipped_fault_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from bridge.job.reports.refault import FaultFollowUp

    monkeypatch.setattr(FaultFollowUp, "_fire", lambda self: None)  # the sabotage: never reports again
    schedule = judged(Schedule(0, "daemon", (
        Event("fault", 0.1, "start", {"ranks": {"5": 0}}),
        Event("refault", 0.02, "annotation:ProcessRecoverStatus", {"ranks": {"5": 0}, "of": "same"}))))
    outcome = await run_schedule(schedule)
    assert "no-silent-wait" in outcome.violations, outcome.violations
