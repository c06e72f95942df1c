"""``python -m tests.idle_keepalive [SECONDS]``: the bridge idle against a simulated
ClusterD that enforces gRPC's default ping policy (the ``7.3`` profile), at real
intervals (ClusterD's keep-alive every 5 s, the bridge's ``grpc_keepalive`` 30 s), then
one UCE fault whose reports must arrive.

Prints the report channel's state and the lost-connection counts every minute, and the
cycle's outcome at the end; gRPC core itself prints "Received a GOAWAY ...
too_many_pings" on stderr if one comes. The default, 600 s, is the measurement
docs/releases.md quotes. Not a test (it takes ten minutes); the scaled version is
tests/test_keepalive_policy.py. Exit code 0 when no connection was lost and the retry
cycle succeeded.
"""

from __future__ import annotations

import asyncio
import sys
import time

from bridge.sim import mindio_ttp
from bridge.sim.clusterd import SimJob
from bridge.sim.clusterd_release import V7_3
from bridge.sim.clusterd_timings import REAL
from bridge.sim.scenario import SimulatedJob

JOB = "idle-job"
REPORT_EVERY = 60.0  # seconds between progress lines


async def run(idle: float) -> int:
    job = SimulatedJob(SimJob(JOB, world_size=8, devices_per_pod=4), release=V7_3, keepalive_interval=5.0,
                       global_fault_delay=10.0, flush_delay=1.0, dump_exit_repeat=80.0, report_timeout=900.0,
                       clusterd_timings=REAL, controller_timings=mindio_ttp.FAST_TIMINGS, wait_time=30)

    def lost(channel: str) -> float:
        return job.metrics.sample("tft_bridge_clusterd_connection_lost_total", {"channel": channel})

    print(f"ClusterD {V7_3.version}, grpc_keepalive {job.config.clusterd.grpc_keepalive:g} s, idle {idle:g} s",
          flush=True)
    await job.start()
    try:
        await job.subscribed(timeout=30)
        assert job.bridge is not None
        started = time.monotonic()
        while (left := idle - (time.monotonic() - started)) > 0:
            await asyncio.sleep(min(REPORT_EVERY, left))  # idle on purpose: the pings are what is measured
            ready = job.bridge.link.wire._ready
            print(f"+{time.monotonic() - started:5.0f} s  report channel {'READY' if ready else 'not ready'}, "
                  f"connections lost: report {lost('report'):g}, signal {lost('signal'):g}", flush=True)
        fault_at = time.monotonic()
        job.training.inject_fault({5: 0})
        status = None
        while status is None and time.monotonic() - fault_at < 60:
            await asyncio.sleep(0.1)  # polls the annotation (a script, not a test: no eventually())
            status = job.sim.podgroup(JOB).get("ProcessRecoverStatus")
        reports = [entry.name for entry in job.sim.journal.select(kind="rpc", job_id=JOB)
                   if entry.name.startswith("Report")]
        print(f"after {idle:g} s idle: {status} {time.monotonic() - fault_at:.2f} s after the fault; reports at "
              f"ClusterD {reports}; connections lost: report {lost('report'):g}, signal {lost('signal'):g}")
        return 0 if status == "retry-success" and lost("report") == lost("signal") == 0 else 1
    finally:
        await job.stop()


if __name__ == "__main__":
    sys.exit(asyncio.run(run(float(sys.argv[1]) if len(sys.argv) > 1 else 600.0)))
