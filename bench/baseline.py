"""What the benchmarks measure the bridge against: the existing MindCluster client's way
of relaying a fault report, and the percentile helper they share."""

from __future__ import annotations

import math

import grpc

from bridge._proto import recover_pb2 as pb
from bridge._proto import recover_pb2_grpc


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` by the nearest-rank method: the smallest value with
    at least ``q`` of the samples at or below it (p99 of 100 samples is the 99th)."""
    ordered = sorted(values)
    rank = math.ceil(q * len(ordered))  # 1-based
    return ordered[min(len(ordered), max(rank, 1)) - 1]


class SyncRelay:
    """The existing client's shape: the callback itself builds the request item by item
    and makes a blocking gRPC call with no deadline before it returns to the controller."""

    def __init__(self, address: str, job_id: str) -> None:
        self.job_id = job_id
        self.channel = grpc.insecure_channel(address)
        self.stub = recover_pb2_grpc.RecoverStub(self.channel)

    def report_fault_ranks(self, faults: dict[int, int], codes: dict[int, str] | None = None) -> int:
        request = pb.ProcessFaultRequest(jobId=self.job_id)
        for rank, fault_type in faults.items():
            request.faultRanks.append(pb.FaultRank(rankId=str(rank), faultType=str(fault_type)))
        return self.stub.ReportProcessFault(request).code

    def close(self) -> None:
        self.channel.close()
