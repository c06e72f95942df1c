"""One job's recovery controller inside the simulated ClusterD (ClusterD's EventController).

The real controller is a table-driven state machine whose handlers block on channels; here
each flow (a fault cycle, the OM pause, save-and-exit, kill-master) is one coroutine that
walks the same states in the same order and journals every state it enters with the
event that led there, so ``journal.states(job)`` reads like ClusterD's "action path".

A *generation* is everything ClusterD recreates in ``reset()``: the report slots, the
signal channel, the subscriber, the fault cache and the background tasks. A reset closes
the old generation (blocked reports answer 599, the stream ends with OK, the running
cycle is cancelled) and starts a detached new one. Subscribing is a reset too.

What outlives a reset, because it does on the real server: the fault centre's scheduled
work (:meth:`JobController.schedule_pre_exit`) and the goroutine of a cycle that was
sleeping before its globalFault: a reset does not stop that sleep, so 11.0 s after the
StopComplete the *new* stream receives a globalFault built from the reset state (uuid
"", no ranks). Both are *detached* tasks, sent through whatever generation is current
when they fire, and cancelled only by a server stop.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

import grpc

from bridge._proto import recover_pb2 as pb

from bridge.sim import clusterd_rules as rules
from bridge.sim.clusterd_channels import RECOVER_STATUS, RECOVER_STRATEGY, REPORT_KINDS, STOP_COMPLETE, OmChannels, Outgoing, ReportSlot, Subscriber
from bridge.sim.clusterd_hot_switch import HotSwitch
from bridge.sim.clusterd_platform import JournaledPlatform
from bridge.sim.clusterd_rules import FaultCache, FaultPair
from bridge.sim.clusterd_release import Release
from bridge.sim.clusterd_retry import RetryRecords
from bridge.sim.clusterd_timings import Timings
from bridge.sim.clusterd_messages import faults_detail, make_signal

log = logging.getLogger("bridge.sim.clusterd")


PROCESS_NOT_READY = 404
RECOVERABLE_RETRY_ERROR = 405
CLIENT_ERROR = 499
EXIT_ISOLATE_RANKS = 201
SIGNAL_ENQUEUE_TIMEOUT = 1.0  # ClusterD's signalEnqueue gives up after 1 s (SignalQueueBusy)

_WAIT_STATE = {
    rules.RETRY: "WaitReportStepRetryStatusState",
    rules.RECOVER: "WaitReportProcessRecoverStatusState",
    rules.DUMP: "WaitReportDumpStatusState",
}
_NOTIFY_EVENT = {
    rules.RETRY: "notifyRetryStrategySuccess",
    rules.RECOVER: "notifyRecoverStrategySuccess",
    rules.DUMP: "notifyDumpStrategySuccess",
}


@dataclass(frozen=True)
class JobConfig:
    """What the first successful Init froze: later PodGroup edits are not seen."""

    job_id: str
    strategies: tuple[str, ...]
    devices_per_pod: int
    hot_switch: bool = False  # the PodGroup label subHealthyStrategy is "hotSwitch"
    platform: bool = False  # the PodGroup carried ProcessRecoverStrategy: platform mode


class Host(Protocol):
    """What a controller needs from the server that owns it."""

    timings: Timings
    #: monotonic time until which no keep-alive is written (``SimClusterD.silence_keepalives``)
    keepalives_silent_until: float
    rng: random.Random
    release: Release

    def record(self, kind: str, name: str, job_id: str, code: int | None = None,
               **detail: Any) -> None: ...
    def violation(self, job_id: str, text: str) -> None: ...
    def next_stream_id(self, key: str) -> int: ...
    def annotate(self, job_id: str, key: str, value: str) -> None: ...
    def podgroup(self, job_id: str) -> dict[str, str]: ...
    def set_label(self, job_id: str, key: str, value: str) -> None: ...
    def retry_records_changed(self, job_id: str, faults: list[FaultPair]) -> None: ...


class CycleEnded(Exception):
    """The flow reached a reset; unwind the coroutine without doing anything more."""


class Generation:
    """The channels and caches one ClusterD ``reset()`` creates."""

    def __init__(self) -> None:
        self.slots: dict[str, ReportSlot[Any]] = {kind: ReportSlot(kind) for kind in REPORT_KINDS}
        self.signals: asyncio.Queue[Outgoing] = asyncio.Queue(maxsize=1)
        self.subscriber: Subscriber[Outgoing] | None = None
        self.faults = FaultCache()
        self.tasks: set[asyncio.Task[Any]] = set()
        #: report puts blocked on a full slot: never cancelled by a reset (closing the
        #: slot makes them answer 599), only by a server stop.
        self.puts: set[asyncio.Task[Any]] = set()
        self.cycle: asyncio.Task[Any] | None = None
        self.om = OmChannels()  # the NIC-switch and stress-test channels (clusterd_om.py)

    def close(self, *, cancel_puts: bool = False) -> None:
        for slot in self.slots.values():
            slot.close()
        self.om.close()
        current = asyncio.current_task()
        for task in self.tasks | (self.puts if cancel_puts else set()):
            if task is not current:
                task.cancel()


class JobController:
    """ClusterD's per-job EventController, created by Register."""

    def __init__(self, host: Host, config: JobConfig) -> None:
        self.host = host
        self.config = config
        self.job_id = config.job_id
        self.state = "INIT"
        self.uuid = ""
        self.unhealthy = False
        self.agent_strategies: list[str] = []
        self.results: list[pb.RecoverStatusRequest] = []
        self.gen = Generation()
        self.stopped = False
        #: tasks that outlive a reset (fault centre, a sleeping cycle's globalFault).
        self.detached: set[asyncio.Task[Any]] = set()
        #: loop time at which the running cycle's globalFault is due, while it waits.
        self._global_fault_due: float | None = None
        self._retry_start_pending = False
        #: jobInfo.HotSwitch: from the PodGroup at Init, off after a failed hot switch
        self.hot_switch_enabled = config.hot_switch
        self.hot_switch: HotSwitch | None = None  # the running hot switch
        #: recoverInPlacePodFaults: the pods ReportProcessFault named (recover-in-place on)
        self.soft_fault_pods: dict[str, None] = {}
        self.in_place = False  # restartFaultProcess: this cycle restarts its faulty processes in place
        #: platform mode's PodGroup exchange (clusterd_platform.py), None outside it
        self.platform = JournaledPlatform(host, self.job_id) if config.platform else None
        #: master's fault-centre records of UCE/HCCL reports and its currentFaults
        #: (clusterd_retry.py): they outlive every reset, as on the real server
        self.retry_records = (RetryRecords(host, self.job_id, host.rng.uniform, self.spawn_detached, self._fault_centre_list,
                                           lambda faults: host.retry_records_changed(self.job_id, faults))
                              if host.release.retry_records else None)

    # ------------------------------------------------------------------ lifecycle

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str, *,
              put: bool = False) -> asyncio.Task[Any]:
        """A task owned by the current generation; its failure is logged and journaled."""
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.job_id}:{name}")
        owner = self.gen.puts if put else self.gen.tasks
        owner.add(task)
        task.add_done_callback(lambda t: self._task_done(owner, t))
        return task

    def all_tasks(self) -> set[asyncio.Task[Any]]:
        return self.gen.tasks | self.gen.puts | self.detached

    def spawn_detached(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """A task that survives resets (only :meth:`shutdown` cancels it)."""
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.job_id}:{name}")
        self.detached.add(task)
        task.add_done_callback(lambda t: self._task_done(self.detached, t))
        return task

    def _task_done(self, owner: set[asyncio.Task[Any]], task: asyncio.Task[Any]) -> None:
        owner.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None and not isinstance(error, CycleEnded):
            log.error("sim clusterd task %s failed", task.get_name(), exc_info=error)
            self.host.violation(self.job_id, f"simulator internal error in {task.get_name()}: {error!r}")

    def reset(self, reason: str, *, start_new: bool = True) -> None:
        """ClusterD's ``reset()``: abort everything, drop buffered reports (blocked report
        RPCs answer 599), end the subscriber's stream with OK, clear uuid and caches."""
        old = self.gen
        if old.subscriber is not None:
            old.subscriber.end(grpc.StatusCode.OK, f"reset: {reason}")
        if start_new and self._global_fault_due is not None:
            self._orphan_global_fault(self._global_fault_due)
        self._global_fault_due = None
        self._retry_start_pending = False
        old.close(cancel_puts=not start_new)
        self.state = "INIT"
        self.uuid = ""
        self.unhealthy = False
        self.agent_strategies = []
        self.results = []
        self.hot_switch = None
        self.soft_fault_pods = {}
        self.in_place = False
        if self.platform is not None:
            self.platform.reset()
        self.gen = Generation()
        if start_new:
            self.host.record("state", "INIT", self.job_id, event=reason, uuid="")

    def shutdown(self) -> list[asyncio.Task[Any]]:
        """Server stop: close everything, start nothing; returns the tasks to await."""
        self.stopped = True
        if self.retry_records is not None:
            self.retry_records.close()
        tasks = list(self.all_tasks())
        self.reset("server stopped", start_new=False)
        for task in self.detached:
            task.cancel()
        return tasks

    def subscribe(self) -> Subscriber[Outgoing]:
        """A new subscriber: reset, then attach it and start the keep-alive sender."""
        self.reset("new subscriber")
        sub: Subscriber[Outgoing] = Subscriber(self.host.next_stream_id(self.job_id), self.gen.signals)
        self.gen.subscriber = sub
        self.spawn(self._keepalive(), "keep-alive")
        return sub

    def stream_broken(self, sub: Subscriber[Outgoing], reason: str) -> None:
        """The client cancelled or the connection broke: ClusterD resets mid-cycle."""
        sub.end(grpc.StatusCode.CANCELLED, reason)
        if self.gen.subscriber is sub and not self.stopped:
            self.reset(reason)

    @property
    def live(self) -> bool:
        return self.gen.subscriber is not None and not self.gen.subscriber.ended.done()

    async def _keepalive(self) -> None:
        """Every interval, a keep-alive carrying the uuid of the moment ("" when idle)."""
        signals = self.gen.signals
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.host.timings.keepalive_interval)
            if loop.time() >= self.host.keepalives_silent_until:
                await signals.put(Outgoing(make_signal(self.job_id, self.uuid, "keep-alive")))

    # ------------------------------------------------------------------ reports

    def put_report(self, kind: str, request: Any,
                   on_block: Callable[[], None] | None = None) -> asyncio.Task[bool]:
        """Start putting ``request`` into its slot; the task outlives the calling RPC.
        ``on_block`` runs if the put finds the slot full and has to wait."""
        return self.spawn(self.gen.slots[kind].put(request, on_block), f"put-{kind}", put=True)

    def slot_full(self, kind: str) -> bool:
        return self.gen.slots[kind].full()

    async def _wait_report(self, kind: str) -> Any | None:
        return await self.gen.slots[kind].get(self.host.timings.report_timeout)

    # ------------------------------------------------------------------ faults

    def report_faults(self, pairs: list[FaultPair], source: str) -> str:
        """Faults from ReportProcessFault or the fault centre. Returns what happened:
        ``lost``, ``cached``, ``scheduled`` (a retry cycle starts shortly), ``recorded``
        (master: the fault centre's record starts a cycle at its next publication if it
        is new, clusterd_retry.py), ``started`` or ``joined``."""
        has_normal = any(fault_type == rules.NORMAL for _, fault_type in pairs)
        recorded = False
        if (source == "ReportProcessFault" and self.retry_records is not None and not has_normal
                and rules.RETRY in self.config.strategies):
            # giveSoftFault2FaultCenter: whoever is subscribed, and whatever the state
            recorded = bool(self.retry_records.report(pairs))
        if not self.live:
            if recorded:
                self.host.record("fault-list", "retry-record", self.job_id, **faults_detail(pairs),
                                 reason="no live subscriber: the record starts a cycle only if one subscribes "
                                        "before the fault centre publishes it")
                return "recorded"
            self.host.record("fault-lost", source, self.job_id, **faults_detail(pairs),
                             reason="no live subscriber: ClusterD's event loop cannot notify")
            return "lost"
        self.gen.faults.save(pairs)
        if source == "ReportProcessFault" and rules.RECOVER_IN_PLACE in self.config.strategies:
            self._note_soft_fault_pods(pairs)
        if has_normal:
            self.unhealthy = True
        if source == "ReportProcessFault":
            unknown = [rank for rank, fault_type in pairs if fault_type not in rules.KNOWN_TYPES]
            if unknown:
                # The fault centre does not know the type: it treats the ranks as a
                # hardware fault on known nodes (preExitProcess), whatever the state.
                self.schedule_pre_exit(unknown, self.host.timings.unknown_type_pre_exit_delay,
                                       "unknown fault type in ReportProcessFault")
            if not has_normal:
                if recorded:
                    return "scheduled" if self._idle() else "joined"
                return self._retry_report(any(t in rules.RETRY_TYPES for _, t in pairs))
        if self._idle():
            if self.host.release.slow_fault_centre:
                return self._start_later(self.host.timings.fault_centre_delay, "fault report")
            self._start(self._fault_cycle(), "fault-cycle")
            return "started"
        if self.state == "ScaleRunningState" and has_normal:
            self._start(self._decide("faultOccur"), "scale-in-fault")
            return "started"
        return "joined"

    def _note_soft_fault_pods(self, pairs: list[FaultPair]) -> None:
        """``updateRestartProcessOrPodInfoBySoftFault``: every pod a business report names
        may restart its processes in place; a rank id that is no integer adds none."""
        numbers = [rules.go_atoi(rank) for rank, _ in pairs]
        if any(n is None for n in numbers):
            return
        for number in numbers:
            assert number is not None
            self.soft_fault_pods[str(number // self.config.devices_per_pod)] = None

    def _can_restart_in_place(self) -> bool:
        """``updateRestartFaultProcess``: recover-in-place configured and a business report
        named the faulty pods; not when software faults span more than one pod."""
        return (rules.RECOVER_IN_PLACE in self.config.strategies and len(self.soft_fault_pods) == 1
                and self.host.release.hot_switch_and_in_place)

    def _retry_report(self, has_retry_type: bool) -> str:
        """UCE/HCCL faults reported alone: the fault centre's retry processor turns the
        business report itself into a retry fault and starts a cycle 0.7-1.0 s later, if
        the job configures ``retry``; otherwise nothing follows."""
        if not self._idle():
            return "joined"
        if not has_retry_type or rules.RETRY not in self.config.strategies:
            return "cached"
        if not self._retry_start_pending:
            self._retry_start_pending = True
            low, high = self.host.timings.retry_report_delay
            if self.host.release.slow_fault_centre:
                low = high = self.host.timings.fault_centre_delay
            delay = round(self.host.rng.uniform(low, high), 3)  # the delay the journal shows is the one waited
            self.host.record("fault-centre", "retry-fault", self.job_id, delay=delay,
                             reason="UCE/HCCL report turned into a retry fault")
            self.spawn(self._start_retry_cycle(delay), "retry-fault")
        return "scheduled"

    def _fault_centre_list(self, faults: list[FaultPair], added: list[FaultPair]) -> None:
        """``notifyFaultInfoForJob`` for a published list of business retry records:
        the cache takes the whole list (saveCacheFault), a cycle starts only for a key
        the previous publication did not hold (getAdditionFault)."""
        self.gen.faults.save(faults)
        if not added:
            self.host.record("fault-list", "no-new-faults", self.job_id, **faults_detail(faults),
                             reason="no new faults added, skip additional processing")
            return
        self.host.record("fault-list", "new-faults", self.job_id, **faults_detail(added),
                         reason="new faults detected, enter additional processing")
        if not self.live:
            self.host.record("fault-lost", "fault-centre", self.job_id, **faults_detail(added),
                             reason="no live subscriber: the cycle it starts is aborted by the next Subscribe's reset")
            return
        if self._idle():
            self._start(self._fault_cycle(), "fault-cycle")
        else:
            self.host.record("fault-list", "event-add-fail", self.job_id, state=self.state,
                             reason="event add fail, order mix: the faults stay in this cycle's cache")

    async def _start_retry_cycle(self, delay: float) -> None:
        await self._sleep(delay)
        self._retry_start_pending = False
        if self._idle() and self.gen.faults.retry and self.live:
            self._start(self._fault_cycle(), "fault-cycle")

    def _start_later(self, delay: float, what: str) -> str:
        """v7.0.RC1's fault centre: the cycle starts ``delay`` after the fault arrived."""
        if not self._retry_start_pending:
            self._retry_start_pending = True
            self.host.record("fault-centre", "cycle-delayed", self.job_id, delay=round(delay, 3),
                             reason=f"{self.host.release.version}: the fault centre starts a cycle "
                                    f"this long after the {what}")
            self.spawn(self._start_cycle_later(delay), "fault-centre-delay")
        return "scheduled"

    async def _start_cycle_later(self, delay: float) -> None:
        await self._sleep(delay)
        self._retry_start_pending = False
        if self._idle() and self.gen.faults and self.live:
            self._start(self._fault_cycle(), "fault-cycle")

    def _repeat_retry_later(self) -> None:
        """v7.3.2's fault centre after a retry cycle that succeeded: it still holds the
        retried fault and starts a second cycle for it, 0.7 s (UCE) / 4 s (HCCL) after
        the first ended, once the job has a subscriber again (clusterd_release.py)."""
        pairs = list(self.gen.faults.retry)
        if not self.host.release.repeats_retry_cycle or not pairs:
            return
        timings = self.host.timings
        hccl = any(fault_type == "2" for _, fault_type in pairs)
        delay = timings.retry_repeat_delay_hccl if hccl else timings.retry_repeat_delay_uce
        self.host.record("fault-centre", "retry-repeat", self.job_id, delay=round(delay, 3),
                         **faults_detail(pairs),
                         reason=f"{self.host.release.version}: the fault centre still holds the retried fault")
        self.spawn_detached(self._repeat_retry_cycle(pairs, delay), "retry-repeat")

    async def _repeat_retry_cycle(self, pairs: list[FaultPair], delay: float) -> None:
        await asyncio.sleep(delay)
        deadline = asyncio.get_running_loop().time() + max(1.0, 10 * self.host.timings.keepalive_interval)
        while not (self.live and self._idle()) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        if self.stopped or not (self.live and self._idle()):
            return
        self.gen.faults.save(pairs)
        self._start(self._fault_cycle(), "fault-cycle")

    def _idle(self) -> bool:
        """INIT with no flow started yet: a flow enters its first state only once its
        task runs, and ClusterD's state changes synchronously with the event."""
        cycle = self.gen.cycle
        return self.state == "INIT" and (cycle is None or cycle.done())

    def schedule_pre_exit(self, ranks: Iterable[str], delay: float, why: str) -> None:
        """The fault centre's preExitProcess for ``ranks`` after ``delay``: faultRanks are
        the ranks with type "1", nodeRankIds their pods, a fresh uuid that is not kept,
        no state change. Sent on whatever stream is live then; lost if none is."""
        ranks = list(ranks)
        self.host.record("fault-centre", "pre-exit-scheduled", self.job_id, ranks=ranks,
                         delay=delay, reason=why)
        self.spawn_detached(self._pre_exit_later(ranks, delay), "pre-exit")

    async def _pre_exit_later(self, ranks: list[str], delay: float) -> None:
        await self._sleep(delay)
        pairs = [(rank, rules.NORMAL) for rank in ranks]
        nodes = rules.pod_indices(ranks, self.config.devices_per_pod, self.host.rng)
        signal = make_signal(self.job_id, rules.new_uuid(), "preExitProcess", rules.PRE_EXIT_ACTIONS,
                             pairs, node_rank_ids=nodes)
        await self._send_detached(signal, "preExitProcess")

    def _orphan_global_fault(self, due: float) -> None:
        """A reset hit a cycle sleeping before its globalFault: the real goroutine sleeps
        on and then sends a globalFault built from the reset state to the new stream."""
        self.host.record("fault-centre", "orphaned-global-fault", self.job_id,
                         reason="a reset aborted the cycle during its wait before globalFault")
        self.spawn_detached(self._orphaned_global_fault(due), "orphaned-global-fault")

    async def _orphaned_global_fault(self, due: float) -> None:
        """Built as the real handler builds every type-1 globalFault, from the state as it
        is when the sleep ends: the normal faults widened to whole pods (which also
        rewrites the cache, like ``updateCacheFaultAndPod``). With no cycle running that is
        uuid "" and no ranks (the observed orphan); once a new cycle has cached faults it
        is that cycle's uuid and its faults' whole pods, the same ranks its own
        globalFault will name."""
        await self._sleep(due - asyncio.get_running_loop().time())
        ranks = self._expand()
        nodes = rules.pod_indices(ranks, self.config.devices_per_pod, self.host.rng)
        signal = self._signal("globalFault", rules.GLOBAL_FAULT_ACTIONS, self.gen.faults.normal,
                              node_rank_ids=nodes)
        await self._send_detached(signal, "globalFault")

    async def _send_detached(self, signal: pb.ProcessManageSignal, what: str) -> None:
        if not self.live:
            self.host.record("fault-lost", what, self.job_id,
                             reason="no live subscriber when the fault centre's signal was due")
            return
        try:
            await asyncio.wait_for(self.gen.signals.put(Outgoing(signal)), SIGNAL_ENQUEUE_TIMEOUT)
        except TimeoutError:
            self.host.record("fault-lost", what, self.job_id, reason="signal channel stayed full for 1 s")

    def _start(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        if self.gen.cycle is not None and not self.gen.cycle.done():
            self.gen.cycle.cancel()
        self.gen.cycle = self.spawn(self._guard(coro), name)
        # A reset may cancel the task before it ever runs: close the flow's coroutine then
        # (a no-op once it ran), instead of a "never awaited" warning at collection.
        self.gen.cycle.add_done_callback(lambda _: coro.close())

    async def _guard(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a flow; an unexpected error resets the job like ClusterD's trigger error."""
        try:
            await coro
        except CycleEnded:
            pass
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the real server resets on any handler error
            log.exception("sim clusterd flow failed for %s", self.job_id)
            self.host.violation(self.job_id, f"simulator internal error: {error!r}")
            if self._owns_generation():
                self.reset(f"handler error: {error!r}")

    # ------------------------------------------------------------------ helpers

    def _enter(self, state: str, event: str) -> None:
        """``event``: the real one's name (clusterd pkg/domain/common/event.go), as its
        action path writes it; the differential compares the paths."""
        self.state = state
        self.host.record("state", state, self.job_id, event=event, uuid=self.uuid)

    def _signal(self, signal_type: str, actions: Iterable[str], faults: Iterable[FaultPair] = (),
                **fields: Any) -> pb.ProcessManageSignal:
        return make_signal(self.job_id, self.uuid, signal_type, actions, faults, **fields)

    async def _notify(self, signal: pb.ProcessManageSignal) -> None:
        """``signalEnqueue`` then wait for the sender: ClusterD only moves on after
        ``Send`` returned. A channel still full after 1 s is SignalQueueBusy: reset."""
        gen = self.gen
        item = Outgoing(signal, asyncio.get_running_loop().create_future())
        try:
            await asyncio.wait_for(gen.signals.put(item), SIGNAL_ENQUEUE_TIMEOUT)
        except TimeoutError:
            self._finish_now("SignalQueueBusy: the signal channel stayed full for 1 s")
        assert item.sent is not None
        try:
            await asyncio.wait_for(item.sent, self.host.timings.report_timeout)
        except (TimeoutError, ConnectionError):
            self._finish_now("notifyFail: the stream never took the signal")

    def _owns_generation(self) -> bool:
        return asyncio.current_task() in self.gen.tasks

    def _finish_now(self, reason: str) -> NoReturn:
        """Reset (unless a reset already replaced this flow's generation) and unwind."""
        if self._owns_generation():
            self.reset(reason)
        raise CycleEnded(reason)

    async def _sleep(self, seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds)

    def _annotate(self, value: str) -> None:
        self.host.annotate(self.job_id, "ProcessRecoverStatus", value)

    def _expand(self) -> list[str]:
        """``updateCacheFaultAndPod``: widen the normal faults to whole pods (a non-integer
        rank id empties the list, as in ClusterD)."""
        ranks, _ = self.gen.faults.expand_normal(self.config.devices_per_pod)
        return ranks

    def _rank0_pod_faulty(self) -> bool:
        numbers = (rules.go_atoi(rank) for rank, _ in self.gen.faults.normal)
        return any(n is not None and n // self.config.devices_per_pod == 0 for n in numbers)

    # ------------------------------------------------------------------ the fault cycle

    async def _fault_cycle(self) -> None:
        self._enter("NotifyWaitFaultFlushingState", "faultOccur")
        if self.platform is not None and await self.platform.wait_strategy() is None:
            await self._fault_retry("waitPlatStrategyTimeout")
        if self._only_dump_first():
            self.agent_strategies.append(rules.DUMP)
            await self._dump_for_fault("dumpForFault")
            return
        await self.stop_train_cycle("notifyFinish")

    async def stop_train_cycle(self, event: str) -> None:
        """``handleNotifyStopTrain`` and the fault cycle after it (also the OM flows'
        failure path, clusterd_om.py)."""
        self._enter("NotifyStopTrainState", event)
        self.uuid = rules.new_uuid()
        await self._notify(self._signal("stopTrain", rules.STOP_TRAIN_ACTIONS,
                                        self.gen.faults.stop_train_faults()))
        self._enter("WaitReportStopCompleteState", "notifySuccess")
        request = await self._wait_report(STOP_COMPLETE)
        if request is None:
            await self._fault_clear("reportTimeout")
        if request.status.code == PROCESS_NOT_READY:
            await self._kill_job("processNotReady")
        await self._recover("receiveReport")

    def _only_dump_first(self) -> bool:
        """``shouldDumpWhenOccurFault``: dump is the job's top strategy and a normal fault
        made the job unhealthy: ClusterD skips stopTrain and sends saveAndExit."""
        strategies = self.config.strategies
        if self.platform is not None:  # onlySupportDumpStrategy: the platform chose dump
            return self.platform.strategy == rules.DUMP and rules.DUMP in strategies and self.unhealthy
        return bool(strategies) and strategies[0] == rules.DUMP and self.unhealthy

    def _strategies(self) -> tuple[str, ...]:
        """The job's strategies as ClusterD's ``support*Strategy`` checks see them: in
        platform mode, retry/recover/dump only if the platform chose that one."""
        if self.platform is None:
            return self.config.strategies
        return self.platform.job_strategies(self.config.strategies)

    async def _recover(self, event: str) -> None:
        """From WaitFaultFlushFinished to the end; loops back after a 405 retry failure."""
        while True:
            self._enter("WaitFaultFlushFinishedState", event)
            faults = self.gen.faults
            had_hccl = "2" in faults.all_types()
            faults.take_retry_to_normal(
                last_result_was_retry=bool(self.results) and self.results[-1].strategy == rules.RETRY,
                retry_supported=rules.RETRY in self._strategies(),
            )
            pure_retry = bool(faults.retry) and not faults.normal
            timings = self.host.timings
            # A pure retry cycle has no flush and no sleep (globalFault < 20 ms after the
            # StopComplete); a type-1 fault makes it 1.0 s flush + 10.0 s.
            wait = 0.0 if pure_retry else timings.flush_delay + timings.global_fault_delay
            self._global_fault_due = asyncio.get_running_loop().time() + wait
            if not pure_retry:
                await self._sleep(timings.flush_delay)
            self._enter("NotifyGlobalFaultState", "flushFinished")
            if not pure_retry:
                await self._sleep(timings.global_fault_delay)
                self.in_place = self._can_restart_in_place()
                if self.in_place:  # waitNormalFaultRecovery: one check period, then the fault is gone
                    self._global_fault_due = asyncio.get_running_loop().time() + timings.in_place_check_delay
                    await self._sleep(timings.in_place_check_delay)
            self._global_fault_due = None
            await self._notify_global_fault(pure_retry, had_hccl)
            self._enter("WaitReportRecoverStrategyState", "notifySuccess")
            request = await self._wait_report(RECOVER_STRATEGY)
            if request is None:
                await self._fault_clear("reportTimeout")
            self.agent_strategies = list(request.strategies)
            await self._decide("receiveReport")
            event = "recoverableRetryError"

    async def _notify_global_fault(self, pure_retry: bool, had_hccl: bool) -> None:
        """timeout 33 only for a pure retry cycle with an HCCL fault: an HCCL fault merged
        into a type-1 cycle gets 0 on the real server."""
        if self.platform is not None:
            pure_retry = await self._platform_confirm(pure_retry)
        timeout = rules.HCCL_GLOBAL_FAULT_TIMEOUT if had_hccl and pure_retry else 0
        if pure_retry:
            signal = self._signal("globalFault", rules.GLOBAL_FAULT_RETRY_ACTIONS,
                                  self.gen.faults.retry, timeout=timeout)
        elif self.in_place:
            # Not widened to whole pods; no pod is to exit (restartPodPods is empty).
            self.gen.faults.keep_normal_in_place()
            signal = self._signal("globalFault", rules.GLOBAL_FAULT_ACTIONS, self.gen.faults.normal, timeout=timeout)
        else:
            ranks = self._expand()
            nodes = rules.pod_indices(ranks, self.config.devices_per_pod, self.host.rng)
            signal = self._signal("globalFault", rules.GLOBAL_FAULT_ACTIONS,
                                  self.gen.faults.normal, timeout=timeout, node_rank_ids=nodes)
        await self._notify(signal)

    async def _platform_confirm(self, pure_retry: bool) -> bool:
        """Platform mode before the globalFault: the confirm exchange (clusterd_platform.py;
        a failure is 509 and FaultRetry). A type-1 cycle goes on with the merged faults
        (``setCacheFault(nil, merged)``); a retry cycle whose merge stayed retry-only keeps
        its retry faults; one the platform added a type-1 fault to drops its retry faults
        and has no normal ones, so its globalFault names no rank and no pod
        (``notifyFaultForRetryFaultCasePlatFormMode``: read from the code, not observed).
        Returns whether the cycle is still a pure retry."""
        assert self.platform is not None
        faults = self.gen.faults
        merged = await self.platform.confirm(faults.retry if pure_retry else faults.normal)
        if merged is None:
            await self._fault_retry("writeConfirmFaultOrWaitResultFaultTimeout")
        if not pure_retry:
            faults.normal, faults.retry = merged, []
            return False
        if all(fault_type != rules.NORMAL for _, fault_type in merged):
            return True
        faults.retry = []
        return False

    async def _platform_rank_table(self, strategy: str) -> str:
        """Platform mode, a recover chosen: ``WaitRankTableReady``; if it fails, the
        platform's strategy is read again (not usable: a handler error, the job resets)
        and the choice falls to dump or exit (``chooseForRecoverFail``)."""
        assert self.platform is not None
        if strategy != rules.RECOVER or await self.platform.rank_table_ready():
            return strategy
        if self.platform.reread_strategy() is None:
            self._finish_now("handler error: flush platform strategy failed")
        return rules.choose_after_recover_failure(self._strategies(), self.agent_strategies)

    def _choose(self) -> str:
        job, agent = self._strategies(), self.agent_strategies
        if not self.results:
            strategy = rules.choose_first(job, agent, bool(self.gen.faults.normal),
                                          self._rank0_pod_faulty(), self.in_place)
            if strategy == rules.RETRY and rules.RETRY not in agent:
                # "uce repair not enabled by controller": the retry faults become normal.
                self.gen.faults.retry_to_normal()
                self._expand()
                return rules.choose_after_recover_failure(job, agent)
            return strategy
        last = self.results[-1].strategy
        if last == rules.RETRY:
            return rules.choose_after_retry_failure(job, agent, self._rank0_pod_faulty(), self.in_place)
        if last in (rules.RECOVER, rules.DOWNGRADE):
            return rules.choose_after_recover_failure(job, agent)
        return rules.EXIT

    async def _decide(self, event: str) -> None:
        """NotifyDecidedStrategy and what follows. Returns only after a 405 retry failure
        (the caller goes back to the flush); every other ending raises CycleEnded."""
        while True:
            self._enter("NotifyDecidedStrategyState", event)
            strategy = self._choose()
            if self.platform is not None:
                strategy = await self._platform_rank_table(strategy)
            extra = rules.DOWNGRADE_EXTRA_PARAMS if strategy == rules.DOWNGRADE else ""
            if strategy == rules.RETRY and rules.HCCL in self.gen.faults.all_types():
                # HCCL: the real server lets the network converge first (UCE: at once).
                await self._sleep(self.host.timings.hccl_retry_pause)
            if strategy == rules.RECOVER_IN_PLACE:
                strategy = await self._notify_recover_in_place()
            else:
                actions = rules.CHANGE_STRATEGY_ACTIONS
                if self.in_place and strategy != rules.RETRY:
                    # handleRestartFaultProcess, any other choice: no longer in place;
                    # the faults widen to whole pods and those pods' nodes exit.
                    self.in_place = False
                    self._expand()
                    actions = rules.IN_PLACE_EXIT_ACTIONS
                await self._notify(self._signal(
                    "changeStrategy", actions, self.gen.faults.retry + self.gen.faults.normal,
                    change_strategy=strategy, extra_params=extra, node_rank_ids=self._fault_pods(),
                ))
            if strategy == rules.EXIT:
                self._enter("CheckRecoverResultState", "notifyExitStrategySuccess")
                await self._exit_tail(rules.EXIT)
            if strategy == rules.DOWNGRADE:
                event = await self._downgrade()
                continue
            self._enter(_WAIT_STATE[strategy], _NOTIFY_EVENT[strategy])
            request = await self._wait_report(RECOVER_STATUS)
            if request is None:
                if strategy == rules.RETRY:
                    await self._fault_retry("reportTimeout")
                await self._fault_clear("reportTimeout")
            event = await self._check_result(request, strategy)
            if event == "recoverableRetryError":
                return

    async def _notify_recover_in_place(self) -> str:
        """handleRestartFaultProcess for recover-in-place: the controller gets ``recover``
        (extraParams ``recover-in-place``), the pods named by business reports restart
        just the fault ranks (``fault_nodes_restart``); the faults stay unwidened. What
        ClusterD then waits for is a recover's result."""
        pods = list(self.soft_fault_pods)
        self.host.rng.shuffle(pods)  # a Go map
        await self._notify(self._signal(
            "changeStrategy", rules.IN_PLACE_CHANGE_ACTIONS, self.gen.faults.normal,
            change_strategy=rules.RECOVER, extra_params=rules.RECOVER_IN_PLACE, node_rank_ids=pods,
        ))
        return rules.RECOVER

    def _record_result(self, request: pb.RecoverStatusRequest, expected: str) -> None:
        self.results.append(request)
        if request.strategy != expected:
            self.host.violation(
                self.job_id,
                f"ReportRecoverStatus strategy={request.strategy!r} consumed while ClusterD waited "
                f"for the {expected!r} result (stale or wrong report); ClusterD judges it by "
                "the reported strategy",
            )

    async def _check_result(self, request: pb.RecoverStatusRequest, expected: str) -> str:
        """CheckRecoverResultState, judged by the strategy the *client* reported, as
        ClusterD does. Returns the event for the next NotifyDecidedStrategy round."""
        self._record_result(request, expected)
        self._enter("CheckRecoverResultState", "receiveReport")
        reported, code = request.strategy, request.status.code
        if reported == rules.RETRY:
            if code == 0:
                self._annotate("retry-success")
                self._repeat_retry_later()
                self._finish_now("recoverSuccess")
            self._annotate("retry-failed")
            if code == RECOVERABLE_RETRY_ERROR:
                return "recoverableRetryError"
            self.agent_strategies = [s for s in self.agent_strategies if s != rules.RECOVER]
            if code == CLIENT_ERROR:
                self.agent_strategies = [s for s in self.agent_strategies if s != rules.DUMP]
            self._enter("KillPodForUnrecoverableRetryState", "unRecoverableRetryError")
            self.gen.faults.retry_to_normal()
            self._expand()
            return "finishKillPod"
        if reported == rules.RECOVER:
            if code == 0:
                self._annotate("recover-success")
                self._finish_now("recoverSuccess")
            self._annotate("recover-failed")
            return "recoverFail"
        if reported == rules.DUMP:
            self._annotate("dump-success" if code == 0 else "dump-failed")
            await self._exit_tail(rules.DUMP)
        if reported == rules.EXIT:
            await self._exit_tail(rules.EXIT)
        self.host.violation(self.job_id, f"ReportRecoverStatus strategy={reported!r} is no strategy: "
                                          "ClusterD fails the handler and resets")
        self._finish_now(f"unexpected strategy {reported!r}")

    async def _downgrade(self) -> str:
        """DP scale-in: wait for the isolated ranks (201), send faultNodesExit, wait for
        the result. Success parks the job in ScaleRunningState; failure returns the event
        that makes the next choice dump or exit."""
        self._enter("WaitReportScaleInIsolateRanksState", "notifyScaleInStrategySuccessEvent")
        request = await self._wait_report(RECOVER_STATUS)
        if request is None:
            self.results.append(pb.RecoverStatusRequest(strategy=rules.DOWNGRADE,
                                                        status=pb.Status(code=CLIENT_ERROR)))
            return "reportTimeout"
        self._record_result(request, rules.DOWNGRADE)
        self._enter("CheckReportScaleInIsolateRanksState", "receiveReport")
        # v7.0.RC1 has no isolateRankIds: the client's value is a field it never reads
        isolate = list(request.isolateRankIds) if self.host.release.isolate_rank_ids else []
        if request.status.code != EXIT_ISOLATE_RANKS or not isolate:
            return "notifyFail"
        nodes = rules.pod_indices(isolate, self.config.devices_per_pod, self.host.rng)
        await self._notify(self._signal("faultNodesExit", rules.FAULT_NODES_EXIT_ACTIONS,
                                        [(rank, rules.NORMAL) for rank in isolate],
                                        node_rank_ids=nodes))
        self._enter("WaitReportScaleInStatusState", "notifyFaultNodesExitSuccessEvent")
        request = await self._wait_report(RECOVER_STATUS)
        if request is None:
            await self._fault_clear("reportTimeout")
        self._record_result(request, rules.DOWNGRADE)
        self._enter("CheckRecoverResultState", "receiveReport")
        if request.status.code == 0:
            self._enter("ScaleRunningState", "scaleInSuccessEvent")
            raise CycleEnded("scaled in")
        return "recoverFail"

    async def _exit_tail(self, strategy: str) -> NoReturn:
        """After dump or exit: the "exit now" notice(s), then FaultRetry and reset.
        ``exit-completed`` is never written (verified on the real server)."""
        timings = self.host.timings
        self._enter("ListenScheduleResultState", "checkFinish")
        if strategy != rules.EXIT:  # at once after the dump's result (docs/clusterd.md)
            await self._notify(self._dump_exit_signal())
        # Platform mode skips the schedule checks and the restart wait ("plat not
        # support pod rescheduling").
        platform = self.platform is not None
        await self._sleep(0.0 if platform else min(timings.schedule_check, timings.dump_exit_repeat))
        self._enter("NotifyRestartAllProcessState", "scheduleSuccess")
        self._enter("WaitRestartAllProcessState", "notifySuccess")
        await self._sleep(0.0 if platform else max(0.0, timings.dump_exit_repeat - timings.schedule_check))
        self._enter("FaultClearState", "restartFinish")
        await self._fault_retry("clearSuccess")

    def _dump_exit_signal(self) -> pb.ProcessManageSignal:
        return self._signal("changeStrategy", rules.CHANGE_STRATEGY_ACTIONS,
                            change_strategy=rules.EXIT, extra_params=rules.DUMP_EXIT,
                            node_rank_ids=self._fault_pods())

    def _fault_pods(self) -> list[str]:
        """Every real changeStrategy lists the pods of the cycle's fault ranks (random
        order: a Go map); [] only when no rank id parses."""
        ranks = [rank for rank, _ in self.gen.faults.retry + self.gen.faults.normal]
        return rules.pod_indices(ranks, self.config.devices_per_pod, self.host.rng)

    async def _fault_clear(self, event: str) -> NoReturn:
        self._enter("FaultClearState", event)
        await self._fault_retry("clearSuccess")

    async def _fault_retry(self, event: str) -> NoReturn:
        """FaultRetry: label pause, dump_exit (master only: clusterd_release.py), (the job
        is running again), label on, reset."""
        self._enter("FaultRetryState", event)
        self.host.set_label(self.job_id, "process-recover-enable", "pause")
        if self.host.release.fault_retry_dump_exit:
            await self._notify(self._dump_exit_signal())
        # Waits for the job to run again (27 polls of 5 s at most): the stream ends
        # with OK 5.0 s after this dump_exit on the real server.
        await self._sleep(self.host.timings.job_running_wait)
        self.host.set_label(self.job_id, "process-recover-enable", "on")
        self._finish_now("finish")

    async def _kill_job(self, event: str) -> NoReturn:
        self._enter("NotifyKillJobState", event)
        await self._notify(self._signal("killMaster", ()))
        self._finish_now("finish")

    async def _dump_for_fault(self, event: str) -> None:
        """NotifyDumpState: saveAndExit (no new uuid: only stopTrain and pause make one),
        then the dump result and the dump_exit tail."""
        self._enter("NotifyDumpState", event)
        ranks = self._expand()
        nodes = rules.pod_indices(ranks, self.config.devices_per_pod, self.host.rng)
        await self._notify(self._signal("saveAndExit", rules.SAVE_AND_EXIT_ACTIONS,
                                        node_rank_ids=nodes))
        self._enter("WaitReportDumpStatusState", "notifySuccess")
        request = await self._wait_report(RECOVER_STATUS)
        if request is None:
            await self._fault_clear("reportTimeout")
        await self._check_result(request, rules.DUMP)

    # ------------------------------------------------------------------ operator flows

    def require_idle(self, what: str) -> None:
        if not self.live:
            raise RuntimeError(f"{what}: job {self.job_id} has no live subscriber")
        if self.state != "INIT":
            raise RuntimeError(f"{what}: job {self.job_id} is in {self.state}, not INIT")

    def start_pause(self, timeout: int) -> None:
        self.require_idle("pause")
        self._start(self._pause(timeout), "pause")

    async def _pause(self, timeout: int) -> None:
        """The OM pause (NIC switch / stress test) as seen on the Recover stream."""
        self._enter("NotifyPauseTrainState", "startSwitchNic")
        self.uuid = rules.new_uuid()
        await self._notify(self._signal("stopTrain", rules.PAUSE_TRAIN_ACTIONS, timeout=timeout))
        self._enter("WaitReportPauseCompleteState", "notifySuccess")
        request = await self._wait_report(STOP_COMPLETE)
        if request is None:
            await self._kill_job("reportTimeout")
        if request.status.code == CLIENT_ERROR:
            await self._kill_job("processPauseFail")
        self._enter("NotifyContinueTrainState", "receiveReport")
        await self._notify(self._signal("changeStrategy", rules.CHANGE_STRATEGY_ACTIONS,
                                        change_strategy=rules.CONTINUE))
        self._enter("WaitContinueTrainState", "notifyContinueSuccessEvent")
        request = await self._wait_report(RECOVER_STATUS)
        if request is None:
            await self._kill_job("reportTimeout")
        if request.status.code == CLIENT_ERROR:
            await self._kill_job("continueTrainFail")
        self._finish_now("switchNicRecvContinue")

    def start_hot_switch(self, rank: str) -> str:
        """A sub-healthy fault on ``rank``'s pod (``notifyFaultInfoForJob``): a hot switch
        when the job has it on, is idle and the pod is not the master's; else skipped.
        Returns ``started`` or why it was skipped."""
        pod = int(rank) // self.config.devices_per_pod
        if not self.hot_switch_enabled or not self.host.release.hot_switch_and_in_place:
            why = "hot switch off for the job (subHealthyStrategy is not hotSwitch, or one failed)"
        elif not self.live:
            why = "no live subscriber"
        elif self.state != "INIT":
            why = f"the job's state machine is in {self.state}"
        elif pod == 0:
            why = "fault on the master pod"
        else:
            self.hot_switch = HotSwitch(self)
            ranks = [str(pod * self.config.devices_per_pod + i) for i in range(self.config.devices_per_pod)]
            self._start(self.hot_switch.run(ranks), "hot-switch")
            return "started"
        self.host.record("fault-centre", "sub-health-skipped", self.job_id, rank=rank, reason=why)
        return f"skipped: {why}"

    def new_pod_running(self) -> None:
        """The backup pod of the running hot switch reached Running."""
        if self.hot_switch is None:
            raise RuntimeError(f"new_pod_running: job {self.job_id} runs no hot switch")
        self.hot_switch.pod_running()

    def start_save_and_exit(self) -> None:
        self.require_idle("save_and_exit")
        self.unhealthy = True
        self._start(self._dump_for_fault("dumpForFault"), "save-and-exit")

    def start_kill_master(self) -> None:
        if not self.live:
            raise RuntimeError(f"kill_master: job {self.job_id} has no live subscriber")
        self._start(self._kill_job("operator"), "kill-master")

    async def push(self, signal: pb.ProcessManageSignal) -> None:
        """A test's own signal, through the same ordered channel; no state change."""
        if not self.live:
            raise RuntimeError(f"job {self.job_id} has no live subscriber")
        await asyncio.wait_for(self.gen.signals.put(Outgoing(signal)), SIGNAL_ENQUEUE_TIMEOUT)

    def check_fault_pairs(self, pairs: list[FaultPair], method: str) -> None:
        for rank, fault_type in pairs:
            problem = rules.pair_problem(rank, fault_type)
            if problem is not None:
                self.host.violation(
                    self.job_id,
                    f"{method} fault rankId={rank!r} faultType={fault_type!r}: ClusterD accepts it "
                    f"unvalidated, but {problem}",
                )


@dataclass
class SimJob:
    """The job's PodGroup as ClusterD reads it at Init.

    ``strategies``: the recover-strategy annotation (``exit`` is always added; unknown
    names are dropped; ``elastic-training`` enables downgrade). ``process_recover``: the
    label process-recover-enable == "on" (False: Init answers 403). ``pod_group_exists``:
    False makes Init answer 502 and Register 402. ``rank_table_job_id``: the pods'
    ``jobID`` label, the id config.Config uses (defaults to ``job_id``). ``hot_switch``:
    the label subHealthyStrategy == "hotSwitch" (it also lets Init answer 0 without
    process_recover).
    """

    job_id: str
    world_size: int = 8
    devices_per_pod: int = 8
    strategies: tuple[str, ...] = ("retry", "recover", "dump", "exit")
    process_recover: bool = True
    hot_switch: bool = False
    pod_group_exists: bool = True
    rank_table_job_id: str | None = None
    #: the nodes' super pod (device info ``SuperPodID``); < 0: not a super pod, NIC switch refused
    super_pod_id: int = 0
    #: the PodGroup's other annotations when the job is created (the harness's ``-anno``,
    #: ``-platform``, ``-plat-result``): ``ProcessRecoverStrategy`` present turns platform
    #: mode on (clusterd_platform.py); later writes go through ``SimClusterD.platform_annotate``
    annotations: dict[str, str] = field(default_factory=dict)

    @property
    def config_job_id(self) -> str:
        return self.rank_table_job_id or self.job_id
