"""The simulated ClusterD against plain grpc.aio clients.

Every test pins one behaviour of the real server (docs/clusterd.md) and would fail if the
simulation were made kinder: the fault centre's own retry cycles and preExitProcess, the
real delays (scaled), stale reports consumed later, blocked second reports, 599 on reset,
OK stream ends, lost faults, nil-status crashes, fallbacks, no exit-completed, and so on.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from dataclasses import replace
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
import pytest

from bridge._proto import config_pb2, config_pb2_grpc, fault_pb2, fault_pb2_grpc
from bridge._proto import recover_pb2 as pb
from bridge._proto import recover_pb2_grpc as pb_grpc
from bridge.sim import clusterd_rules as rules
from bridge.sim.clusterd import SERVER_OPTIONS, SimClusterD, SimJob
from bridge.sim.clusterd_release import RELEASES
from bridge.sim.clusterd_timings import REAL, Timings
from bridge.sim.journal import Journal, JournalEntry

pytestmark = pytest.mark.timeout(20)

JOB = "job-1"
#: The real delays / 100 (ratios kept), with the few a test waits on made shorter still.
T = REAL.scaled(0.01, keepalive_interval=0.1, global_fault_delay=0.01, flush_delay=0.01,
                report_timeout=3.0, dump_exit_repeat=0.05)
FAST: dict[str, Any] = dict(timings=T, seed=7, rank_table_delay=0.01)


# --------------------------------------------------------------------------- helpers


class Stream:
    """A subscribe stream read in the background; signals queue up in order."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.items: asyncio.Queue[Any] = asyncio.Queue()
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.task = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        try:
            async for message in self.call:
                self.items.put_nowait(message)
            self.code = await self.call.code()
        except grpc.aio.AioRpcError as error:
            self.code, self.details = error.code(), error.details() or ""
        except asyncio.CancelledError:
            self.code = grpc.StatusCode.CANCELLED
        self.items.put_nowait(None)

    async def next(self, timeout: float = 2.0, *, keepalive: bool = False) -> Any:
        """The next message (keep-alives skipped unless asked for)."""
        deadline = time.monotonic() + timeout
        while True:
            item = await asyncio.wait_for(self.items.get(), max(0.01, deadline - time.monotonic()))
            if item is None:
                raise AssertionError(f"stream ended with {self.code} {self.details!r}")
            if keepalive or getattr(item, "signalType", "") != "keep-alive":
                return item

    async def no_signal(self, seconds: float) -> None:
        """Nothing but keep-alives (and no end) for ``seconds``."""
        with pytest.raises(TimeoutError):
            await self.next(seconds)

    async def ended(self, timeout: float = 2.0) -> grpc.StatusCode:
        await asyncio.wait_for(asyncio.shield(self.task), timeout)
        assert self.code is not None
        return self.code

    def cancel(self) -> None:
        self.call.cancel()


class Client:
    """A plain grpc.aio client of the Recover service for one job."""

    def __init__(self, channel: grpc.aio.Channel, job_id: str = JOB) -> None:
        self.channel = channel
        self.stub = pb_grpc.RecoverStub(channel)
        self.job_id = job_id
        self.info = pb.ClientInfo(jobId=job_id, role="test")

    async def init(self) -> int:
        return (await self.stub.Init(self.info, timeout=2)).code

    async def register(self) -> int:
        return (await self.stub.Register(self.info, timeout=2)).code

    async def subscribe(self, sim: SimClusterD) -> Stream:
        opened = len(sim.journal.select("stream-open", job_id=self.job_id))
        stream = Stream(self.stub.SubscribeProcessManageSignal(self.info))
        await sim.wait_for(lambda e: e.kind == "stream-open" and e.job_id == self.job_id
                           and len(sim.journal.select("stream-open", job_id=self.job_id)) > opened)
        return stream

    async def session(self, sim: SimClusterD) -> Stream:
        assert await self.init() == 0
        assert await self.register() == 0
        return await self.subscribe(sim)

    async def fault(self, faults: dict[Any, Any], timeout: float = 2) -> int:
        request = pb.ProcessFaultRequest(jobId=self.job_id, faultRanks=_ranks(faults))
        return (await self.stub.ReportProcessFault(request, timeout=timeout)).code

    async def stop_complete(self, code: int = 0, timeout: float = 2) -> int:
        request = pb.StopCompleteRequest(jobId=self.job_id, status=pb.Status(code=code))
        return (await self.stub.ReportStopComplete(request, timeout=timeout)).code

    async def strategies(self, names: Iterable[str], timeout: float = 2) -> int:
        request = pb.RecoverStrategyRequest(jobId=self.job_id, strategies=list(names))
        return (await self.stub.ReportRecoverStrategy(request, timeout=timeout)).code

    async def status(self, code: int, strategy: str, isolate: Iterable[str] = (),
                     timeout: float = 2) -> int:
        request = pb.RecoverStatusRequest(jobId=self.job_id, status=pb.Status(code=code),
                                          strategy=strategy, isolateRankIds=list(isolate))
        return (await self.stub.ReportRecoverStatus(request, timeout=timeout)).code


def _ranks(faults: dict[Any, Any]) -> list[pb.FaultRank]:
    return [pb.FaultRank(rankId=str(r), faultType=str(t)) for r, t in faults.items()]


def faults_of(signal: pb.ProcessManageSignal) -> dict[int, int]:
    out: dict[int, int] = {}
    for fault in signal.faultRanks:
        rank, kind = int(fault.rankId), int(fault.faultType)
        if out.get(rank) != 1:
            out[rank] = kind
    return out


def is_state(job: str, name: str) -> Any:
    return lambda e: e.kind == "state" and e.job_id == job and e.name == name


async def make_sim(*jobs: SimJob, **options: Any) -> SimClusterD:
    settings = {**FAST, **options}
    sim = SimClusterD(jobs or (SimJob(JOB, world_size=16, devices_per_pod=8),), **settings)
    await sim.start()
    return sim


@contextlib.asynccontextmanager
async def own_sim(*jobs: SimJob, **options: Any) -> AsyncIterator[tuple[SimClusterD, Client]]:
    """A server with jobs or options of the test's own (the ``sim`` fixture's is the
    default one) and a client on it; the server stopped however the block ends, so a
    failed test leaves no port or task behind."""
    sim = await make_sim(*jobs, **options)
    try:
        assert sim.address is not None
        async with grpc.aio.insecure_channel(sim.address) as chan:
            yield sim, Client(chan)
    finally:
        await sim.stop()


@pytest.fixture
async def sim() -> AsyncIterator[SimClusterD]:
    server = await make_sim()
    yield server
    await server.stop()
    assert server.violations == []


@pytest.fixture
async def channel(sim: SimClusterD) -> AsyncIterator[grpc.aio.Channel]:
    assert sim.address is not None
    async with grpc.aio.insecure_channel(sim.address) as chan:
        yield chan


@pytest.fixture
def client(channel: grpc.aio.Channel) -> Client:
    return Client(channel)


async def run_to_strategy_wait(sim: SimClusterD, client: Client, stream: Stream,
                               faults: dict[int, int]) -> tuple[Any, Any]:
    """Fault -> stopTrain -> StopComplete -> globalFault; returns both signals."""
    assert await client.fault(faults) == 0
    stop = await stream.next()
    assert stop.signalType == "stopTrain"
    assert await client.stop_complete() == 0
    global_fault = await stream.next()
    assert global_fault.signalType == "globalFault"
    await sim.wait_for(is_state(client.job_id, "WaitReportRecoverStrategyState"))
    return stop, global_fault


# --------------------------------------------------------------------------- transport and session


def test_server_options_follow_clusterd_limits() -> None:
    options = dict(SERVER_OPTIONS)
    assert options["grpc.http2.min_ping_interval_without_data_ms"] == 3000
    assert options["grpc.keepalive_permit_without_calls"] == 1
    assert options["grpc.max_receive_message_length"] == 4 * 1024 * 1024
    assert options["grpc.max_send_message_length"] == 8 * 1024 * 1024
    assert options["grpc.max_concurrent_streams"] == 64


async def test_start_reports_address_and_stop_leaves_no_task() -> None:
    sim = await make_sim()
    assert sim.address is not None and re.fullmatch(r"127\.0\.0\.1:\d+", sim.address)
    async with grpc.aio.insecure_channel(sim.address) as chan:
        client = Client(chan)
        stream = await client.session(sim)
        await client.fault({1: 1})
        await stream.next()  # a cycle waits for StopComplete
        # A blocked second report: its put task must not outlive stop().
        await client.strategies(["recover"])
        blocked = asyncio.ensure_future(client.strategies(["recover"], timeout=5))
        await sim.wait_for(lambda e: e.kind == "report-blocked"
                           and e.name == "ReportRecoverStrategy")
        assert not blocked.done()
        await sim.stop()
        with pytest.raises(grpc.aio.AioRpcError):
            await blocked
        await stream.ended()
    leftovers = [t for t in asyncio.all_tasks() if t.get_name().startswith(f"{JOB}:")]
    assert leftovers == []


async def test_init_codes(sim: SimClusterD, channel: grpc.aio.Channel) -> None:
    sim.add_job(SimJob("off", process_recover=False))
    sim.add_job(SimJob("no-pg", pod_group_exists=False))
    assert await Client(channel, "unknown").init() == 502
    assert await Client(channel, "no-pg").init() == 502
    assert await Client(channel, "off").init() == 403
    assert await Client(channel).init() == 0
    # Cached after the first success: later PodGroup changes are not seen.
    sim.jobs[JOB].process_recover = False
    assert await Client(channel).init() == 0


async def test_register_codes() -> None:
    sim = await make_sim(SimJob("a"), SimJob("b"), SimJob("c"), max_jobs=2)
    try:
        async with grpc.aio.insecure_channel(sim.address) as chan:
            a, b, c = Client(chan, "a"), Client(chan, "b"), Client(chan, "c")
            assert await a.register() == 408  # before Init
            assert await Client(chan, "nobody").register() == 408
            assert await a.init() == 0
            assert await a.register() == 0
            assert await a.register() == 0  # idempotent
            assert sim.labels("a")["process-recover-enable"] == "on"
            assert await b.init() == 0
            sim.jobs["b"].pod_group_exists = False  # PodGroup gone after Init
            assert await b.register() == 402
            sim.jobs["b"].pod_group_exists = True
            assert await b.register() == 0
            assert await c.init() == 0
            assert await c.register() == 500  # max_jobs reached
            # Register does not start the event loop: a fault before Subscribe is lost.
            assert await a.fault({1: 1}) == 0
            assert sim.journal.select("fault-lost", job_id="a")
            assert sim.state("a") == "INIT"
    finally:
        await sim.stop()


async def test_healthcheck_always_zero_and_never_rate_limited(
        sim: SimClusterD, channel: grpc.aio.Channel) -> None:
    stub = pb_grpc.RecoverStub(channel)
    sim.fail_next_unary(1)
    reply = await stub.HealthCheck(pb.ClientInfo(jobId="whoever"), timeout=2)
    assert reply.code == 0
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.Init(pb.ClientInfo(jobId=JOB), timeout=2)
    assert error.value.code() == grpc.StatusCode.UNKNOWN
    assert error.value.details() == "qps exceeded, method=/Recover/Init"


async def test_qps_limit_token_bucket() -> None:
    async with own_sim(qps_limit=3) as (sim, client):
        codes: list[int | str] = []
        for _ in range(5):
            try:
                codes.append(await client.init())
            except grpc.aio.AioRpcError as error:
                assert error.code() == grpc.StatusCode.UNKNOWN
                assert error.details().startswith("qps exceeded")
                codes.append("qps")
        assert codes[:3] == [0, 0, 0] and "qps" in codes[3:]
        stub = pb_grpc.RecoverStub(client.channel)
        for _ in range(5):  # HealthCheck has its own bucket
            assert (await stub.HealthCheck(client.info, timeout=2)).code == 0


async def test_fail_next_unary_covers_reports_and_config(sim: SimClusterD,
                                                         client: Client,
                                                         channel: grpc.aio.Channel) -> None:
    sim.fail_next_unary(2)
    with pytest.raises(grpc.aio.AioRpcError, match="method=/Recover/ReportStopComplete"):
        await client.stop_complete()
    config = config_pb2_grpc.ConfigStub(channel)
    with pytest.raises(grpc.aio.AioRpcError, match=r"method=/config\.Config/Register"):
        await config.Register(config_pb2.ClientInfo(jobId=JOB), timeout=2)
    assert await client.init() == 0


async def test_subscribe_unregistered_fails_unknown(client: Client, sim: SimClusterD) -> None:
    stream = Stream(client.stub.SubscribeProcessManageSignal(client.info))
    assert await stream.ended() == grpc.StatusCode.UNKNOWN
    assert stream.details == f"jobId={JOB} not registed"
    assert await client.init() == 0
    stream = Stream(client.stub.SubscribeProcessManageSignal(client.info))
    assert await stream.ended() == grpc.StatusCode.UNKNOWN  # Init alone is not enough


async def test_reports_for_unknown_job_answer_400(sim: SimClusterD, client: Client) -> None:
    assert await client.fault({1: 1}) == 400
    assert await client.stop_complete() == 400
    assert await client.strategies(["recover"]) == 400
    assert await client.status(0, "recover") == 400
    assert await client.init() == 0
    assert await client.stop_complete() == 400  # inited is not registered


async def test_status_info_strings_are_the_real_ones_misspellings_included(
        sim: SimClusterD, channel: grpc.aio.Channel) -> None:
    sim.add_job(SimJob("off", process_recover=False))
    stub = pb_grpc.RecoverStub(channel)

    async def info(call: Any, request: Any) -> tuple[int, str]:
        reply = await call(request, timeout=2)
        return reply.code, reply.info

    def who(job: str) -> pb.ClientInfo:
        return pb.ClientInfo(jobId=job, role="test")

    assert await info(stub.Init, who("nope")) == (502, "job(uid=nope) one of jobName, pgName, ns is empty")
    assert await info(stub.Init, who("off")) == (
        403, "job(uid=off) process-recover-enable and subhealthy hotswtich not open:<nil>")
    assert await info(stub.Register, who(JOB)) == (408, f"jobId={JOB} not inited")
    assert await info(stub.Init, who(JOB)) == (0, f"job(uid={JOB}) init success")
    assert await info(stub.Init, who(JOB)) == (0, f"job(uid={JOB}) init success")  # cached
    assert await info(stub.Register, who(JOB)) == (0, "register success")
    assert await info(stub.Register, who(JOB)) == (0, "register success")
    assert await info(stub.HealthCheck, who("x")) == (0, "jobId=x, receive HeathCheck")
    unknown = pb.StopCompleteRequest(jobId="nope", status=pb.Status(code=0))
    assert await info(stub.ReportStopComplete, unknown) == (400, "jobId=nope not registed")
    assert await info(stub.ReportProcessFault, pb.ProcessFaultRequest(jobId="nope")) == (
        400, "jobId=nope not registed")
    assert await info(stub.ReportProcessFault, pb.ProcessFaultRequest(jobId=JOB)) == (
        0, "receive ReportProcessFault")
    queued = pb.RecoverStrategyRequest(jobId=JOB, strategies=["retry"])
    assert await info(stub.ReportRecoverStrategy, queued) == (
        0, f"jobId={JOB}, uuid=, receive ReportRecoverStrategy")


async def test_register_refusals_carry_the_real_info() -> None:
    sim = await make_sim(SimJob("a"), SimJob("b"), max_jobs=1)
    try:
        async with grpc.aio.insecure_channel(sim.address) as chan:
            stub = pb_grpc.RecoverStub(chan)
            for job in ("a", "b"):
                assert (await stub.Init(pb.ClientInfo(jobId=job), timeout=2)).code == 0
            assert (await stub.Register(pb.ClientInfo(jobId="a"), timeout=2)).code == 0
            full = await stub.Register(pb.ClientInfo(jobId="b"), timeout=2)
            assert (full.code, full.info) == (500, "out of max serve jobs, reuse registry for jobId=b")
            sim.jobs["b"].pod_group_exists = False
            gone = await stub.Register(pb.ClientInfo(jobId="b"), timeout=2)
            assert (gone.code, gone.info) == (402, "jobId=b not exist, reuse registry")
    finally:
        await sim.stop()


# --------------------------------------------------------------------------- the stream


async def test_keepalive_uuid_is_empty_when_idle_and_the_cycle_uuid_in_a_cycle(
        sim: SimClusterD, client: Client) -> None:
    stream = await client.session(sim)
    idle = await stream.next(keepalive=True)
    assert idle.signalType == "keep-alive" and idle.uuid == "" and idle.jobId == JOB
    assert list(idle.actions) == [] and list(idle.faultRanks) == []
    await client.fault({3: 1})
    stop = await stream.next()
    assert re.fullmatch(r"[0-9A-F]+-[0-9a-f]{32}", stop.uuid)
    while (signal := await stream.next(keepalive=True)).signalType != "keep-alive":
        pass
    assert signal.uuid == stop.uuid


async def test_successful_cycle_expands_pods_and_ends_stream_with_ok() -> None:
    async with own_sim(SimJob(JOB, world_size=8, devices_per_pod=2,
                              strategies=("recover", "dump"))) as (sim, client):
        stream = await client.session(sim)
        stop, global_fault = await run_to_strategy_wait(sim, client, stream, {1: 1, 4: 1})
        assert list(stop.actions) == ["stop_train"]
        assert faults_of(stop) == {1: 1, 4: 1}  # as reported, not expanded
        assert list(global_fault.actions) == ["on_global_rank", "fault_nodes_exit"]
        assert faults_of(global_fault) == {0: 1, 1: 1, 4: 1, 5: 1}
        assert sorted(global_fault.nodeRankIds) == ["0", "2"]
        assert global_fault.timeout == 0
        assert await client.strategies(["recover", "dump", "exit"]) == 0
        change = await stream.next()
        assert (change.signalType, list(change.actions)) == ("changeStrategy", ["change_strategy"])
        assert change.changeStrategy == "recover"
        assert await client.status(0, "recover") == 0
        assert await stream.ended() == grpc.StatusCode.OK
        assert {stop.uuid, global_fault.uuid, change.uuid} == {stop.uuid}
        assert sim.podgroup(JOB)["ProcessRecoverStatus"] == "recover-success"
        assert sim.state(JOB) == "INIT" and sim.uuid(JOB) == ""
        assert sim.journal.states(JOB)[1:] == [  # ClusterD's action path
            "NotifyWaitFaultFlushingState", "NotifyStopTrainState",
            "WaitReportStopCompleteState", "WaitFaultFlushFinishedState",
            "NotifyGlobalFaultState", "WaitReportRecoverStrategyState",
            "NotifyDecidedStrategyState", "WaitReportProcessRecoverStatusState",
            "CheckRecoverResultState", "INIT",
        ]
        # The path as the real server logs it when the cycle closes, its event names
        # included (read from the real ClusterD's log by the differential).
        assert [path for path, _ in sim.journal.action_paths(JOB)] == [
            "INIT(faultOccur)-->NotifyWaitFaultFlushingState(notifyFinish)-->NotifyStopTrainState(notifySuccess)-->"
            "WaitReportStopCompleteState(receiveReport)-->WaitFaultFlushFinishedState(flushFinished)-->"
            "NotifyGlobalFaultState(notifySuccess)-->WaitReportRecoverStrategyState(receiveReport)-->"
            "NotifyDecidedStrategyState(notifyRecoverStrategySuccess)-->"
            "WaitReportProcessRecoverStatusState(receiveReport)-->CheckRecoverResultState(recoverSuccess)-->INIT"]
        # A fault between the stream end and the re-subscribe is lost.
        assert await client.fault({2: 1}) == 0
        assert sim.journal.select("fault-lost", job_id=JOB)
        stream = await client.subscribe(sim)
        await stream.no_signal(0.2)
        assert sim.state(JOB) == "INIT"
        assert sim.violations == []


async def test_second_subscriber_ends_first_with_ok_and_aborts_the_cycle(
        sim: SimClusterD, client: Client) -> None:
    first = await client.session(sim)
    await client.fault({1: 1})
    await first.next()
    # the server moves on once its send returned, which may be after the client read it
    await sim.wait_for(is_state(JOB, "WaitReportStopCompleteState"))
    second = await client.subscribe(sim)
    assert await first.ended() == grpc.StatusCode.OK
    # Streams are numbered per job, from 1.
    assert [e.detail["stream"] for e in sim.journal.select("stream-open", job_id=JOB)] == [1, 2]
    assert sim.journal.select("stream-end", job_id=JOB)[0].detail["stream"] == 1
    assert sim.state(JOB) == "INIT" and sim.uuid(JOB) == ""
    # The aborted cycle's StopComplete is just buffered; nothing is sent.
    assert await client.stop_complete() == 0
    await second.no_signal(0.2)


async def test_client_cancel_aborts_the_cycle(sim: SimClusterD, client: Client) -> None:
    stream = await client.session(sim)
    await run_to_strategy_wait(sim, client, stream, {1: 1})
    stream.cancel()
    await stream.ended()
    await sim.wait_for(lambda e: e.kind == "stream-end" and e.code == grpc.StatusCode.CANCELLED.value[0])
    await sim.wait_for(lambda e: e.kind == "state" and e.name == "INIT"
                       and "cancelled" in e.detail["event"])
    assert sim.state(JOB) == "INIT"
    assert await client.strategies(["recover"]) == 0  # buffered, nobody acts on it
    assert sim.journal.signals("changeStrategy") == []


async def test_drop_subscriber_is_unavailable_and_blocked_report_gets_599(
        sim: SimClusterD, client: Client) -> None:
    stream = await client.session(sim)
    await client.fault({1: 1})
    await stream.next()
    await client.stop_complete()
    await sim.wait_for(is_state(JOB, "WaitReportRecoverStrategyState"))
    assert await client.status(0, "recover") == 0  # out of phase: kept
    blocked = asyncio.ensure_future(client.status(0, "recover", timeout=5))
    # The second one is stuck inside the server: wait until it is, so the reset below
    # cannot overtake it (a report arriving after the reset would be queued: 0, not 599).
    await sim.wait_for(lambda e: e.kind == "report-blocked" and e.name == "ReportRecoverStatus")
    assert not blocked.done()
    await sim.drop_subscriber(JOB)
    assert await stream.ended() == grpc.StatusCode.UNAVAILABLE
    assert await blocked == 599
    assert sim.state(JOB) == "INIT"


async def test_faults_with_no_subscriber_are_lost(sim: SimClusterD, client: Client) -> None:
    assert await client.init() == 0 and await client.register() == 0
    assert await client.fault({5: 1}) == 0
    lost = await sim.wait_for(lambda e: e.kind == "fault-lost")
    assert lost.detail["faults"] == {5: 1}
    stream = await client.subscribe(sim)
    await stream.no_signal(0.2)
    assert sim.state(JOB) == "INIT"


async def test_retry_type_faults_alone_start_nothing_without_retry_configured() -> None:
    async with own_sim(SimJob(JOB, world_size=16, devices_per_pod=8, strategies=("recover", "dump"))) as (sim, client):
        stream = await client.session(sim)
        assert await client.fault({3: 0, 4: 2}) == 0
        # 20 times the fault centre's delay: a retry cycle would have started by now.
        await stream.no_signal(20 * T.retry_report_delay[1])
        assert [e.detail["outcome"] for e in sim.journal.rpcs("ReportProcessFault")] == ["cached"]
        assert await client.fault({9: 1}) == 0
        stop = await stream.next()
        assert faults_of(stop) == {3: 0, 4: 2, 9: 1}  # the cached retry faults ride along
        assert [f.rankId for f in stop.faultRanks] == ["3", "4", "9"]


@pytest.mark.parametrize("fault_type", [0, 2])
async def test_uce_or_hccl_report_alone_starts_a_retry_cycle(fault_type: int) -> None:
    # No flush, no sleep before a pure retry globalFault: 30 s each would blow the timeout.
    async with own_sim(timings=replace(T, flush_delay=30.0, global_fault_delay=30.0,
                                       retry_report_delay=(0.05, 0.08), hccl_retry_pause=0.2)) as (sim, client):
        stream = await client.session(sim)
        assert await client.fault({3: fault_type}) == 0
        report = sim.journal.rpcs("ReportProcessFault")[-1]
        assert report.detail["outcome"] == "scheduled"
        stop = await stream.next()
        assert stop.signalType == "stopTrain" and stop.uuid and faults_of(stop) == {3: fault_type}
        centre = sim.journal.select("fault-centre", "retry-fault", JOB)[-1]
        assert 0.05 <= centre.detail["delay"] <= 0.08  # the fault centre's 0.7-1.0 s, scaled
        assert sim.journal.signals("stopTrain")[-1].at - centre.at >= centre.detail["delay"]
        await client.stop_complete()
        global_fault = await stream.next(5)
        assert list(global_fault.actions) == ["on_global_rank"]
        assert faults_of(global_fault) == {3: fault_type}
        assert list(global_fault.nodeRankIds) == []
        assert global_fault.timeout == (33 if fault_type == 2 else 0)
        await client.strategies(["retry", "recover", "dump"])
        change = await stream.next()
        assert (change.changeStrategy, list(change.nodeRankIds)) == ("retry", ["0"])
        deciding = sim.journal.select("state", "NotifyDecidedStrategyState", JOB)[-1]
        waited = sim.journal.signals("changeStrategy")[-1].at - deciding.at
        if fault_type == 2:
            assert waited >= 0.2  # HCCL: the real 3.0 s pause, scaled
        await client.status(0, "retry")
        assert await stream.ended() == grpc.StatusCode.OK
        assert sim.podgroup(JOB)["ProcessRecoverStatus"] == "retry-success"


async def test_uce_retry_change_strategy_does_not_wait_for_the_hccl_pause() -> None:
    async with own_sim(timings=replace(T, hccl_retry_pause=60.0)) as (sim, client):  # would blow the timeout
        stream = await client.session(sim)
        await client.fault({3: 0})
        await stream.next()
        await client.stop_complete()
        await stream.next()
        await client.strategies(["retry"])
        assert (await stream.next()).changeStrategy == "retry"
        await client.status(0, "retry")


async def test_retry_reports_during_the_fault_centre_delay_start_one_cycle() -> None:
    # The fault centre's times at half the real ones, so the second report lands inside the
    # delay on a loaded machine too (the scaled 7-10 ms did not always).
    centre = replace(T, retry_report_delay=(0.35, 0.5), retry_record_hold=5.0, fault_centre_period=0.5)
    async with own_sim(timings=centre) as (sim, client):
        stream = await client.session(sim)
        assert await client.fault({3: 0}) == 0
        assert await client.fault({4: 2}) == 0  # still before the cycle starts
        stop = await stream.next()
        assert faults_of(stop) == {3: 0, 4: 2}
        await client.stop_complete()
        assert (await stream.next()).signalType == "globalFault"
        assert len(sim.journal.signals("stopTrain")) == 1
        assert len(sim.journal.select("fault-centre", "retry-fault", JOB)) == 1
        assert sim.violations == []


async def test_signals_keep_order_and_actions_order(sim: SimClusterD, client: Client) -> None:
    stream = await client.session(sim)
    await client.fault({1: 1})
    await stream.next()
    await client.stop_complete()
    global_fault = await stream.next()
    assert list(global_fault.actions) == ["on_global_rank", "fault_nodes_exit"]
    await client.strategies(["recover"])
    await stream.next()
    kinds = [e.name for e in sim.journal.signals(job_id=JOB)]
    assert kinds == ["stopTrain", "globalFault", "changeStrategy"]
    await client.status(0, "recover")
    await stream.ended()


# --------------------------------------------------------------------------- report buffers


async def test_stale_stop_complete_is_consumed_by_the_next_cycle(sim: SimClusterD,
                                                                 client: Client) -> None:
    stream = await client.session(sim)
    assert await client.stop_complete() == 0  # while idle: queued, not refused
    await client.fault({1: 1})
    assert (await stream.next()).signalType == "stopTrain"
    # The server does not wait for the real StopComplete: globalFault comes anyway.
    assert (await stream.next()).signalType == "globalFault"
    assert len(sim.journal.rpcs("ReportStopComplete")) == 1


async def test_subscribe_drops_buffered_reports(sim: SimClusterD, client: Client) -> None:
    await client.session(sim)
    assert await client.stop_complete() == 0  # buffered...
    stream = await client.subscribe(sim)  # ...and dropped by the reset
    await client.fault({1: 1})
    await stream.next()
    await stream.no_signal(0.2)  # now the server really waits for StopComplete
    assert sim.state(JOB) == "WaitReportStopCompleteState"


async def test_faults_join_a_running_cycle(sim: SimClusterD, client: Client) -> None:
    stream = await client.session(sim)
    await client.fault({1: 1})
    await stream.next()
    assert await client.fault({17: 1, 30: 0}) == 0  # during the cycle: joins it
    assert sim.journal.rpcs("ReportProcessFault")[-1].detail["outcome"] == "joined"
    await client.stop_complete()
    global_fault = await stream.next()
    assert faults_of(global_fault) == {r: 1 for r in [*range(0, 8), *range(16, 24), *range(24, 32)]}
    assert sorted(global_fault.nodeRankIds, key=int) == ["0", "2", "3"]


async def test_second_report_blocks_until_the_deadline_and_lands_later(
        sim: SimClusterD, client: Client) -> None:
    stream = await client.session(sim)
    assert await client.stop_complete() == 0
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await client.stop_complete(code=7, timeout=0.3)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started >= 0.25
    # The server goroutine keeps trying: once the first is consumed, the second lands.
    await client.fault({1: 1})
    await stream.next()
    late = await sim.wait_for(lambda e: e.kind == "report-late")
    assert late.detail["status"]["code"] == 7
    await stream.next()  # globalFault
    # ...and it will answer the *next* StopComplete wait: a third report blocks again.
    with pytest.raises(grpc.aio.AioRpcError):
        await client.stop_complete(timeout=0.2)


async def test_reset_answers_blocked_report_599(sim: SimClusterD, client: Client) -> None:
    await client.session(sim)
    assert await client.strategies(["recover"]) == 0
    assert sim.journal.select(kind="report-blocked") == []  # an empty slot never blocks
    blocked = asyncio.ensure_future(client.strategies(["dump"], timeout=5))
    await sim.wait_for(lambda e: e.kind == "report-blocked"
                       and e.name == "ReportRecoverStrategy")
    assert not blocked.done()
    await client.subscribe(sim)  # any reset
    assert await blocked == 599


async def test_missing_status_is_a_violation_and_crashes(sim: SimClusterD, client: Client) -> None:
    stream = await client.session(sim)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await client.stub.ReportStopComplete(pb.StopCompleteRequest(jobId=JOB), timeout=2)
    assert error.value.code() == grpc.StatusCode.INTERNAL
    assert await stream.ended() == grpc.StatusCode.OK  # the job was reset
    with pytest.raises(grpc.aio.AioRpcError):
        await client.stub.ReportRecoverStatus(pb.RecoverStatusRequest(jobId="nobody", strategy="dump"),
                                              timeout=2)
    assert len(sim.violations) == 2 and "without status" in sim.violations[0]
    assert len(sim.journal.select("violation")) == 2
    sim.violations.clear()


async def test_stop_complete_404_sends_kill_master(sim: SimClusterD, client: Client) -> None:
    stream = await client.session(sim)
    await client.fault({1: 1})
    stop = await stream.next()
    assert await client.stop_complete(code=404) == 0
    kill = await stream.next()
    assert kill.signalType == "killMaster" and kill.uuid == stop.uuid
    assert await stream.ended() == grpc.StatusCode.OK


async def test_stop_complete_failure_code_still_counts_as_stopped(sim: SimClusterD,
                                                                  client: Client) -> None:
    stream = await client.session(sim)
    await client.fault({1: 1})
    await stream.next()
    assert await client.stop_complete(code=499) == 0
    assert (await stream.next()).signalType == "globalFault"


# --------------------------------------------------------------------------- strategies


async def test_fault_centre_retry_fault_skips_the_flush_and_retries() -> None:
    async with own_sim(flush_delay=30.0, global_fault_delay=30.0) as (sim, client):  # would blow the timeout
        stream = await client.session(sim)
        assert await sim.start_clusterd_fault(JOB, {3: 0}) == "started"
        stop = await stream.next()
        assert faults_of(stop) == {3: 0}
        await client.stop_complete()
        global_fault = await stream.next(5)
        assert list(global_fault.actions) == ["on_global_rank"]
        assert faults_of(global_fault) == {3: 0}
        assert list(global_fault.nodeRankIds) == [] and global_fault.timeout == 0
        await client.strategies(["retry", "recover", "dump"])
        change = await stream.next()
        assert change.changeStrategy == "retry"
        await client.status(0, "retry")
        assert await stream.ended() == grpc.StatusCode.OK
        assert sim.podgroup(JOB)["ProcessRecoverStatus"] == "retry-success"


async def test_type1_cycle_waits_flush_plus_sleep_before_global_fault() -> None:
    async with own_sim(timings=replace(T, flush_delay=0.1, global_fault_delay=0.3)) as (sim, client):
        stream = await client.session(sim)
        await run_to_strategy_wait(sim, client, stream, {1: 1})
        stopped = sim.journal.select("state", "WaitFaultFlushFinishedState", JOB)[-1].at
        flushed = sim.journal.select("state", "NotifyGlobalFaultState", JOB)[-1].at
        sent = sim.journal.signals("globalFault")[-1].at
        assert flushed - stopped >= 0.1 and sent - stopped >= 0.1 + 0.3


async def test_hccl_in_a_pure_retry_cycle_gets_timeout_33(sim: SimClusterD, client: Client) -> None:
    stream = await client.session(sim)
    await client.fault({2: 2})
    await stream.next()
    await client.stop_complete()
    assert (await stream.next()).timeout == 33


async def test_hccl_merged_into_a_type1_cycle_gets_timeout_0(sim: SimClusterD, client: Client) -> None:
    stream = await client.session(sim)
    _, global_fault = await run_to_strategy_wait(sim, client, stream, {2: 2, 9: 1})
    assert list(global_fault.actions) == ["on_global_rank", "fault_nodes_exit"]
    assert global_fault.timeout == 0


async def test_normal_fault_is_never_retried(sim: SimClusterD, client: Client) -> None:
    stream = await client.session(sim)
    await run_to_strategy_wait(sim, client, stream, {3: 1})
    await client.strategies(["retry", "recover", "dump"])
    assert (await stream.next()).changeStrategy == "recover"
    await client.status(0, "recover")


async def test_agent_without_retry_turns_uce_into_dump_not_recover(sim: SimClusterD,
                                                                  client: Client) -> None:
    stream = await client.session(sim)
    await client.fault({3: 0})
    await stream.next()
    await client.stop_complete()
    await stream.next()
    await client.strategies(["recover", "dump"])
    change = await stream.next()
    assert change.changeStrategy == "dump"
    assert faults_of(change) == {r: 1 for r in range(8)}  # became a normal, expanded fault
    await client.status(0, "dump")


async def test_retry_405_goes_back_to_global_fault_then_recover(sim: SimClusterD,
                                                                client: Client) -> None:
    stream = await client.session(sim)
    await client.fault({9: 0})
    await stream.next()
    await client.stop_complete()
    first_global = await stream.next()
    assert list(first_global.actions) == ["on_global_rank"]
    await client.strategies(["retry", "recover", "dump"])
    assert (await stream.next()).changeStrategy == "retry"
    await client.status(405, "retry")
    second_global = await stream.next()
    assert second_global.signalType == "globalFault"
    assert list(second_global.actions) == ["on_global_rank", "fault_nodes_exit"]
    assert faults_of(second_global) == {r: 1 for r in range(8, 16)}
    assert list(second_global.nodeRankIds) == ["1"]
    assert sim.podgroup(JOB)["ProcessRecoverStatus"] == "retry-failed"
    await stream.no_signal(0.1)  # a new strategy report is needed first
    await client.strategies(["retry", "recover", "dump"])
    assert (await stream.next()).changeStrategy == "recover"  # never retry twice
    await client.status(0, "recover")
    assert await stream.ended() == grpc.StatusCode.OK
    assert sim.podgroup(JOB)["ProcessRecoverStatus"] == "recover-success"


@pytest.mark.parametrize(("code", "expected"), [(406, "dump"), (499, "exit")])
async def test_retry_406_excludes_recover_and_499_also_dump(
        sim: SimClusterD, client: Client, code: int, expected: str) -> None:
    stream = await client.session(sim)
    await client.fault({1: 0})
    await stream.next()
    await client.stop_complete()
    await stream.next()
    await client.strategies(["retry", "recover", "dump"])
    await stream.next()
    await client.status(code, "retry")
    change = await stream.next()
    assert change.changeStrategy == expected
    assert sim.journal.signals("globalFault") and len(sim.journal.signals("globalFault")) == 1


async def test_recover_failure_then_dump_then_dump_exit_twice(sim: SimClusterD,
                                                              client: Client) -> None:
    stream = await client.session(sim)
    await run_to_strategy_wait(sim, client, stream, {1: 1})
    await client.strategies(["recover", "dump"])
    assert (await stream.next()).changeStrategy == "recover"
    await client.status(499, "recover")
    assert (await stream.next()).changeStrategy == "dump"
    assert sim.podgroup(JOB)["ProcessRecoverStatus"] == "recover-failed"
    await client.status(1, "dump")
    first = await stream.next()
    second = await stream.next()
    for notice in (first, second):
        assert (notice.changeStrategy, notice.extraParams) == ("exit", "dump_exit")
    entries = sim.journal.signals("changeStrategy")[-2:]
    assert entries[1].at - entries[0].at >= T.dump_exit_repeat
    assert await stream.ended() == grpc.StatusCode.OK
    end = sim.journal.select("stream-end", job_id=JOB)[-1]
    assert end.at - entries[1].at >= T.job_running_wait  # the real 5.0 s
    assert sim.podgroup(JOB)["ProcessRecoverStatus"] == "dump-failed"
    assert sim.labels(JOB)["process-recover-enable"] == "on"


async def test_exit_expects_no_report_and_never_writes_exit_completed(sim: SimClusterD,
                                                                     client: Client) -> None:
    stream = await client.session(sim)
    await run_to_strategy_wait(sim, client, stream, {1: 1})
    await client.strategies([])  # nothing offered: exit
    exit_signal = await stream.next()
    assert (exit_signal.changeStrategy, exit_signal.extraParams) == ("exit", "")
    dump_exit = await stream.next()  # no RecoverStatus was sent
    assert (dump_exit.changeStrategy, dump_exit.extraParams) == ("exit", "dump_exit")
    assert await stream.ended() == grpc.StatusCode.OK
    assert "ProcessRecoverStatus" not in sim.podgroup(JOB)
    assert sim.journal.rpcs("ReportRecoverStatus") == []


async def test_a_stream_ending_during_the_schedule_checks_closes_the_path_there() -> None:
    """Seen on the real server: after an exit it checks four times, 5 s apart, whether
    the fault pods were rescheduled (ListenScheduleResultState) before it restarts all
    processes, and a stream that ends in those 20 s (a bridge whose controller ended
    exits) closes the cycle's path at ListenScheduleResultState. The simulation used to
    go through to WaitRestartAllProcessState at once."""
    async with own_sim(timings=replace(T, schedule_check=2.0, dump_exit_repeat=3.0)) as (sim, client):
        stream = await client.session(sim)
        await run_to_strategy_wait(sim, client, stream, {1: 1})
        await client.strategies([])  # nothing offered: exit
        assert (await stream.next()).changeStrategy == "exit"
        await sim.wait_for(lambda e: e.kind == "state" and e.name == "ListenScheduleResultState")
        stream.cancel()  # the bridge exits within the schedule checks
        await sim.wait_for(lambda e: e.kind == "state" and e.name == "INIT" and e.detail.get("event") != "new subscriber")
        paths = [path for path, _ in sim.journal.action_paths(JOB)]
        assert paths == ["INIT(faultOccur)-->NotifyWaitFaultFlushingState(notifyFinish)-->"
                         "NotifyStopTrainState(notifySuccess)-->WaitReportStopCompleteState(receiveReport)-->"
                         "WaitFaultFlushFinishedState(flushFinished)-->NotifyGlobalFaultState(notifySuccess)-->"
                         "WaitReportRecoverStrategyState(receiveReport)-->"
                         "NotifyDecidedStrategyState(notifyExitStrategySuccess)-->CheckRecoverResultState(checkFinish)-->"
                         "ListenScheduleResultState"]


async def test_strategy_needs_the_job_configuration_too() -> None:
    async with own_sim(SimJob(JOB, strategies=("recover",))) as (sim, client):
        stream = await client.session(sim)
        await run_to_strategy_wait(sim, client, stream, {1: 1})
        await client.strategies(["dump", "retry"])  # neither dump nor retry configured
        assert (await stream.next()).changeStrategy == "exit"


async def test_result_is_judged_by_the_reported_strategy(sim: SimClusterD, client: Client) -> None:
    stream = await client.session(sim)
    await run_to_strategy_wait(sim, client, stream, {1: 1})
    await client.strategies(["recover", "dump"])
    assert (await stream.next()).changeStrategy == "recover"
    await client.status(0, "dump")  # wrong strategy: ClusterD believes it
    notice = await stream.next()
    assert notice.extraParams == "dump_exit"
    assert sim.podgroup(JOB)["ProcessRecoverStatus"] == "dump-success"
    assert any("strategy='dump'" in v for v in sim.violations)
    sim.violations.clear()


async def test_report_timeout_ends_in_fault_retry() -> None:
    async with own_sim(report_timeout=0.2) as (sim, client):
        stream = await client.session(sim)
        await client.fault({1: 1})
        await stream.next()
        notice = await stream.next()  # no StopComplete ever
        assert (notice.changeStrategy, notice.extraParams) == ("exit", "dump_exit")
        assert await stream.ended() == grpc.StatusCode.OK
        writes = sim.journal.select("annotation", "label:process-recover-enable")
        labels = [e.detail["value"] for e in writes]
        assert labels == ["on", "pause", "on"]
        assert "FaultRetryState" in sim.journal.states(JOB)


async def test_downgrade_flow() -> None:
    job = SimJob(JOB, world_size=16, devices_per_pod=8, strategies=("elastic-training", "dump"))
    async with own_sim(job) as (sim, client):
        stream = await client.session(sim)
        await run_to_strategy_wait(sim, client, stream, {9: 1})
        await client.strategies(["downgrade", "dump"])
        change = await stream.next()
        assert change.changeStrategy == "downgrade"
        assert change.extraParams == '{"scale-in-strategy": "DP"}'
        isolate = [str(r) for r in range(8, 16)]
        await client.status(201, "downgrade", isolate)
        exit_nodes = await stream.next()
        assert exit_nodes.signalType == "faultNodesExit"
        assert list(exit_nodes.actions) == ["fault_nodes_exit"]
        assert exit_nodes.uuid == change.uuid
        await client.status(0, "downgrade")
        await sim.wait_for(is_state(JOB, "ScaleRunningState"))
        await stream.no_signal(0.1)  # no reset: the job runs scaled in


async def test_no_downgrade_when_rank0_pod_is_faulty() -> None:
    job = SimJob(JOB, strategies=("elastic-training", "dump"))
    async with own_sim(job) as (sim, client):
        stream = await client.session(sim)
        await run_to_strategy_wait(sim, client, stream, {2: 1})
        await client.strategies(["downgrade", "dump"])
        assert (await stream.next()).changeStrategy == "dump"


async def test_dump_first_job_gets_save_and_exit_instead_of_stop_train() -> None:
    async with own_sim(SimJob(JOB, strategies=("dump",))) as (sim, client):
        stream = await client.session(sim)
        await client.fault({1: 1})
        save = await stream.next()
        assert (save.signalType, list(save.actions)) == ("saveAndExit", ["save_and_exit"])
        assert list(save.nodeRankIds) == ["0"]
        await client.status(0, "dump")
        assert (await stream.next()).extraParams == "dump_exit"
        assert await stream.ended() == grpc.StatusCode.OK
        assert sim.podgroup(JOB)["ProcessRecoverStatus"] == "dump-success"
        assert sim.journal.signals("stopTrain") == []


async def test_non_numeric_rank_is_a_violation_and_empties_the_cycle(sim: SimClusterD,
                                                                    client: Client) -> None:
    stream = await client.session(sim)
    assert await client.fault({" 2": 1}) == 0  # accepted: ClusterD validates nothing
    stop = await stream.next()
    assert [(f.rankId, f.faultType) for f in stop.faultRanks] == [(" 2", "1")]
    await client.stop_complete()
    global_fault = await stream.next()
    assert list(global_fault.faultRanks) == [] and list(global_fault.nodeRankIds) == []
    await client.strategies(["recover"])
    assert list((await stream.next()).nodeRankIds) == []  # no rank id parses: no pods
    assert sim.violations and "rankId=' 2'" in sim.violations[0]
    assert "non-integer rank id" in sim.violations[0] and "unknown fault type" not in sim.violations[0]
    sim.violations.clear()
    await client.status(0, "recover")


# --------------------------------------------------------------------------- operator flows


async def test_pause_flow(sim: SimClusterD, client: Client) -> None:
    stream = await client.session(sim)
    await sim.pause(JOB, timeout=7)
    pause = await stream.next()
    assert (pause.signalType, list(pause.actions), pause.timeout) == ("stopTrain", ["pause_train"], 7)
    await client.stop_complete()
    resume = await stream.next()
    assert (resume.changeStrategy, resume.uuid) == ("continue", pause.uuid)
    await client.status(0, "")
    assert await stream.ended() == grpc.StatusCode.OK
    assert sim.podgroup(JOB) == {}


async def test_pause_failure_kills_master(sim: SimClusterD, client: Client) -> None:
    stream = await client.session(sim)
    await sim.pause(JOB)
    await stream.next()
    await client.stop_complete(code=499)
    assert (await stream.next()).signalType == "killMaster"
    assert await stream.ended() == grpc.StatusCode.OK


async def test_pause_needs_an_idle_subscribed_job(sim: SimClusterD, client: Client) -> None:
    await client.init()
    await client.register()
    with pytest.raises(RuntimeError, match="no live subscriber"):
        await sim.pause(JOB)
    stream = await client.subscribe(sim)
    await client.fault({1: 1})
    await stream.next()
    with pytest.raises(RuntimeError, match="not INIT"):
        await sim.pause(JOB)


async def test_kill_master_mid_cycle(sim: SimClusterD, client: Client) -> None:
    stream = await client.session(sim)
    await client.fault({1: 1})
    stop = await stream.next()
    await sim.kill_master(JOB)
    kill = await stream.next()
    assert (kill.signalType, kill.uuid, list(kill.actions)) == ("killMaster", stop.uuid, [])
    assert await stream.ended() == grpc.StatusCode.OK


async def test_device_faults_give_pre_exit_after_their_delays_and_change_no_state(
        sim: SimClusterD, client: Client) -> None:
    stream = await client.session(sim)
    await sim.pre_exit(JOB, [9], uce=True)  # UCE hardware code: the longer delay
    await sim.pre_exit(JOB, [8])
    scheduled = sim.journal.select("fault-centre", "pre-exit-scheduled", JOB)[0].at
    first, second = await stream.next(), await stream.next()
    for signal in (first, second):
        assert (signal.signalType, list(signal.actions)) == ("preExitProcess", ["pre exit process"])
        assert list(signal.nodeRankIds) == ["1"] and signal.uuid
    assert faults_of(first) == {8: 1} and faults_of(second) == {9: 1}  # non-UCE first
    assert first.uuid != second.uuid
    sent = [e.at for e in sim.journal.signals("preExitProcess")]
    assert sent[0] - scheduled >= T.pre_exit_delay and sent[1] - scheduled >= T.pre_exit_uce_delay
    assert sim.uuid(JOB) == "" and sim.state(JOB) == "INIT"
    assert [e.name for e in sim.journal.select("state", job_id=JOB)] == ["INIT"]  # the subscribe


async def test_unknown_fault_type_gives_pre_exit_with_a_fresh_uuid_and_no_cycle() -> None:
    async with own_sim(SimJob(JOB, world_size=4, devices_per_pod=2)) as (sim, client):
        stream = await client.session(sim)
        assert await client.fault({2: 9}) == 0
        reported = sim.journal.select("fault-centre", "pre-exit-scheduled", JOB)[-1].at
        signal = await stream.next()
        assert signal.signalType == "preExitProcess"
        assert faults_of(signal) == {2: 1} and list(signal.nodeRankIds) == ["1"]
        assert signal.uuid and sim.uuid(JOB) == ""
        assert sim.journal.signals("preExitProcess")[0].at - reported >= T.unknown_type_pre_exit_delay
        await stream.no_signal(0.1)
        assert sim.state(JOB) == "INIT" and sim.journal.signals("stopTrain") == []
        assert len(sim.violations) == 1
        assert "faultType='9'" in sim.violations[0] and "unknown fault type" in sim.violations[0]
        assert "non-integer" not in sim.violations[0]


async def test_cancel_mid_wait_and_resubscribe_gets_the_orphaned_global_fault() -> None:
    # 2 s: room for the cancel and the new subscribe on a loaded machine before it is due.
    async with own_sim(timings=replace(T, global_fault_delay=2.0)) as (sim, client):
        stream = await client.session(sim)
        assert await client.fault({1: 1}) == 0
        await stream.next()
        assert await client.stop_complete() == 0
        await sim.wait_for(is_state(JOB, "NotifyGlobalFaultState"))
        stopped = sim.journal.select("state", "WaitFaultFlushFinishedState", JOB)[-1].at
        stream.cancel()
        await stream.ended()
        fresh = await client.subscribe(sim)
        ghost = await fresh.next(5)
        assert ghost.signalType == "globalFault"
        assert list(ghost.actions) == ["on_global_rank", "fault_nodes_exit"]
        assert (ghost.uuid, list(ghost.faultRanks), list(ghost.nodeRankIds)) == ("", [], [])
        sent = sim.journal.signals("globalFault")[-1]
        assert sent.detail["stream"] == 2 and sent.at - stopped >= T.flush_delay + 2.0
        assert await client.strategies(["recover", "dump"]) == 0  # buffered; nothing follows
        await fresh.no_signal(0.2)
        assert sim.state(JOB) == "INIT" and sim.journal.signals("changeStrategy") == []


async def test_reset_without_a_new_subscriber_loses_the_orphaned_global_fault() -> None:
    async with own_sim(timings=replace(T, global_fault_delay=0.2)) as (sim, client):
        stream = await client.session(sim)
        await client.fault({1: 1})
        await stream.next()
        await client.stop_complete()
        await sim.wait_for(is_state(JOB, "NotifyGlobalFaultState"))
        stream.cancel()
        lost = await sim.wait_for(lambda e: e.kind == "fault-lost" and e.name == "globalFault")
        assert "no live subscriber" in lost.detail["reason"]
        assert sim.journal.signals("globalFault") == []


async def test_change_strategy_names_the_pods_of_the_fault_ranks() -> None:
    async with own_sim(SimJob(JOB, world_size=4, devices_per_pod=2)) as (sim, client):
        stream = await client.session(sim)
        await client.fault({2: 0})  # pod 1 only
        await stream.next()
        await client.stop_complete()
        await stream.next()
        await client.strategies(["retry", "recover", "dump"])
        retry = await stream.next()
        assert (retry.changeStrategy, list(retry.nodeRankIds)) == ("retry", ["1"])
        await client.status(0, "retry")
        await stream.ended()
        stream = await client.session(sim)
        await run_to_strategy_wait(sim, client, stream, {0: 1, 3: 1})  # both pods
        await client.strategies(["recover", "dump"])
        changes = [await stream.next()]
        await client.status(499, "recover")
        changes.append(await stream.next())
        await client.status(0, "dump")
        changes += [await stream.next(), await stream.next()]
        assert [(c.changeStrategy, c.extraParams) for c in changes] == [
            ("recover", ""), ("dump", ""), ("exit", "dump_exit"), ("exit", "dump_exit")]
        for change in changes:
            assert sorted(change.nodeRankIds) == ["0", "1"]


async def test_save_and_exit(sim: SimClusterD, client: Client) -> None:
    stream = await client.session(sim)
    await sim.save_and_exit(JOB)
    assert (await stream.next()).signalType == "saveAndExit"
    await client.status(0, "dump")
    assert (await stream.next()).extraParams == "dump_exit"
    assert (await stream.next()).extraParams == "dump_exit"
    assert await stream.ended() == grpc.StatusCode.OK


# --------------------------------------------------------------------------- injected misbehaviour


async def test_duplicate_and_delayed_signals(sim: SimClusterD, client: Client) -> None:
    stream = await client.session(sim)
    sim.duplicate_next_signal()
    await client.fault({1: 1})
    first, again = await stream.next(), await stream.next()
    assert first == again and first.signalType == "stopTrain"
    sim.delay_next_signal(0.3)
    started = time.monotonic()
    await client.stop_complete()
    assert (await stream.next()).signalType == "globalFault"
    assert time.monotonic() - started >= 0.3
    assert sim.journal.signals("globalFault")[0].detail["delayed"] == 0.3


async def test_foreign_and_malformed_signals(sim: SimClusterD, client: Client) -> None:
    stream = await client.session(sim)
    await sim.send_foreign_signal(JOB, "other-job")
    foreign = await stream.next()
    assert foreign.jobId == "other-job" and list(foreign.actions) == ["stop_train"]
    await sim.send_signal(JOB, signalType="globalFault", actions=["on_global_rank"],
                          faultRanks=[("x", "1")])
    bad = await stream.next()
    assert bad.jobId == JOB and bad.faultRanks[0].rankId == "x"
    assert sim.state(JOB) == "INIT"


async def test_restart_loses_all_state(sim: SimClusterD, client: Client) -> None:
    stream = await client.session(sim)
    await run_to_strategy_wait(sim, client, stream, {1: 1})
    await client.strategies(["recover"])
    await stream.next()
    await client.status(0, "recover")
    await stream.ended()
    address = sim.address
    stream = await client.subscribe(sim)
    await sim.restart()
    assert sim.address == address
    assert await stream.ended() != grpc.StatusCode.OK
    assert await client.stop_complete() == 400
    assert await client.register() == 408
    assert await client.init() == 0 and await client.register() == 0
    assert sim.podgroup(JOB)["ProcessRecoverStatus"] == "recover-success"  # on the PodGroup
    stream = await client.subscribe(sim)
    await client.fault({1: 1})
    assert (await stream.next()).signalType == "stopTrain"


# --------------------------------------------------------------------------- config.Config


async def test_rank_table_stream(sim: SimClusterD, channel: grpc.aio.Channel) -> None:
    sim.add_job(SimJob("owner-uid", rank_table_job_id="mindie-job"))
    config = config_pb2_grpc.ConfigStub(channel)
    info = config_pb2.ClientInfo(jobId="mindie-job", role="coordinator")
    stream = Stream(config.SubscribeRankTable(info))
    assert await stream.ended() == grpc.StatusCode.UNKNOWN
    assert stream.details == "jobId=mindie-job not registered, role=coordinator"

    await sim.push_rank_table("owner-uid", '{"v": 1}')  # nobody listening: kept as current
    assert (await config.Register(info, timeout=2)).code == 0
    stream = Stream(config.SubscribeRankTable(info))
    first = await stream.next()
    assert (first.jobId, first.rankTable) == ("mindie-job", '{"v": 1}')
    await sim.push_rank_table("owner-uid", '{"v": 1}')  # identical: sent again
    assert (await stream.next()).rankTable == '{"v": 1}'
    await stream.no_signal(0.15)  # no keep-alive on this stream
    assert (await config.Register(info, timeout=2)).code == 0  # kicks the subscriber
    assert await stream.ended() == grpc.StatusCode.OK

    stream = Stream(config.SubscribeRankTable(info))  # the new publisher
    assert (await stream.next()).rankTable == '{"v": 1}'
    stream.cancel()
    await stream.ended()
    await sim.wait_for(lambda e: e.kind == "stream-end" and e.name == "SubscribeRankTable"
                       and e.code == grpc.StatusCode.CANCELLED.value[0])
    again = Stream(config.SubscribeRankTable(info))  # publisher deleted with the stream
    assert await again.ended() == grpc.StatusCode.UNKNOWN


# --------------------------------------------------------------------------- units


def test_rules_fault_cache_and_strategies() -> None:
    assert rules.dedupe_faults([("1", "0"), ("1", "1"), ("1", "2"), ("2", "2"), ("2", "0")]) == [
        ("1", "1"), ("2", "0")]
    cache = rules.FaultCache()
    cache.save([("3", "0"), ("3", "1")])
    assert cache.stop_train_faults() == [("3", "1")]
    cache.save([("4", "2")])
    assert cache.stop_train_faults() == [("4", "2"), ("3", "1")]
    assert rules.same_node_ranks(["3", "4"], 2) == (["2", "3", "4", "5"], False)
    assert cache.expand_normal(2) == (["2", "3"], False)
    assert (cache.normal, cache.retry) == ([("2", "1"), ("3", "1")], [])
    assert rules.same_node_ranks(["1", " 2"], 2) == ([], True)
    assert rules.job_strategies(["dump", "bogus", "retry"]) == ("retry", "dump", "exit")
    assert rules.choose_first(("retry", "recover", "exit"), ["recover"], True, False) == "recover"
    assert rules.choose_first(("retry", "exit"), [], False, False) == "retry"
    assert rules.choose_after_recover_failure(("dump", "exit"), ["recover"]) == "exit"
    assert re.fullmatch(r"[0-9A-F]+-[0-9a-f]{32}", rules.new_uuid())


async def test_journal_wait_for_past_future_and_timeout() -> None:
    journal = Journal()
    seen: list[JournalEntry] = []
    journal.add_listener(seen.append)
    journal.record("rpc", "Init", JOB, 0, role="x")
    assert (await journal.wait_for(lambda e: e.name == "Init", 0.1)).code == 0
    waiter = asyncio.ensure_future(journal.wait_for(lambda e: e.name == "later", 1))
    await asyncio.sleep(0)  # one loop turn so the waiter registers first: the "future" path
    journal.record("signal", "later", JOB, uuid="u", actions=["a"], faults={1: 1})
    assert (await waiter).detail["uuid"] == "u"
    with pytest.raises(TimeoutError, match="no journal entry"):
        await journal.wait_for(lambda e: False, 0.05)
    assert len(seen) == 2
    assert "faults=1:1" in journal.format(seen[1]) and "signal later" in journal.format(seen[1])
    with pytest.raises(ValueError):
        journal.record("nonsense", "x", JOB)


# --------------------------------------------------------------------------- real timings and the CLI


def test_default_timings_are_the_real_servers() -> None:
    """The one table every scaled test above stands on (docs/clusterd.md)."""
    assert SimClusterD().timings == REAL == Timings()
    assert REAL.keepalive_interval == 5.0
    assert REAL.retry_report_delay == (0.7, 1.0)
    assert REAL.flush_delay + REAL.global_fault_delay == 11.0  # StopComplete -> globalFault, type 1
    assert REAL.hccl_retry_pause == 3.0
    assert REAL.dump_exit_repeat == 80.0 and REAL.job_running_wait == 5.0
    assert (REAL.pre_exit_delay, REAL.pre_exit_uce_delay) == (10.85, 20.80)
    assert REAL.unknown_type_pre_exit_delay == 10.95
    assert REAL.report_timeout == 900.0
    half = REAL.scaled(0.5, report_timeout=1.0)
    assert half.pre_exit_uce_delay == REAL.pre_exit_uce_delay / 2 and half.retry_report_delay == (0.35, 0.5)
    assert half.report_timeout == 1.0
    assert SimClusterD(timings=half, flush_delay=0.0).timings == replace(half, flush_delay=0.0)


def test_sim_clusterd_cli_defaults_to_the_real_timings() -> None:
    from bridge.cli import build_parser
    from bridge.sim import cli

    args = build_parser().parse_args(["sim-clusterd", "--job", "j", "--world-size", "4", "--devices-per-pod",
                                      "2", "--strategies", "retry,recover,dump", "--keepalive", "5"])
    assert cli.build(args).timings == REAL
    fast = build_parser().parse_args(["sim-clusterd", "--job", "j", "--time-scale", "0.01", "--phase-delay", "0.2"])
    assert cli.build(fast).timings == REAL.scaled(0.01, global_fault_delay=0.2)


async def test_sim_clusterd_stdin_commands(sim: SimClusterD, client: Client) -> None:
    from bridge.sim.cli import COMMANDS, run_command

    stream = await client.session(sim)
    assert await run_command(sim, JOB, "help\n") == COMMANDS
    assert "device-fault" in COMMANDS
    assert "unknown command" in await run_command(sim, JOB, "explode")
    assert "failed" in await run_command(sim, JOB, "device-fault x")
    assert "failed" in await run_command(sim, "other-job", "device-fault 1")
    assert "unknown command" in await run_command(sim, JOB, "device-fault 1 hbm")
    assert await run_command(sim, JOB, "") == ""
    assert "scheduled" in await run_command(sim, JOB, "device-fault 9,10 uce")
    signal = await stream.next()
    assert signal.signalType == "preExitProcess" and faults_of(signal) == {9: 1, 10: 1}
    assert sim.journal.signals("preExitProcess")[0].at - sim.journal.select("fault-centre")[0].at \
        >= T.pre_exit_uce_delay
    assert await run_command(sim, JOB, "kill-master") == "killMaster started"
    assert (await stream.next()).signalType == "killMaster"
    assert await stream.ended() == grpc.StatusCode.OK


async def test_sim_clusterd_hot_switch_commands() -> None:
    from bridge.cli import build_parser
    from bridge.sim import cli
    from bridge.sim.cli import run_command

    args = build_parser().parse_args(["sim-clusterd", "--job", JOB, "--hot-switch"])
    assert cli.build(args).jobs[JOB].hot_switch
    async with own_sim(HOT, timings=T.scaled(1.0, new_pod_timeout=5.0)) as (sim, client):
        stream = await client.session(sim)
        assert "failed" in await run_command(sim, JOB, "new-pod-running")  # no switch runs
        assert "unknown command" in await run_command(sim, JOB, "sub-health x")
        assert await run_command(sim, JOB, "sub-health 3") == "sub-healthy fault on rank 3: started"
        assert list((await stream.next()).actions) == ["hot switch"]
        assert await run_command(sim, JOB, "new-pod-running") == "the backup pod runs"
        assert list((await stream.next()).actions) == ["new pod running"]


# --------------------------------------------------------------------------- release profiles

async def test_v7_0_signals_have_no_fields_7_to_9_and_isolate_ranks_are_not_read() -> None:
    """v7.0.RC1's ProcessManageSignal ends at changeStrategy: no timeout (an HCCL
    globalFault's 33), no nodeRankIds (changeStrategy's pods), no extraParams."""
    async with own_sim(timings=replace(T, hccl_retry_pause=0.01), release=RELEASES["7.0"]) as (sim, client):
        stream = await client.session(sim)
        assert await client.fault({3: 2}) == 0
        await stream.next(5)
        await client.stop_complete()
        global_fault = await stream.next(5)
        assert global_fault.timeout == 0  # master: 33
        await client.strategies(["retry", "recover", "dump"])
        change = await stream.next(5)
        assert change.changeStrategy == "retry" and list(change.nodeRankIds) == []  # master: ["0"]
        assert sim.journal.signals("changeStrategy")[-1].detail["nodeRankIds"] == []


async def test_v7_0_has_no_health_check() -> None:
    async with own_sim(release=RELEASES["7.0"]) as (sim, client):
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await client.stub.HealthCheck(pb.ClientInfo(jobId=JOB), timeout=2)
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("fault_type, release_name", [(0, "7.0"), (1, "7.0"), (1, "master")])
async def test_the_fault_centre_of_v7_0_starts_a_cycle_4_s_after_the_report(fault_type: int,
                                                                          release_name: str) -> None:
    timings = replace(T, fault_centre_delay=0.3, retry_report_delay=(0.01, 0.02))
    async with own_sim(timings=timings, release=RELEASES[release_name]) as (sim, client):
        stream = await client.session(sim)
        assert await client.fault({3: fault_type}) == 0
        reported = sim.journal.rpcs("ReportProcessFault")[-1]
        stop = await stream.next(5)
        assert stop.signalType == "stopTrain"
        waited = sim.journal.signals("stopTrain")[-1].at - reported.at
        if release_name == "7.0":
            assert waited >= 0.3  # the real 4 s, scaled
        else:
            assert waited < 0.3  # master: at once for a process fault


async def successful_retry_cycle(client: Client, stream: Stream, faults: dict[int, int]) -> Any:
    """A whole pure-retry cycle that succeeds: the fault report, stop-complete, the
    strategies and result 0, each answered by its signal; the stream then ends OK.
    Returns the cycle's stopTrain."""
    assert await client.fault(faults) == 0
    stop = await stream.next(5)
    await client.stop_complete()
    await stream.next(5)
    await client.strategies(["retry", "recover", "dump"])
    await stream.next(5)
    await client.status(0, "retry")
    assert await stream.ended() == grpc.StatusCode.OK
    return stop


@pytest.mark.parametrize("fault_type, repeat_delay", [(0, 0.07), (2, 0.4)])
async def test_v7_3_repeats_a_retry_cycle_that_succeeded(fault_type: int, repeat_delay: float) -> None:
    """The fault centre still holds the retried fault: a second cycle 0.7 s (UCE) / 4 s
    (HCCL) after the first ended, scaled here; a new subscriber gets its stopTrain."""
    timings = replace(T, retry_repeat_delay_uce=0.07, retry_repeat_delay_hccl=0.4, hccl_retry_pause=0.01,
                      retry_report_delay=(0.01, 0.02))
    async with own_sim(timings=timings, release=RELEASES["7.3"]) as (sim, client):
        first = await successful_retry_cycle(client, await client.session(sim), {3: fault_type})
        ended = sim.journal.select("stream-end", "SubscribeProcessManageSignal", JOB)[-1]
        stream = await client.subscribe(sim)
        again = await stream.next(5)
        assert again.signalType == "stopTrain" and faults_of(again) == {3: fault_type} and again.uuid != first.uuid
        repeat = sim.journal.select("fault-centre", "retry-repeat", JOB)[-1]
        assert repeat.detail["delay"] == repeat_delay
        assert sim.journal.signals("stopTrain")[-1].at - ended.at >= repeat_delay
        # The controller's answer to the repeat (its device stop fails): retry-failed.
        await client.stop_complete()
        await stream.next(5)
        await client.strategies(["retry", "recover", "dump"])
        await stream.next(5)
        await client.status(499, "retry")
        await sim.wait_for(lambda e: e.kind == "annotation" and e.detail.get("value") == "retry-failed")


async def test_master_does_not_repeat_a_retry_cycle_that_succeeded() -> None:
    timings = replace(T, retry_report_delay=(0.01, 0.02))
    async with own_sim(timings=timings) as (sim, client):
        await successful_retry_cycle(client, await client.session(sim), {3: 0})
        assert sim.journal.select("fault-centre", "retry-repeat", JOB) == []


# --------------------------------------------------------------------------- hot switch

HOT = SimJob(JOB, world_size=8, devices_per_pod=2, strategies=("recover", "dump"), hot_switch=True)


async def at_pause_result_wait(sim: SimClusterD, client: Client) -> Stream:
    """A hot switch of pod 1 up to ClusterD's wait for the client's strategies."""
    stream = await client.session(sim)
    assert await sim.sub_health_fault(JOB, 3) == "started"
    await stream.next()  # hot switch
    await sim.new_pod_running(JOB)
    await stream.next()  # new pod running
    return stream


async def test_a_hot_switch_migrates_with_uuid_less_signals_and_ends_with_a_reset() -> None:
    """hot_switch_controller.go: hot switch (the pod's ranks, type 1), new pod running,
    the client's ["migration"], changeStrategy migration, the result 0, a reset."""
    async with own_sim(HOT, timings=T.scaled(1.0, new_pod_timeout=5.0)) as (sim, client):
        stream = await client.session(sim)
        assert await sim.sub_health_fault(JOB, 5) == "started"
        switch = await stream.next()
        assert (switch.signalType, list(switch.actions), switch.uuid) == ("hot-switch", ["hot switch"], "")
        assert faults_of(switch) == {4: 1, 5: 1}  # the whole pod
        await stream.no_signal(0.2)  # waits for the backup pod
        await sim.new_pod_running(JOB)
        running = await stream.next()
        assert (running.signalType, list(running.actions), running.uuid) == ("hot-switch", ["new pod running"], "")
        assert await client.strategies(["migration"]) == 0
        migration = await stream.next()
        assert (migration.signalType, list(migration.actions)) == ("changeStrategy", ["change_strategy"])
        assert (migration.changeStrategy, migration.uuid, list(migration.faultRanks)) == ("migration", "", [])
        assert await client.status(0, "migration") == 0
        assert await stream.ended() == grpc.StatusCode.OK
        assert sim.journal.states(JOB)[1:] == [
            "NotifyPrepareHotSwitchState", "WaitNewPodState", "WaitNotifyPodRunningResultState",
            "WaitReportPauseResultState", "WaitOldPodDeletedState", "WaitNotifyRestartTrainResultState",
            "WaitReportRestartTrainResultState", "InitState", "INIT",
        ]
        assert [e.name for e in sim.journal.select("kube", job_id=JOB)] == ["create-backup-pod", "delete-old-pod"]
        assert sim.violations == []


@pytest.mark.parametrize("answer", [["exit"], []])
async def test_a_hot_switch_offered_exit_deletes_the_first_pod_and_turns_the_switch_off(answer: list[str]) -> None:
    async with own_sim(HOT, timings=T.scaled(1.0, new_pod_timeout=5.0)) as (sim, client):
        stream = await at_pause_result_wait(sim, client)
        assert await client.strategies(answer) == 0
        assert await stream.ended() == grpc.StatusCode.OK  # no changeStrategy exit before it
        assert [(e.name, e.detail.get("pod")) for e in sim.journal.select("kube", job_id=JOB)] == [
            ("create-backup-pod", None), ("delete-pod", "0")]
        await client.subscribe(sim)
        assert (await sim.sub_health_fault(JOB, 3)).startswith("skipped: hot switch off")


async def test_a_backup_pod_that_never_runs_gives_stop_switch() -> None:
    async with own_sim(HOT, timings=T.scaled(1.0, new_pod_timeout=0.2)) as (sim, client):
        stream = await client.session(sim)
        assert await sim.sub_health_fault(JOB, 3) == "started"
        await stream.next()
        stop = await stream.next()
        assert (stop.signalType, list(stop.actions), stop.uuid) == ("hot-switch", ["stop switch"], "")
        assert await stream.ended() == grpc.StatusCode.OK


async def test_a_migration_that_fails_deletes_the_first_pod() -> None:
    async with own_sim(HOT, timings=T.scaled(1.0, new_pod_timeout=5.0)) as (sim, client):
        stream = await at_pause_result_wait(sim, client)
        assert await client.strategies(["migration"]) == 0
        await stream.next()
        assert await client.status(406, "migration") == 0
        assert await stream.ended() == grpc.StatusCode.OK
        assert [e.name for e in sim.journal.select("kube", job_id=JOB)][-1] == "delete-pod"


@pytest.mark.parametrize("job, rank, why", [
    (SimJob(JOB, world_size=8, devices_per_pod=2), 3, "hot switch off"),  # no subHealthyStrategy label
    (HOT, 1, "fault on the master pod"),
])
async def test_a_sub_health_fault_without_a_hot_switch_is_skipped(job: SimJob, rank: int, why: str) -> None:
    async with own_sim(job) as (sim, client):
        stream = await client.session(sim)
        assert (await sim.sub_health_fault(JOB, rank)).startswith(f"skipped: {why}")
        await stream.no_signal(0.2)


async def test_a_hot_switch_waits_for_an_idle_job() -> None:
    async with own_sim(HOT) as (sim, client):
        stream = await client.session(sim)
        assert await client.fault({0: 1}) == 0
        await stream.next()  # stopTrain: a cycle runs
        assert (await sim.sub_health_fault(JOB, 5)).startswith("skipped: the job's state machine is in")


async def test_hot_switch_alone_lets_init_answer_0() -> None:
    """``process-recover-enable and subhealthy hotswtich not open``: either opens Init."""
    job = SimJob(JOB, world_size=8, devices_per_pod=2, process_recover=False, hot_switch=True)
    async with own_sim(job) as (sim, client):
        assert await client.init() == 0


# --------------------------------------------------------------------------- recover-in-place

IN_PLACE = SimJob(JOB, world_size=8, devices_per_pod=2, strategies=("recover-in-place", "recover", "dump"))


async def test_recover_in_place_keeps_the_fault_ranks_and_restarts_them_in_place() -> None:
    """controller.go: a business report's fault on one pod, recover-in-place configured:
    globalFault names only the fault rank (no whole pod, no node to exit), 3 s later
    than a plain type-1 cycle; changeStrategy recover with extraParams recover-in-place
    and fault_nodes_restart for that pod."""
    async with own_sim(IN_PLACE) as (sim, client):
        stream = await client.session(sim)
        stop, global_fault = await run_to_strategy_wait(sim, client, stream, {3: 1})
        assert (list(global_fault.actions), faults_of(global_fault)) == (["on_global_rank", "fault_nodes_exit"], {3: 1})
        assert list(global_fault.nodeRankIds) == []
        assert await client.strategies(["exit", "dump", "recover"]) == 0
        change = await stream.next()
        assert list(change.actions) == ["change_strategy", "fault_nodes_restart"]
        assert (change.changeStrategy, change.extraParams) == ("recover", "recover-in-place")
        assert (faults_of(change), list(change.nodeRankIds)) == ({3: 1}, ["1"])
        assert await client.status(0, "recover") == 0
        assert await stream.ended() == grpc.StatusCode.OK
        assert sim.podgroup(JOB)["ProcessRecoverStatus"] == "recover-success"
        assert sim.violations == []


async def test_recover_in_place_waits_one_check_period_before_global_fault() -> None:
    timings = T.scaled(1.0, global_fault_delay=0.05, in_place_check_delay=0.5)
    for job, extra in ((IN_PLACE, 0.5), (SimJob(JOB, world_size=8, devices_per_pod=2), 0.0)):
        async with own_sim(job, timings=timings) as (sim, client):
            stream = await client.session(sim)
            assert await client.fault({3: 1}) == 0
            await stream.next()
            sent = time.monotonic()  # before the call: the server may answer while it waits
            assert await client.stop_complete() == 0
            await stream.next(5)
            took = time.monotonic() - sent
            assert took >= timings.flush_delay + timings.global_fault_delay + extra


async def test_software_faults_on_two_pods_are_not_recovered_in_place() -> None:
    async with own_sim(IN_PLACE) as (sim, client):
        stream = await client.session(sim)
        stop, global_fault = await run_to_strategy_wait(sim, client, stream, {3: 1, 4: 1})
        assert faults_of(global_fault) == {2: 1, 3: 1, 4: 1, 5: 1}  # whole pods again
        assert await client.strategies(["exit", "dump", "recover"]) == 0
        change = await stream.next()
        assert (list(change.actions), change.changeStrategy, change.extraParams) == (
            ["change_strategy"], "recover", "")


async def test_a_failed_in_place_recover_falls_back_to_dump_with_the_pods_exiting() -> None:
    async with own_sim(IN_PLACE) as (sim, client):
        stream = await client.session(sim)
        await run_to_strategy_wait(sim, client, stream, {3: 1})
        assert await client.strategies(["exit", "dump", "recover"]) == 0
        await stream.next()
        assert await client.status(406, "recover") == 0
        dump = await stream.next()
        assert (list(dump.actions), dump.changeStrategy) == (["change_strategy", "fault_nodes_exit"], "dump")
        assert (faults_of(dump), list(dump.nodeRankIds)) == ({2: 1, 3: 1}, ["1"])


async def test_v7_0_has_neither_recover_in_place_nor_hot_switch() -> None:
    job = SimJob(JOB, world_size=8, devices_per_pod=2, strategies=("recover-in-place", "recover", "dump"),
                 hot_switch=True)
    async with own_sim(job, release=RELEASES["7.0"]) as (sim, client):
        stream = await client.session(sim)
        assert (await sim.sub_health_fault(JOB, 3)).startswith("skipped: hot switch off")
        _, global_fault = await run_to_strategy_wait(sim, client, stream, {3: 1})
        assert faults_of(global_fault) == {2: 1, 3: 1}  # widened to the pod as ever


# --------------------------------------------------------------------------- the fault centre's retry records

#: the record held long enough that a whole retry cycle fits inside it on a loaded machine
RECORDS = replace(T, retry_record_hold=1.5, fault_centre_period=0.05, retry_report_delay=(0.05, 0.08))


async def _retry_cycle(client: Client, stream: Stream, faults: dict[int, int]) -> None:
    """One retry cycle after a UCE/HCCL report, to its end (the stream ends with OK)."""
    assert await client.fault(faults) == 0
    stop = await stream.next()
    assert stop.signalType == "stopTrain"
    await client.stop_complete()
    assert (await stream.next()).signalType == "globalFault"
    await client.strategies(["retry", "recover", "dump"])
    assert (await stream.next()).changeStrategy == "retry"
    await client.status(0, "retry")
    assert await stream.ended() == grpc.StatusCode.OK


async def test_a_repeated_uce_while_its_record_is_held_starts_no_cycle_until_the_record_expired() -> None:
    async with own_sim(timings=RECORDS) as (sim, client):
        await _retry_cycle(client, await client.session(sim), {2: 0})
        stream = await client.session(sim)
        second = asyncio.get_running_loop().time()
        assert await client.fault({2: 0}) == 0  # answered OK: nothing tells the client it is skipped
        skipped = await sim.journal.wait_for(lambda e: e.kind == "fault-list" and e.name == "no-new-faults"
                                             and e.at > second)
        assert skipped.detail["faults"] == {2: 0}
        expired = await sim.journal.wait_for(lambda e: e.name == "retry-record-expired" and e.at > second, 5)
        assert expired.at - second >= RECORDS.retry_record_hold  # the second report refreshed the record
        assert not [s for s in sim.journal.signals("stopTrain") if s.at > second]
        assert sim.state(JOB) == "INIT"
        # Once a publication no longer holds the record, the same report is new again.
        await sim.journal.wait_for(lambda e: e.kind == "fault-centre" and e.name == "fault-msg"
                                   and e.detail["signalType"] == "normal" and e.at >= expired.at)
        assert await client.fault({2: 0}) == 0
        stop = await stream.next()
        assert stop.signalType == "stopTrain" and faults_of(stop) == {2: 0}


async def test_a_uce_on_another_rank_after_a_retry_starts_a_cycle_naming_the_held_record_too() -> None:
    async with own_sim(timings=RECORDS) as (sim, client):
        await _retry_cycle(client, await client.session(sim), {2: 0})
        stream = await client.session(sim)
        assert await client.fault({1: 0}) == 0
        stop = await stream.next()
        # saveCacheFault takes the whole published list: rank 2's record rides along
        assert faults_of(stop) == {1: 0, 2: 0}
        new = sim.journal.select("fault-list", "new-faults", JOB)[-1]
        assert new.detail["faults"] == {1: 0}


async def test_a_retry_record_is_published_by_the_fault_service_as_restart_business() -> None:
    job = "job-records"  # the Fault service refuses job ids shorter than 8 characters
    async with own_sim(SimJob(job, world_size=16, devices_per_pod=8), timings=RECORDS) as (sim, plain):
        client = Client(plain.channel, job)
        await client.session(sim)
        stub = fault_pb2_grpc.FaultStub(client.channel)
        assert await client.fault({5: 0}) == 0
        await sim.journal.wait_for(lambda e: e.name == "fault-msg" and e.detail["signalType"] == "fault")
        answer = await stub.GetFaultMsgSignal(fault_pb2.ClientInfo(jobId=job, role="test"), timeout=2)
        (node,) = answer.faultSignal.nodeFaultInfo
        (device,) = node.faultDevice
        assert (node.nodeName, device.deviceId) == ("node-0", "5")  # 8 NPUs per pod: rank 5 is NPU 5 of pod 0
        assert (list(device.faultCodes), list(device.faultLevels)) == (["80E01801"], ["RestartBusiness"])
        await sim.journal.wait_for(lambda e: e.name == "retry-record-expired", 5)
        answer = await stub.GetFaultMsgSignal(fault_pb2.ClientInfo(jobId=job, role="test"), timeout=2)
        assert answer.faultSignal.signalType == "normal"


async def test_a_uce_published_before_a_subscribe_is_lost_to_its_reset_until_the_record_expired() -> None:
    async with own_sim(timings=RECORDS) as (sim, client):
        first = await client.session(sim)
        first.cancel()  # no subscriber: the cycle the record starts has nobody to notify
        await sim.journal.wait_for(lambda e: e.kind == "stream-end")
        reported = asyncio.get_running_loop().time()
        assert await client.fault({3: 0}) == 0
        lost = await sim.journal.wait_for(lambda e: e.kind == "fault-lost" and e.at > reported)
        assert lost.name == "fault-centre"
        stream = await client.subscribe(sim)
        await stream.no_signal(0.3)  # held: every publication says no new faults
        assert sim.journal.select("fault-list", "no-new-faults", JOB)
        assert await client.fault({3: 0}) == 0  # reported again too early: refreshes the record
        expired = await sim.journal.wait_for(lambda e: e.name == "retry-record-expired", 5)
        await sim.journal.wait_for(lambda e: e.name == "fault-msg" and e.detail["signalType"] == "normal"
                                   and e.at >= expired.at)
        assert await client.fault({3: 0}) == 0
        assert faults_of(await stream.next()) == {3: 0}


async def test_a_uce_reported_before_a_subscribe_survives_when_the_subscribe_comes_before_the_tick() -> None:
    slow_tick = replace(RECORDS, retry_report_delay=(0.5, 0.5))
    async with own_sim(timings=slow_tick) as (sim, client):
        first = await client.session(sim)
        first.cancel()
        await sim.journal.wait_for(lambda e: e.kind == "stream-end")
        assert await client.fault({3: 0}) == 0
        assert sim.journal.rpcs("ReportProcessFault")[-1].detail["outcome"] == "recorded"
        stream = await client.subscribe(sim)  # its reset comes before the record's first publication
        assert faults_of(await stream.next()) == {3: 0}
