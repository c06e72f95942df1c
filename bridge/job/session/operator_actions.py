"""ClusterD's operator (OM) actions on the job's ranks, declined at once.

A NIC switch (``SubscribeNotifySwitch``) or a stress test (``SubscribeNotifyExecStressTest``)
needs the ranks' processes, and the bridge hosts only the controller. ``OperatorActions``
holds both notify streams for the whole run and answers each request, after
``REPLY_DELAY``, that it did not perform it, in ClusterD's terms: ``SwitchResult{result:
false}`` for a NIC switch, code ``"1"`` (exec failed) for every rank and op of a stress
test. Why these answers and what ClusterD does with them: docs/clusterd.md section 12.

Each request is logged and counted in ``tft_bridge_om_requests_total{operation,result}``;
its reply is one unary call with the RPC deadline, never repeated (ClusterD's result
channels hold one answer: a second would block its handler).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from bridge._proto import recover_pb2 as pb
from bridge.job.session.aux_stream import AuxStream
from bridge.job.session.clusterd import ClusterDClient, RpcFailure, client_info
from bridge.job.metrics import BridgeMetrics

log = logging.getLogger(__name__)

NOTIFY_SWITCH = "/Recover/SubscribeNotifySwitch"
NOTIFY_STRESS_TEST = "/Recover/SubscribeNotifyExecStressTest"
REPLY_SWITCH = "/Recover/ReplySwitchNicResult"
REPLY_STRESS_TEST = "/Recover/ReplyStressTestResult"
#: ClusterD's StressTestExecFail (clusterd/pkg/common/constant/const.go): the test did not run.
STRESS_TEST_EXEC_FAIL = "1"
DECLINED = "not run: tft-bridge hosts the controller only"
#: Ranks answered one by one; a larger job gets an empty result, which ClusterD's
#: parseStressTestResult reads the same way (nothing isolated, training resumes): one
#: entry per rank and op would pass gRPC's 4 MiB message limit near 50 000 ranks, and
#: ClusterD echoes the whole result into its log and the operator's message.
MAX_RESULT_RANKS = 4096
#: ClusterD's stress ops (om_service.go: "0: aic, 1: p2p"), as result keys.
STRESS_OP_NAMES = {0: "aic", 1: "p2p"}
SHOWN_RANKS = 8  # how many ranks a log line names
#: How long an answer waits: the operator's response stream can be opened only while the
#: flow runs, and an answer at once ends the flow before an operator's tool opened it
#: (docs/clusterd.md section 12).
REPLY_DELAY = 0.25


def declined_stress_result(job_id: str, request: pb.StressTestRankParams) -> pb.StressTestResult:
    """Every rank and op of ``request`` answered "exec failed" (module docstring); no
    rank at all beyond ``MAX_RESULT_RANKS``."""
    result = pb.StressTestResult(jobId=job_id)
    if len(request.stressParam) > MAX_RESULT_RANKS:
        return result
    for rank, ops in request.stressParam.items():
        rank_result = result.stressResult[rank]
        for op in ops.ops or (0,):
            entry = rank_result.rankResult[STRESS_OP_NAMES.get(op, str(op))]
            entry.code, entry.result = STRESS_TEST_EXEC_FAIL, f"{STRESS_TEST_EXEC_FAIL}-exec failed ({DECLINED})"
    return result


def _shown(ranks: list[str]) -> str:
    more = f" ... {len(ranks)} ranks in all" if len(ranks) > SHOWN_RANKS else ""
    return ",".join(ranks[:SHOWN_RANKS]) + more


class OperatorActions:
    """The two notify streams and their answers: ``run()`` on the event loop until
    ``stop()``; subscribes only while ``ready`` (the signal stream is live)."""

    def __init__(self, job_id: str, client: ClusterDClient, metrics: BridgeMetrics, *,
                 ready: Callable[[], Awaitable[Any]], reply_delay: float = REPLY_DELAY) -> None:
        self.job_id = job_id
        self.reply_delay = reply_delay
        self.client = client
        self.metrics = metrics
        request = client_info(job_id, client.config.role)
        self.streams = [
            AuxStream("switch_nic", client, metrics, NOTIFY_SWITCH, request, pb.SwitchRankList.FromString,
                      self._switch, ready=ready),
            AuxStream("stress_test", client, metrics, NOTIFY_STRESS_TEST, request,
                      pb.StressTestRankParams.FromString, self._stress_test, ready=ready),
        ]

    async def run(self) -> None:
        await asyncio.gather(*(stream.run() for stream in self.streams))

    def stop(self) -> None:
        for stream in self.streams:
            stream.stop()

    def _foreign(self, operation: str, job_id: str) -> bool:
        if job_id and job_id != self.job_id:
            self.metrics.om_requests.labels(operation, "foreign_job").inc()
            log.warning("ignoring a %s request for job %r (this bridge serves %r)", operation, job_id[:128], self.job_id)
            return True
        return False

    async def _switch(self, request: pb.SwitchRankList) -> None:
        if self._foreign("switch_nic", request.jobId):
            return
        ranks = list(request.rankID)
        log.warning("ClusterD asks the job to switch the NICs of ranks %s (ops %s): declined, the bridge cannot "
                    "switch NICs (that needs the ranks); ClusterD answers the operator 'switch nic failed' and "
                    "runs its failure path (a recovery cycle with no fault ranks)", _shown(ranks),
                    list(request.op)[:SHOWN_RANKS])
        reply = pb.SwitchResult(jobId=self.job_id, result=False)
        await self._reply("switch_nic", REPLY_SWITCH, reply.SerializeToString())

    async def _stress_test(self, request: pb.StressTestRankParams) -> None:
        if self._foreign("stress_test", request.jobId):
            return
        ranks = sorted(request.stressParam)
        log.warning("ClusterD asks the job to stress-test ranks %s: declined, the bridge cannot run stress tests "
                    "(that needs the ranks); answered 'exec failed', ClusterD resumes training", _shown(ranks))
        reply = declined_stress_result(self.job_id, request)
        await self._reply("stress_test", REPLY_STRESS_TEST, reply.SerializeToString())

    async def _reply(self, operation: str, method: str, payload: bytes) -> None:
        await asyncio.sleep(self.reply_delay)
        try:
            status = await self.client.call_status(method, payload)
        except RpcFailure as failure:
            result = "reply_failed"
            log.error("the %s answer did not reach ClusterD (%s %s): ClusterD waits for it until its own "
                      "timeout, training stays paused meanwhile", operation, failure.status, failure.detail[:200])
        else:
            result = "declined" if status.code == 0 else "reply_failed"
            if status.code != 0:
                log.error("ClusterD refused the %s answer: code %d %s", operation, status.code, status.info[:200])
        self.metrics.om_requests.labels(operation, result).inc()
