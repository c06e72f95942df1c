"""The simulated ClusterD's protobuf messages: signals built, requests decoded for the journal.

Decoding is tolerant on purpose: the journal must show what a buggy client really sent
(a rank ``" 2"``, a type ``"x"``), so malformed entries are kept under ``bad_faults``
instead of raising.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from bridge._proto import recover_pb2 as pb

from bridge.sim.clusterd_rules import FaultPair, is_canonical_pair


def fault_pairs(ranks: Iterable[pb.FaultRank]) -> list[FaultPair]:
    return [(f.rankId, f.faultType) for f in ranks]


def fault_ranks(faults: Iterable[FaultPair] | Mapping[Any, Any]) -> list[pb.FaultRank]:
    """``FaultRank`` messages from pairs or a ``{rank: type}`` map (values stringified)."""
    items = faults.items() if isinstance(faults, Mapping) else faults
    return [pb.FaultRank(rankId=str(rank), faultType=str(kind)) for rank, kind in items]


def faults_detail(pairs: Iterable[FaultPair]) -> dict[str, Any]:
    """``faults`` as ``{int rank: int type}`` (ClusterD's merge rule: type 1 sticky, else
    the later wins) plus ``bad_faults``, the entries that are not canonical."""
    faults: dict[int, int] = {}
    bad: list[FaultPair] = []
    for rank, fault_type in pairs:
        if not is_canonical_pair(rank, fault_type):
            bad.append((rank, fault_type))
            continue
        number = int(rank)
        if faults.get(number) != 1:
            faults[number] = int(fault_type)
    out: dict[str, Any] = {"faults": faults}
    if bad:
        out["bad_faults"] = bad
    return out


def status_detail(request: Any) -> dict[str, Any] | None:
    if not request.HasField("status"):
        return None
    return {"code": request.status.code, "info": request.status.info}


def request_detail(method: str, request: Any) -> dict[str, Any]:
    """The decoded request of a Recover RPC, for the journal."""
    detail: dict[str, Any] = {}
    if method in ("Init", "Register", "HealthCheck", "SubscribeProcessManageSignal"):
        detail["role"] = request.role
        return detail
    if method in ("ReportStopComplete", "ReportRecoverStatus"):
        detail["status"] = status_detail(request)
    if method in ("ReportStopComplete", "ReportRecoverStrategy", "ReportProcessFault"):
        detail.update(faults_detail(fault_pairs(request.faultRanks)))
    if method == "ReportRecoverStrategy":
        detail["strategies"] = list(request.strategies)
    if method == "ReportRecoverStatus":
        detail["strategy"] = request.strategy
        detail["isolateRankIds"] = list(request.isolateRankIds)
    return detail


def signal_detail(signal: pb.ProcessManageSignal) -> dict[str, Any]:
    """Every field of a signal, actions in order, faults decoded."""
    detail: dict[str, Any] = {
        "uuid": signal.uuid,
        "jobId": signal.jobId,
        "actions": list(signal.actions),
    }
    detail.update(faults_detail(fault_pairs(signal.faultRanks)))
    detail.update(
        changeStrategy=signal.changeStrategy,
        timeout=signal.timeout,
        nodeRankIds=list(signal.nodeRankIds),
        extraParams=signal.extraParams,
    )
    return detail


def make_signal(job_id: str, uuid: str, signal_type: str, actions: Iterable[str] = (),
                faults: Iterable[FaultPair] = (), *, change_strategy: str = "",
                timeout: int = 0, node_rank_ids: Iterable[str] = (),
                extra_params: str = "") -> pb.ProcessManageSignal:
    return pb.ProcessManageSignal(
        uuid=uuid,
        jobId=job_id,
        signalType=signal_type,
        actions=list(actions),
        faultRanks=fault_ranks(list(faults)),
        changeStrategy=change_strategy,
        timeout=timeout,
        nodeRankIds=list(node_rank_ids),
        extraParams=extra_params,
    )
