"""A ClusterD that answers like the real one, for the latency benchmarks.

The real ClusterD is a Go service: each Report* handler decodes the request, logs one
line, puts the report in a one-slot buffer and answers code 0 (docs/clusterd.md
section 4), about 0.6-1.1 ms from a synchronous client's send to its log line on a
loopback node. The project's simulation (``bridge/sim``) journals and simulates every
request in Python and answers far later, which hides the client's own thread hops
behind the server's time. This server does the least a server can: its handlers run on
grpcio's synchronous server, stamp ``time.monotonic()`` (CLOCK_MONOTONIC, shared by
every process of a machine) the moment the request is decoded, append the stamp to a
list and answer the real codes' ``Status(code=0)``. Nothing else runs in the handler.

It runs in a process of its own (``FastClusterD``): sharing the measured client's
interpreter would make its decoding compete for the GIL. The stamps stay in the child
until the parent asks for them (``dump``): streaming them to the parent as they happen
would wake the measured process's event loop on the very path it measures.

A recovery cycle needs a stream and a uuid, so with ``cycles on`` the child also plays
the shortest real cycle, a pure retry (docs/clusterd.md section 7), on a thread of its
own that the handlers wake after stamping and answering nothing late:
fault report -> stopTrain -> stop-complete -> globalFault [on_global_rank] -> strategy
report -> changeStrategy retry -> result report -> the stream ends with OK (ClusterD
resets the job after every cycle; the client subscribes again). Unlike the real server
it sends stopTrain at once instead of 0.7-1.0 s later: that wait is not on any measured
path. Every cycle signal carries the cycle's uuid, every stream keep-alives.

    python bench/fast_clusterd.py --child --listen 127.0.0.1:PORT --job JOB
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import secrets
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

from child_server import ChildServer  # bench/ is this script's directory: on sys.path

#: The reply of every Report* handler: ClusterD's code 0 (docs/clusterd.md section 3).
REPORTS = ("ReportProcessFault", "ReportStopComplete", "ReportRecoverStrategy", "ReportRecoverStatus")


@dataclass
class Stamp:
    at: float  # CLOCK_MONOTONIC when the event happened in the child
    kind: str  # "rpc", "stream-open", "stream-end", "cycle-done", "listening"
    name: str
    detail: dict[str, Any] = field(default_factory=dict)


class FastClusterD(ChildServer):
    """Parent side: start the child, ask for its stamps, switch cycles on or off."""

    def __init__(self, listen: str, job: str, keepalive: float = 1.0) -> None:
        super().__init__([sys.executable, __file__, "--child", "--listen", listen, "--job", job,
                          "--keepalive", str(keepalive)])
        self.address = listen
        self.events: list[Stamp] = []  # sent eagerly by the child: stream open/end, cycle done
        self._changed = asyncio.Event()
        self._dumps: asyncio.Queue[list[Stamp]] = asyncio.Queue()

    async def wait_listening(self) -> None:
        await self.wait_event(lambda e: e.kind == "listening", 20)

    async def on_line(self, data: dict[str, Any]) -> None:
        if "dump" in data:
            await self._dumps.put([Stamp(*item) for item in data["dump"]])
            return
        self.events.append(Stamp(data["at"], data["kind"], data["name"], data.get("detail", {})))
        self._changed.set()

    async def wait_event(self, predicate: Callable[[Stamp], bool], timeout: float, after: int = 0) -> Stamp:
        """The first eager event at index >= ``after`` matching ``predicate``."""
        deadline = time.monotonic() + timeout
        checked = after
        while True:
            for index in range(checked, len(self.events)):
                if predicate(self.events[index]):
                    return self.events[index]
            checked = max(checked, len(self.events))
            self._changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no matching event from the fast ClusterD")
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    async def dump(self) -> list[Stamp]:
        """Every RPC stamp since the last dump, in arrival order."""
        await self.command("dump")
        return await asyncio.wait_for(self._dumps.get(), 20)


# --------------------------------------------------------------------------- child

_END = object()


class _Child:
    def __init__(self, job: str, keepalive: float) -> None:
        from bridge._proto import recover_pb2 as pb

        self.pb = pb
        self.job = job
        self.keepalive = keepalive
        self.stamps: list[tuple[float, str, str, dict[str, Any]]] = []
        self.ok = pb.Status(code=0, info="receive")
        self.cycles = False
        self._out_lock = threading.Lock()
        self._stream: queue.SimpleQueue[Any] | None = None  # the live subscriber's signal queue
        self._stream_id = 0
        self._reports: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()  # the cycle thread's input
        threading.Thread(target=self._play_cycles, name="cycle", daemon=True).start()

    # ---------------------------------------------------------------- output
    def emit(self, kind: str, name: str, at: float, detail: dict[str, Any] | None = None) -> None:
        with self._out_lock:
            sys.stdout.write(json.dumps({"at": at, "kind": kind, "name": name, "detail": detail or {}}) + "\n")
            sys.stdout.flush()

    def dump(self) -> None:
        taken, self.stamps = self.stamps, []
        with self._out_lock:
            sys.stdout.write(json.dumps({"dump": taken}) + "\n")
            sys.stdout.flush()

    # ---------------------------------------------------------------- handlers
    def handlers(self) -> Any:
        import grpc

        pb = self.pb

        def report(name: str) -> Callable[[Any, Any], Any]:
            def handle(request: Any, context: Any) -> Any:
                self.stamps.append((time.monotonic(), "rpc", name, {}))
                if self.cycles:
                    self._reports.put((name, request))
                return self.ok
            return handle

        def session(request: Any, context: Any) -> Any:
            return pb.Status(code=0, info="ok")

        unary = {name: grpc.unary_unary_rpc_method_handler(
            report(name), request_deserializer=getattr(pb, _REQUEST[name]).FromString,
            response_serializer=pb.Status.SerializeToString) for name in REPORTS}
        for name in ("Init", "Register", "HealthCheck"):
            unary[name] = grpc.unary_unary_rpc_method_handler(
                session, request_deserializer=pb.ClientInfo.FromString,
                response_serializer=pb.Status.SerializeToString)
        unary["SubscribeProcessManageSignal"] = grpc.unary_stream_rpc_method_handler(
            self.subscribe, request_deserializer=pb.ClientInfo.FromString,
            response_serializer=pb.ProcessManageSignal.SerializeToString)
        return grpc.method_handlers_generic_handler("Recover", unary)

    def subscribe(self, request: Any, context: Any) -> Iterator[Any]:
        """One subscriber: a new subscription ends the previous stream (ClusterD resets)."""
        signals: queue.SimpleQueue[Any] = queue.SimpleQueue()
        if self._stream is not None:
            self._stream.put(_END)
        self._stream = signals
        self._stream_id += 1
        stream_id = self._stream_id
        self.emit("stream-open", self.job, time.monotonic(), {"stream": stream_id})
        try:
            while context.is_active():
                try:
                    signal = signals.get(timeout=self.keepalive)
                except queue.Empty:
                    signal = self.pb.ProcessManageSignal(jobId=self.job, signalType="keep-alive")
                if signal is _END:
                    return
                yield signal
        finally:
            if self._stream is signals:
                self._stream = None
            self.emit("stream-end", self.job, time.monotonic(), {"stream": stream_id})

    # ---------------------------------------------------------------- the retry cycle
    def _push(self, signal: Any) -> None:
        if self._stream is not None:
            self._stream.put(signal)

    def _play_cycles(self) -> None:
        pb = self.pb
        uuid, faults, step = "", [], "idle"
        while True:
            name, request = self._reports.get()
            if step == "idle" and name == "ReportProcessFault":
                uuid = f"{time.time_ns():X}-{secrets.token_hex(16)}"
                faults = list(request.faultRanks)
                step = "stop"
                self._push(pb.ProcessManageSignal(uuid=uuid, jobId=self.job, signalType="stopTrain",
                                                  actions=["stop_train"], faultRanks=faults))
            elif step == "stop" and name == "ReportStopComplete":
                step = "strategy"
                self._push(pb.ProcessManageSignal(uuid=uuid, jobId=self.job, signalType="globalFault",
                                                  actions=["on_global_rank"], faultRanks=faults))
            elif step == "strategy" and name == "ReportRecoverStrategy":
                step = "result"
                self._push(pb.ProcessManageSignal(uuid=uuid, jobId=self.job, signalType="changeStrategy",
                                                  actions=["change_strategy"], changeStrategy="retry"))
            elif step == "result" and name == "ReportRecoverStatus":
                step = "idle"
                self.emit("cycle-done", self.job, time.monotonic(), {"code": request.status.code})
                if self._stream is not None:
                    self._stream.put(_END)  # ClusterD resets the job after every cycle


_REQUEST = {"ReportProcessFault": "ProcessFaultRequest", "ReportStopComplete": "StopCompleteRequest",
            "ReportRecoverStrategy": "RecoverStrategyRequest", "ReportRecoverStatus": "RecoverStatusRequest"}


def _serve(args: argparse.Namespace) -> None:
    import grpc

    child = _Child(args.job, args.keepalive)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers((child.handlers(),))
    server.add_insecure_port(args.listen)
    server.start()
    child.emit("listening", args.listen, time.monotonic())
    for line in sys.stdin:
        command = line.split()
        if not command:
            continue
        if command[0] == "dump":
            child.dump()
        elif command[0] == "cycles":
            child.cycles = command[1] == "on"
    server.stop(1).wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", action="store_true", required=True)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--keepalive", type=float, default=1.0)
    _serve(parser.parse_args())
    os._exit(0)  # grpc's threads: leave at once once the parent closed stdin
