"""An operator's gRPC client for ClusterD's OM actions (NIC switch, stress test).

What an operator (or MindCluster's own tooling) does: ``StressTest`` / ``SwitchNicTrack``
on the Recover service, then the response stream for the outcome message. Used against
the simulated ClusterD and the real one alike, so both are driven the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import grpc

from bridge._proto import recover_pb2 as pb
from bridge._proto import recover_pb2_grpc as pb_grpc


class Operator:
    """``async with Operator(address) as op:`` -- every call with a deadline."""

    def __init__(self, address: str, timeout: float = 5.0) -> None:
        self.address = address
        self.timeout = timeout
        self.channel: grpc.aio.Channel | None = None

    async def __aenter__(self) -> "Operator":
        self.channel = grpc.aio.insecure_channel(self.address)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.channel is not None:
            await self.channel.close(grace=None)

    @property
    def stub(self) -> pb_grpc.RecoverStub:
        assert self.channel is not None
        return pb_grpc.RecoverStub(self.channel)  # type: ignore[no-untyped-call]

    async def stress_test(self, job_id: str, all_nodes_ops: Sequence[int] = (0,),
                          per_node: Mapping[str, Sequence[int]] | None = None) -> pb.Status:
        request = pb.StressTestParam(jobID=job_id, allNodesOps=list(all_nodes_ops) if per_node is None else [])
        for node, ops in (per_node or {}).items():
            request.stressParam[node].ops.extend(ops)
        return await self.stub.StressTest(request, timeout=self.timeout)  # type: ignore[no-any-return]

    async def switch_nic(self, job_id: str, nic_ops: Mapping[str, Sequence[tuple[str, bool]]]) -> pb.Status:
        request = pb.SwitchNics(jobID=job_id)
        for node, devices in nic_ops.items():
            request.nicOps[node].dev.extend(dev for dev, _ in devices)
            request.nicOps[node].op.extend(op for _, op in devices)
        return await self.stub.SwitchNicTrack(request, timeout=self.timeout)  # type: ignore[no-any-return]

    async def response(self, job_id: str, operation: str, timeout: float) -> str:
        """The outcome ClusterD gives the operator (one message on the response stream)."""
        if operation == "stress_test":
            call = self.stub.SubscribeStressTestResponse(pb.StressTestRequest(jobID=job_id), timeout=timeout)
        else:
            call = self.stub.SubscribeSwitchNicSignal(pb.SwitchNicRequest(jobID=job_id), timeout=timeout)
        message = await asyncio.wait_for(call.read(), timeout)
        call.cancel()
        return "" if message is grpc.aio.EOF else str(message.msg)
