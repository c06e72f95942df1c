"""Run chaos schedules: inject each event at its moment, let the job settle, check.

One schedule at a time on one event loop: start the entry point's harness, arm every
event (a timer, or a wait for its journal trigger), run them, bring ClusterD back if the
schedule left it down or frozen, wait until the job is quiet (training again with every
reported fault delivered, or ended), stop the bridge as systemd would, and check the
invariants (``tests.chaos.invariants``). A failing schedule is shrunk (events dropped
while it still fails the same way) and printed with the one command that replays it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from bridge.sim.clusterd import JournalEntry

from . import invariants
from .harness import JOB, DaemonHarness, Harness, SeedHarness
from .schedule import DEVICES_PER_POD, TERMINAL_KINDS, Event, Schedule, generate

log = logging.getLogger("tests.chaos")

#: Events whose trigger has not come this long after the start are skipped.
HORIZON = 8.0
#: How long a job gets to come back to training and quiet after the last event.
SETTLE = 30.0
#: The job must stay quiet this long to count as settled (a fault injected just before
#: has then been seen by the controller, which polls every 20 ms).
QUIET = 0.5


@dataclass
class Outcome:
    schedule: Schedule
    violations: dict[str, list[str]]
    injected: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0
    #: the journal and the stub's log, one line each, in time order (``--dump``)
    trace: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return bool(self.violations)


def replay_command(schedule: Schedule) -> str:
    return f"python -m tests.chaos --replay '{schedule.to_json()}'"


def make_harness(entry: str) -> Harness:
    if entry == "daemon":
        return DaemonHarness()
    if entry == "seed":
        return SeedHarness()
    if entry == "process":
        from .process import ProcessHarness

        return ProcessHarness()
    raise ValueError(f"unknown entry point {entry!r}")


#: A hook the self-checks use to break the harness on purpose (see tests/test_chaos.py):
#: called with the started harness before the events run.
Sabotage = Callable[[Harness], Awaitable[None] | None]


class Run:
    """One schedule on one harness."""

    def __init__(self, schedule: Schedule, harness: Harness) -> None:
        self.schedule = schedule
        self.h = harness
        self.injected: Counter[str] = Counter()
        self.skipped: Counter[str] = Counter()
        self.bridge_stops: list[float] = []
        self.kills: list[float] = []
        self.exits: list[tuple[int | None, float, float]] = []
        self.terminated = False
        #: SIGTERM and SIGKILL-and-restart one at a time: a SIGTERM that lands while the
        #: restarted bridge is still importing meets Python's default handler, not the
        #: bridge's (systemd does not stop a unit mid-restart either)
        self.lifecycle = asyncio.Lock()

    # ------------------------------------------------------------------ the events

    async def act(self, event: Event) -> bool:
        """Do ``event``; False when it could not apply (a rank already down, no stream)."""
        h, sim, a = self.h, self.h.sim, event.args
        kind = event.kind
        if kind in ("fault", "refault"):
            faults = {int(r): int(t) for r, t in a["ranks"].items() if h.connected(int(r))}
            if not faults:
                return False
            h.inject(faults)
        elif kind == "pod_fault":
            first = int(a["pod"]) * DEVICES_PER_POD
            faults = {r: 1 for r in range(first, first + DEVICES_PER_POD) if h.connected(r)}
            if not faults:
                return False
            h.inject(faults)
        elif kind == "burst":
            done = False
            for rank, fault_type in a["faults"]:
                if h.connected(int(rank)):
                    h.inject({int(rank): int(fault_type)})
                    done = True
                await asyncio.sleep(float(a.get("gap", 0)))  # the gap is the behaviour injected
            return done
        elif kind == "clusterd_restart":
            await sim.stop()
            await asyncio.sleep(float(a["down"]))  # ClusterD stays down this long: the behaviour injected
            await sim.restart()
        elif kind == "clusterd_freeze":
            h.proxy.freeze()
            await asyncio.sleep(float(a["seconds"]))  # ClusterD answers nothing this long: the behaviour injected
            h.proxy.thaw()
        elif kind == "refuse":
            sim.fail_next_unary(int(a["count"]))
        elif kind == "drop_stream":
            try:
                await sim.drop_subscriber(JOB)
            except (RuntimeError, KeyError, TimeoutError):
                return False
        elif kind == "keepalive_silence":
            sim.silence_keepalives(float(a["seconds"]))
        elif kind == "slow_signal":
            sim.delay_next_signal(float(a["delay"]))
        elif kind == "duplicate_signal":
            sim.duplicate_next_signal()
        elif kind == "replay_signal":
            return await self.replay_signal()
        elif kind == "rank_table":
            from ..test_ranktable_validation import V10, V12

            await sim.push_rank_table(JOB, json.dumps(V10 if int(a["version"]) % 2 else V12))
        elif kind == "slow_notify":
            h.slow_notifies(float(a["delay"]), int(a["count"]))
        elif kind == "slow_destroy":
            h.set_destroy_delay(float(a["delay"]))
        elif kind == "sigterm":
            async with self.lifecycle:
                self.bridge_stops.append(time.monotonic())
                code, seconds = await h.request_stop()
                self.exits.append((code, seconds, h.stop_budget))
                self.terminated = True
        elif kind == "sigkill_restart":
            async with self.lifecycle:
                if self.terminated:
                    return False
                self.kills.append(time.monotonic())
                await h.sigkill_restart()
        return True

    async def replay_signal(self) -> bool:
        """The newest signal ClusterD wrote, written again on the live stream (a repeat
        or a late, reordered copy of it): same uuid, type, actions and ranks."""
        signals = [e for e in self.h.sim.journal.entries if e.kind == "signal" and e.job_id == JOB
                   and e.name != "keep-alive" and e.detail.get("jobId") == JOB]
        if not signals:
            return False
        last = signals[-1].detail
        fields: dict[str, Any] = {"signalType": signals[-1].name, "uuid": last.get("uuid", ""),
                                  "actions": list(last.get("actions") or ()),
                                  "faultRanks": {str(r): str(t) for r, t in dict(last.get("faults") or {}).items()}}
        if last.get("changeStrategy"):
            fields["changeStrategy"] = last["changeStrategy"]
        if last.get("timeout"):
            fields["timeout"] = int(last["timeout"])
        try:
            await self.h.sim.send_signal(JOB, **fields)
        except Exception as error:  # noqa: BLE001 -- no live stream: the event did not apply
            log.debug("replay_signal not applied: %r", error)
            return False
        return True

    async def fire(self, event: Event) -> None:
        if event.trigger != "start":
            kind, name = event.trigger.split(":", 1)
            try:
                await self.h.sim.wait_for(lambda e: e.kind == kind and e.name == name and e.job_id == JOB, HORIZON)
            except TimeoutError:
                self.skipped[event.kind] += 1
                return
        await asyncio.sleep(event.at)  # the event's moment is the schedule's: the behaviour injected
        if self.terminated:
            self.skipped[event.kind] += 1
            return
        if await self.act(event):
            self.injected[event.kind] += 1
        else:
            self.skipped[event.kind] += 1

    async def run_events(self) -> None:
        tasks = [asyncio.ensure_future(self.fire(e)) for e in self.schedule.events]
        terminal = [t for t, e in zip(tasks, self.schedule.events) if e.kind in TERMINAL_KINDS]
        others = [t for t in tasks if t not in terminal]
        try:
            if others:
                await asyncio.wait(others, timeout=HORIZON + 10)
            if terminal:
                await asyncio.wait(terminal, timeout=HORIZON + 30)
        finally:
            for task, event in zip(tasks, self.schedule.events):
                if not task.done():
                    task.cancel()
                    self.skipped[event.kind] += 1
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for result in results:
                if isinstance(result, Exception):
                    raise result

    # ------------------------------------------------------------------ settle and observe

    async def restore(self) -> None:
        """Whatever the schedule left broken comes back: ClusterD thawed and serving."""
        self.h.proxy.thaw()
        if self.h.sim._server is None:
            await self.h.sim.restart()

    def quiet(self) -> str | None:
        """None when the job is quiet (or ended); else what it still waits for."""
        state = self.h.stub_state()
        if self.terminated or state in invariants.KILLED_STATES or any(
                r.kind == "state" and r.name in invariants.KILLED_STATES for r in self.h.records()):
            return None
        if state != "NORMAL":
            if state == "REPAIR" and invariants.repair_hang_by_design(self.observation(final=False)) is not None:
                return None  # it would hang until ClusterD gives up: nothing left to wait for
            return f"the controller is in {state}"
        sim_state = self.h.sim.state(JOB)
        if sim_state != "INIT":
            return f"ClusterD's job is in {sim_state}"
        ctl = self.h.sim.controllers.get(JOB)
        if ctl is None or not ctl.live or not self.h.subscribed():
            return "no live subscription"
        pending = invariants.reports_in_cycle(self.observation(final=False))
        if pending:
            return pending[0]
        return None

    async def settle(self) -> str | None:
        deadline = time.monotonic() + SETTLE
        quiet_since: float | None = None
        why: str | None = "never looked"
        while time.monotonic() < deadline:
            why = self.quiet()
            now = time.monotonic()
            if why is None:
                quiet_since = quiet_since or now
                if now - quiet_since >= QUIET:
                    return None
            else:
                quiet_since = None
            await asyncio.sleep(0.05)  # the poll of the bounded settle wait (deadline above)
        return f"not quiet {SETTLE:.0f} s after the schedule: {why}"

    def observation(self, final: bool = True, unsettled: str | None = None) -> invariants.Observation:
        journal: list[JournalEntry] = list(self.h.sim.journal.entries)
        obs = invariants.Observation(
            schedule=self.schedule, job_id=JOB, journal=journal, records=self.h.records(),
            sim_violations=list(self.h.sim.violations), stub_violations=self.h.stub_violations(),
            stop_requested_at=getattr(self.h, "stop_requested_at", None) if final else None,
            bridge_stops=list(self.bridge_stops), kills=list(self.kills), exits=list(self.exits), unsettled=unsettled)
        if final:
            obs.successes = {"journal": float(invariants.journal_successes(journal, JOB)), **self.h.success_counts()}
        return obs


async def run_schedule(schedule: Schedule, sabotage: Sabotage | None = None) -> Outcome:
    """Run one schedule from a fresh harness to its verdict."""
    started = time.monotonic()
    if schedule.entry == "node":  # the node service: its own runner and invariants (tests/chaos/node.py)
        from .node import NodeChaos

        chaos = NodeChaos([(e.kind, e.at, dict(e.args)) for e in schedule.events])
        violations = await chaos.run()
        return Outcome(schedule, violations, Counter(chaos.injected), Counter(), time.monotonic() - started)
    harness = make_harness(schedule.entry)
    run = Run(schedule, harness)
    try:
        await harness.start()
        if sabotage is not None:
            result = sabotage(harness)
            if asyncio.iscoroutine(result):
                await result
        await run.run_events()
        await run.restore()
        unsettled = await run.settle()
        if not run.terminated:
            code, seconds = await harness.request_stop()
            run.exits.append((code, seconds, harness.stop_budget))
        obs = run.observation(final=True, unsettled=unsettled)
        violations = invariants.check(obs)
    finally:
        await harness.close()
    return Outcome(schedule, violations, run.injected, run.skipped, time.monotonic() - started, trace(obs))


def trace(obs: invariants.Observation) -> list[str]:
    """Both peers' records merged by time (one monotonic clock): what a failure needs."""
    lines = [(e.at, "clusterd " + invariants.format_entry(e)) for e in obs.journal
             if not (e.kind == "signal" and e.name == "keep-alive")]
    lines += [(r.t, f"stub     {r.kind} {r.name} {r.args!r}" + ("" if r.result is None else f" -> {r.result!r}"))
              for r in obs.records]
    lines.sort(key=lambda pair: pair[0])
    base = lines[0][0] if lines else 0.0
    return [f"{at - base:8.3f} {text}" for at, text in lines]


async def shrink(outcome: Outcome, sabotage: Sabotage | None = None, budget: int = 12) -> Outcome:
    """Drop events, one at a time from the last, while the schedule still fails one of
    the same invariants; at most ``budget`` re-runs (a failure may be timing-dependent)."""
    wanted = set(outcome.violations)
    best = outcome
    tries = 0
    progress = True
    while progress and tries < budget:
        progress = False
        for index in reversed(range(len(best.schedule.events))):
            if tries >= budget or len(best.schedule.events) <= 1:
                break
            candidate = best.schedule.without(index)
            tries += 1
            result = await run_schedule(candidate, sabotage)
            if wanted & set(result.violations):
                best = result
                progress = True
                break
    return best


def describe(outcome: Outcome) -> str:
    lines = [f"schedule seed={outcome.schedule.seed} entry={outcome.schedule.entry} "
             f"events={len(outcome.schedule.events)} recoverable={outcome.schedule.recoverable}"
             + (f" ({outcome.schedule.reason})" if outcome.schedule.reason else "")]
    for name, problems in outcome.violations.items():
        for problem in problems:
            lines.append(f"  VIOLATION {name}: {problem}")
    return "\n".join(lines)


async def run_many(seeds: list[int], entry: str | None, *, do_shrink: bool = True, warmup: int = 3,
                   out: Callable[[str], None] = print, stop_after: int | None = None) -> dict[str, Any]:
    """Run the schedules of ``seeds``; the figures a long run prints."""
    injected: Counter[str] = Counter()
    skipped: Counter[str] = Counter()
    violations: Counter[str] = Counter()
    by_entry: Counter[str] = Counter()
    entries: Counter[str] = Counter()
    failures: list[tuple[Outcome, Outcome]] = []
    unrecoverable = 0
    marks: dict[str, invariants.Resources] = {"start": invariants.resources()}
    started = time.monotonic()
    for index, seed in enumerate(seeds):
        schedule = generate(seed, entry)
        outcome = await run_schedule(schedule)
        injected.update(outcome.injected)
        skipped.update(outcome.skipped)
        unrecoverable += not schedule.recoverable
        entries[schedule.entry] += 1
        if outcome.failed:
            violations.update({name: len(p) for name, p in outcome.violations.items()})
            by_entry.update({f"{name} on {schedule.entry}": len(p) for name, p in outcome.violations.items()})
            out(describe(outcome))
            shrunk = await shrink(outcome) if do_shrink else outcome
            out(f"  shrunk to {len(shrunk.schedule.events)} event(s); replay with:" if do_shrink else "  replay with:")
            out(f"  {replay_command(shrunk.schedule)}")
            failures.append((outcome, shrunk))
            if stop_after is not None and len(failures) >= stop_after:
                seeds = seeds[:index + 1]
                break
        if index + 1 == warmup:
            marks["warm"] = invariants.resources()
        if (index + 1) % 25 == 0:
            out(f"... {index + 1} schedules, {sum(injected.values())} events injected, "
                f"{sum(violations.values())} violations, {time.monotonic() - started:.0f} s")
    marks["end"] = invariants.resources()
    growth = invariants.resource_growth(marks)
    if growth:
        violations["no-resource-growth"] += len(growth)
        for problem in growth:
            out(f"VIOLATION no-resource-growth: {problem}")
    return {"schedules": len(seeds), "entries": entries, "by_entry": by_entry, "injected": injected, "skipped": skipped, "violations": violations,
            "unrecoverable": unrecoverable, "failures": failures, "marks": marks,
            "seconds": time.monotonic() - started}
