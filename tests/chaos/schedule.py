"""A chaos schedule: what happens to one simulated job, and whether it can still recover.

A schedule is data (JSON), so a failure prints it and one command replays it
(``python -m tests.chaos --replay '<json>'``), and the shrinker can drop events from it.
Every event fires either a number of seconds after the job is subscribed (``trigger``
"start") or that long after the first journal entry of the simulated ClusterD that
matches its trigger (``signal:stopTrain``, ``rpc:ReportStopComplete``, ...): that is how
a schedule reaches "a random controller state" without sleeping in the dark.

The generator decides, per schedule, whether the job keeps a recovery path (the
``recoverable`` flag and its ``reason``): a ClusterD unreachable for longer than the
controller's MindX wait while a fault is pending ends the job by design (the controller
gives up waiting and exits, docs/mindio-controller.md), so for those schedules the
"never killed" invariant is not checked, while every other invariant still is.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from bridge.sim.mindio_ttp import REAL_TIMINGS

#: The simulated job: 16 ranks, 4 per pod (ClusterD expands a type-1 fault to its pod).
WORLD_SIZE = 16
DEVICES_PER_POD = 4
#: The controller's MindX wait (MINDIO_WAIT_MINDX_TIME, whole seconds, at least 1).
WAIT = 4
#: The bridge's report RPC deadline (``clusterd.rpc_timeout``) on every entry point.
RPC_TIMEOUT = 2.0
#: Both peers' real delays run this much faster in a schedule: ClusterD's
#: (``harness.CLUSTERD_TIMINGS``) and the controller's (``CONTROLLER_TIMINGS``), so every
#: ratio between them is the real one. A controller faster than that against a scaled
#: ClusterD inverts orderings the real peers keep: a retry's repair (real: 1-5 s) ending
#: inside one tick of ClusterD's fault centre (real: 1 s) lets the tick after the cycle's
#: reset start a cycle for the retry records the cycle's own reports refreshed.
TIME_SCALE = 0.02
CONTROLLER_TIMINGS: dict[str, float] = {name: seconds * TIME_SCALE for name, seconds in REAL_TIMINGS.items()}
#: The entry points a schedule can run on.
ENTRIES = ("daemon", "seed", "process", "node")

#: Journal triggers: a schedule event fires ``at`` seconds after the first matching entry.
TRIGGERS = ("start", "signal:stopTrain", "rpc:ReportStopComplete", "signal:globalFault",
            "rpc:ReportRecoverStrategy", "signal:changeStrategy", "rpc:ReportRecoverStatus",
            "rpc:ReportProcessFault", "annotation:ProcessRecoverStatus")

#: Event kinds, by the side they act on.
FAULT_KINDS = ("fault", "pod_fault", "burst")
#: A second fault right after a recovery (its trigger: ClusterD writing the first
#: recovery's result), on the first fault's rank or another one. Drawn apart from the
#: other kinds (``refault_event``), so adding it left every other seed's events as they were.
REFAULT_KINDS = ("refault",)
#: How long after the first recovery's result the second fault may come: ClusterD's
#: fault-centre hold (10 s) scaled like its other delays (tests/chaos/harness.py), and a
#: little more, so both sides of the hold are drawn.
REFAULT_WINDOW = 0.3
CLUSTERD_KINDS = ("clusterd_restart", "clusterd_freeze", "refuse", "drop_stream", "keepalive_silence",
                  "slow_signal", "duplicate_signal", "replay_signal", "rank_table")
CONTROLLER_KINDS = ("slow_notify", "slow_destroy")
BRIDGE_KINDS = ("sigterm", "sigkill_restart")
#: The node service's entry point has its own kinds (tests/chaos/node.py), and only those.
from .node import NODE_KINDS  # noqa: E402 - beside the other kinds on purpose

KINDS = FAULT_KINDS + REFAULT_KINDS + CLUSTERD_KINDS + CONTROLLER_KINDS + BRIDGE_KINDS + NODE_KINDS
#: Kinds that end the job's bridge for good: nothing after them runs.
TERMINAL_KINDS = frozenset({"sigterm"})
#: Kinds only a real bridge process can take.
PROCESS_ONLY_KINDS = frozenset({"sigkill_restart"})
#: Kinds the seed-API launcher cannot take (it has no daemon to signal).
DAEMON_ONLY_KINDS = frozenset({"sigterm", "sigkill_restart", "slow_destroy"})


@dataclass(frozen=True)
class Event:
    """One thing done to the job. ``args`` depend on ``kind`` (see ``tests.chaos.actions``)."""

    kind: str
    at: float
    trigger: str = "start"
    args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown chaos event kind {self.kind!r} (known: {', '.join(KINDS)})")
        if self.trigger not in TRIGGERS:
            raise ValueError(f"unknown trigger {self.trigger!r} (known: {', '.join(TRIGGERS)})")
        if not 0 <= self.at < 60:
            raise ValueError(f"event {self.kind}: at={self.at!r} must be 0 <= at < 60 seconds")


@dataclass(frozen=True)
class Schedule:
    seed: int
    entry: str
    events: tuple[Event, ...]
    recoverable: bool = True
    reason: str = ""

    def __post_init__(self) -> None:
        if self.entry not in ENTRIES:
            raise ValueError(f"unknown entry point {self.entry!r} (known: {', '.join(ENTRIES)})")
        for event in self.events:
            if event.kind in PROCESS_ONLY_KINDS and self.entry != "process":
                raise ValueError(f"event {event.kind} needs the process entry point, not {self.entry}")
            if event.kind in DAEMON_ONLY_KINDS and self.entry == "seed":
                raise ValueError(f"event {event.kind} needs a bridge daemon, not the seed API")
            if (event.kind in NODE_KINDS) != (self.entry == "node"):
                raise ValueError(f"event {event.kind} does not apply to the {self.entry} entry point "
                                 f"(the node entry point takes {', '.join(NODE_KINDS)} and only those)")

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> Schedule:
        raw = json.loads(text)
        events = tuple(Event(e["kind"], float(e["at"]), e.get("trigger", "start"), dict(e.get("args", {})))
                       for e in raw["events"])
        schedule = Schedule(int(raw.get("seed", 0)), raw["entry"], events)
        # the recovery path is re-judged from the events: a shrunk or hand-edited schedule
        # must not keep a verdict its events no longer justify
        return judged(schedule)

    def without(self, index: int) -> Schedule:
        return judged(replace(self, events=self.events[:index] + self.events[index + 1:]))

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for event in self.events:
            out[event.kind] = out.get(event.kind, 0) + 1
        return out


def judged(schedule: Schedule) -> Schedule:
    """The schedule with its recovery-path verdict derived from its events."""
    recoverable, reason = recovery_path(schedule.events)
    return replace(schedule, recoverable=recoverable, reason=reason)


def recovery_path(events: Iterable[Event]) -> tuple[bool, str]:
    """Whether the job keeps a recovery path through ``events``, and if not, why.

    The controller waits ``WAIT`` s for each answer of ClusterD. A ClusterD unreachable
    (killed, or frozen) for half of that or more can leave a pending fault unanswered
    past the wait (the bridge needs the rest for the watchdog, the re-subscribe and
    ClusterD's own delays), and the controller then exits: the job ends by design."""
    for event in events:
        if event.kind == "clusterd_restart" and event.args.get("down", 0) >= WAIT / 2:
            return False, f"ClusterD down {event.args['down']} s, past half the controller's {WAIT} s wait"
        if event.kind == "clusterd_freeze" and event.args.get("seconds", 0) >= WAIT / 2:
            return False, f"ClusterD frozen {event.args['seconds']} s, past half the controller's {WAIT} s wait"
    return True, ""


def pod_of(rank: int) -> list[int]:
    first = rank - rank % DEVICES_PER_POD
    return list(range(first, first + DEVICES_PER_POD))


def _event(rng: random.Random, entry: str) -> Event:
    kinds = [k for k in KINDS
             if k not in NODE_KINDS and k not in REFAULT_KINDS
             and not (k in PROCESS_ONLY_KINDS and entry != "process")
             and not (k in DAEMON_ONLY_KINDS and entry == "seed")]
    # faults are what a schedule is about: weight them up
    weights = [6 if k in FAULT_KINDS else 1 for k in kinds]
    kind = rng.choices(kinds, weights)[0]
    trigger = "start" if kind in FAULT_KINDS and rng.random() < 0.6 else rng.choice(TRIGGERS)
    at = round(rng.uniform(0, 1.5) if trigger == "start" else rng.choice((0.0, rng.uniform(0, 0.5))), 3)
    args: dict[str, Any] = {}
    if kind == "fault":
        args = {"ranks": {str(rng.randrange(WORLD_SIZE)): rng.choice((0, 1, 2))}}
    elif kind == "pod_fault":
        args = {"pod": rng.randrange(WORLD_SIZE // DEVICES_PER_POD)}
    elif kind == "burst":
        args = {"faults": [[rng.randrange(WORLD_SIZE), rng.choice((0, 1, 2))] for _ in range(rng.randint(2, 4))],
                "gap": round(rng.uniform(0.0, 0.2), 3)}
    elif kind == "clusterd_restart":
        long = rng.random() < 0.1
        args = {"down": round(rng.uniform(WAIT / 2, WAIT + 1) if long else rng.uniform(0.0, 0.8), 3)}
    elif kind == "clusterd_freeze":
        long = rng.random() < 0.1
        args = {"seconds": round(rng.uniform(WAIT / 2, WAIT + 1) if long else rng.uniform(0.2, 1.6), 3)}
    elif kind == "refuse":
        args = {"count": rng.randint(1, 4)}
    elif kind == "keepalive_silence":
        args = {"seconds": round(rng.uniform(0.5, 1.5), 3)}
    elif kind == "slow_signal":
        args = {"delay": round(rng.uniform(0.05, 0.8), 3)}
    elif kind == "rank_table":
        args = {"version": rng.randint(1, 1000)}
    elif kind == "slow_notify":
        args = {"delay": round(rng.uniform(0.05, 0.5), 3), "count": rng.randint(1, 3)}
    elif kind == "slow_destroy":
        args = {"delay": round(rng.uniform(0.1, 2.0), 3)}
    return Event(kind, at, trigger, args)


def refault_event(seed: int, events: list[Event]) -> Event | None:
    """For about half the seeds, a second fault inside ``REFAULT_WINDOW`` after the first
    recovery's result: a UCE or HCCL fault on the first timed fault's rank (ClusterD's
    fault centre may still hold that rank's record and skip it) or on another rank. Its
    own random stream: the seed's other events are drawn as before."""
    rng = random.Random(f"refault-{seed}")
    if rng.random() < 0.5:
        return None
    first = next((e for e in events if e.kind == "fault" and e.trigger == "start"), None)
    if first is None:
        return None
    rank = int(next(iter(first.args["ranks"])))
    same = rng.random() < 0.5
    if not same:
        rank = rng.choice([r for r in range(WORLD_SIZE) if r != rank])
    return Event("refault", round(rng.uniform(0, REFAULT_WINDOW), 3), "annotation:ProcessRecoverStatus",
                 {"ranks": {str(rank): rng.choice((0, 2))}, "of": "same" if same else "other"})


def generate(seed: int, entry: str | None = None) -> Schedule:
    """The schedule of ``seed``: 1-6 events, at least one fault on a timer (the other
    triggers need a cycle to start), for about half the seeds a second fault right after
    the first recovery (``refault_event``); a ``sigterm``, if drawn, is moved last
    (nothing happens to a job after its bridge stopped)."""
    rng = random.Random(seed)
    entry = entry or rng.choice(("daemon", "daemon", "seed", "process"))
    if entry == "node":
        from .node import draw

        return Schedule(seed, entry, tuple(Event(kind, at, "start", args) for kind, at, args in draw(rng)))
    events = [_event(rng, entry) for _ in range(rng.randint(1, 6))]
    if not any(e.kind in FAULT_KINDS and e.trigger == "start" for e in events):
        events.insert(0, Event("fault", round(rng.uniform(0, 1.0), 3), "start",
                               {"ranks": {str(rng.randrange(WORLD_SIZE)): rng.choice((0, 1, 2))}}))
    if (refault := refault_event(seed, events)) is not None:
        events.append(refault)
    terminal = [e for e in events if e.kind in TERMINAL_KINDS][:1]
    events = [e for e in events if e.kind not in TERMINAL_KINDS] + terminal
    return judged(Schedule(seed, entry, tuple(events)))
