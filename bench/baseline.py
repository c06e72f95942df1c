"""What the benchmarks measure the bridge against: the existing MindCluster client's shape
(every callback makes its blocking Report* call before it returns; a reader thread
notifies the controller inline), and the percentile helpers they share."""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from bridge._proto import recover_pb2 as pb
from bridge._proto import recover_pb2_grpc


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` by the nearest-rank method: the smallest value with
    at least ``q`` of the samples at or below it (p99 of 100 samples is the 99th)."""
    ordered = sorted(values)
    rank = math.ceil(q * len(ordered))  # 1-based
    return ordered[min(len(ordered), max(rank, 1)) - 1]


def p50_gap_interval(ours: list[float], theirs: list[float], resamples: int = 2000,
                     seed: int = 1) -> tuple[float, float]:
    """A 95% bootstrap interval of ``p50(ours) - p50(theirs)``. A target on the gap
    between two medians of a few dozen samples each is read against it: when the gap's
    own spread is as wide as the slack, a single run's verdict is the machine's noise.
    Seeded, so the same samples always print the same interval."""
    rng = random.Random(seed)
    gaps = sorted(pct(rng.choices(ours, k=len(ours)), 0.5) - pct(rng.choices(theirs, k=len(theirs)), 0.5)
                  for _ in range(resamples))
    return gaps[int(0.025 * resamples)], gaps[int(0.975 * resamples) - 1]


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


class _StampedStub:
    """A stub whose calls note their method and start time (the request already built)."""

    def __init__(self, stub: Any, sent: list[tuple[str, float]]) -> None:
        self.stub, self._sent = stub, sent  # the gRPC stub (bench_loaded stamps its call starts)

    def __getattr__(self, method: str) -> Callable[..., Any]:
        call = getattr(self.stub, method)

        def stamped(request: Any) -> Any:
            self._sent.append((method, time.monotonic()))
            return call(request)
        return stamped


class SyncClient:
    """MindCluster's client shape around the stub controller: every callback makes its
    Report* call, blocking, with no deadline, before it returns to the controller; the
    reader thread calls the notify functions inline, in the signal's action order, then
    pauses 10 ms (as ``bench_relay.baseline_signals`` does), and after the stream ends it
    runs Init, Register, Subscribe again. Reports go on a channel of their own, as the
    bridge's do, so neither side waits behind the other's stream."""

    def __init__(self, address: str, job_id: str, ttp: Any = None) -> None:
        """``ttp``: the controller module it hosts (``mindio_ttp.controller_ttp``); the
        stub's unless given (bench_conformance.py hosts a real MindIO TFT build)."""
        if ttp is None:
            from bridge.sim.mindio_ttp import controller_ttp as ttp

        self.ttp = ttp
        self.job_id = job_id
        self.reports = grpc.insecure_channel(address)
        self.sent: list[tuple[str, float]] = []  # (method, time.monotonic()) as each Report* call starts
        self.report_stub = _StampedStub(recover_pb2_grpc.RecoverStub(self.reports), self.sent)
        self.signals = grpc.insecure_channel(address)
        self.signal_stub = recover_pb2_grpc.RecoverStub(self.signals)
        self.errors: list[str] = []
        self.streams_heard = 0  # subscriptions that delivered a first message (keep-alive or signal)
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
                heard = False
                for signal in self._stream:
                    if not heard:
                        heard = True
                        self.streams_heard += 1
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
