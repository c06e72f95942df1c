"""The fault centre's business-plane retry records of one job, as ClusterD master keeps them.

A UCE ("0") or HCCL ("2") fault in ReportProcessFault starts no cycle by itself: ClusterD
hands it to its fault centre, which turns it into a record and publishes the job's fault
list every tick; the Recover service starts a cycle for a fault only when the published
list holds a (rank, type) it did not hold at the previous publication. Read from
``component/clusterd`` (docs/clusterd.md section 7, "The fault centre's retry records"):

* ``ReportProcessFault`` -> ``giveSoftFault2FaultCenter`` -> ``ReportRetryInfo``: the
  record of the rank's NPU, keyed by device, its ``RecoverTime`` the report's time; a
  later report of the same device replaces it (a fresh ``RecoverTime``). Written whether
  or not anybody is subscribed, and never touched by the Recover service's ``reset``.
* ``jobRankFaultInfoProcessor.retryInBusinessPlane`` / ``ValidBusinessRecoverTime``: the
  job's fault list holds ``{rank, 80E01801 (HCCL: its code), RestartBusiness,
  DoStepRetry}`` while ``now - RecoverTime <= JobReportInfoExpiredTimeout`` (10 s);
  ``faultProcessCenter.Work`` runs and publishes every second.
* ``FaultRecoverService.notifyFaultInfoForJob``: ``getAdditionFault`` replaces the job's
  ``currentFaults`` with the published keys and returns those not held before;
  ``saveCacheFault`` adds the whole list to the controller's cache; no added key ->
  ``no new faults added, skip additional processing``; otherwise ``FaultOccurEvent``
  (a cycle when the controller is idle, else ``event add fail, order mix``). Only
  ``DeleteJob`` forgets ``currentFaults``.

So a rank reported again while its record is still published is never new: its second
report refreshes the record and is skipped, and the rank counts as new again only at the
first publication after its record expired (10 s after its last report, plus up to one
tick). Times are the simulator's :class:`~.clusterd_timings.Timings`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Protocol

from bridge.sim import clusterd_rules as rules
from bridge.sim.clusterd_rules import FaultPair
from bridge.sim.clusterd_timings import Timings

#: the job's fault list names a business-reported retry fault with these (ClusterD's constants)
UCE_CODE, HCCL_RETRY_CODE, RESTART_BUSINESS = "80E01801", "8C1F860B", "RestartBusiness"


class RecordsHost(Protocol):
    """What the records need from the server: its clock table, RNG and journal."""

    timings: Timings

    def record(self, kind: str, name: str, job_id: str, code: int | None = None, **detail: Any) -> None: ...


class RetryRecords:
    """One job's records and its ``currentFaults``; owned by the job's controller, on the
    server's event loop. ``on_publish(faults, added)`` is the Recover service's
    ``notifyFaultInfoForJob`` (called only with a non-empty list); ``on_change(faults)``
    tells the Fault service which (rank, type) records it publishes."""

    def __init__(self, host: RecordsHost, job_id: str, uniform: Callable[[float, float], float],
                 spawn: Callable[[Coroutine[Any, Any, None], str], "asyncio.Task[Any]"],
                 on_publish: Callable[[list[FaultPair], list[FaultPair]], None],
                 on_change: Callable[[list[FaultPair]], None]) -> None:
        self.host = host
        self.job_id = job_id
        self._uniform = uniform
        self._spawn = spawn  # a task that outlives resets, its failure logged (the controller's)
        self._on_publish = on_publish
        self._on_change = on_change
        self.records: dict[str, tuple[str, float]] = {}  # rank -> (type, RecoverTime as loop time)
        self.current: frozenset[FaultPair] = frozenset()  # s.currentFaults[jobId]
        self._published: tuple[FaultPair, ...] = ()
        self._wake = asyncio.Event()
        self._next_at: float | None = None  # loop time of the next publication
        self._task: asyncio.Task[None] | None = None

    def report(self, pairs: Iterable[FaultPair]) -> list[FaultPair]:
        """``ReportRetryInfo`` for each UCE/HCCL entry; returns the entries recorded."""
        now = asyncio.get_running_loop().time()
        recorded = [(rank, kind) for rank, kind in pairs if kind in rules.RETRY_TYPES]
        for rank, kind in recorded:
            self.records[rank] = (kind, now)
        if recorded:
            if self._next_at is None:  # idle centre: the next tick, as observed 0.7-1.0 s after the report
                low, high = self.host.timings.retry_report_delay
                delay = round(self._uniform(low, high), 3)  # the delay the journal shows is the one waited
                self.host.record("fault-centre", "retry-fault", self.job_id, delay=delay,
                                 reason="UCE/HCCL report turned into a retry record, published at the next tick")
                # counted from the journal entry (its clock is the loop's): a reader never sees it shorter
                self._next_at = asyncio.get_running_loop().time() + delay
                self._wake.set()
            if self._task is None or self._task.done():
                self._task = self._spawn(self._run(), "fault-centre")
        return recorded

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._next_at is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            await asyncio.sleep(max(0.0, self._next_at - loop.time()))
            self.publish()
            busy = bool(self.records) or bool(self.current)
            self._next_at = loop.time() + self.host.timings.fault_centre_period if busy else None

    def publish(self) -> None:
        """One tick: expire records, then ``getAdditionFault`` and ``notifyFaultInfoForJob``."""
        now = asyncio.get_running_loop().time()
        hold = self.host.timings.retry_record_hold
        for rank in [rank for rank, (_, at) in self.records.items() if now - at > hold]:
            kind, _ = self.records.pop(rank)
            self.host.record("fault-list", "retry-record-expired", self.job_id, rank=rank, faultType=kind)
        faults = sorted(((rank, kind) for rank, (kind, _) in self.records.items()), key=lambda p: int(p[0]))
        keys = frozenset(faults)
        added = [pair for pair in faults if pair not in self.current]
        self.current = keys
        if tuple(faults) != self._published:
            self._published = tuple(faults)
            self._on_change(list(faults))
        if faults:
            self._on_publish(faults, added)

    def close(self) -> None:
        """A server stop: the centre's memory goes with it."""
        if self._task is not None:
            self._task.cancel()
        self.records.clear()
        self.current = frozenset()


def record_code(fault_type: str) -> str:
    """``GetRetryCodeByFaultType``: the code the job's fault list carries for a record."""
    return UCE_CODE if fault_type == rules.UCE else HCCL_RETRY_CODE
