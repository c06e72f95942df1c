"""Issue 16's end-to-end critical path, for bench_loaded.py: from the controller's SECOND
``report_fault_ranks`` callback of a recovery cycle to ClusterD logging receipt of the
``ReportRecoverStrategy`` that follows it, over real recovery cycles.

Two clients run the same cycles against a simulated ClusterD in its own process
(``remote_sim.py``), each with the stub controller (a process-wide singleton, so one at
a time):

* the bridge as built (``SimulatedJob``), the callbacks and notifies as the daemon
  registers and makes them;
* ``SyncClient``: MindCluster's client shape, the controller's four callbacks each make
  a blocking gRPC call before they return, and one reader thread iterates
  SubscribeProcessManageSignal and calls the notify functions inline, re-subscribing
  (Init, Register, Subscribe) after every stream end.

A cycle is a pure retry cycle (a UCE on one rank, ``retry`` among the job's strategies,
which is why this does not use remote_sim's MEASURING_STRATEGIES): stopTrain ->
stop-complete -> globalFault -> the 2nd report_fault_ranks -> report_strategies ->
changeStrategy retry -> report_result, and ClusterD ends the stream. It is the shortest
cycle that crosses the measured path, so many fit in a run; its path has no ClusterD
sleep in it (ReportRecoverStrategy -> changeStrategy is immediate without an HCCL fault).

Times: the stub stamps every callback on the controller's thread just before it runs
(``time.monotonic()``); the simulated ClusterD stamps each RPC when it logs it
(CLOCK_MONOTONIC in the child process, the same clock).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from remote_sim import RemoteSim
from soak import wait_live_on_new_stream

from bridge._proto import recover_pb2 as pb
from bridge._proto import recover_pb2_grpc

WORLD_SIZE = 16  # the 16-rank runs
DEVICES_PER_POD = 4
#: retry first: a UCE report alone starts a pure retry cycle (docs/clusterd.md section 7)
STRATEGIES = ("retry", "recover", "dump", "exit")
PHASE_DELAY = 0.01  # ClusterD's wait before globalFault: not on the measured path
KEEPALIVE = 1.0
CYCLE_TIMEOUT = 15.0


class CycleFailed(Exception):
    """A cycle that did not run as a retry cycle to retry-success."""


@dataclass
class CycleTimes:
    """One cycle's milestones (monotonic seconds); None where the run did not show one."""

    second_fault_cb: float  # the controller calls report_fault_ranks the 2nd time
    fault_received: float | None  # ClusterD logs the ReportProcessFault that follows it
    strategies_cb: float  # the controller calls report_strategies
    strategy_sent: float | None  # the bridge's relay starts the RecoverStrategy RPC (bridge only)
    strategy_received: float  # ClusterD logs ReportRecoverStrategy
    fault_at_loop: float | None = None  # the 2nd fault report reaches the bridge's event loop (bridge only)
    fault_sent: float | None = None  # the bridge's relay starts the 2nd fault report's RPC (bridge only)

    @property
    def total(self) -> float:
        return self.strategy_received - self.second_fault_cb


async def run_cycle(sim: RemoteSim, training: Any, index: int,
                    ready_again: Callable[[int], Awaitable[None]],
                    sent_log: Iterable[tuple[str, float]] | None = None) -> CycleTimes:
    """Inject a UCE on one rank, wait for ClusterD's retry-success and for the client to
    be subscribed again with the controller back in NORMAL; return the cycle's times.
    ``ready_again(mark)`` waits for the client's next live stream after journal seq
    ``mark``. ``sent_log``: the bridge relay's (kind, time) send log with the bench's
    ("loop <callback>", time) stamps, if any."""
    rank = (index * 5 + 1) % WORLD_SIZE
    with training.cond:  # the stub's log is per cycle: indexes below are this cycle's
        training.events.clear()
        training.callback_durations.clear()
    del sim.entries[:-1]
    mark = sim.last_seq
    training.inject_fault({rank: 0})
    done = await sim.wait_for(lambda e: e.kind == "annotation" and e.name == "ProcessRecoverStatus",
                              CYCLE_TIMEOUT, after=mark)
    if done.detail.get("value") != "retry-success":
        raise CycleFailed(f"cycle {index}: ClusterD wrote {done.detail.get('value')!r}, not 'retry-success'")
    await ready_again(mark)
    deadline = time.monotonic() + CYCLE_TIMEOUT
    while training.state != "NORMAL":
        if time.monotonic() > deadline:
            raise CycleFailed(f"cycle {index}: the controller is {training.state}, not back to NORMAL")
        await asyncio.sleep(0.002)
    faults = training.callbacks("report_fault_ranks")
    strategies = training.callbacks("report_strategies")
    if len(faults) < 2 or not strategies:
        raise CycleFailed(f"cycle {index}: {len(faults)} report_fault_ranks, {len(strategies)} report_strategies")
    second, offered = faults[1].t, strategies[0].t
    entries = [e for e in sim.entries if e.seq > mark]
    global_fault = next((e for e in entries if e.kind == "signal" and e.name == "globalFault"), None)
    after_global = [e for e in entries if global_fault is not None and e.seq > global_fault.seq]
    fault_rpc = next((e for e in after_global if e.kind == "rpc" and e.name == "ReportProcessFault"), None)
    strategy_rpc = next((e for e in entries if e.kind == "rpc" and e.name == "ReportRecoverStrategy"), None)
    if strategy_rpc is None:
        raise CycleFailed(f"cycle {index}: no ReportRecoverStrategy in ClusterD's journal")
    sent = fault_sent = at_loop = None
    if sent_log is not None:
        log = list(sent_log)
        sent = next((t for kind, t in log if kind == "strategy" and t >= offered), None)
        fault_sent = next((t for kind, t in log if kind == "fault" and t >= second), None)
        at_loop = next((t for kind, t in log if kind == "loop report_fault_ranks" and t >= second), None)
    return CycleTimes(second, fault_rpc.at if fault_rpc else None, offered, sent, strategy_rpc.at, at_loop,
                      fault_sent)


async def next_stream_open(sim: RemoteSim, mark: int) -> int:
    """ClusterD ended the cycle's stream after ``mark`` and a client subscribed again:
    the seq of that stream-open."""
    ended = await sim.wait_for(lambda e: e.kind == "stream-end", CYCLE_TIMEOUT, after=mark)
    opened = await sim.wait_for(lambda e: e.kind == "stream-open", CYCLE_TIMEOUT, after=ended.seq)
    return opened.seq


def bridge_ready_again(job: Any, sim: RemoteSim) -> Callable[[int], Awaitable[None]]:
    """The bridge's next stream is open on ClusterD's side and its session is live."""

    async def ready(mark: int) -> None:
        try:
            await wait_live_on_new_stream(job, sim, mark, CYCLE_TIMEOUT)
        except TimeoutError as error:
            raise CycleFailed(f"the bridge did not re-subscribe: {error}") from None

    return ready


class SyncClient:
    """MindCluster's client shape around the stub controller: every callback makes its
    Report* call, blocking, with no deadline, before it returns to the controller; the
    reader thread calls the notify functions inline, in the signal's action order, then
    pauses 10 ms (as ``bench_relay.baseline_signals`` does), and after the stream ends it
    runs Init, Register, Subscribe again. Reports go on a channel of their own, as the
    bridge's do, so neither side waits behind the other's stream."""

    def __init__(self, address: str, job_id: str) -> None:
        from bridge.sim.mindio_ttp import controller_ttp as ttp

        self.ttp = ttp
        self.job_id = job_id
        self.reports = grpc.insecure_channel(address)
        self.report_stub = recover_pb2_grpc.RecoverStub(self.reports)
        self.signals = grpc.insecure_channel(address)
        self.signal_stub = recover_pb2_grpc.RecoverStub(self.signals)
        self.errors: list[str] = []
        self._stopping = threading.Event()
        self._stream: Any = None
        self._reader = threading.Thread(target=self._read, name="sync-reader", daemon=True)

    # ---------------------------------------------------------------- the four callbacks

    def _faults(self, faults: dict[int, int]) -> list[pb.FaultRank]:
        return [pb.FaultRank(rankId=str(rank), faultType=str(kind)) for rank, kind in faults.items()]

    def _call(self, what: str, call: Callable[[], Any]) -> int:
        try:
            call()
        except Exception as error:
            self.errors.append(f"{what}: {error}")
            raise  # the controller sees 1, as with the real client
        return 0

    def report_fault_ranks(self, faults: dict[int, int], codes: dict[int, str] | None = None) -> int:
        return self._call("ReportProcessFault", lambda: self.report_stub.ReportProcessFault(
            pb.ProcessFaultRequest(jobId=self.job_id, faultRanks=self._faults(faults))))

    def report_stop_complete(self, code: int, msg: str, faults: dict[int, int]) -> int:
        return self._call("ReportStopComplete", lambda: self.report_stub.ReportStopComplete(
            pb.StopCompleteRequest(jobId=self.job_id, status=pb.Status(code=code, info=msg),
                                   faultRanks=self._faults(faults))))

    def report_strategies(self, faults: dict[int, int], strategies: list[str]) -> int:
        return self._call("ReportRecoverStrategy", lambda: self.report_stub.ReportRecoverStrategy(
            pb.RecoverStrategyRequest(jobId=self.job_id, faultRanks=self._faults(faults),
                                      strategies=list(strategies))))

    def report_result(self, code: int, msg: str, faults: dict[int, int], strategy: str) -> int:
        return self._call("ReportRecoverStatus", lambda: self.report_stub.ReportRecoverStatus(
            pb.RecoverStatusRequest(jobId=self.job_id, status=pb.Status(code=code, info=msg), strategy=strategy)))

    def register(self) -> None:
        for action in ("report_fault_ranks", "report_stop_complete", "report_strategies", "report_result"):
            self.ttp.tft_register_mindx_callback(action, getattr(self, action))

    # ---------------------------------------------------------------- the reader

    def start_reader(self) -> None:
        self._reader.start()

    def _read(self) -> None:
        info = pb.ClientInfo(jobId=self.job_id, role="baseline")
        while not self._stopping.is_set():
            try:
                self.signal_stub.Init(info)
                self.signal_stub.Register(info)
                self._stream = self.signal_stub.SubscribeProcessManageSignal(info)
                for signal in self._stream:
                    if signal.signalType != "keep-alive":
                        self._act(signal)
                        time.sleep(0.01)
            except grpc.RpcError as error:
                if not self._stopping.is_set():
                    self.errors.append(f"stream: {error}")
                    time.sleep(0.05)

    def _act(self, signal: Any) -> None:
        faults = {int(f.rankId): int(f.faultType) for f in signal.faultRanks}
        for action in signal.actions:
            if action == "stop_train":
                self.ttp.tft_notify_controller_stop_train(faults, "stop")
            elif action == "on_global_rank":
                self.ttp.tft_notify_controller_on_global_rank(faults, max(1, int(signal.timeout)))
            elif action == "change_strategy":
                self.ttp.tft_notify_controller_change_strategy(signal.changeStrategy)

    def close(self) -> None:
        self._stopping.set()
        if self._stream is not None:
            self._stream.cancel()
        if self._reader.is_alive():
            self._reader.join(5)
        self.reports.close()
        self.signals.close()
