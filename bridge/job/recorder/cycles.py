"""The recovery flight recorder: every cycle's timeline, kept on disk beside the bridge.

Per recovery cycle: each controller callback (fault ranks by type, strategies), each
ClusterD RPC with its code and latency, each signal, each notify with the controller's
return, every refusal and drop with its reason, and the outcome. ``tft-bridge history``
reads it back; ``bridge.job.recorder.model`` derives the phases and waits.

Two halves:

* ``Recorder``, on the event loop (the report path and the dispatcher call it): each
  hook is O(1), one small tuple appended to a bounded deque, and never blocks or wakes
  anything; a fault map above ``INLINE_FAULTS`` ranks keeps only its per-type counts. A
  full deque drops the event and counts ``tft_bridge_recorder_errors_total{reason=
  "queue_full"}``; a cycle's opening, uuid and close always pass.
* ``RecorderWriter``, a thread of its own (``tft-recorder``): wakes every ``poll``
  seconds while events come, every ``idle_poll`` once a wake-up found none, writes each
  batch in one transaction (``bridge.job.recorder.store``), keeps the store in its
  bounds and hands each closed cycle to the optional OTLP exporter. A store failure
  (full disk, unwritable directory, corrupt file) is counted by reason and logged within
  a budget, the store re-opened later; it never stops the bridge.

Grouping: a cycle opens at the controller's first fault report or ClusterD's first
signal of a flow, takes ClusterD's uuid when a signal brings one (a later different uuid
is a change, not a new cycle), and closes when the controller's flow reaches a final
outcome, lingering ``GRACE`` seconds for the final report's RPC, a drop or a repeated
signal. A cycle a signal opens stays tentative until the controller is involved: while
the controller is idle, a refused or no-op signal joins the cycle that closed just
before when it repeats it, else closes as ``not_forwarded``. A fault report never
answered stays open until the stop (``unfinished``); one a crash left open is
``interrupted`` at the next start.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge.job.reports.controller_flow import ControllerFlow, Step
from bridge.core.recorder_config import RecorderConfig
from bridge.job.recorder.model import summarise
from bridge.job.recorder.store import Store, StoreError

log = logging.getLogger(__name__)

FAULT_TYPE_NAMES = {0: "uce", 1: "other", 2: "hccl"}
#: Fault maps up to this size are listed rank by rank (microseconds on the loop); larger
#: ones are kept as the per-type counts the metrics made (BridgeMetrics.count_faults).
INLINE_FAULTS = 64
#: How long a closed cycle still takes the final report's RPC, a drop or a repeated signal.
GRACE = 2.0
LOG_EVERY = 300.0  # seconds between repeated log lines of one failure kind


def summarise_faults(faults: dict[int, int], by_type: dict[str, int] | None = None) -> dict[str, Any]:
    """A fault map as the record keeps it: ranks by type, and the ranks themselves when
    few. ``by_type``: the counts the metrics already made (see BridgeMetrics.count_faults),
    so a 100 000-rank map is counted once, not again here; without them a large map is
    recorded by size only (counting it would hold the loop -- or, on the writer thread,
    the GIL -- for milliseconds while its report is being sent)."""
    if len(faults) <= INLINE_FAULTS:
        counted: dict[str, int] = {}
        for fault_type in faults.values():
            name = FAULT_TYPE_NAMES.get(fault_type, str(fault_type))
            counted[name] = counted.get(name, 0) + 1
        return {"ranks": len(faults), "by_type": counted,
                "list": ",".join(f"{rank}:{kind}" for rank, kind in sorted(faults.items()))}
    if by_type is not None:
        return {"ranks": len(faults), "by_type": dict(by_type)}
    return {"ranks": len(faults), "by_type": {}, "approximate": True}


class ErrorLog:
    """Counts recorder failures by reason; logs each kind once, then at most every
    LOG_EVERY seconds with how many happened meanwhile."""

    def __init__(self, metrics: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self._counter = getattr(metrics, "recorder_errors", None)
        self._clock = clock
        self._last: dict[str, float] = {}
        self._since: dict[str, int] = {}
        self._lock = threading.Lock()  # the loop (queue_full) and the writer both report

    def __call__(self, reason: str, detail: str = "", count: int = 1) -> None:
        if self._counter is not None:
            self._counter.labels(reason).inc(count)
        now = self._clock()
        with self._lock:
            last = self._last.get(reason)
            if last is not None and now - last < LOG_EVERY:
                self._since[reason] = self._since.get(reason, 0) + count
                return
            missed = self._since.pop(reason, 0)
            self._last[reason] = now
        more = f" ({missed} more since the last message)" if missed else ""
        log.error("flight recorder: %s%s%s; the bridge carries on without this record",
                  reason, f": {detail}" if detail else "", more)


# --------------------------------------------------------------------------- loop side

@dataclass
class _Cycle:
    key: str
    opened_by: str
    uuid: str | None = None
    progressed: bool = False  # a callback or an accepted notify: the controller is in it
    exit_decided: bool = False
    result_code: int | None = None
    strategy: str = ""
    rescheduled: bool = False
    closing_at: float | None = None  # monotonic time the final outcome was reached
    outcome: str | None = None  # forced outcome (not_forwarded)
    last: float = field(default_factory=time.monotonic)
    # A cycle a signal opened stays tentative (nothing written) until the controller is
    # involved: a repeated signal refused after a cycle closed (ClusterD repeats an exit
    # notice every few seconds) belongs to that cycle, not to a new one.
    tentative: bool = False
    pending: list[tuple[float, str, dict[str, Any]]] = field(default_factory=list)
    opened_at: float = 0.0


class NullRecorder:
    """The recorder switched off: every hook is a no-op."""

    enabled = False

    def callback(self, name: str, at: float, faults: dict[int, int] | None = None,
                 by_type: dict[str, int] | None = None, **fields: Any) -> None: ...
    def rpc(self, method: str, code: str | int, started: float, duration: float) -> None: ...
    def signal(self, signal_type: str, uuid: str, actions: list[str], strategy: str = "", params: str = "",
               ranks: int = 0) -> None: ...
    def notify(self, action: str, rc: int, started: float, duration: float, strategy: str = "") -> None: ...
    def refused(self, reason: str, signal_type: str, uuid: str, actions: list[str], detail: str = "") -> None: ...
    def dropped(self, report: str, cycle: str | None, reason: str) -> None: ...
    def session(self, state: str) -> None: ...
    def hook(self, action: str, result: str) -> None: ...
    def repeated(self) -> None: ...
    def rereported(self, reason: str, faults: dict[int, int]) -> None: ...
    def clusterd_faults(self, info: dict[str, Any]) -> None: ...
    def tick(self) -> None: ...
    def close(self) -> None: ...


class Recorder(NullRecorder):
    """Loop-side hooks. Each call is O(1) and never raises into its caller."""

    enabled = True
    LATE = 60.0  # seconds a closed cycle still takes late events (a report's RPC, a repeated signal)
    FAULTS_HOLD = 120.0  # seconds ClusterD's fault information waits for the cycle it caused

    def __init__(self, job_id: str, flow: ControllerFlow, writer: RecorderWriter, *, grace: float = GRACE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.job_id = job_id
        self.flow = flow
        self.writer = writer
        self.grace = grace
        self._clock = clock
        self._offset = time.time() - clock()  # monotonic -> Unix time, fixed at start
        self._boot = f"{int(time.time() * 1000):x}"
        self._count = 0
        self._cycle: _Cycle | None = None
        self._last_key: str | None = None  # the cycle closed last, for late events
        self._last_uuid: str | None = None
        self._last_closed = float("-inf")
        # ClusterD's fault information (bridge/job/session/fault_centre.py) not yet in any cycle: (when, summary).
        self._held_faults: tuple[float, dict[str, Any]] | None = None
        self._faults_unavailable = False

    @property
    def current(self) -> str | None:
        """The open cycle's key (tests, the demo); None while nothing is open."""
        return self._cycle.key if self._cycle is not None and not self._cycle.tentative else None

    # ------------------------------------------------------------------ plumbing
    def _wall(self, mono: float) -> float:
        return mono + self._offset

    def _open(self, opened_by: str, at: float, tentative: bool = False) -> _Cycle:
        self._count += 1
        cycle = _Cycle(f"{self._boot}-{self._count}", opened_by, last=at, tentative=tentative, opened_at=at)
        self._cycle = cycle
        if not tentative:
            self.writer.put(("open", cycle.key, opened_by, self._wall(at), self.job_id))
        self._faults_into(cycle, at)
        return cycle

    def _faults_into(self, cycle: _Cycle, at: float) -> None:
        """A new cycle takes ClusterD's fault information seen shortly before it (the
        fault centre publishes a device fault before the recovery it causes), or says
        that the release does not serve it."""
        held = self._held_faults
        if held is not None and at - held[0] <= self.FAULTS_HOLD:
            self._emit(cycle, held[0], "clusterd_faults", held[1])
            if not cycle.tentative:  # a signal asking nothing of the controller may not be the cycle
                self._held_faults = None
        elif self._faults_unavailable:
            self._emit(cycle, at, "clusterd_faults", {"signal": "unavailable", "devices": []})

    def _commit(self, cycle: _Cycle) -> None:
        """A tentative cycle becomes real: write its opening and what it held back."""
        if not cycle.tentative:
            return
        cycle.tentative = False
        self.writer.put(("open", cycle.key, cycle.opened_by, self._wall(cycle.opened_at), self.job_id))
        if cycle.uuid:
            self.writer.put(("uuid", cycle.key, cycle.uuid))
        held = self._held_faults
        for at, kind, data in cycle.pending:
            self.writer.put(("event", cycle.key, self._wall(at), kind, data))
            if held is not None and data is held[1]:
                self._held_faults = None  # the cycle it was held for
        cycle.pending.clear()

    def _emit(self, cycle: _Cycle | str, at: float, kind: str, data: dict[str, Any]) -> None:
        if isinstance(cycle, str):
            self.writer.put(("event", cycle, self._wall(at), kind, data))
            return
        cycle.last = max(cycle.last, at)
        if cycle.tentative:
            if len(cycle.pending) < 64:
                cycle.pending.append((at, kind, data))
            return
        self.writer.put(("event", cycle.key, self._wall(at), kind, data))

    def _recent_closed(self) -> str | None:
        if self._last_key is not None and self._clock() - self._last_closed < self.LATE:
            return self._last_key
        return None

    def _finish(self, cycle: _Cycle, at: float | None = None) -> None:
        if self._cycle is cycle:
            self._cycle = None
        if cycle.tentative:
            self._commit(cycle)
        if cycle.outcome is not None:
            outcome = cycle.outcome
        elif cycle.exit_decided:
            outcome = "exit"
        elif cycle.result_code is not None:
            outcome = {0: "success", 201: "isolated"}.get(cycle.result_code, "failed")
        elif cycle.rescheduled:
            outcome = "rescheduled"
        elif not cycle.progressed:
            outcome = "not_forwarded"
        else:
            outcome = "unfinished"
        ended = cycle.closing_at if cycle.closing_at is not None else (at if at is not None else cycle.last)
        self.writer.put(("close", cycle.key, self._wall(ended), outcome, cycle.strategy))
        self._last_key, self._last_uuid, self._last_closed = cycle.key, cycle.uuid, self._clock()

    def _closing(self, cycle: _Cycle, at: float, outcome: str | None = None) -> None:
        if cycle.closing_at is None:
            cycle.closing_at = at
        if outcome is not None:
            cycle.outcome = outcome

    def _check_flow(self, cycle: _Cycle, at: float) -> None:
        """Close the cycle when the controller's flow reached a final outcome."""
        step = self.flow.step
        if step is Step.EXITED or step is Step.IDLE and cycle.progressed:
            self._closing(cycle, at)
        elif cycle.closing_at is not None and cycle.progressed:
            cycle.closing_at = None  # the flow went on (e.g. a second action of the signal)
            cycle.outcome = None

    def _involved(self) -> _Cycle | None:
        """The cycle the controller is now part of (a tentative one becomes real)."""
        cycle = self._cycle
        if cycle is not None and cycle.tentative:
            self._commit(cycle)
        return cycle

    def _guard(self, what: str, error: BaseException) -> None:
        self.writer.errors("record_failed", f"{what}: {error!r}")

    # ------------------------------------------------------------------ hooks (event loop)
    def callback(self, name: str, at: float, faults: dict[int, int] | None = None,
                 by_type: dict[str, int] | None = None, **fields: Any) -> None:
        """A controller callback, after the bridge handled it (``at``: the controller's
        monotonic time). ``by_type``: the fault counts already made for the metrics.
        ``fields``: code, strategies, strategy -- small values only."""
        try:
            cycle = self._involved()
            if cycle is not None and cycle.closing_at is not None and name == "report_fault_ranks":
                self._finish(cycle)
                cycle = None
            if cycle is None:
                cycle = self._open("fault" if name == "report_fault_ranks" else "callback", at)
            data: dict[str, Any] = {"name": name, **fields}
            if faults is not None:
                data["faults"] = summarise_faults(faults, by_type)
            self._emit(cycle, at, "callback", data)
            cycle.progressed = True
            if name == "report_result":
                cycle.result_code = fields.get("code")
                if fields.get("strategy"):
                    cycle.strategy = fields["strategy"]
            self._check_flow(cycle, at)
        except Exception as error:  # noqa: BLE001 - recording must never break the report path
            self._guard("callback", error)

    def rpc(self, method: str, code: str | int, started: float, duration: float) -> None:
        """A ClusterD unary RPC (``code``: ClusterD's Status code or the gRPC status)."""
        try:
            data = {"method": method, "code": code, "latency": round(duration, 6)}
            cycle = self._cycle
            if cycle is not None and not cycle.tentative:
                self._emit(cycle, started, "rpc", data)
                if cycle.closing_at is not None and method == "ReportRecoverStatus":
                    self._finish(cycle)
                return
            # Only a report's RPC belongs to a cycle already closed; the routine
            # re-subscription after it (Init, Register) does not.
            recent = self._recent_closed() if method.startswith("Report") else None
            if recent is not None:
                self._emit(recent, started, "rpc", data)
        except Exception as error:  # noqa: BLE001
            self._guard("rpc", error)

    def signal(self, signal_type: str, uuid: str, actions: list[str], strategy: str = "", params: str = "",
               ranks: int = 0) -> None:
        """A signal for this job about to be dispatched (keep-alives are not recorded)."""
        try:
            at = self._clock()
            cycle = self._cycle
            if cycle is not None and cycle.closing_at is not None and (not uuid or uuid != cycle.uuid):
                self._finish(cycle)
                cycle = None
            if cycle is None:
                cycle = self._open("signal", at, tentative=True)
            if uuid and uuid != cycle.uuid:
                if cycle.uuid is not None:
                    self._emit(cycle, at, "uuid", {"old": cycle.uuid, "new": uuid})
                cycle.uuid = uuid
                if not cycle.tentative:
                    self.writer.put(("uuid", cycle.key, uuid))
            if signal_type == "killMaster":
                cycle.rescheduled = True
            self._emit(cycle, at, "signal", {"type": signal_type, "uuid": uuid, "actions": list(actions),
                                             "strategy": strategy, "params": params, "ranks": ranks})
        except Exception as error:  # noqa: BLE001
            self._guard("signal", error)

    def notify(self, action: str, rc: int, started: float, duration: float, strategy: str = "") -> None:
        """A notify call into the controller and what it returned."""
        try:
            cycle = self._involved()
            if cycle is None:
                cycle = self._open("signal", started)
            data: dict[str, Any] = {"action": action, "rc": rc, "duration": round(duration, 6)}
            if strategy:
                data["strategy"] = strategy
            self._emit(cycle, started, "notify", data)
            if rc == 0:
                cycle.progressed = True
                if action == "change_strategy":
                    if strategy == "exit":
                        cycle.exit_decided = True
                        cycle.strategy = cycle.strategy if cycle.strategy == "dump" else "exit"  # a dump's exit notice
                    else:
                        cycle.strategy = strategy
                elif action == "save_and_exit":
                    cycle.strategy = "dump"
            self._check_flow(cycle, started + duration)
        except Exception as error:  # noqa: BLE001
            self._guard("notify", error)

    def refused(self, reason: str, signal_type: str, uuid: str, actions: list[str], detail: str = "") -> None:
        """A signal or action not forwarded, and why."""
        try:
            at = self._clock()
            cycle = self._cycle
            data = {"reason": reason, "signal": signal_type, "uuid": uuid, "actions": list(actions), "detail": detail}
            if cycle is None:
                if reason == "foreign_job":
                    return  # another job's traffic is not this job's history
                cycle = self._open("signal", at, tentative=True)
            self._emit(cycle, at, "refused", data)
            if cycle.progressed or self.flow.step is not Step.IDLE:
                return
            recent = self._recent_closed()
            if cycle.tentative and recent is not None and (not cycle.uuid or cycle.uuid == self._last_uuid):
                # A repeat of the cycle that just closed: its events go there.
                for when, kind, held in cycle.pending:
                    self._emit(recent, when, kind, held)
                self._cycle = None
                return
            self._commit(cycle)
            self._closing(cycle, at, "not_forwarded")
        except Exception as error:  # noqa: BLE001
            self._guard("refused", error)

    def dropped(self, report: str, cycle: str | None, reason: str) -> None:
        """A report the wire dropped, and why."""
        try:
            data = {"report": report, "cycle": cycle, "reason": reason}
            current = self._cycle
            if current is not None and not current.tentative:
                self._emit(current, self._clock(), "dropped", data)
                if current.closing_at is not None and report == "result":
                    self._finish(current)
                return
            recent = self._recent_closed()
            if recent is not None:
                self._emit(recent, self._clock(), "dropped", data)
        except Exception as error:  # noqa: BLE001
            self._guard("dropped", error)

    def session(self, state: str) -> None:
        """A ClusterD session change, recorded only inside a cycle still running
        (re-subscriptions mid-recovery are part of its story; the routine ones after it
        are not)."""
        try:
            cycle = self._cycle
            if cycle is not None and not cycle.tentative and cycle.closing_at is None:
                self._emit(cycle, self._clock(), "session", {"state": state})
        except Exception as error:  # noqa: BLE001
            self._guard("session", error)

    def repeated(self) -> None:
        """The running cycle repeats a retry cycle that succeeded (repeats.py): it closes
        with the outcome ``repeat_after_success``, whatever its result says."""
        try:
            cycle = self._cycle
            if cycle is not None:
                cycle.outcome = "repeat_after_success"
                self._emit(cycle, self._clock(), "repeat", {"of": self._last_uuid or ""})
        except Exception as error:  # noqa: BLE001 - recording must never break the signal path
            self._guard("repeated", error)

    def rereported(self, reason: str, faults: dict[int, int]) -> None:
        """The bridge reported the flow's faults once more: ClusterD had answered the
        controller's report OK and started no recovery (refault.py; ``reason`` as in
        ``tft_bridge_fault_rereports_total``)."""
        try:
            cycle = self._cycle
            if cycle is not None:
                self._emit(cycle, self._clock(), "rereport", {"reason": reason, **summarise_faults(faults)})
        except Exception as error:  # noqa: BLE001 - recording must never break its caller
            self._guard("rereported", error)

    def clusterd_faults(self, info: dict[str, Any]) -> None:
        """What ClusterD's fault centre saw for the job (bridge/job/session/fault_centre.py: a bounded
        summary). Goes into the running cycle; outside one it waits ``FAULTS_HOLD``
        seconds for the cycle it causes. "unavailable" (the release has no Fault
        service) is said once in every cycle from then on."""
        try:
            at = self._clock()
            if info.get("signal") == "unavailable":
                self._faults_unavailable = True
                if self._cycle is not None:
                    self._emit(self._cycle, at, "clusterd_faults", info)
                return
            self._faults_unavailable = False
            if self._cycle is not None:
                self._emit(self._cycle, at, "clusterd_faults", info)
            elif info.get("signal") != "normal":
                self._held_faults = (at, info)
        except Exception as error:  # noqa: BLE001 - recording must never break its caller
            self._guard("clusterd_faults", error)

    def hook(self, action: str, result: str) -> None:
        """A node hook ClusterD asked for, and its result."""
        try:
            cycle = self._involved()
            if cycle is not None:
                self._emit(cycle, self._clock(), "hook", {"action": action, "result": result})
        except Exception as error:  # noqa: BLE001
            self._guard("hook", error)

    def tick(self) -> None:
        """Called every second or so: close a cycle whose grace is over, or whose flow
        went back to idle by a path no hook saw (a pause that timed out)."""
        try:
            cycle = self._cycle
            if cycle is None:
                return
            now = self._clock()
            if cycle.tentative and cycle.closing_at is None and self.flow.step is Step.IDLE \
                    and now - cycle.last >= self.grace:
                # A signal that asked the controller for nothing (a log-only action): a
                # repeat of the cycle just closed goes there, anything else stands alone.
                recent = self._recent_closed()
                if recent is not None and (not cycle.uuid or cycle.uuid == self._last_uuid):
                    for when, kind, held in cycle.pending:
                        self._emit(recent, when, kind, held)
                    self._cycle = None
                    return
                self._closing(cycle, cycle.last, "not_forwarded")
            if cycle.closing_at is None and cycle.progressed and self.flow.step is Step.IDLE \
                    and now - cycle.last >= self.grace:
                self._closing(cycle, cycle.last)
            if cycle.closing_at is not None and now - cycle.closing_at >= self.grace:
                self._finish(cycle)
        except Exception as error:  # noqa: BLE001
            self._guard("tick", error)

    def close(self) -> None:
        """The bridge stops: an open cycle ends as it stands (``unfinished`` when no
        outcome was reached)."""
        if self._cycle is not None:
            self._finish(self._cycle, self._clock())


# --------------------------------------------------------------------------- writer thread

@dataclass
class _Open:
    key: str
    job: str
    opened_by: str
    started: float
    events: list[dict[str, Any]] = field(default_factory=list)
    seq: int = 0
    dropped: int = 0
    uuid: str | None = None
    uuids: list[str] = field(default_factory=list)


class RecorderWriter:
    """Owns the store; drains the loop's deque on its own thread (``tft-recorder``), every
    ``poll`` seconds while events come and every ``idle_poll`` seconds after a wake-up
    that found none. ``start()`` starts the thread; ``stop()`` writes what is queued and
    joins it (bounded). ``on_closed(record)`` gets each closed cycle on the writer's
    thread; ``on_died()``, when given, is called on the writer's thread if it ends
    without ``stop()`` (a bug: store failures are counted, never end it)."""

    def __init__(self, config: RecorderConfig, directory: Path, metrics: Any, *,
                 on_closed: Callable[[dict[str, Any]], None] | None = None, poll: float = 0.2,
                 idle_poll: float = 1.0, reopen_every: float = 30.0,
                 on_died: Callable[[], None] | None = None, errors: ErrorLog | None = None) -> None:
        self.config = config
        self.directory = directory
        self.errors = errors or ErrorLog(metrics)  # shared with the exporter when there is one
        self.on_closed = on_closed
        self.poll = poll
        self.idle_poll = max(poll, idle_poll)
        self.reopen_every = reopen_every
        self.store = Store(directory, config.max_cycles, int(config.max_mb * 1024 * 1024))
        self._items: collections.deque[tuple[Any, ...]] = collections.deque()
        self._limit = config.queue_limit
        self._open: dict[str, _Open] = {}
        self._late_seq: collections.OrderedDict[str, int] = collections.OrderedDict()  # closed keys -> next seq
        # Cycles whose row is not committed yet: re-sent with every batch until one
        # commits, so a failed batch (full disk) loses its events, never the cycle.
        self._unwritten: dict[str, tuple[str, str, str, float]] = {}
        self._stop = threading.Event()
        self._next_open = 0.0
        self.written = 0  # events committed (tests, status)
        self.closed = 0  # cycles closed
        self.on_died = on_died
        self._thread: threading.Thread | None = None

    @property
    def path(self) -> Path:
        return self.store.path

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tft-recorder", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def put(self, item: tuple[Any, ...]) -> None:
        """Event loop: O(1). Never blocks, never wakes the writer. Only events are
        dropped when the queue is full: a cycle's opening, uuid and close (a few per
        cycle) always pass, so a storm costs detail, never the cycle or its outcome."""
        if len(self._items) >= self._limit and item[0] == "event":
            self.errors("queue_full", f"more than {self._limit} events waiting for the writer")
            return
        self._items.append(item)

    def stop(self, timeout: float = 5.0) -> None:
        """Write what is queued, then stop the thread (bounded wait)."""
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)
        else:
            self._drain()  # never started (tests): still write
            self.store.close()

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        try:
            self._ensure_store()  # at start: a problem shows at once, and a crashed run's open cycle is closed
            wait = self.poll
            while not self._stop.is_set():
                self._stop.wait(wait)
                wait = self.poll if self._items else self.idle_poll
                self._drain_guarded()
            self._drain_guarded()
        except Exception:
            log.exception("flight recorder: the writer thread failed")
        finally:
            self.store.close()
            if not self._stop.is_set() and self.on_died is not None:
                self.on_died()

    def _drain_guarded(self) -> None:
        try:
            self._drain()
        except Exception as error:  # noqa: BLE001 - a bug loses a batch, never the recorder or the bridge
            self.errors("write_failed", f"batch lost: {error!r}")

    def _ensure_store(self) -> bool:
        if self.store.is_open:
            return True
        now = time.monotonic()
        if now < self._next_open:
            return False
        try:
            self.store.open()
        except StoreError as error:
            self._next_open = now + self.reopen_every
            self.errors(error.reason, error.detail)
            return False
        log.info("flight recorder: writing %s", self.store.path)
        return True

    def _drain(self) -> None:
        while self._items:
            batch = []
            while self._items and len(batch) < 2000:
                batch.append(self._items.popleft())
            self._apply(batch)

    def _apply(self, batch: list[tuple[Any, ...]]) -> None:
        events: list[tuple[str, int, float, str, dict[str, Any]]] = []
        updates: list[tuple[str, dict[str, Any]]] = []
        finished: list[dict[str, Any]] = []
        truncated = 0
        for item in batch:
            op, key = item[0], item[1]
            if op == "open":
                _, _, opened_by, started, job = item
                self._open[key] = _Open(key, job, opened_by, started)
                self._unwritten[key] = (key, job, opened_by, started)
            elif op == "event":
                _, _, t, kind, data = item
                cycle = self._open.get(key)
                if cycle is None:  # a late event of a closed cycle
                    if key not in self._late_seq:
                        continue
                    seq = self._late_seq[key]
                    self._late_seq[key] = seq + 1
                    events.append((key, seq, t, kind, data))
                    continue
                if cycle.seq >= self.config.max_events_per_cycle:
                    cycle.dropped += 1
                    truncated += 1
                    continue
                cycle.events.append({"t": t, "kind": kind, **data})
                events.append((key, cycle.seq, t, kind, data))
                cycle.seq += 1
            elif op == "uuid":
                cycle = self._open.get(key)
                if cycle is not None:
                    cycle.uuid = item[2]
                    cycle.uuids.append(item[2])
                    updates.append((key, {"uuid": cycle.uuid, "uuids": list(cycle.uuids)}))
            elif op == "close":
                _, _, ended, outcome, strategy = item
                cycle = self._open.pop(key, None)
                if cycle is None:
                    continue
                if len(self._unwritten) > 64:  # the store is down for long: keep the newest only
                    self._unwritten.pop(next(iter(self._unwritten)))
                outcome_event = {"outcome": outcome, "strategy": strategy}
                events.append((key, cycle.seq, ended, "outcome", outcome_event))
                cycle.events.append({"t": ended, "kind": "outcome", **outcome_event})
                self._late_seq[key] = cycle.seq + 1
                while len(self._late_seq) > 16:
                    self._late_seq.popitem(last=False)
                summary = summarise(cycle.events, cycle.started, ended, cycle.opened_by)
                updates.append((key, {"ended": ended, "outcome": outcome, "strategy": strategy or None,
                                      "summary": summary, "events_dropped": cycle.dropped,
                                      "uuid": cycle.uuid, "uuids": list(cycle.uuids)}))
                finished.append({"key": key, "job": cycle.job, "uuid": cycle.uuid, "uuids": cycle.uuids,
                                 "opened_by": cycle.opened_by, "started": cycle.started, "ended": ended,
                                 "outcome": outcome, "strategy": strategy, "summary": summary,
                                 "events": cycle.events, "events_dropped": cycle.dropped})
        if truncated:
            self.errors("events_truncated", f"a cycle exceeded {self.config.max_events_per_cycle} events",
                        truncated)
        opens = list(self._unwritten.values())
        if self._ensure_store():
            try:
                self.store.write(opens, events, updates)
                self._unwritten.clear()
                self.written += len(events)
                self.store.enforce_bounds()
            except StoreError as error:
                self.errors(error.reason, error.detail)
                if error.reason in ("unwritable", "corrupt"):
                    self.store.close()  # re-opened (and re-checked) later
                    self._next_open = time.monotonic() + self.reopen_every
        for record in finished:
            self.closed += 1
            if self.on_closed is not None:
                try:
                    self.on_closed(record)
                except Exception as error:  # noqa: BLE001
                    self.errors("otel_export", repr(error))


# --------------------------------------------------------------------------- as the daemon runs it

class Recording:
    """The recorder of one running bridge: the loop-side hooks, the writer thread and
    the optional OTLP exporter, started and stopped together by the daemon
    (``from_config``, ``start()``, ``stop()``)."""

    def __init__(self, recorder: NullRecorder, writer: RecorderWriter | None = None, exporter: Any = None) -> None:
        self.recorder = recorder
        self.writer = writer
        self.exporter = exporter

    @classmethod
    def from_config(cls, config: Any, flow: ControllerFlow, metrics: Any, *,
                    on_died: Callable[[], None] | None = None) -> Recording:
        """From a BridgeConfig's [recorder] and [otel] sections; a no-op when disabled.
        Never raises: a recorder that cannot start is counted and the bridge runs on.
        ``on_died``: the writer thread's (``RecorderWriter``)."""
        from bridge.core.recorder_config import state_directory

        settings: RecorderConfig = config.recorder
        if not settings.enabled:
            return cls(NullRecorder())
        errors = ErrorLog(metrics)
        exporter = None
        if config.otel.enabled:
            try:
                from bridge.job.recorder.otel import OtlpExporter  # imported only here: no cost when off

                exporter = OtlpExporter(config.otel, errors)
            except ImportError as error:
                errors("otel_export", f"the otel extra is not installed ({error}); traces are not exported")
        writer = RecorderWriter(settings, state_directory(settings, config.job_id), metrics, errors=errors,
                                on_closed=exporter.submit if exporter is not None else None, on_died=on_died)
        return cls(Recorder(config.job_id, flow, writer), writer, exporter)

    def start(self) -> None:
        """The exporter first: the writer hands it closed cycles."""
        if self.exporter is not None:
            self.exporter.start()
        if self.writer is not None:
            self.writer.start()

    def stop(self, budget: float = 5.0) -> None:
        """Blocking (run it off the loop): write what is queued, export what is closed,
        within ``budget`` seconds in all (the unit's TimeoutStopSec has the drain and the
        controller's destroy to cover too). Traces still queued then are not sent; their
        cycles are in the store."""
        deadline = time.monotonic() + budget
        if self.writer is not None:
            self.writer.stop(budget * 0.6)
        if self.exporter is not None:
            self.exporter.stop(max(0.1, deadline - time.monotonic()))
