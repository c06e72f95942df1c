"""Every delay of the simulated ClusterD in one table, defaulting to the real server's.

Why one table: a client tuned against a simulation that answers faster than the real
server is too tight in production, so the defaults are the delays measured on the real
ClusterD (docs/clusterd.md, "Cycle phases and timings"). Tests that want speed pass a
faster table explicitly, usually :meth:`Timings.scaled`, which keeps every ratio and
therefore every ordering the real server has (a test can then assert the ordering on a
scaled clock and the absolute values on :data:`REAL`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class Timings:
    """Seconds. Each field names the real behaviour it reproduces."""

    #: keep-alive cadence on the signal stream (grpc_init.go keepAliveInterval).
    keepalive_interval: float = 5.0
    #: ReportProcessFault with only UCE ("0") / HCCL ("2") faults: the fault centre turns
    #: the report into a retry fault and stopTrain follows this long after it (observed
    #: 0.70-1.00 s; drawn uniformly from the range with the simulator's seeded RNG).
    retry_report_delay: tuple[float, float] = (0.7, 1.0)
    #: master: how long the fault centre publishes a business-reported UCE/HCCL record
    #: after the last report of that rank (JobReportInfoExpiredTimeout, 10 s; read from
    #: the code, clusterd_retry.py) ...
    retry_record_hold: float = 10.0
    #: ... and its tick: it publishes the job's fault list every second while it holds a
    #: record (faultProcessCenter.Work's ticker).
    fault_centre_period: float = 1.0
    #: v7.3.2 only (clusterd_release.py): after a retry cycle that succeeded, the fault
    #: centre starts a second cycle for the same fault this long after the first ended:
    #: a UCE ("0") ...
    retry_repeat_delay_uce: float = 0.7
    #: ... and an HCCL ("2") fault.
    retry_repeat_delay_hccl: float = 4.0
    #: v7.0.RC1 only: a cycle starts this long after the fault report (master: at once
    #: for a type-1 fault, ``retry_report_delay`` for UCE/HCCL).
    fault_centre_delay: float = 4.0
    #: WaitFaultFlushFinished, only once a type-"1" fault is involved.
    flush_delay: float = 1.0
    #: NotifyGlobalFault's sleep after the flush, only once a type-"1" fault is involved
    #: (flush + this = the observed 11.0 s from ReportStopComplete to globalFault).
    global_fault_delay: float = 10.0
    #: changeStrategy retry comes this long after ReportRecoverStrategy when an HCCL
    #: ("2") fault is in the cycle (a UCE alone: at once).
    hccl_retry_pause: float = 3.0
    #: every "wait for a client report" state (15 min).
    report_timeout: float = 900.0
    #: the second exit/dump_exit comes this long after the first: ``schedule_check`` in
    #: ListenScheduleResultState, the rest in WaitRestartAllProcessState.
    dump_exit_repeat: float = 80.0
    #: ListenScheduleResultState after a dump or exit: four checks 5 s apart whether the
    #: fault pods were rescheduled (handleListenScheduleResult; a running job then counts
    #: as scheduled). A stream that ends meanwhile closes the path in that state.
    schedule_check: float = 20.0
    #: FaultRetry: after its dump_exit the server waits for the job to run again; the
    #: stream then ends with OK this long after that dump_exit.
    job_running_wait: float = 5.0
    #: a device fault with a non-UCE hardware code, no business report: preExitProcess.
    pre_exit_delay: float = 10.85
    #: a device fault with a UCE hardware code, no business report: preExitProcess.
    pre_exit_uce_delay: float = 20.80
    #: ReportProcessFault with an unknown fault type (e.g. "9"): preExitProcess.
    unknown_type_pre_exit_delay: float = 10.95
    #: recover-in-place: waitNormalFaultRecovery checks whether the fault is gone after
    #: one JobFaultCheckPeriod (a business report's fault always is), before globalFault.
    in_place_check_delay: float = 3.0
    #: hot switch: how long ClusterD waits for the backup pod to run before ``stop switch``
    #: (monitorNewPodStatus: one minute, from the code).
    new_pod_timeout: float = 60.0
    #: hot switch: from ClusterD asking for the old pod's deletion to its informer seeing
    #: it gone (the scheduler's work; not measured).
    old_pod_delete_delay: float = 1.0

    #: platform mode: how often ClusterD reads the PodGroup while it waits for the
    #: platform's strategy, result faults or rank table (constant.CheckPeriod, 3 s) ...
    platform_poll: float = 3.0
    #: ... and how long it waits for each before giving up (ProcessControlTimeout, 300 s).
    platform_wait: float = 300.0

    def scaled(self, factor: float, **overrides: object) -> Timings:
        """Every delay times ``factor`` (ratios and orderings kept), then ``overrides``."""
        changes: dict[str, object] = {}
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, tuple):
                changes[item.name] = tuple(v * factor for v in value)
            else:
                changes[item.name] = value * factor
        changes.update(overrides)
        return replace(self, **changes)  # type: ignore[arg-type]


#: The real server's delays (the defaults), for tests that assert the table itself.
REAL = Timings()
#: A hundred times faster, every ratio kept: what the in-process harness
#: (:class:`bridge.sim.scenario.SimulatedJob`) starts from, since its users are tests,
#: benchmarks and the demo, which say so explicitly by using it.
FAST = REAL.scaled(0.01)

__all__ = ["FAST", "REAL", "Timings"]
