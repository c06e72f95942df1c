"""Return codes of the ClusterD recovery protocol: ``Code``, with ``Code.meaning`` for logs.

The seed's table plus 201 (a downgrade's result). The bridge sends 201, 404, 405, 406 and
499 inside its reports; ClusterD answers only 0, 400, 402, 403, 408, 500, 502 and 599
(docs/clusterd.md section 3).
"""

from __future__ import annotations

import enum


class Code(enum.IntEnum):
    meaning: str

    def __new__(cls, value: int, meaning: str) -> "Code":
        member = int.__new__(cls, value)
        member._value_ = value
        member.meaning = meaning
        return member

    OK = (0, "the call succeeded (for a report: queued, not necessarily accepted in this phase)")
    ExitIsolateRanks = (201, "client: downgrade chose to isolate ranks (isolateRankIds follow)")
    UnRegistry = (400, "the job id is not registered with ClusterD")
    OrderMix = (401, "request out of state-machine order (only ever logged by the server)")
    JobNotExist = (402, "the job id does not exist")
    ProcessRescheduleOff = (403, "process-level recovery is switched off for this job")
    ProcessNotReady = (404, "client: training processes are not up (stop-complete)")
    RecoverableRetryError = (405, "client: retry failed, recover still allowed")
    UnRecoverableRetryError = (406, "client: recovery failed, dump or exit allowed")
    DumpError = (407, "saving the dying-gasp checkpoint failed")
    UnInit = (408, "Init has not been called for this job")
    ClientError = (499, "client: recovery failed, exit only")
    OutOfMaxServeJobs = (500, "ClusterD already serves its maximum number of jobs")
    OperateConfigMapError = (501, "ClusterD failed to operate a ConfigMap")
    OperatePodGroupError = (502, "ClusterD failed to read or patch the job's PodGroup")
    ScheduleTimeout = (503, "pod scheduling timed out")
    SignalQueueBusy = (504, "the control-signal queue was busy")
    EventQueueBusy = (505, "the state-machine event queue was busy")
    ControllerEventCancel = (506, "the state machine has exited")
    WaitReportTimeout = (507, "timed out waiting for a client report")
    WaitPlatStrategyTimeout = (508, "timed out waiting for the AI platform's recovery strategy")
    WriteConfirmFaultOrWaitPlatResultFault = (509, "AI platform fault annotations were wrong or late")
    ServerInnerError = (599, "ClusterD internal error (e.g. the job's state machine was reset)")

    @classmethod
    def describe(cls, value: int) -> str:
        """``"403 ProcessRescheduleOff: ..."`` for known codes, ``"777 (unknown code)"`` otherwise."""
        try:
            code = cls(value)
        except ValueError:
            return f"{value} (unknown code)"
        return f"{int(code)} {code.name}: {code.meaning}"


#: Codes the bridge (or a seed-API caller) puts into the status of its own reports.
CLIENT_CODES: frozenset[Code] = frozenset(
    {Code.OK, Code.ExitIsolateRanks, Code.ProcessNotReady, Code.RecoverableRetryError,
     Code.UnRecoverableRetryError, Code.ClientError}
)

#: Codes the live ClusterD returns in ``Status.code`` of its replies.
SERVER_CODES: frozenset[Code] = frozenset(
    {Code.OK, Code.UnRegistry, Code.JobNotExist, Code.ProcessRescheduleOff, Code.UnInit,
     Code.OutOfMaxServeJobs, Code.OperatePodGroupError, Code.ServerInnerError}
)
