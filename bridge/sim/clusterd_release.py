"""What differs between the ClusterD releases in use, as the simulated ClusterD plays them.

A client checked against master alone breaks on the releases most clusters run. Each
:class:`Release` holds what was observed on the unmodified ClusterD service code of that
release, next to MindCluster's own synchronous client (docs/releases.md):

* **Ping policy.** Master sets an enforcement policy (client pings at least 3 s apart,
  allowed without a call). v7.3.2 and v7.0.RC1 set none, so gRPC's default applies: a
  ping less than 5 minutes after the previous one, or without an open call, is a strike
  unless the server wrote something since; the third strike closes the connection with
  GOAWAY ENHANCE_YOUR_CALM ``too_many_pings``. gRPC core enforces it the same way in the
  simulator's server (the options below), so the simulation fails where the release does.
* **Repeated retry cycle** (v7.3.2): after a retry cycle that succeeded, the fault centre
  still holds the reported UCE/HCCL fault and starts a second cycle 0.7 s (UCE) / 4 s
  (HCCL) after the first ended; the controller, whose device is healthy again, fails its
  device stop (499 ``notify device stop failed``) and the job's status ends
  ``retry-failed``. Master drops a repeat that adds no new fault.
* **Slow fault centre** (v7.0.RC1): a cycle starts about 4 s after the fault report
  (master: under 1 s).
* **Protocol** (v7.0.RC1): ``ProcessManageSignal`` has no fields 7-9 (``timeout``,
  ``nodeRankIds``, ``extraParams``), ``RecoverStatusRequest`` no ``isolateRankIds`` (a
  client's value is an unknown field the server never reads), and there is no
  ``HealthCheck`` RPC (UNIMPLEMENTED). v7.2.RC1 to v7.3.2 and branch v26.0.0 share
  master's recover.proto and config.proto.
* **FaultRetry's exit notice** (v7.3.2, v7.0.RC1): FaultRetry (a report timeout, a
  platform-mode 508/509, the end of a dump or exit) pauses the job's label and resets
  without sending anything; master sends the ``dump_exit`` notice first (its
  ``handleFaultRetry`` calls ``sendDumpExit``; read in the sources of every release tag,
  observed on the v7.3.2 harness: a 509 in platform mode sent no signal).
* **Hot switch and recover-in-place** (read in the sources): v7.3.2 has both, as master
  does; v7.0.RC1 has neither (a ``recover-in-place`` annotation is an unknown name,
  dropped; a sub-healthy fault starts no switch).

Delays are in real seconds here and scale with the simulator's :class:`Timings`
(``Timings.retry_repeat_delay_*``, ``Timings.fault_centre_delay``).
"""

from __future__ import annotations

from dataclasses import dataclass

#: ClusterD master's transport limits (docs/clusterd.md, "Transport"): client pings >= 3 s
#: apart, allowed without calls; the server pings an idle client after 1 min (5 s timeout).
#: The option's name is gRPC core's GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
#: "grpc.http2.min_ping_interval_without_data_ms"; an unknown name (such as the macro's
#: own spelling) is ignored silently and leaves gRPC's 5-minute default in force.
MASTER_PING_POLICY: tuple[tuple[str, int], ...] = (
    ("grpc.http2.min_ping_interval_without_data_ms", 3000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_ping_strikes", 2),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 5_000),
)

#: gRPC's default server policy, spelled out (it is also what gRPC core does unasked):
#: pings at most every 5 minutes while the server writes nothing, none without a call,
#: GOAWAY too_many_pings at the third strike; the server itself pings after 2 hours.
DEFAULT_PING_POLICY: tuple[tuple[str, int], ...] = (
    ("grpc.http2.min_ping_interval_without_data_ms", 300_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_ping_strikes", 2),
    ("grpc.keepalive_time_ms", 7_200_000),
    ("grpc.keepalive_timeout_ms", 20_000),
)


@dataclass(frozen=True)
class Release:
    """One ClusterD release's observable differences from master."""

    name: str  #: what ``--release`` takes
    version: str  #: the release it stands for
    ping_policy: tuple[tuple[str, int], ...]
    repeats_retry_cycle: bool = False  #: a succeeded retry cycle's fault starts a second cycle
    slow_fault_centre: bool = False  #: a cycle starts ``Timings.fault_centre_delay`` after the report
    signal_fields_7_to_9: bool = True  #: ProcessManageSignal timeout, nodeRankIds, extraParams
    isolate_rank_ids: bool = True  #: RecoverStatusRequest.isolateRankIds is read
    health_check: bool = True  #: the HealthCheck RPC exists
    hot_switch_and_in_place: bool = True  #: the hot switch and recover-in-place exist
    fault_service: bool = True  #: the Fault service (fault.Fault) is served (not by the v7.3.2 harness)
    fault_retry_dump_exit: bool = True  #: FaultRetry sends the dump_exit notice before it resets
    #: UCE/HCCL reports become fault-centre records that start a cycle only when new
    #: (master's ``getAdditionFault``, clusterd_retry.py); the older profiles keep their
    #: observed fault centres (``repeats_retry_cycle``, ``slow_fault_centre``)
    retry_records: bool = True


MASTER = Release("master", "master (and branch v26.0.0)", MASTER_PING_POLICY)
V7_3 = Release("7.3", "v7.3.2 (v7.2.RC1-v7.3.2 share its protocol)", DEFAULT_PING_POLICY,
               repeats_retry_cycle=True, fault_service=False, fault_retry_dump_exit=False, retry_records=False)
V7_0 = Release("7.0", "v7.0.RC1", DEFAULT_PING_POLICY, slow_fault_centre=True,
               signal_fields_7_to_9=False, isolate_rank_ids=False, health_check=False,
               hot_switch_and_in_place=False, fault_service=False, fault_retry_dump_exit=False,
               retry_records=False)

RELEASES: dict[str, Release] = {release.name: release for release in (MASTER, V7_3, V7_0)}


def release(name: str) -> Release:
    """The profile ``name`` names; ValueError listing the known ones otherwise."""
    try:
        return RELEASES[name]
    except KeyError:
        raise ValueError(f"unknown ClusterD release {name!r}; known: {', '.join(RELEASES)}") from None


__all__ = ["DEFAULT_PING_POLICY", "MASTER", "MASTER_PING_POLICY", "RELEASES", "Release", "V7_0", "V7_3", "release"]
