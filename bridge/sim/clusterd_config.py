"""The ``/config.Config/*`` servicer of the simulated ClusterD (rank-table publisher).

Real behaviour kept (docs/clusterd.md section 11): Register always answers 0 and
replaces the job's publisher, ending the previous subscriber's stream with OK; subscribing
needs a publisher; the current table is pushed shortly after subscribing and on every
change, with no de-duplication and no keep-alive; when a stream ends its publisher is
deleted, so the client must Register again before re-subscribing.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from bridge._proto import config_pb2
from bridge._proto import config_pb2_grpc

from bridge.sim.clusterd_channels import Subscriber
from bridge.sim.clusterd_recover import grpc_code
from bridge.sim.journal import Journal

#: ClusterD's publisher buffers up to 1000 tables; newer ones are dropped beyond that.
PUBLISHER_BUFFER = 1000


@dataclass
class Publisher:
    """One Register's publisher; it serves one subscriber at most."""

    job_id: str
    role: str
    subscriber: Subscriber[config_pb2.RankTableStream] | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def close(self, reason: str) -> None:
        if self.subscriber is not None:
            self.subscriber.end(grpc.StatusCode.OK, reason)
        for task in self.tasks:
            task.cancel()

    def offer(self, job_id: str, table: str) -> bool:
        """Queue one table for the live subscriber; False when nobody gets it."""
        sub = self.subscriber
        if sub is None or sub.ended.done() or sub.queue.full():
            return False
        sub.queue.put_nowait(config_pb2.RankTableStream(jobId=job_id, rankTable=table))
        return True


class ConfigHost(Protocol):
    """What the Config service reads and changes of the simulation (``SimClusterD``)."""

    journal: Journal
    publishers: dict[str, Publisher]
    rank_tables: dict[str, str]
    rank_table_delay: float

    def qps_refuses(self, path: str) -> bool: ...

    def next_stream_id(self, key: str) -> int: ...


class ConfigService(config_pb2_grpc.ConfigServicer):
    """ClusterD's Config service over the simulation's rank tables."""

    def __init__(self, sim: ConfigHost) -> None:
        self.sim = sim

    async def Register(self, request: config_pb2.ClientInfo,
                       context: grpc.aio.ServicerContext) -> config_pb2.Status:
        path = "/config.Config/Register"
        if self.sim.qps_refuses(path):
            self.sim.journal.record("rpc", "config.Register", request.jobId, None,
                                    role=request.role, grpc_status="UNKNOWN",
                                    error=f"qps exceeded, method={path}")
            await context.abort(grpc.StatusCode.UNKNOWN, f"qps exceeded, method={path}")
        old = self.sim.publishers.pop(request.jobId, None)
        if old is not None:
            old.close("a new Register replaced the publisher")
        self.sim.publishers[request.jobId] = Publisher(request.jobId, request.role)
        self.sim.journal.record("rpc", "config.Register", request.jobId, 0, role=request.role)
        return config_pb2.Status(code=0, info=f"jobId={request.jobId} register success")

    async def SubscribeRankTable(self, request: config_pb2.ClientInfo,
                                 context: grpc.aio.ServicerContext) -> None:
        job_id, journal = request.jobId, self.sim.journal
        publisher = self.sim.publishers.get(job_id)
        if publisher is None:
            refusal = f"jobId={job_id} not registered, role={request.role}"
            journal.record("stream-end", "SubscribeRankTable", job_id,
                           grpc_code(grpc.StatusCode.UNKNOWN), reason=refusal)
            await context.abort(grpc.StatusCode.UNKNOWN, refusal)
            return
        if publisher.subscriber is not None:
            publisher.subscriber.end(grpc.StatusCode.OK, "another subscriber took the publisher")
        sub: Subscriber[config_pb2.RankTableStream] = Subscriber(
            self.sim.next_stream_id(f"config.Config/{job_id}"), asyncio.Queue(maxsize=PUBLISHER_BUFFER)
        )
        publisher.subscriber = sub
        journal.record("stream-open", "SubscribeRankTable", job_id, stream=sub.stream_id,
                       role=request.role)
        initial = asyncio.get_running_loop().create_task(self._initial_push(publisher, sub))
        publisher.tasks.add(initial)
        initial.add_done_callback(publisher.tasks.discard)
        try:
            while (message := await sub.next()) is not None:
                journal.record("signal", "rankTable", job_id, None, stream=sub.stream_id,
                               jobId=message.jobId, rankTable=message.rankTable)
                await context.write(message)
        except asyncio.CancelledError:
            sub.end(grpc.StatusCode.CANCELLED, "client cancelled or connection broken")
            journal.record("stream-end", "SubscribeRankTable", job_id,
                           grpc_code(grpc.StatusCode.CANCELLED), stream=sub.stream_id,
                           reason="client cancelled, connection broken or server stopped")
            raise
        finally:
            initial.cancel()
            if self.sim.publishers.get(job_id) is publisher and publisher.subscriber is sub:
                # ClusterD deletes the publisher when its stream ends.
                del self.sim.publishers[job_id]
        end = sub.ended.result()
        journal.record("stream-end", "SubscribeRankTable", job_id, grpc_code(end.code),
                       stream=sub.stream_id, reason=end.reason)

    async def _initial_push(self, publisher: Publisher,
                            sub: Subscriber[config_pb2.RankTableStream]) -> None:
        """"The current table is pushed shortly after subscribing" (if one exists)."""
        await asyncio.sleep(self.sim.rank_table_delay)
        table = self.sim.rank_tables.get(publisher.job_id)
        if table is not None and publisher.subscriber is sub:
            publisher.offer(publisher.job_id, table)
