"""ClusterD's hot switch for one job, as its hot-switch controller walks it.

From ``hot_switch_controller.go`` and ``getHotSwitchRules`` (rules.go) of
component/clusterd: a sub-healthy fault on a pod of a job whose PodGroup label
``subHealthyStrategy`` is ``hotSwitch`` (``SimJob.hot_switch``) starts it, only while the
job's state machine is idle and never for the master pod (rank 0's). What the client
sees, all with the uuid "" (the flow makes none) and signal type ``hot-switch``:

1. ``hot switch`` with every rank of the sub-healthy pod, type "1"
   (``normalFaultAssociateSameNodeRank``); ClusterD asks the operator for a backup pod.
2. The backup pod Running (``SimClusterD.new_pod_running``) within one minute
   (``timings.new_pod_timeout``): ``new pod running``. Otherwise ``stop switch`` and the
   failure path.
3. ClusterD waits (15 minutes) for the client's ReportRecoverStrategy: ``["exit"]`` alone
   (the controller's pause failed) or an empty list is the failure path; anything else
   is a migration.
4. Migration: ClusterD asks for the old pod's deletion and, once it is gone
   (``timings.old_pod_delete_delay``; the scheduler does it), sends changeStrategy
   ``migration`` (signal type changeStrategy) and waits for the ReportRecoverStatus:
   0 is success, 406 the failure path; any other code leaves the flow where it is
   (the real handler returns no event), until the next reset.
5. Success ends with a reset (the stream ends with OK). The failure path
   (``notifyStopJob``) deletes the job's first pod, so the whole job is rescheduled,
   turns the hot switch off for the job (``cleanStateWhenFailed``) and resets; no
   changeStrategy exit is ever sent, so a controller that offered ``["exit"]`` waits
   out its own timer.

The pods themselves are not simulated: the journal records each Kubernetes operation
(``kube`` entries) instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, NoReturn, Protocol

from bridge._proto import recover_pb2 as pb

from bridge.sim import clusterd_rules as rules
from bridge.sim.clusterd_channels import RECOVER_STATUS, RECOVER_STRATEGY
from bridge.sim.clusterd_rules import FaultPair
from bridge.sim.clusterd_timings import Timings


class SwitchHost(Protocol):
    """What a hot switch reads and records of the simulation (``clusterd_job.Host``)."""

    timings: Timings

    def record(self, kind: str, name: str, job_id: str, code: int | None = None, **detail: Any) -> None: ...


class SwitchController(Protocol):
    """The steps of the job's controller a hot switch drives (``clusterd_job.JobController``)."""

    host: SwitchHost
    job_id: str
    hot_switch_enabled: bool

    def _enter(self, state: str, event: str) -> None: ...

    def _signal(self, signal_type: str, actions: Iterable[str], faults: Iterable[FaultPair] = (),
                **fields: Any) -> pb.ProcessManageSignal: ...

    async def _notify(self, signal: pb.ProcessManageSignal) -> None: ...

    async def _wait_report(self, kind: str) -> Any | None: ...

    async def _sleep(self, seconds: float) -> None: ...

    def _finish_now(self, reason: str) -> NoReturn: ...

HOT_SWITCH_SIGNAL = "hot-switch"
MIGRATION = "migration"
MIGRATION_FAILED = 406  # UnRecoverableRetryError: RestartFaildEvent


class HotSwitch:
    """One hot switch of ``ctl``'s job; ``run`` is the flow, ``pod_running`` step 2's event."""

    def __init__(self, ctl: SwitchController) -> None:
        self.ctl = ctl
        self.new_pod = asyncio.Event()  # the backup pod reached Running

    def pod_running(self) -> None:
        self.new_pod.set()

    async def run(self, pod_ranks: list[str]) -> None:
        ctl = self.ctl
        ctl._enter("NotifyPrepareHotSwitchState", "BeginHotSwitchEvent")
        await ctl._notify(ctl._signal(HOT_SWITCH_SIGNAL, ("hot switch",), [(rank, rules.NORMAL) for rank in pod_ranks]))
        ctl._enter("WaitNewPodState", "notifySuccess")
        ctl.host.record("kube", "create-backup-pod", ctl.job_id, ranks=list(pod_ranks))
        try:
            await asyncio.wait_for(self.new_pod.wait(), ctl.host.timings.new_pod_timeout)
        except TimeoutError:
            ctl._enter("WaitNotifyPodFailedResultState", "NewPodTimeoutEvent")
            await ctl._notify(ctl._signal(HOT_SWITCH_SIGNAL, ("stop switch",)))
            self._failed("notifySuccess")
        ctl._enter("WaitNotifyPodRunningResultState", "NewPodRunningEvent")
        await ctl._notify(ctl._signal(HOT_SWITCH_SIGNAL, ("new pod running",)))
        ctl._enter("WaitReportPauseResultState", "notifySuccess")
        request = await ctl._wait_report(RECOVER_STRATEGY)
        if request is None:
            await self._stop_job("ReportTimeoutEvent")
        strategies = list(request.strategies)
        if not strategies or strategies == [rules.EXIT]:
            await self._stop_job("ExitEvent")
        ctl._enter("WaitOldPodDeletedState", "MigrationEvent")
        ctl.host.record("kube", "delete-old-pod", ctl.job_id)
        await ctl._sleep(ctl.host.timings.old_pod_delete_delay)
        ctl._enter("WaitNotifyRestartTrainResultState", "OldPodDeletedEvent")
        await ctl._notify(ctl._signal("changeStrategy", rules.CHANGE_STRATEGY_ACTIONS, change_strategy=MIGRATION))
        ctl._enter("WaitReportRestartTrainResultState", "notifySuccess")
        request = await ctl._wait_report(RECOVER_STATUS)
        if request is None:
            await self._stop_job("ReportTimeoutEvent")
        code = request.status.code
        if code == 0:
            ctl._enter("InitState", "RestartSuccessEvent")
            ctl._finish_now("hot switch succeeded")
        if code == MIGRATION_FAILED:
            await self._stop_job("RestartFaildEvent")
        # The real handler logs "responce code from mindio is not expected" and returns no
        # event: the flow stays here until something resets the job.
        ctl.host.record("stuck", "WaitReportRestartTrainResultState", ctl.job_id, code=code,
                        reason="a migration result other than 0 or 406 moves ClusterD nowhere")
        await asyncio.Event().wait()

    async def _stop_job(self, event: str) -> NoReturn:
        """notifyStopJob: the job's first pod is deleted (the whole job restarts)."""
        self.ctl._enter("NotifyStopJobState", event)
        self.ctl.host.record("kube", "delete-pod", self.ctl.job_id, pod="0",
                             reason="hot switch failed: the job is rescheduled")
        self._failed("notifySuccess")

    def _failed(self, event: str) -> NoReturn:
        """cleanStateWhenFailed: the job's hot switch is off from now on, then reset."""
        self.ctl.hot_switch_enabled = False
        self.ctl._enter("InitState", event)
        self.ctl._finish_now("hot switch failed")
