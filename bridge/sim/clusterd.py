"""The simulated ClusterD: the real server's Recover, config.Config and Fault gRPC services,
as unforgiving as the real server, for the bridge's tests, the demo and ``tft-bridge
sim-clusterd``.

docs/clusterd.md describes the real server's observable behaviour and its section 9
where this simulation knowingly differs: read both before changing anything here.
:class:`SimClusterD` serves the jobs given as :class:`SimJob` (the PodGroup's
configuration); ``await start()`` returns its address, ``await stop()`` ends every stream
and task and drops the in-memory state (a restart is both; PodGroup annotations, labels
and rank tables survive, as they live in Kubernetes). Everything runs on the caller's
event loop. Every delay comes from one :class:`~.clusterd_timings.Timings` table whose
defaults are the real server's; :class:`~.clusterd_release.Release` picks the release
played (master by default). Tests drive what a client cannot (device faults, platform
annotations, the hot switch, the OM flows) through its methods and read what it saw and
did in :attr:`SimClusterD.journal`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

import grpc

from bridge._proto import config_pb2_grpc, fault_pb2_grpc
from bridge._proto import recover_pb2 as pb
from bridge._proto import recover_pb2_grpc as pb_grpc

from bridge.sim import clusterd_rules as rules
from bridge.sim.clusterd_config import ConfigService, Publisher
from bridge.sim.clusterd_fault import UCE_CODE, UCE_LEVEL, DeviceFaults, FaultService
from bridge.sim.clusterd_job import JobConfig, JobController, SimJob
from bridge.sim.clusterd_recover import RecoverService
from bridge.sim.clusterd_release import MASTER, RELEASES, Release
from bridge.sim.clusterd_timings import REAL, Timings
from bridge.sim.clusterd_messages import fault_ranks
from bridge.sim.journal import Journal, JournalEntry

__all__ = ["MASTER", "RELEASES", "REAL", "SERVER_OPTIONS", "Release", "Journal", "JournalEntry", "SimClusterD", "SimJob", "Timings"]

log = logging.getLogger("bridge.sim.clusterd")

#: ClusterD's message and stream limits (docs/clusterd.md, "Transport"): 4 MiB in, 8 MiB
#: out, 64 streams per connection. The ping policy comes from the release (clusterd_release.py).
LIMIT_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", 4 * 1024 * 1024),
    ("grpc.max_send_message_length", 8 * 1024 * 1024),
    ("grpc.max_concurrent_streams", 64),
)


def server_options(release: Release = MASTER) -> tuple[tuple[str, int], ...]:
    """The server options of ``release``: its ping policy and ClusterD's limits."""
    return release.ping_policy + LIMIT_OPTIONS


#: Master's server options: client pings >= 3 s apart, allowed without calls; the server
#: pings an idle client after 1 min with a 5 s timeout; the limits above.
SERVER_OPTIONS: tuple[tuple[str, int], ...] = server_options(MASTER)


class _TokenBucket:
    """ClusterD's unary limiter: ``rate`` calls per second, burst ``rate``."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self.tokens = float(rate)
        self.stamp = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(float(self.rate), self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False


class SimClusterD:
    """A grpc.aio server speaking ClusterD's Recover and config.Config protocols.

    Journal details: RPCs carry the decoded request (``faults`` as ``{rank: type}``,
    ``bad_faults`` for non-canonical entries, ``status`` as ``{"code", "info"}`` or None,
    ``strategies``, ``strategy``, ``isolateRankIds``) and ``outcome`` where useful;
    signals carry ``uuid, jobId, actions, faults, changeStrategy, timeout, nodeRankIds,
    extraParams`` and ``stream``; states carry the ``event`` that led there;
    ``fault-centre`` entries (``retry-fault`` with its ``delay``, ``pre-exit-scheduled``
    with ``ranks`` and ``delay``, ``orphaned-global-fault``) are written when the fault
    centre schedules something, before its delay starts, so tests measure delays from them.
    """

    def __init__(self, jobs: Iterable[SimJob] = (), *, timings: Timings | None = None,
                 keepalive_interval: float | None = None, global_fault_delay: float | None = None,
                 flush_delay: float | None = None, report_timeout: float | None = None,
                 dump_exit_repeat: float | None = None, max_jobs: int = 10_000,
                 qps_limit: int | None = None, seed: int | None = None,
                 rank_table_delay: float = 0.05, release: Release = MASTER) -> None:
        """``timings`` defaults to the real server's (:data:`~.clusterd_timings.REAL`);
        the keyword delays, when given, override single fields of it. ``release``: the
        ClusterD release played (its ping policy, fault centre and protocol)."""
        self.release = release
        self.jobs: dict[str, SimJob] = {job.job_id: job for job in jobs}
        overrides = {"keepalive_interval": keepalive_interval, "global_fault_delay": global_fault_delay,
                     "flush_delay": flush_delay, "report_timeout": report_timeout,
                     "dump_exit_repeat": dump_exit_repeat}
        self.timings: Timings = replace(timings or REAL,
                                        **{k: v for k, v in overrides.items() if v is not None})
        self.max_jobs = max_jobs
        self.qps_limit = qps_limit
        self.rank_table_delay = rank_table_delay
        self.rng = random.Random(seed)
        self.journal = Journal()
        self.violations: list[str] = []
        self.server_credentials: grpc.ServerCredentials | None = None  # set for TLS / mTLS tests
        self.address: str | None = None
        # Kubernetes-side state: survives a ClusterD restart.
        self._annotations: dict[str, dict[str, str]] = {job.job_id: dict(job.annotations) for job in jobs}
        self._labels: dict[str, dict[str, str]] = {}
        self.rank_tables: dict[str, str] = {}
        # The nodes' device faults (device-info ConfigMaps: survive a restart) and the
        # Fault service's publishers (dropped at a stop), bridge/sim/clusterd_fault.py.
        self.device_faults = DeviceFaults(self)
        # Test instructions.
        self._fail_next = 0
        self._delay_next = 0.0
        self._delay_subscribe = 0.0  # see delay_next_subscribe
        self._duplicate_next = False
        self.keepalives_silent_until = 0.0  # loop time; see silence_keepalives
        self._server: grpc.aio.Server | None = None
        self._host = "127.0.0.1"
        self._port = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stream_ids: dict[str, itertools.count[int]] = {}
        self._forget_server_state()

    def _forget_server_state(self) -> None:
        """ClusterD keeps all of this in memory only."""
        self.inited: dict[str, JobConfig] = {}
        self.controllers: dict[str, JobController] = {}
        self.publishers: dict[str, Publisher] = {}
        self._bucket = _TokenBucket(self.qps_limit) if self.qps_limit else None

    # ------------------------------------------------------------------ lifecycle

    async def start(self, listen: str = "127.0.0.1:0") -> str:
        if self._server is not None:
            raise RuntimeError("SimClusterD already started")
        server = grpc.aio.server(options=list(server_options(self.release)))
        pb_grpc.add_RecoverServicer_to_server(RecoverService(self), server)  # type: ignore[no-untyped-call]
        config_pb2_grpc.add_ConfigServicer_to_server(ConfigService(self), server)  # type: ignore[no-untyped-call]
        if self.release.fault_service:
            fault_pb2_grpc.add_FaultServicer_to_server(FaultService(self), server)  # type: ignore[no-untyped-call]
        if self.server_credentials is not None:
            # What a TLS-terminating proxy in front of ClusterD looks like to a client.
            port = server.add_secure_port(listen, self.server_credentials)
        else:
            port = server.add_insecure_port(listen)
        if not port:
            raise RuntimeError(f"SimClusterD cannot listen on {listen}")
        await server.start()
        self._server = server
        self._host = listen.rsplit(":", 1)[0]
        self._port = port
        self.address = f"{self._host}:{port}"
        return self.address

    async def stop(self, grace: float | None = 0) -> None:
        """Stop serving and leave no task behind; all in-memory state is dropped."""
        server, self._server = self._server, None
        tasks: list[asyncio.Task[Any]] = list(self._tasks)
        for ctl in self.controllers.values():
            subscriber = ctl.gen.subscriber
            if subscriber is not None:
                subscriber.end(grpc.StatusCode.UNAVAILABLE, "ClusterD stopped")
            ctl.gen.om.server_stopped = True  # its notify streams break too (clusterd_om.py)
            tasks += ctl.shutdown()
        self.device_faults.close()
        for publisher in self.publishers.values():
            tasks += publisher.tasks
            publisher.close("ClusterD stopped")
        if server is not None:
            await server.stop(grace)
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, Exception):
                log.error("sim clusterd task failed during stop: %r", result)
        self._forget_server_state()

    async def restart(self) -> None:
        """A ClusterD restart: stop, lose every Init, Register, buffer and cycle, start
        again on the same port. PodGroup annotations and rank tables (Kubernetes) stay."""
        listen = f"{self._host}:{self._port}"
        await self.stop()
        self.journal.record("state", "clusterd-restarted", "", listen=listen)
        await self.start(listen)

    async def __aenter__(self) -> SimClusterD:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ jobs and state

    def add_job(self, job: SimJob) -> None:
        self.jobs[job.job_id] = job
        self._annotations.setdefault(job.job_id, dict(job.annotations))

    def init_job(self, job: SimJob) -> None:
        """Init freezes the PodGroup's configuration, platform mode included."""
        self.inited[job.job_id] = JobConfig(job.job_id, rules.job_strategies(job.strategies),
                                            job.devices_per_pod, job.hot_switch,
                                            rules.platform_mode(self.podgroup(job.job_id)))

    def register_job(self, job_id: str) -> None:
        self.controllers[job_id] = JobController(self, self.inited[job_id])
        self.set_label(job_id, "process-recover-enable", "on")

    def retry_records_changed(self, job_id: str, faults: list[tuple[str, str]]) -> None:
        """The fault centre's retry records of a job changed: the Fault service publishes them."""
        self.device_faults.set_records(job_id, faults)

    def state(self, job_id: str) -> str:
        ctl = self.controllers.get(job_id)
        return ctl.state if ctl is not None else "INIT"

    def podgroup(self, job_id: str) -> dict[str, str]:
        """The job's PodGroup annotations: the job's own (``SimJob.annotations``), what
        the platform wrote (:meth:`platform_annotate`) and what ClusterD wrote."""
        return dict(self._annotations.get(job_id, {}))

    def platform_annotate(self, job_id: str, values: Mapping[str, str]) -> None:
        """The AI platform writes PodGroup annotations (the harness's ``POST
        /pg/annotate``: an empty value deletes the key), e.g. ``ProcessRecoverStrategy``
        and ``RankTableReady`` in platform mode. Journaled as ``annotation`` entries with
        ``by="platform"``; ClusterD reads them at its next poll."""
        annotations = self._annotations.setdefault(job_id, {})
        for key, value in values.items():
            if value:
                annotations[key] = value
            else:
                annotations.pop(key, None)
            self.journal.record("annotation", key, job_id, value=value, by="platform")

    def labels(self, job_id: str) -> dict[str, str]:
        """The PodGroup labels ClusterD wrote (process-recover-enable)."""
        return dict(self._labels.get(job_id, {}))

    def uuid(self, job_id: str) -> str:
        ctl = self.controllers.get(job_id)
        return ctl.uuid if ctl is not None else ""

    # ------------------------------------------------------------------ Host protocol

    def record(self, kind: str, name: str, job_id: str, code: int | None = None,
               **detail: Any) -> None:
        self.journal.record(kind, name, job_id, code, **detail)

    def violation(self, job_id: str, text: str) -> None:
        self.violations.append(f"{job_id}: {text}")
        self.journal.record("violation", "protocol", job_id, text=text)
        log.warning("protocol violation by the client of job %s: %s", job_id, text)

    def next_stream_id(self, key: str) -> int:
        """Streams are numbered 1, 2, ... per job (and per rank-table job) for the life of
        this simulator, restarts included, so tests can name "the job's second stream"."""
        return next(self._stream_ids.setdefault(key, itertools.count(1)))

    def annotate(self, job_id: str, key: str, value: str) -> None:
        self._annotations.setdefault(job_id, {})[key] = value
        self.journal.record("annotation", key, job_id, value=value)

    def set_label(self, job_id: str, key: str, value: str) -> None:
        self._labels.setdefault(job_id, {})[key] = value
        self.journal.record("annotation", f"label:{key}", job_id, value=value)

    # ------------------------------------------------------------------ limiter and tweaks

    def qps_refuses(self, path: str) -> bool:
        """True when this unary call must fail with UNKNOWN ``qps exceeded``."""
        if self._fail_next > 0:
            self._fail_next -= 1
            return True
        return self._bucket is not None and not self._bucket.take()

    def fail_next_unary(self, count: int = 1) -> None:
        """The next ``count`` unary calls (not HealthCheck) fail like an empty bucket."""
        self._fail_next += count

    def delay_next_signal(self, seconds: float) -> None:
        """Hold the next non-keep-alive signal ``seconds`` before writing it."""
        self._delay_next = seconds

    def delay_next_subscribe(self, seconds: float) -> None:
        """The next SubscribeProcessManageSignal handler starts ``seconds`` late, before
        its reset: a report sent on another connection after the Subscribe request can
        then reach ClusterD before that reset (two connections, two handlers, no order)."""
        self._delay_subscribe = seconds

    def take_subscribe_delay(self) -> float:
        delay, self._delay_subscribe = self._delay_subscribe, 0.0
        return delay

    def silence_keepalives(self, seconds: float) -> None:
        """Write no keep-alive on any stream for ``seconds`` (signals still go out), then
        resume at the usual cadence: a ClusterD whose keep-alive goroutine stalled a while.
        Unlike a longer ``keepalive_interval``, the silence ends on time."""
        self.keepalives_silent_until = asyncio.get_running_loop().time() + seconds

    def duplicate_next_signal(self) -> None:
        """Write the next non-keep-alive signal twice."""
        self._duplicate_next = True

    def take_tweaks(self) -> tuple[float, bool]:
        delay, duplicate = self._delay_next, self._duplicate_next
        self._delay_next, self._duplicate_next = 0.0, False
        return delay, duplicate

    # ------------------------------------------------------------------ injection

    def _controller(self, job_id: str) -> JobController:
        ctl = self.controllers.get(job_id)
        if ctl is None:
            raise KeyError(f"job {job_id} is not registered with the simulated ClusterD")
        return ctl

    async def drop_subscriber(self, job_id: str) -> None:
        """Abort the job's live stream with UNAVAILABLE, as a broken connection would,
        and reset the job mid-cycle like the real server on a broken stream."""
        ctl = self._controller(job_id)
        sub = ctl.gen.subscriber
        if sub is None or sub.ended.done():
            raise RuntimeError(f"job {job_id} has no live subscriber")
        sub.end(grpc.StatusCode.UNAVAILABLE, "simulated connection loss")
        ctl.reset("stream broken (simulated connection loss)")
        await self.journal.wait_for(
            lambda e: e.kind == "stream-end" and e.detail.get("stream") == sub.stream_id
            and e.job_id == job_id, timeout=2.0)

    async def send_signal(self, job_id: str, **fields: Any) -> None:
        """Push any ProcessManageSignal on the job's stream (jobId and uuid default to the
        job's); ``faultRanks`` may be a ``{rank: type}`` map or (rank, type) pairs."""
        ctl = self._controller(job_id)
        fields.setdefault("jobId", job_id)
        fields.setdefault("uuid", ctl.uuid)
        ranks = fields.pop("faultRanks", ())
        if isinstance(ranks, Mapping) or (ranks and not isinstance(next(iter(ranks)), pb.FaultRank)):
            ranks = fault_ranks(ranks)
        signal = pb.ProcessManageSignal(faultRanks=list(ranks), **fields)
        await ctl.push(signal)

    async def send_foreign_signal(self, job_id: str, foreign_job_id: str,
                                  signal_type: str = "stopTrain",
                                  actions: Iterable[str] = ("stop_train",)) -> None:
        """On ``job_id``'s stream, a signal that belongs to another job."""
        await self.send_signal(job_id, jobId=foreign_job_id, uuid=rules.new_uuid(),
                               signalType=signal_type, actions=list(actions))

    async def start_clusterd_fault(self, job_id: str, faults: Mapping[int, int]) -> str:
        """The fault centre raising FaultOccur for a job at once (a shortcut: on the real
        server a device fault without a business report gives preExitProcess, see
        :meth:`pre_exit`; a UCE/HCCL business report starts its retry cycle by itself).
        Starts a cycle with stopTrain when idle. Returns ``started``, ``joined`` or
        ``lost``."""
        ctl = self._controller(job_id)
        pairs = [(str(rank), str(kind)) for rank, kind in faults.items()]
        self.device_faults.inject(job_id, [rank for rank, kind in faults.items() if kind != 0])
        self.device_faults.inject(job_id, [rank for rank, kind in faults.items() if kind == 0], UCE_CODE, UCE_LEVEL)
        return ctl.report_faults(pairs, "fault-centre")

    async def pause(self, job_id: str, timeout: int = 0) -> None:
        """OM pause: stopTrain [pause_train] -> StopComplete -> changeStrategy continue ->
        RecoverStatus(0) ends it (499 or a timeout: killMaster)."""
        self._controller(job_id).start_pause(timeout)

    async def kill_master(self, job_id: str) -> None:
        """killMaster with the current uuid, then reset (the stream ends with OK)."""
        self._controller(job_id).start_kill_master()

    async def pre_exit(self, job_id: str, ranks: Iterable[int | str], *, uce: bool = False) -> None:
        """A device fault on ``ranks`` that reaches ClusterD only from its fault centre (no
        business report): preExitProcess ["pre exit process"] after the real delay
        (``timings.pre_exit_delay``, 10.85 s, or ``pre_exit_uce_delay``, 20.80 s, for a
        UCE hardware code), with those ranks as type "1", their pods as nodeRankIds and
        a throw-away uuid; no state change. Returns at once; the journal shows the
        ``fault-centre`` entry now and the signal later."""
        ctl = self._controller(job_id)
        delay = self.timings.pre_exit_uce_delay if uce else self.timings.pre_exit_delay
        self.device_faults.inject(job_id, ranks, *((UCE_CODE, UCE_LEVEL) if uce else ()))
        ctl.schedule_pre_exit([str(rank) for rank in ranks], delay,
                              f"device fault ({'UCE' if uce else 'non-UCE'} hardware code)")

    async def sub_health_fault(self, job_id: str, rank: int) -> str:
        """A sub-healthy NPU fault on ``rank`` from the fault centre: with the job's hot
        switch on, idle, and not on the master pod, a hot switch of that rank's pod
        (bridge/sim/clusterd_hot_switch.py). Returns ``started`` or why it was skipped."""
        return self._controller(job_id).start_hot_switch(str(rank))

    async def new_pod_running(self, job_id: str) -> None:
        """The running hot switch's backup pod is Running: ``new pod running`` follows."""
        self._controller(job_id).new_pod_running()

    def device_fault(self, job_id: str, ranks: Iterable[int | str], code: str = "80C98000",
                     level: str = "RestartNPU") -> None:
        """An NPU fault the device plugin reports for ``ranks`` (the harness's ``POST
        /fault/device``): published on the Fault service only; no signal by itself here
        (use :meth:`pre_exit` for the fault centre's preExitProcess as well)."""
        self.device_faults.inject(job_id, ranks, code, level)

    def clear_device_faults(self, job_id: str) -> None:
        """The device faults recovered (``POST /fault/clear``): a "normal" FaultMsgSignal."""
        self.device_faults.clear(job_id)

    async def save_and_exit(self, job_id: str) -> None:
        """saveAndExit [save_and_exit]; then a RecoverStatus for dump, dump_exit twice."""
        self._controller(job_id).start_save_and_exit()

    async def push_rank_table(self, job_id: str, table_json: str) -> None:
        """Publish a new rank table (identical tables are sent again: no de-dup). With no
        live subscriber the change is lost, but the next subscribe gets the table."""
        job = self.jobs.get(job_id)
        config_id = job.config_job_id if job is not None else job_id
        self.rank_tables[config_id] = table_json
        publisher = self.publishers.get(config_id)
        if publisher is not None:
            publisher.offer(config_id, table_json)

    async def wait_for(self, predicate: Callable[[JournalEntry], bool],
                       timeout: float = 5.0) -> JournalEntry:
        return await self.journal.wait_for(predicate, timeout)
