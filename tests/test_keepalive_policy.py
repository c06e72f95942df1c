"""Keep-alive pings every ClusterD release accepts, and a lost connection made visible.

ClusterD v7.3.2 and v7.0.RC1 set no ping enforcement policy, so gRPC's default applies:
a ping less than 5 minutes after the last one while the server wrote nothing, or with no
call open, is a strike; the third closes the connection with GOAWAY ENHANCE_YOUR_CALM
"too_many_pings". The bridge's report channel used to ping every ``grpc_keepalive``
without a call and got that GOAWAY about 2 minutes after it opened, silently.

These tests run the pings on a scaled clock (``grpc_keepalive`` 1 s instead of 30 s;
gRPC's default policy itself is not scaled, so it is as strict as on the real server)
and hold the bridge idle for several ping intervals: the idle time is the behaviour
under test, not a wait for something. The simulated release must close the connection
of a client pinging the old way (else these tests could not fail), and the bridge must
log and count that when it happens.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

import grpc
from types import SimpleNamespace
import pytest

from bridge.job.session import clusterd as clusterd_module
from bridge._proto import recover_pb2 as pb
from bridge.core.backoff import Backoff
from bridge.job.session.clusterd import ClusterDClient, channel_options, report_channel
from bridge.core.config import ClusterDConfig
from bridge.job.metrics import BridgeMetrics
from bridge.sim.clusterd import SimClusterD, SimJob
from bridge.sim.clusterd_release import DEFAULT_PING_POLICY, MASTER, RELEASES
from bridge.sim.scenario import SimulatedJob
from bridge.sim import mindio_ttp
from bridge.job.cycle_state import Cycles
from bridge.job.reports.kinds import report_of

from .conftest import eventually
from .wire_rig import WireRig

pytestmark = pytest.mark.timeout(90)

#: The scaled ping interval; the policy's strikes then come 1 s apart.
PING = 1.0
#: Long enough for three strikes and the GOAWAY with pings PING apart, twice over.
IDLE = 6 * PING


def old_options(config: ClusterDConfig, *, pings: float | None = None) -> list[tuple[str, Any]]:
    """What the bridge did before: pings every grpc_keepalive on both channels, with or
    without a call."""
    return [("grpc.keepalive_time_ms", int(config.grpc_keepalive * 1000)), ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
            ("grpc.enable_retries", 0)]


def lost(metrics: BridgeMetrics, channel: str) -> float:
    return metrics.sample("tft_bridge_clusterd_connection_lost_total", {"channel": channel})


# --------------------------------------------------------------------------- the simulated release

#: Just above master's 3 s floor: master accepts these pings without a call, gRPC's
#: default policy does not.
MASTER_SAFE_PING = 3.5


@pytest.mark.parametrize("name, closes", [("master", False), ("7.3", True)])
async def test_a_release_with_the_default_policy_closes_an_idle_pinging_client(name: str, closes: bool) -> None:
    """The simulation fails where the release fails: an idle channel pinging every 3.5 s
    without a call is closed by 7.3 (gRPC's default policy; 7.0 has the same) and kept
    by master, which allows pings 3 s apart with or without a call."""
    sim = SimClusterD([SimJob("job-ping")], release=RELEASES[name])
    address = await sim.start()
    channel = grpc.insecure_channel(address, old_options(ClusterDConfig(grpc_keepalive=MASTER_SAFE_PING)))
    states: list[grpc.ChannelConnectivity] = []
    channel.subscribe(states.append, try_to_connect=True)
    # The default policy's GOAWAY came about four pings (14 s) after READY, where a fixed
    # 14 s look raced it: a release that closes is waited for, one that keeps is held 17.5 s.
    hold = 5 * MASTER_SAFE_PING
    try:
        await eventually(lambda: grpc.ChannelConnectivity.READY in states, what="the channel connected")
        if closes:
            await eventually(lambda: states[-1] is not grpc.ChannelConnectivity.READY, timeout=2 * hold,
                             what=f"{name} closing the idle pinging channel")
        else:
            await asyncio.sleep(hold)  # idle on purpose: the pings are what is tested
            assert states[-1] is grpc.ChannelConnectivity.READY, f"{name}: connectivity {[s.name for s in states]}"
    finally:
        channel.close()
        await sim.stop()


def test_the_release_profiles_spell_out_grpcs_default_policy() -> None:
    policy = dict(DEFAULT_PING_POLICY)
    assert policy["grpc.http2.min_ping_interval_without_data_ms"] == 300_000
    assert policy["grpc.keepalive_permit_without_calls"] == 0
    assert policy["grpc.http2.max_ping_strikes"] == 2
    assert dict(MASTER.ping_policy)["grpc.http2.min_ping_interval_without_data_ms"] == 3000
    assert RELEASES["7.0"].ping_policy == RELEASES["7.3"].ping_policy == DEFAULT_PING_POLICY


# --------------------------------------------------------------------------- the channels' options

def test_no_channel_pings_without_a_call_and_each_pings_as_every_release_accepts() -> None:
    config = ClusterDConfig()
    signal = dict(channel_options(config))
    report = dict(channel_options(config, pings=0))
    rank_table = dict(channel_options(config, pings=ClusterDClient(config, BridgeMetrics(), quiet_stream=True)._pings))
    default_floor = dict(DEFAULT_PING_POLICY)["grpc.http2.min_ping_interval_without_data_ms"]
    for options in (signal, report, rank_table):
        assert options["grpc.keepalive_permit_without_calls"] == 0
        assert options["grpc.client_idle_timeout_ms"] == 2**31 - 1  # never dropped for being unused
    assert "grpc.keepalive_time_ms" not in report  # gRPC's default: never
    # ClusterD writes on the signal stream every keepalive_interval: each ping follows a write.
    assert signal["grpc.keepalive_time_ms"] == config.grpc_keepalive * 1000 >= 2 * config.keepalive_interval * 1000
    # ClusterD writes on the rank table's stream only on a change: pings beyond the floor.
    assert rank_table["grpc.keepalive_time_ms"] > default_floor


def test_the_rank_table_subscriber_uses_the_quiet_stream_pings() -> None:
    from bridge.core.config import RankTableConfig
    from bridge.job.session.rank_table import RankTableSubscriber

    subscriber = RankTableSubscriber(RankTableConfig(), ClusterDConfig(), BridgeMetrics())
    assert subscriber.client._pings is not None and subscriber.client._pings * 1000 > \
        dict(DEFAULT_PING_POLICY)["grpc.http2.min_ping_interval_without_data_ms"]


async def test_the_idle_timeout_the_bridge_turns_off_is_grpcs_own_option() -> None:
    """gRPC drops a connection unused for its client idle timeout (30 minutes by
    default), which the report channel would count as lost; the bridge sets that
    timeout to the maximum (test above). A misspelt option is ignored silently, so this
    shows the name takes effect: shortened to 0.5 s, the unused channel leaves READY."""
    sim = SimClusterD([SimJob("job-idle-timeout")])
    address = await sim.start()
    channel = grpc.insecure_channel(address, [("grpc.client_idle_timeout_ms", 500)])
    states: list[grpc.ChannelConnectivity] = []
    channel.subscribe(states.append, try_to_connect=True)
    try:
        health = channel.unary_unary("/Recover/HealthCheck")  # the idle timer counts from a call's end
        answer = await asyncio.to_thread(health, pb.ClientInfo(jobId="x").SerializeToString(), timeout=5)
        assert pb.Status.FromString(answer).code == 0
        # gRPC delivers connectivity changes on a thread of its own, possibly after the call
        # returned: wait for READY to be seen, then for a state after it.
        ready = grpc.ChannelConnectivity.READY
        await eventually(lambda: ready in states and states[-1] is not ready, timeout=5,
                         what="the unused channel dropped")
    finally:
        channel.close()
        await sim.stop()


# --------------------------------------------------------------------------- the bridge, idle

def scaled_job(release_name: str) -> SimulatedJob:
    job = SimulatedJob(SimJob("job-idle", world_size=8, devices_per_pod=4), release=RELEASES[release_name],
                       controller_timings=mindio_ttp.FAST_TIMINGS)
    # Validation keeps grpc_keepalive >= 10 s for real deployments; the scaled clock
    # needs 1 s (ClusterD's keep-alive on the stream is 0.5 s here, still twice as often).
    job.config = replace(job.config, clusterd=replace(job.config.clusterd, grpc_keepalive=PING))
    return job


@pytest.mark.parametrize("release_name", ["master", "7.3", "7.0"])
async def test_the_bridge_idle_past_the_policy_keeps_its_connections_and_delivers(release_name: str) -> None:
    job = scaled_job(release_name)
    await job.start()
    try:
        await job.subscribed()
        assert job.bridge is not None
        wire = job.bridge.link.wire
        await eventually(lambda: wire._ready, what="the report channel connected")
        await asyncio.sleep(IDLE)  # idle on purpose: the pings are what is tested
        assert wire._ready
        assert lost(job.metrics, "report") == 0 and lost(job.metrics, "signal") == 0
        job.training.inject_fault({5: 0})
        await eventually(lambda: job.sim.podgroup("job-idle").get("ProcessRecoverStatus") == "retry-success",
                         timeout=30, what="the retry cycle after the idle time")
        reports = [e.name for e in job.sim.journal.select(kind="rpc", job_id="job-idle") if e.name.startswith("Report")]
        assert reports.count("ReportRecoverStatus") == 1
        assert lost(job.metrics, "report") == 0
    finally:
        await job.stop()
    assert not job.sim.violations


async def test_a_goaway_on_the_report_channel_is_logged_and_counted(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """With the old options, 7.3 closes the idle report channel; the bridge says so (it
    used to be silent) and the next report still goes through on a new connection."""
    monkeypatch.setattr(clusterd_module, "channel_options", old_options)
    job = scaled_job("7.3")
    await job.start()
    try:
        await job.subscribed()
        with caplog.at_level(logging.WARNING, logger="bridge.job.session.clusterd"):
            await eventually(lambda: lost(job.metrics, "report") >= 1, timeout=IDLE + 10,
                             what="the report channel's GOAWAY counted")
        assert any("closed the report channel's connection" in r.getMessage() for r in caplog.records)
        job.training.inject_fault({5: 0})
        await eventually(lambda: job.sim.podgroup("job-idle").get("ProcessRecoverStatus") == "retry-success",
                         timeout=30, what="the retry cycle over a reconnected channel")
    finally:
        await job.stop()


# --------------------------------------------------------------------------- a report in flight

class _SlowReports:
    """A ClusterD stand-in whose ReportProcessFault answers only after ``hold`` seconds,
    writing nothing meanwhile (as a report that waits for ClusterD's one-slot buffer
    does)."""

    def __init__(self, hold: float) -> None:
        self.hold = hold
        self.received = 0
        self.server: grpc.aio.Server | None = None

    async def report(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self.received += 1
        await asyncio.sleep(self.hold)  # a server that holds the call: the behaviour under test
        return pb.Status(code=0, info="ok").SerializeToString()

    async def start(self) -> str:
        self.server = grpc.aio.server(options=list(DEFAULT_PING_POLICY))
        handler = grpc.unary_unary_rpc_method_handler(self.report)
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "Recover", {"ReportProcessFault": handler})])
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return f"127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)


async def test_a_report_in_flight_across_a_goaway_is_counted_never_lost_silently() -> None:
    """ClusterD sends GOAWAY and closes the connection while a report waits in it (here
    a server stopping without grace; ClusterD's Go server does the same after a
    too_many_pings GOAWAY). The call fails on a connection that was ready, an outcome
    that is unknown (the report reached ClusterD): the failure and the lost connection are
    counted, and the fault report stays queued (resending a fault is harmless: ClusterD
    merges faults; a cycle-bound report would be dropped, tests/test_relay.py)."""
    server = _SlowReports(hold=30.0)
    address = await server.start()
    metrics = BridgeMetrics()
    listener = SimpleNamespace(taken=lambda reports: None, dropped=lambda *args: None,
                               outcome_unknown=lambda kind: None, faults_delivered=lambda *args: None)
    wire = WireRig("job-goaway", report_channel(ClusterDConfig(address=address)), asyncio.get_running_loop(),
                   listener, metrics, rpc_timeout=30.0, backoff=Backoff(5.0, 5.0)).start()  # type: ignore[arg-type]
    wire.publish(Cycles(live=True, running="uuid-1", stream="stream:1"))
    try:
        await eventually(lambda: wire.wire._ready, what="the report channel connected")
        wire.put(report_of("report_fault_ranks", ({3: 0},), 0.0))
        await eventually(lambda: server.received == 1, what="the report arrived at ClusterD")
        await server.stop()
        await eventually(lambda: sum(sample.value for family in metrics.registry.collect() for sample in family.samples
                                     if sample.name == "tft_bridge_clusterd_rpcs_total"
                                     and sample.labels.get("method") == "ReportProcessFault") == 1,
                         what="the failed call counted")
        await eventually(lambda: lost(metrics, "report") == 1, what="the lost connection counted")
        assert server.received == 1 and len(wire) == 1
    finally:
        await asyncio.to_thread(wire.stop, 5.0)
        await server.stop()


async def test_a_goaway_on_the_signal_stream_is_logged_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    """Pings faster than ClusterD writes on the stream collect strikes: here ClusterD's
    keep-alive is set to 30 s and the pings to 1 s (the configuration check refuses such
    a pair; the test builds it on purpose). 7.3 closes the connection; the stream's end
    is logged and counted as a lost connection, and the bridge subscribes again."""
    job = SimulatedJob(SimJob("job-idle", world_size=8, devices_per_pod=4), release=RELEASES["7.3"],
                       keepalive_interval=30.0, controller_timings=mindio_ttp.FAST_TIMINGS,
                       config_overrides={"clusterd": {"grpc_keepalive": 60.0}})
    job.config = replace(job.config, clusterd=replace(job.config.clusterd, grpc_keepalive=PING))
    await job.start()
    try:
        with caplog.at_level(logging.WARNING, logger="bridge.job.session.clusterd"):
            await eventually(lambda: lost(job.metrics, "signal") >= 1, timeout=IDLE + 10,
                             what="the signal stream's GOAWAY counted")
        assert any("closed the signal channel's connection" in r.getMessage() for r in caplog.records)
        await eventually(lambda: len(job.sim.journal.select("stream-open", job_id="job-idle")) >= 2,
                         timeout=10, what="a new subscription")
    finally:
        await job.stop()
