"""A report the controller gives while it is being destroyed still reaches ClusterD.

docs/mindio-controller.md section 7: destroyed during the recover wait (ARF, waiting for
the restarted ranks), the real controller reports ``report_result(406, ...)`` while its
destroy blocks. The bridge used to stop the outbox and the session before destroying the
controller, so that 406 was dropped at shutdown and ClusterD waited out its own timeout
for a result the controller had given. ``Link.stop`` now destroys first, with the
session and the outbox running, and drains afterwards (bridge/job/assembly.py).
"""

from __future__ import annotations

import pytest

from bridge.job.daemon import EXIT_OK
from bridge.sim.clusterd import SimJob
from bridge.sim.mindio_ttp import FAST_TIMINGS
from bridge.sim.scenario import SimulatedJob

from .conftest import eventually

pytestmark = pytest.mark.timeout(90)

JOB = "job-stop-406"


async def test_the_406_of_a_controller_destroyed_in_the_recover_wait_reaches_clusterd() -> None:
    # wait_time 1: after the 406 the stub's destroy still blocks one MindX wait (the real
    # one does too: section 7); the destroy timeout (10 s) outlasts it.
    job = SimulatedJob(SimJob(JOB, world_size=8, devices_per_pod=4), wait_time=1,
                       controller_timings=FAST_TIMINGS)
    try:
        await job.start()
        await job.subscribed()
        job.training.auto_restart = False  # the restarted ranks never come back: recover waits
        job.training.inject_fault({5: 1})
        await eventually(lambda: [n.args[0] for n in job.training.notifies("change_strategy")] == ["recover"],
                         20, what="ClusterD chose recover and the controller was told")
        await eventually(lambda: job.training.state.value == "REPAIR", 10, what="the controller in the recover wait")
        assert [r.detail["status"]["code"] for r in job.sim.journal.rpcs("ReportRecoverStatus", job_id=JOB)] == []
        assert job.bridge is not None and job._run is not None
        job.bridge.request_stop()
        assert await job.wait_exit(60) == EXIT_OK
        # The controller gave its 406 during the destroy ...
        results = [c.args[0] for c in job.training.callbacks("report_result")]
        assert results == [406], results
        # ... and it reached ClusterD (before: dropped as "shutdown", never sent).
        codes = [r.detail["status"]["code"] for r in job.sim.journal.rpcs("ReportRecoverStatus", job_id=JOB)]
        assert codes == [406], codes
        assert job.metrics.sample("tft_bridge_reports_sent_total", {"kind": "result"}) == 1
    finally:
        await job.stop()
