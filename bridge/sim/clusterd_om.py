"""ClusterD's operator (OM) flows in the simulation: NIC switch and stress test.

From ``om_service.go``, ``om_controller.go`` and ``rules.go`` (getSwitchNicRules,
getStressTestRules, getOMRules). The operator's ``SwitchNicTrack`` / ``StressTest``
starts a flow in INIT only (411 otherwise); the flow pauses training like the OM pause,
then puts the work into a one-slot channel of the *current* reset generation and waits,
with no time limit, until a ``SubscribeNotifySwitch`` / ``SubscribeNotifyExecStressTest``
listener has written it (``NotifySuccessEvent``): with no listener the job stays paused,
as measured on the real server. A listener reads the generation it subscribed under and
its stream ends with OK at that generation's reset, like the real one (the reset
cancels the context it waits on).

After the notify ClusterD waits (``report_timeout``) for the client's reply:

* NIC switch: ``result`` true -> changeStrategy continue -> RecoverStatus ends it;
  false (or a 406 RecoverStatus, or the timeout) -> "switch nic failed" to the operator
  and ``handleNotifyStopTrain``: stopTrain ["stop_train"] with the cached faults (none),
  then the fault cycle from WaitReportStopComplete on.
* Stress test: first ``pauseStartAgent`` on the signal stream (new uuid, not awaited),
  then the result: ``continueStartAgent`` (new uuid) and ``parseStressTestResult``: code
  "2" isolates the rank's node (all its ranks become type-1 faults), "3"/"4" make the
  rank a type-1 fault; either way stopTrain and the fault cycle. Any other code: the
  operator gets the per-rank results and changeStrategy continue resumes training.

Every message for the operator goes to the flow's response channel, read by
``SubscribeSwitchNicSignal`` / ``SubscribeStressTestResponse`` (one message, then the
stream ends). Nodes are ``node-<pod>``, devices ``0..devices_per_pod-1`` and rank
``pod * devices_per_pod + device``, as in the real-peers harness.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import grpc

from bridge._proto import recover_pb2 as pb

from bridge.sim import clusterd_rules as rules
from bridge.sim.clusterd_channels import next_item
from bridge.sim.clusterd_job import CLIENT_ERROR, RECOVER_STATUS, STOP_COMPLETE, CycleEnded, JobController

if TYPE_CHECKING:
    from bridge.sim.clusterd_job import SimJob

OM_IS_RUNNING = 411
OM_PARAM_INVALID = 413
UN_REGISTRY = 400
UNRECOVERABLE_RETRY_ERROR = 406
STRESS_TEST_TIMEOUT = 900  # stressTestTimeout, the pause's timeout for a stress test
STRESS_OPS = (0, 1)  # "0: aic, 1: p2p"
FIND_FAULT = "2"
RANK_FAULT_CODES = ("3", "4")  # StressTestTimeout, StressTestVolRecoverFail


def node_ranks(job: SimJob) -> dict[str, list[str]]:
    """``getNodeRankMap``: node name -> its ranks."""
    pods = job.world_size // job.devices_per_pod
    return {f"node-{pod}": [str(pod * job.devices_per_pod + dev) for dev in range(job.devices_per_pod)]
            for pod in range(pods)}


def check_switch(job: SimJob, request: pb.SwitchNics) -> str:
    """``checkNicsParam``: "" or the real server's message (code 413)."""
    nodes = node_ranks(job)
    for node, devices in request.nicOps.items():
        if node not in nodes:
            return f"node:{node} not exist in job:{request.jobID}"
        if len(devices.dev) != len(devices.op):
            return "dev and op length is not equal"
        if not devices.dev:
            return "dev or op is empty"
        for dev in devices.dev:
            if not dev.isdigit() or int(dev) >= job.devices_per_pod:
                return f"device:{dev} not exist in node:{node}"
        if job.super_pod_id < 0:
            return f"node:{node} should operate in superPodID"
    return ""


def check_stress(job: SimJob, request: pb.StressTestParam) -> str:
    """``checkStressTestParam``: "" or the real server's message (code 413)."""
    if request.allNodesOps:
        return _check_ops(list(request.allNodesOps), "AllNodes")
    if not request.stressParam:
        return "stress test node is nil"
    nodes = node_ranks(job)
    for node, ops in request.stressParam.items():
        if not ops.ops:
            return f"node:{node} stress test ops is 0"
        if node not in nodes:
            return f"node:{node} not exist in job:{request.jobID}"
        if problem := _check_ops(list(ops.ops), node):
            return problem
    return ""


def _check_ops(ops: list[int], node: str) -> str:
    for op in ops:
        if op not in STRESS_OPS:
            return f"op:{op} not exist in support operation:{list(STRESS_OPS)}"
    if len(set(ops)) != len(ops):
        return f"node:{node} stress test ops should not repeat"
    return ""


def stress_rank_ops(job: SimJob, request: pb.StressTestParam) -> dict[str, list[int]]:
    """``getNodeRankOpsMap`` flattened to rank -> ops (what ``notifyStressTest`` sends)."""
    nodes = node_ranks(job)
    if request.allNodesOps:
        return {rank: list(request.allNodesOps) for ranks in nodes.values() for rank in ranks}
    return {rank: list(ops.ops) for node, ops in request.stressParam.items() for rank in nodes[node]}


def switch_ranks(job: SimJob, request: pb.SwitchNics) -> tuple[list[str], list[bool]]:
    """``getGlobalRankIDAndOp``."""
    nodes = node_ranks(job)
    ranks: list[str] = []
    ops: list[bool] = []
    for node, devices in request.nicOps.items():
        ranks += [nodes[node][int(dev)] for dev in devices.dev]
        ops += list(devices.op)
    return ranks, ops


class OmFlows:
    """The two flows of one job's controller; each runs as the controller's cycle."""

    def __init__(self, ctl: JobController, job: SimJob) -> None:
        self.ctl = ctl
        self.job = job

    def start_switch_nic(self, ranks: list[str], ops: list[bool]) -> None:
        self.ctl.require_idle("SwitchNicTrack")
        self.ctl.gen.om.operation = "switch_nic"
        self.ctl._start(self._switch_nic(ranks, ops), "switch-nic")

    def start_stress_test(self, rank_ops: dict[str, list[int]]) -> None:
        self.ctl.require_idle("StressTest")
        self.ctl.gen.om.operation = "stress_test"
        self.ctl._start(self._stress_test(rank_ops), "stress-test")

    async def _pause(self, event: str, timeout: int) -> None:
        """NotifyPauseTrain and WaitReportPauseComplete (``handleWaitPauseTrainComplete``)."""
        ctl, om = self.ctl, self.ctl.gen.om
        ctl._enter("NotifyPauseTrainState", event)
        ctl.uuid = rules.new_uuid()
        await ctl._notify(ctl._signal("stopTrain", rules.PAUSE_TRAIN_ACTIONS, timeout=timeout))
        ctl._enter("WaitReportPauseCompleteState", "notifySuccess")
        request = await ctl._wait_report(STOP_COMPLETE)
        if request is None:
            om.respond("pause train timeout")
            await ctl._kill_job("reportTimeout")
        if request.status.code == CLIENT_ERROR:
            om.respond("om failed, pause train failed")
            await ctl._kill_job("processPauseFail")

    async def _until_notified(self) -> None:
        """NotifySuccessEvent: a listener wrote the notify. No time limit on the real
        server (the stall); a reset ends the wait with the flow."""
        om = self.ctl.gen.om
        done = asyncio.ensure_future(om.notified.wait())
        closed = asyncio.ensure_future(om.closed.wait())
        try:
            await asyncio.wait({done, closed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            done.cancel()
            closed.cancel()
        if not om.notified.is_set():
            raise CycleEnded("reset while waiting for an OM listener")

    async def _reply_or_status(self, results: asyncio.Queue[Any]) -> tuple[Any, Any]:
        """The client's OM reply, or a RecoverStatus (the controller's error while it
        waits), whichever comes first within ``report_timeout``: (reply, status)."""
        ctl = self.ctl
        reply = asyncio.ensure_future(results.get())
        status = asyncio.ensure_future(ctl._wait_report(RECOVER_STATUS))
        try:
            await asyncio.wait({reply, status}, timeout=ctl.host.timings.report_timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            reply.cancel()
            status.cancel()
        got_reply = reply.result() if reply.done() and not reply.cancelled() else None
        got_status = status.result() if status.done() and not status.cancelled() else None
        return got_reply, got_status

    async def _continue(self) -> None:
        """NotifyContinueTrain and WaitContinueTrain: training resumes, the flow ends."""
        ctl, om = self.ctl, self.ctl.gen.om
        ctl._enter("NotifyContinueTrainState", "receiveReport")
        await ctl._notify(ctl._signal("changeStrategy", rules.CHANGE_STRATEGY_ACTIONS, ctl.gen.faults.normal,
                                      change_strategy=rules.CONTINUE))
        ctl._enter("WaitContinueTrainState", "notifyContinueSuccess")
        request = await ctl._wait_report(RECOVER_STATUS)
        if request is None:
            om.respond("switch nic failed, continue train timeout")
            await ctl._kill_job("reportTimeout")
        if request.status.code == CLIENT_ERROR:
            om.respond("switch nic failed, continue train failed")
            await ctl._kill_job("continueTrainFail")
        ctl._finish_now("switchNicRecvContinue" if om.operation == "switch_nic" else "stressTestRecvContinue")

    async def _stop_train(self, event: str, faults: Iterable[rules.FaultPair] = ()) -> None:
        """``handleNotifyStopTrain`` / ``handleStressTestFail``: the fault cycle."""
        ctl = self.ctl
        ctl.gen.faults.save(list(faults))
        await ctl.stop_train_cycle(event)

    async def _switch_nic(self, ranks: list[str], ops: list[bool]) -> None:
        ctl, om = self.ctl, self.ctl.gen.om
        await self._pause("startSwitchNic", 0)
        ctl._enter("NotifySwitchNicState", "switchNicRecvPause")
        om.switch_notify.put_nowait(pb.SwitchRankList(rankID=ranks, op=ops, jobId=ctl.job_id))
        await self._until_notified()
        ctl._enter("WaitSwitchNicFinishedState", "notifySuccess")
        reply, status = await self._reply_or_status(om.switch_result)
        if reply is not None and reply.result:
            await self._continue()
        if reply is not None:
            om.respond("switch nic failed, switch nic failed")
            await self._stop_train("switchNicFail")
        if status is not None and status.status.code == UNRECOVERABLE_RETRY_ERROR:
            om.respond("switch nic failed, report error when switching nic")
            await self._stop_train("waitSwitchNicRecvFault")
        om.respond("switch nic failed, report switch nic timeout")
        await self._stop_train("reportTimeout")

    async def _stress_test(self, rank_ops: dict[str, list[int]]) -> None:
        ctl, om = self.ctl, self.ctl.gen.om
        await self._pause("startStressTest", STRESS_TEST_TIMEOUT)
        ctl._enter("NotifyStressTestState", "stressTestRecvPause")
        params = pb.StressTestRankParams(jobId=ctl.job_id)
        for rank, ops in rank_ops.items():
            params.stressParam[rank].ops.extend(ops)
        om.stress_notify.put_nowait(params)
        await self._until_notified()
        ctl._enter("WaitStressTestFinishedState", "notifySuccess")
        await self._agent_signal("pauseStartAgent", "pause_start_agent")
        reply, status = await self._reply_or_status(om.stress_result)
        if reply is None:
            if status is not None and status.status.code == UNRECOVERABLE_RETRY_ERROR:
                om.respond("recv fault, when stressing test")
                await self._stop_train("stressTestFail")
            om.respond("stress test failed, report stress test timeout")
            await self._stop_train("reportTimeout")
        await self._agent_signal("continueStartAgent", "continue_start_agent")
        faults = self._parse(reply)
        results = {rank: {op: {"code": r.code, "result": r.result} for op, r in result.rankResult.items()}
                   for rank, result in reply.stressResult.items()}
        if faults:
            om.respond(f"stress test find fault, faultRank:{sorted(faults)},result:{json.dumps(results)}")
            await self._stop_train("stressTestFail", faults)
        om.respond(f"stress test finish, result:{json.dumps(results)}")
        await self._continue()

    def _parse(self, reply: pb.StressTestResult) -> list[rules.FaultPair]:
        """``parseStressTestResult``: the type-1 faults a result makes (empty: it passed)."""
        nodes = node_ranks(self.job)
        node_of = {rank: node for node, ranks in nodes.items() for rank in ranks}
        faults: dict[str, str] = {}
        for rank, result in reply.stressResult.items():
            for op_result in result.rankResult.values():
                if op_result.code == FIND_FAULT and rank in node_of:
                    faults.update((r, rules.NORMAL) for r in nodes[node_of[rank]])
                if op_result.code in RANK_FAULT_CODES:
                    faults[rank] = rules.NORMAL
        return sorted(faults.items())

    async def _agent_signal(self, signal_type: str, action: str) -> None:
        """``sendAgentSignal``: a new uuid, enqueued, never waited for."""
        ctl = self.ctl
        ctl.uuid = rules.new_uuid()
        try:
            await ctl.push(ctl._signal(signal_type, (action,)))
        except (RuntimeError, TimeoutError) as error:
            ctl.host.record("om", f"{signal_type}-not-sent", ctl.job_id, reason=str(error))


class OmService:
    """The OM RPCs of the Recover servicer (mixed into ``RecoverService``)."""

    sim: Any  # the SimClusterD

    def _om_controller(self, job_id: str) -> JobController | None:
        return self.sim.controllers.get(job_id)  # type: ignore[no-any-return]

    def _om_status(self, method: str, job_id: str, code: int, info: str, **detail: Any) -> pb.Status:
        self.sim.journal.record("rpc", method, job_id, code, info=info, **detail)
        return pb.Status(code=code, info=info)

    def _start_om(self, method: str, request: Any, job_id: str, check: Any, start: Any) -> pb.Status:
        """The checks both operator RPCs make, then the flow (411 when not INIT)."""
        ctl = self._om_controller(job_id)
        job = self.sim.jobs.get(job_id)
        if job is None:
            return self._om_status(method, job_id, OM_PARAM_INVALID, f"job:{job_id} not exist")
        if ctl is None:
            return self._om_status(method, job_id, OM_PARAM_INVALID, f"job:{job_id} is not registered")
        if problem := check(job, request):
            return self._om_status(method, job_id, OM_PARAM_INVALID, problem)
        try:
            start(OmFlows(ctl, job))
        except RuntimeError:
            return self._om_status(method, job_id, OM_IS_RUNNING, f"jobId={job_id} om is running, or job recovering")
        return self._om_status(method, job_id, 0, "operation was successfully distributed", **detail_of(request))

    async def SwitchNicTrack(self, request: pb.SwitchNics, context: Any) -> pb.Status:
        job = self.sim.jobs.get(request.jobID)
        return self._start_om("SwitchNicTrack", request, request.jobID, check_switch,
                              lambda flows: flows.start_switch_nic(*switch_ranks(job, request)))

    async def StressTest(self, request: pb.StressTestParam, context: Any) -> pb.Status:
        job = self.sim.jobs.get(request.jobID)
        return self._start_om("StressTest", request, request.jobID, check_stress,
                              lambda flows: flows.start_stress_test(stress_rank_ops(job, request)))

    async def _notify_stream(self, method: str, request: pb.ClientInfo, context: Any, queue_name: str) -> None:
        """``listenSwitchNicNotifyChannel`` / ``listenStressTestNotifyChannel``: the
        channel of the generation subscribed under, until that generation's reset."""
        journal = self.sim.journal
        ctl = self._om_controller(request.jobId)
        if ctl is None:
            message = f"jobId={request.jobId} not registed, please wait agent register"
            journal.record("om-stream-end", method, request.jobId, 2, reason=message)
            await context.abort(grpc.StatusCode.UNKNOWN, message)
            return
        om = ctl.gen.om
        queue: asyncio.Queue[Any] = getattr(om, queue_name)
        journal.record("om-stream-open", method, request.jobId, role=request.role)
        while (message := await next_item(queue, om.closed)) is not None:
            journal.record("om-notify", method, request.jobId, ranks=sorted(_ranks_of(message)))
            await context.write(message)
            om.notified.set()
        if om.server_stopped:
            journal.record("om-stream-end", method, request.jobId, 14, reason="ClusterD stopped")
            await context.abort(grpc.StatusCode.UNAVAILABLE, "ClusterD stopped")
        journal.record("om-stream-end", method, request.jobId, 0, reason="reset")

    async def SubscribeNotifySwitch(self, request: pb.ClientInfo, context: Any) -> None:
        await self._notify_stream("SubscribeNotifySwitch", request, context, "switch_notify")

    async def SubscribeNotifyExecStressTest(self, request: pb.ClientInfo, context: Any) -> None:
        await self._notify_stream("SubscribeNotifyExecStressTest", request, context, "stress_notify")

    def _om_reply(self, method: str, request: Any, queue_name: str, detail: dict[str, Any]) -> pb.Status:
        ctl = self._om_controller(request.jobId)
        if ctl is None:
            return self._om_status(method, request.jobId, UN_REGISTRY, f"jobId={request.jobId} not registed")
        queue: asyncio.Queue[Any] = getattr(ctl.gen.om, queue_name)
        if queue.full():
            # The real handler blocks on the full channel for good (and panics on one a
            # reset closed): a client must reply once per request.
            self.sim.violation(request.jobId, f"{method} while an earlier reply is still unread: the real "
                                              "ClusterD's handler blocks on its one-slot result channel")
            return self._om_status(method, request.jobId, 0, "reply success", **detail)
        queue.put_nowait(request)
        return self._om_status(method, request.jobId, 0, "reply success", **detail)

    async def ReplySwitchNicResult(self, request: pb.SwitchResult, context: Any) -> pb.Status:
        return self._om_reply("ReplySwitchNicResult", request, "switch_result", {"result": request.result})

    async def ReplyStressTestResult(self, request: pb.StressTestResult, context: Any) -> pb.Status:
        codes = sorted({r.code for rank in request.stressResult.values() for r in rank.rankResult.values()})
        return self._om_reply("ReplyStressTestResult", request, "stress_result",
                              {"ranks": len(request.stressResult), "codes": codes})

    async def _response_stream(self, method: str, job_id: str, context: Any) -> None:
        """``SubscribeSwitchNicSignal`` / ``SubscribeStressTestResponse``: one message for
        the operator, then the stream ends."""
        ctl = self._om_controller(job_id)
        if ctl is None or not ctl.gen.om.operation:
            await context.abort(grpc.StatusCode.UNKNOWN, f"jobId={job_id} is not running an OM flow")
            return
        message = await asyncio.wait_for(ctl.gen.om.responses.get(), self.sim.timings.report_timeout)
        self.sim.journal.record("om-response", method, job_id, msg=message)
        await context.write(pb.SwitchNicResponse(jobID=job_id, msg=message) if method == "SubscribeSwitchNicSignal"
                            else pb.StressTestResponse(jobID=job_id, msg=message))

    async def SubscribeSwitchNicSignal(self, request: pb.SwitchNicRequest, context: Any) -> None:
        await self._response_stream("SubscribeSwitchNicSignal", request.jobID, context)

    async def SubscribeStressTestResponse(self, request: pb.StressTestRequest, context: Any) -> None:
        await self._response_stream("SubscribeStressTestResponse", request.jobID, context)


def detail_of(request: Any) -> dict[str, Any]:
    if isinstance(request, pb.SwitchNics):
        return {"nicOps": {node: list(devices.dev) for node, devices in request.nicOps.items()}}
    return {"allNodesOps": list(request.allNodesOps),
            "stressParam": {node: list(ops.ops) for node, ops in request.stressParam.items()}}


def _ranks_of(message: Any) -> list[str]:
    return list(message.rankID) if isinstance(message, pb.SwitchRankList) else list(message.stressParam)
