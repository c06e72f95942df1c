"""What ClusterD's fault centre saw for the job (its Fault service, docs/clusterd.md
section 13), kept for the flight recorder.

``FaultCentreReader`` registers and subscribes for the whole run (an ``AuxStream``),
reads the job's faults as they stand after each Register, and hands a bounded summary of
each message (``summarise``: at most ``MAX_DEVICES`` devices, ``MAX_CODES`` codes and
levels each, every string cut to ``MAX_TEXT``) to ``on_info``. A release that does not
serve the service yields the summary ``{"signal": "unavailable"}``. Only each message's
result is counted (``tft_bridge_fault_info_messages_total{result}``); nothing of a
message becomes a metric label.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from bridge._proto import fault_pb2
from bridge.job.session.aux_stream import AuxStream
from bridge.job.session.clusterd import ClusterDClient
from bridge.job.metrics import BridgeMetrics
from bridge.job.recorder.model import clusterd_faults_text

log = logging.getLogger(__name__)

REGISTER = "/fault.Fault/Register"
GET = "/fault.Fault/GetFaultMsgSignal"
SUBSCRIBE = "/fault.Fault/SubscribeFaultMsgSignal"
MAX_DEVICES = 16
MAX_CODES = 8
MAX_TEXT = 64
UNAVAILABLE = "unavailable"  # the summary of a release without the Fault service

#: The summary the recorder keeps: ``signal`` ("fault", "normal" or "unavailable"),
#: ``devices`` [{node, device, type, codes, levels}], ``more`` (devices left out).
FaultInfo = dict[str, Any]


def _cut(text: str) -> str:
    return text[:MAX_TEXT]


def _list(values: Any) -> list[str]:
    return [_cut(str(value)) for value in list(values)[:MAX_CODES]]


def summarise(message: fault_pb2.FaultMsgSignal) -> tuple[FaultInfo, bool]:
    """The bounded summary of one message, and whether anything was cut."""
    devices: list[dict[str, Any]] = []
    cut = False
    total = 0
    for node in message.nodeFaultInfo:
        node_devices = list(node.faultDevice)
        if not node_devices:  # a node-level fault with no device
            node_devices = [fault_pb2.DeviceFaultInfo(faultLevel=node.faultLevel)]
        for device in node_devices:
            total += 1
            if len(devices) >= MAX_DEVICES:
                continue
            levels = list(device.faultLevels) or ([device.faultLevel] if device.faultLevel else [])
            cut = cut or len(device.faultCodes) > MAX_CODES or len(levels) > MAX_CODES
            devices.append({"node": _cut(node.nodeName or node.nodeIP), "device": _cut(device.deviceId),
                            "type": _cut(device.deviceType), "codes": _list(device.faultCodes),
                            "levels": _list(levels)})
    info: FaultInfo = {"signal": _cut(message.signalType or "fault"), "devices": devices}
    if total > len(devices):
        info["more"] = total - len(devices)
        cut = True
    return info, cut


class FaultCentreReader:
    """Register + SubscribeFaultMsgSignal for the job: ``run()`` on the event loop until
    ``stop()``, subscribing only while ``ready``. ``on_info(summary)`` gets every
    message's summary on the loop and must be O(1) (the recorder appends it); ``last``
    is the latest summary."""

    def __init__(self, job_id: str, client: ClusterDClient, metrics: BridgeMetrics, *,
                 ready: Callable[[], Awaitable[Any]], on_info: Callable[[FaultInfo], None]) -> None:
        self.job_id = job_id
        self.client = client
        self.metrics = metrics
        self.on_info = on_info
        self.last: FaultInfo | None = None  # the latest summary (tests, status)
        self._request = fault_pb2.ClientInfo(jobId=job_id, role=client.config.role).SerializeToString()
        self.stream: AuxStream[fault_pb2.FaultMsgSignal] = AuxStream(
            "fault_info", client, metrics, SUBSCRIBE, self._request, fault_pb2.FaultMsgSignal.FromString,
            self._handle, ready=ready, prepare=self._register, on_unimplemented=self._unavailable)

    async def run(self) -> None:
        await self.stream.run()

    def stop(self) -> None:
        self.stream.stop()

    async def _register(self) -> bool:
        """The Fault service's Register (a publisher for this job and role); a gRPC error
        (UNIMPLEMENTED included) propagates to the stream loop."""
        assert self.client.channel is not None
        register = self.client.channel.unary_unary(REGISTER, request_serializer=None,
                                                   response_deserializer=fault_pb2.Status.FromString)
        status = await register(self._request, timeout=self.client.config.rpc_timeout)
        if status.code != 0:
            log.warning("ClusterD's Fault service refused Register for job %s: %d %s", self.job_id, status.code,
                        status.info[:200])
            return False
        await self._current()
        return True

    async def _current(self) -> None:
        """The job's faults as they stand: the stream sends only changes, and one may
        have come while no subscription was open. Best effort: a refusal (job ids under
        8 characters) or a failed call only means the next change is the first heard."""
        assert self.client.channel is not None
        get = self.client.channel.unary_unary(GET, request_serializer=None,
                                              response_deserializer=fault_pb2.FaultQueryResult.FromString)
        try:
            result = await get(self._request, timeout=self.client.config.rpc_timeout)
        except grpc.aio.AioRpcError as error:
            log.debug("GetFaultMsgSignal for job %s: %s %s", self.job_id, error.code().name, error.details())
            return
        if result.HasField("faultSignal") and result.faultSignal.signalType == "fault":
            await self._handle(result.faultSignal)

    def _unavailable(self) -> None:
        if self.last is None or self.last.get("signal") != UNAVAILABLE:
            self.metrics.fault_info.labels(UNAVAILABLE).inc()
            self._deliver({"signal": UNAVAILABLE, "devices": []})

    async def _handle(self, message: fault_pb2.FaultMsgSignal) -> None:
        if message.jobId and message.jobId != self.job_id:
            self.metrics.fault_info.labels("foreign_job").inc()
            return
        info, cut = summarise(message)
        self.metrics.fault_info.labels("received").inc()
        if cut:
            self.metrics.fault_info.labels("truncated").inc()
        log.info("ClusterD's fault centre for job %s: %s", self.job_id, clusterd_faults_text(info))
        self._deliver(info)

    def _deliver(self, info: FaultInfo) -> None:
        self.last = info
        try:
            self.on_info(info)
        except Exception:  # the recorder never raises; a bug there must not end the stream
            log.exception("recording ClusterD's fault information failed")


