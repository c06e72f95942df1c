"""The simulated ClusterD's Fault service (``fault.Fault``), fed by its fault injections.

From ``application/fault/grpc_service.go`` and observed on the real-peers harness:

* ``Register(jobId, role)``: an empty role is a gRPC error; an unknown job answers 402
  (``JobNotExist``) with a gRPC error; otherwise 0 ``register success``, and the job's
  publisher for that role is replaced (the previous subscriber's stream ends with OK).
* ``SubscribeFaultMsgSignal``: needs the publisher (``jobId=... not registered,
  role=...`` otherwise); nothing is sent on subscribing; every change of the job's device
  faults sends a ``FaultMsgSignal``: ``signalType`` "fault" with one ``NodeFaultInfo``
  per node (``faultLevel`` "UnHealthy") and its devices (``deviceType`` "NPU", the codes,
  ``faultLevel`` "UnHealthy", ``faultLevels`` the codes' levels), or "normal" once they
  are cleared (measured: about 0.8 s after the device plugin's report; here at once).
  The stream's end deletes the publisher.
* ``GetFaultMsgSignal``: job ids shorter than 8 characters are refused (code 400 and an
  error), an unknown job or one without faults answers 200 with a "normal" signal.

Device faults come from :meth:`SimClusterD.device_fault` (the harness's
``POST /fault/device``: default code ``80C98000``, level ``RestartNPU``) and from the
fault-centre injections (``pre_exit``: ``80C98000``/``RestartNPU``, or the UCE code
``80E01801``/``RestartRequest`` read from ClusterD's constants, not observed), and the
fault centre's records of business-reported UCE/HCCL faults (``80E01801``/
``RestartBusiness`` on the rank's NPU while the record is held, clusterd_retry.py). Nodes are
``node-<pod>``, the device the rank's index in its pod. ClusterD releases without the
service (``Release.fault_service`` false, e.g. the v7.3.2 harness) answer UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import uuid as uuidlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from bridge._proto import fault_pb2, fault_pb2_grpc

from bridge.sim.clusterd_channels import next_item
from bridge.sim.clusterd_job import SimJob
from bridge.sim.clusterd_retry import RESTART_BUSINESS, record_code
from bridge.sim.journal import Journal


class FaultHost(Protocol):
    """What the Fault service reads of the simulation (``SimClusterD``)."""

    jobs: dict[str, SimJob]
    journal: Journal

    @property
    def device_faults(self) -> "DeviceFaults": ...

JOB_NOT_EXIST = 402
INVALID_REQ_PARAM = 400
SUCCESS_CODE = 200
MIN_JOB_ID = 8
DEFAULT_CODE, DEFAULT_LEVEL = "80C98000", "RestartNPU"
UCE_CODE, UCE_LEVEL = "80E01801", "RestartRequest"


@dataclass
class DeviceFault:
    """One NPU's fault as the fault centre publishes it."""


    node: str
    device: str
    code: str
    level: str


@dataclass
class FaultPublisher:
    """One registered Fault-service stream of a job (on the server's loop): signals queued for it,
    ``stopped`` set when it must end."""


    job_id: str
    role: str
    queue: asyncio.Queue[fault_pb2.FaultMsgSignal] = field(default_factory=asyncio.Queue)
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    server_stopped: bool = False  # its stream ends UNAVAILABLE (a server stop), not OK (a new Register)


def fault_signal(job_id: str, faults: Iterable[DeviceFault]) -> fault_pb2.FaultMsgSignal:
    """``faultDeviceToSortedFaultMsgSignal``: nodes sorted, one entry per device."""
    message = fault_pb2.FaultMsgSignal(uuid=str(uuidlib.uuid4()), jobId=job_id, signalType="normal")
    by_node: dict[str, dict[str, list[DeviceFault]]] = {}
    for fault in faults:
        by_node.setdefault(fault.node, {}).setdefault(fault.device, []).append(fault)
    if not by_node:
        return message
    message.signalType = "fault"
    for node in sorted(by_node):
        pod = node.rsplit("-", 1)[-1]
        info = message.nodeFaultInfo.add(nodeName=node, nodeIP=f"192.168.100.{10 + int(pod)}" if pod.isdigit() else "",
                                         nodeSN=f"SN{int(pod):04d}" if pod.isdigit() else "", faultLevel="UnHealthy")
        for device in sorted(by_node[node], key=lambda d: int(d) if d.isdigit() else 0):
            entries = by_node[node][device]
            info.faultDevice.add(deviceId=device, deviceType="NPU", faultCodes=[f.code for f in entries],
                                 faultLevel="UnHealthy", faultLevels=[f.level for f in entries])
    return message


class DeviceFaults:
    """The fault centre's view of every job's devices, and the publishers reading it."""

    def __init__(self, sim: FaultHost) -> None:
        self.sim = sim
        self.faults: dict[str, list[DeviceFault]] = {}
        #: the fault centre's business retry records (clusterd_retry.py), per job
        self.records: dict[str, list[DeviceFault]] = {}
        self.publishers: dict[tuple[str, str], FaultPublisher] = {}

    def inject(self, job_id: str, ranks: Iterable[int | str], code: str = DEFAULT_CODE,
               level: str = DEFAULT_LEVEL) -> None:
        job = self.sim.jobs.get(job_id)
        per_pod = job.devices_per_pod if job is not None else 8
        faults = self.faults.setdefault(job_id, [])
        for rank in ranks:
            number = int(rank)
            faults.append(DeviceFault(f"node-{number // per_pod}", str(number % per_pod), code, level))
        self.publish(job_id)

    def set_records(self, job_id: str, faults: Iterable[tuple[str, str]]) -> None:
        """The NPUs of these (rank, type) carry a business-reported retry record
        (``80E01801``/``RestartBusiness`` for a UCE, clusterd_retry.py); publish it."""
        job = self.sim.jobs.get(job_id)
        per_pod = job.devices_per_pod if job is not None else 8
        self.records[job_id] = [DeviceFault(f"node-{int(rank) // per_pod}", str(int(rank) % per_pod),
                                            record_code(kind), RESTART_BUSINESS) for rank, kind in faults]
        self.publish(job_id)

    def current(self, job_id: str) -> list[DeviceFault]:
        """The job's device faults and retry records, as the service reports them."""
        return [*self.faults.get(job_id, ()), *self.records.get(job_id, ())]

    def clear(self, job_id: str) -> None:
        if self.faults.pop(job_id, None):
            self.publish(job_id)

    def publish(self, job_id: str) -> None:
        message = fault_signal(job_id, self.current(job_id))
        self.sim.journal.record("fault-centre", "fault-msg", job_id, signalType=message.signalType,
                                devices=sum(len(n.faultDevice) for n in message.nodeFaultInfo))
        for (job, _), publisher in self.publishers.items():
            if job == job_id:
                publisher.queue.put_nowait(message)

    def close(self) -> None:
        """A server stop: every stream breaks, and the in-memory retry records are gone."""
        self.records.clear()
        for publisher in self.publishers.values():
            publisher.server_stopped = True
            publisher.stopped.set()
        self.publishers.clear()


class FaultService(fault_pb2_grpc.FaultServicer):
    def __init__(self, sim: FaultHost) -> None:
        self.sim = sim

    @property
    def centre(self) -> DeviceFaults:
        return self.sim.device_faults

    def _record(self, method: str, job_id: str, code: int | None, **detail: Any) -> None:
        self.sim.journal.record("rpc", f"Fault.{method}", job_id, code, **detail)

    async def Register(self, request: fault_pb2.ClientInfo, context: Any) -> fault_pb2.Status:
        if not request.role:
            self._record("Register", request.jobId, None, grpc_status="UNKNOWN")
            await context.abort(grpc.StatusCode.UNKNOWN, "request is nil or role is empty")
        if request.jobId not in self.sim.jobs:
            self._record("Register", request.jobId, JOB_NOT_EXIST, grpc_status="UNKNOWN")
            await context.abort(grpc.StatusCode.UNKNOWN, f"jobId={request.jobId} not exist and is not multi-instance")
        old = self.centre.publishers.pop((request.jobId, request.role), None)
        if old is not None:
            old.stopped.set()
        self.centre.publishers[(request.jobId, request.role)] = FaultPublisher(request.jobId, request.role)
        self._record("Register", request.jobId, 0, role=request.role)
        return fault_pb2.Status(code=0, info="register success")

    async def SubscribeFaultMsgSignal(self, request: fault_pb2.ClientInfo, context: Any) -> None:
        key = (request.jobId, request.role)
        publisher = self.centre.publishers.get(key)
        if not request.role or publisher is None:
            self.sim.journal.record("om-stream-end", "Fault.SubscribeFaultMsgSignal", request.jobId, 2,
                                    reason="not registered")
            await context.abort(grpc.StatusCode.UNKNOWN,
                                f"jobId={request.jobId} not registered, role={request.role}")
            return
        self.sim.journal.record("om-stream-open", "Fault.SubscribeFaultMsgSignal", request.jobId, role=request.role)
        try:
            while (message := await next_item(publisher.queue, publisher.stopped)) is not None:
                await context.write(message)
        finally:
            if self.centre.publishers.get(key) is publisher:
                del self.centre.publishers[key]
        if publisher.server_stopped:
            self.sim.journal.record("om-stream-end", "Fault.SubscribeFaultMsgSignal", request.jobId, 14,
                                    reason="ClusterD stopped")
            await context.abort(grpc.StatusCode.UNAVAILABLE, "ClusterD stopped")
        self.sim.journal.record("om-stream-end", "Fault.SubscribeFaultMsgSignal", request.jobId, 0,
                                reason="publisher replaced")

    async def GetFaultMsgSignal(self, request: fault_pb2.ClientInfo, context: Any) -> fault_pb2.FaultQueryResult:
        if not MIN_JOB_ID <= len(request.jobId) <= 128:
            self._record("GetFaultMsgSignal", request.jobId, INVALID_REQ_PARAM, grpc_status="UNKNOWN")
            await context.abort(grpc.StatusCode.UNKNOWN, f"job with jobId: {request.jobId} is invalid")
        message = fault_signal(request.jobId, self.centre.current(request.jobId))
        self._record("GetFaultMsgSignal", request.jobId, SUCCESS_CODE, signalType=message.signalType)
        return fault_pb2.FaultQueryResult(code=SUCCESS_CODE, info="all info returned", faultSignal=message)
