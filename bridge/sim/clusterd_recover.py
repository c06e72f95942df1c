"""The ``/Recover/*`` servicer of the simulated ClusterD.

Thin on purpose: each RPC journals its decoded request and its answer and delegates the
behaviour to :class:`~bridge.sim.clusterd_job.JobController`. What lives here is what
the real server does before the controller sees a call: the QPS limiter, the nil-status
crash, the 400/402/403/408/500/502 answers and the stream writer.

Every ``Status.info`` and gRPC details string is the real server's, misspellings
included ("not registed", "hotswtich", "HeathCheck"): a client that logs or matches
them must see what production shows (docs/clusterd.md, "Return codes").
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import grpc

from bridge._proto import recover_pb2 as pb
from bridge._proto import recover_pb2_grpc as pb_grpc

from bridge.sim.clusterd_channels import Outgoing, Subscriber
from bridge.sim.clusterd_om import OmService
from bridge.sim.clusterd_job import RECOVER_STATUS, RECOVER_STRATEGY, STOP_COMPLETE, JobConfig, JobController, SimJob
from bridge.sim.clusterd_release import Release
from bridge.sim.clusterd_timings import Timings
from bridge.sim.clusterd_messages import fault_pairs, request_detail, signal_detail
from bridge.sim.journal import Journal


class RecoverHost(Protocol):
    """What the Recover service reads and changes of the simulation (``SimClusterD``)."""

    release: Release
    timings: Timings
    journal: Journal
    jobs: dict[str, SimJob]
    inited: dict[str, JobConfig]
    controllers: dict[str, JobController]
    max_jobs: int

    def qps_refuses(self, path: str) -> bool: ...

    def init_job(self, job: SimJob) -> None: ...

    def register_job(self, job_id: str) -> None: ...

    def take_tweaks(self) -> tuple[float, bool]: ...

    def violation(self, job_id: str, text: str) -> None: ...

UN_REGISTRY = 400
JOB_NOT_EXIST = 402
PROCESS_RECOVER_OFF = 403
UN_INIT = 408
OUT_OF_MAX_SERVE_JOBS = 500
OPERATE_POD_GROUP_ERROR = 502
SERVER_INNER_ERROR = 599


def grpc_code(code: grpc.StatusCode) -> int:
    return int(code.value[0])


class RecoverService(OmService, pb_grpc.RecoverServicer):
    """ClusterD's Recover service over the simulation's state."""

    def __init__(self, sim: RecoverHost) -> None:
        self.sim = sim

    # ------------------------------------------------------------------ plumbing

    def _reply(self, method: str, request: Any, code: int, info: str, **extra: Any) -> pb.Status:
        self.sim.journal.record("rpc", method, request.jobId, code,
                                **request_detail(method, request), **extra)
        return pb.Status(code=code, info=info)

    async def _admit(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> None:
        """The server-wide unary token bucket (HealthCheck has its own, never empty here)."""
        path = f"/Recover/{method}"
        if self.sim.qps_refuses(path):
            self.sim.journal.record("rpc", method, request.jobId, None,
                                    **request_detail(method, request),
                                    grpc_status="UNKNOWN", error=f"qps exceeded, method={path}")
            await context.abort(grpc.StatusCode.UNKNOWN, f"qps exceeded, method={path}")

    # ------------------------------------------------------------------ session RPCs

    async def Init(self, request: pb.ClientInfo, context: grpc.aio.ServicerContext) -> pb.Status:
        await self._admit("Init", request, context)
        job_id = request.jobId
        if job_id in self.sim.inited:
            return self._reply("Init", request, 0, f"job(uid={job_id}) init success", cached=True)
        job = self.sim.jobs.get(job_id)
        if job is None or not job.pod_group_exists:
            return self._reply("Init", request, OPERATE_POD_GROUP_ERROR,
                               f"job(uid={job_id}) one of jobName, pgName, ns is empty")
        if not job.process_recover and not job.hot_switch:
            # Go formats the nil error of that branch as "<nil>".
            return self._reply("Init", request, PROCESS_RECOVER_OFF,
                               f"job(uid={job_id}) process-recover-enable and subhealthy "
                               "hotswtich not open:<nil>")
        self.sim.init_job(job)
        return self._reply("Init", request, 0, f"job(uid={job_id}) init success")

    async def Register(self, request: pb.ClientInfo, context: grpc.aio.ServicerContext) -> pb.Status:
        await self._admit("Register", request, context)
        job_id = request.jobId
        if job_id in self.sim.controllers:
            return self._reply("Register", request, 0, "register success", cached=True)
        if job_id not in self.sim.inited:
            return self._reply("Register", request, UN_INIT, f"jobId={job_id} not inited")
        job = self.sim.jobs.get(job_id)
        if job is None or not job.pod_group_exists:
            return self._reply("Register", request, JOB_NOT_EXIST,
                               f"jobId={job_id} not exist, reuse registry")
        if len(self.sim.controllers) >= self.sim.max_jobs:
            return self._reply("Register", request, OUT_OF_MAX_SERVE_JOBS,
                               f"out of max serve jobs, reuse registry for jobId={job_id}")
        self.sim.register_job(job_id)
        return self._reply("Register", request, 0, "register success")

    async def HealthCheck(self, request: pb.ClientInfo, context: grpc.aio.ServicerContext) -> pb.Status:
        if not self.sim.release.health_check:  # v7.0.RC1 has no such RPC
            self.sim.journal.record("rpc", "HealthCheck", request.jobId, None, grpc_status="UNIMPLEMENTED")
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        return self._reply("HealthCheck", request, 0, f"jobId={request.jobId}, receive HeathCheck")

    # ------------------------------------------------------------------ the stream

    async def SubscribeProcessManageSignal(self, request: pb.ClientInfo,
                                           context: grpc.aio.ServicerContext) -> None:
        job_id = request.jobId
        journal = self.sim.journal
        if delay := self.sim.take_subscribe_delay():
            await asyncio.sleep(delay)
        ctl = self.sim.controllers.get(job_id)
        if ctl is None:
            message = f"jobId={job_id} not registed"
            journal.record("stream-end", "SubscribeProcessManageSignal", job_id,
                           grpc_code(grpc.StatusCode.UNKNOWN), reason=message, role=request.role)
            await context.abort(grpc.StatusCode.UNKNOWN, message)
            return
        sub = ctl.subscribe()
        journal.record("stream-open", "SubscribeProcessManageSignal", job_id,
                       stream=sub.stream_id, role=request.role)
        try:
            while (item := await sub.next()) is not None:
                await self._write(context, ctl, sub, item)
        except asyncio.CancelledError:
            if not ctl.stopped:
                ctl.stream_broken(sub, "client cancelled or connection broken")
            journal.record("stream-end", "SubscribeProcessManageSignal", job_id,
                           grpc_code(grpc.StatusCode.CANCELLED), stream=sub.stream_id,
                           reason="client cancelled, connection broken or server stopped")
            raise
        except Exception as error:  # a failed write is a broken stream: reset, as ClusterD does
            if not ctl.stopped:
                ctl.stream_broken(sub, f"stream write failed: {error!r}")
            journal.record("stream-end", "SubscribeProcessManageSignal", job_id,
                           grpc_code(grpc.StatusCode.UNKNOWN), stream=sub.stream_id,
                           reason=f"stream write failed: {error!r}")
            raise
        end = sub.ended.result()
        journal.record("stream-end", "SubscribeProcessManageSignal", job_id, grpc_code(end.code),
                       stream=sub.stream_id, reason=end.reason)
        if end.code != grpc.StatusCode.OK:
            await context.abort(end.code, end.reason)

    async def _write(self, context: grpc.aio.ServicerContext, ctl: JobController,
                     sub: Subscriber[Outgoing], item: Outgoing) -> None:
        signal = item.signal
        if not self.sim.release.signal_fields_7_to_9:  # v7.0.RC1's ProcessManageSignal ends at field 6
            signal = pb.ProcessManageSignal()
            signal.CopyFrom(item.signal)
            for name in ("timeout", "nodeRankIds", "extraParams"):
                signal.ClearField(name)
        delay, duplicate = (0.0, False) if signal.signalType == "keep-alive" else self.sim.take_tweaks()
        if delay:
            await asyncio.sleep(delay)
        for copy in range(2 if duplicate else 1):
            # Journaled first, so that whatever a client has received is in the journal.
            self.sim.journal.record("signal", signal.signalType, ctl.job_id, None,
                                    stream=sub.stream_id, **signal_detail(signal),
                                    **({"delayed": delay} if delay else {}),
                                    **({"duplicate": True} if copy else {}))
            # Bounded: a client that stops reading must not pin this handler forever.
            await asyncio.wait_for(context.write(signal), self.sim.timings.report_timeout)
        if item.sent is not None and not item.sent.done():
            item.sent.set_result(None)

    # ------------------------------------------------------------------ reports

    async def ReportProcessFault(self, request: pb.ProcessFaultRequest,
                                 context: grpc.aio.ServicerContext) -> pb.Status:
        await self._admit("ReportProcessFault", request, context)
        ctl = self.sim.controllers.get(request.jobId)
        if ctl is None:
            return self._reply("ReportProcessFault", request, UN_REGISTRY,
                               f"jobId={request.jobId} not registed")
        pairs = fault_pairs(request.faultRanks)
        ctl.check_fault_pairs(pairs, "ReportProcessFault")
        outcome = ctl.report_faults(pairs, "ReportProcessFault")
        return self._reply("ReportProcessFault", request, 0, "receive ReportProcessFault",
                           outcome=outcome)

    async def ReportStopComplete(self, request: pb.StopCompleteRequest,
                                 context: grpc.aio.ServicerContext) -> pb.Status:
        return await self._report("ReportStopComplete", STOP_COMPLETE, request, context)

    async def ReportRecoverStrategy(self, request: pb.RecoverStrategyRequest,
                                    context: grpc.aio.ServicerContext) -> pb.Status:
        return await self._report("ReportRecoverStrategy", RECOVER_STRATEGY, request, context)

    async def ReportRecoverStatus(self, request: pb.RecoverStatusRequest,
                                  context: grpc.aio.ServicerContext) -> pb.Status:
        return await self._report("ReportRecoverStatus", RECOVER_STATUS, request, context)

    async def _report(self, method: str, kind: str, request: Any,
                      context: grpc.aio.ServicerContext) -> pb.Status:
        """Queue the report in its one-slot buffer, whatever the state. 0 means queued;
        a full slot blocks this RPC until drained (0) or reset (599)."""
        job_id = request.jobId
        if kind != RECOVER_STRATEGY and not request.HasField("status"):
            await self._nil_status_crash(method, request, context)
        await self._admit(method, request, context)
        ctl = self.sim.controllers.get(job_id)
        if ctl is None:
            return self._reply(method, request, UN_REGISTRY, f"jobId={job_id} not registed")
        # The real handler formats its answer (with the uuid of that moment) before the put.
        accepted = f"jobId={job_id}, uuid={ctl.uuid}, receive {method}"
        blocked = ctl.slot_full(kind)
        put = ctl.put_report(kind, request, lambda: self.sim.journal.record(
            "report-blocked", method, job_id, None, **request_detail(method, request)))
        try:
            queued = await asyncio.shield(put)
        except asyncio.CancelledError:
            self.sim.journal.record("rpc", method, job_id, None, **request_detail(method, request),
                                    outcome="caller gave up while blocked on a full slot; "
                                            "the server keeps trying to queue it")
            put.add_done_callback(lambda task: self._late(method, request, task))
            raise
        if queued:
            return self._reply(method, request, 0, accepted, blocked=blocked)
        return self._reply(method, request, SERVER_INNER_ERROR,
                           f"jobId={job_id}, uuid={ctl.uuid}, chan closed", blocked=blocked)

    def _late(self, method: str, request: Any, task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and task.exception() is None and task.result():
            self.sim.journal.record("report-late", method, request.jobId, None,
                                    **request_detail(method, request))

    async def _nil_status_crash(self, method: str, request: Any,
                                context: grpc.aio.ServicerContext) -> None:
        """The real ClusterD dereferences ``status`` even for an unknown job: nil pointer,
        the whole process dies. Here: a violation, the job resets, the RPC fails."""
        text = (f"{method} without status: the real ClusterD crashes (nil pointer) and "
                "every job loses its state")
        self.sim.violation(request.jobId, text)
        self.sim.journal.record("rpc", method, request.jobId, None,
                                **request_detail(method, request), grpc_status="INTERNAL",
                                error=text)
        ctl = self.sim.controllers.get(request.jobId)
        if ctl is not None:
            ctl.reset("ClusterD crashed: nil status")
        await context.abort(grpc.StatusCode.INTERNAL, text)
