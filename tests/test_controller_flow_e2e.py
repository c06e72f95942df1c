"""The flow gate's wait limits against the simulated ClusterD and the stub controller.

After a ClusterD pause the controller waits max(that pause's timeout,
MINDIO_WAIT_MINDX_TIME) for every later stop_train: it never forgets the timeout
(docs/mindio-controller.md section 6; bridge/job/reports/controller_flow.py ``wait_limit``). The gate used to
give every wait MINDIO_WAIT_MINDX_TIME + 5 s, so a stopTrain that ClusterD sent later than
that after the fault report was refused while the controller was still waiting for it,
and the controller then timed out into EXIT: the job was killed.
"""

from __future__ import annotations

import pytest

from bridge.sim.clusterd import SimJob
from bridge.sim.clusterd_timings import FAST
from bridge.sim.mindio_ttp import FAST_TIMINGS
from bridge.sim.scenario import SimulatedJob

from .conftest import eventually

pytestmark = pytest.mark.timeout(90)

JOB = "job-flow-wait"
#: ClusterD's stopTrain comes this long after a UCE's fault report: past the gate's
#: old limit (the 1 s wait + 5 s), well inside the controller's real one (the pause's 600 s).
STOP_DELAY = 8.0


async def test_a_stop_train_after_a_pause_is_forwarded_while_the_controller_still_waits() -> None:
    job = SimulatedJob(SimJob(JOB, world_size=8, devices_per_pod=4), wait_time=1,
                       controller_timings=FAST_TIMINGS,
                       # the fault centre publishes its record for the hold: it must outlast the delay
                       clusterd_timings=FAST.scaled(1.0, retry_report_delay=(STOP_DELAY, STOP_DELAY),
                                                    retry_record_hold=STOP_DELAY + 2.0))
    try:
        await job.start()
        await job.subscribed()
        await job.sim.pause(JOB, timeout=0)  # 0: the bridge's configured default, 600 s
        await job.sim.wait_for(lambda e: e.kind == "rpc" and e.name == "ReportRecoverStatus", timeout=10)
        assert [(n.args[1], n.args[2]) for n in job.training.notifies("stop_train")] == [("pause", 600)]
        job.training.inject_fault({5: 0})  # a UCE: ClusterD answers with stopTrain STOP_DELAY later
        await job.sim.wait_for(lambda e: e.kind == "annotation" and e.name == "ProcessRecoverStatus"
                               and e.detail.get("value") == "retry-success", timeout=40)
        assert [n.args[1] for n in job.training.notifies("stop_train")] == ["pause", "stop"]
        assert job.metrics.sample("tft_bridge_signals_refused_total", {"reason": "unexpected_step"}) == 0
        await eventually(lambda: job.training.state.value == "NORMAL", 10, what="the controller training again")
        assert not job.sim.violations and not job.training.violations
    finally:
        await job.stop()
