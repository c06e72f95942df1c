"""Starting simulated jobs (bridge + simulated ClusterD + stub controller) in a test.

Shared because every end-to-end test needs the same two guarantees, and each copy had
to get them right on its own: a job is in the teardown list *before* it starts (a start
that fails half-way still gets stopped, so no server, thread or port outlives the test:
the next test on a loaded machine would otherwise see its keep-alives), and the stub
controller runs at ``FAST_TIMINGS`` unless a test asks for the real pace. The ``jobs``
and ``notifier`` fixtures that use this live in conftest.py.
"""

from __future__ import annotations

from typing import Any

from bridge.sim.clusterd import SimJob
from bridge.sim.journal import JournalEntry
from bridge.sim.mindio_ttp import FAST_TIMINGS
from bridge.sim.scenario import SimulatedJob
from bridge.core.systemd import Notifier

from .conftest import eventually


async def start_job(jobs: list[SimulatedJob], spec: SimJob, *, subscribed: bool = True,
                    **kwargs: Any) -> SimulatedJob:
    """Start a :class:`SimulatedJob` for ``spec``, registered in ``jobs`` (the ``jobs``
    fixture stops it) before it starts; with ``subscribed``, return once the bridge's
    signal stream is live, the point from which ClusterD can reach the controller."""
    kwargs.setdefault("controller_timings", FAST_TIMINGS)
    job = SimulatedJob(spec, **kwargs)
    jobs.append(job)
    await job.start()
    if subscribed:
        await job.subscribed()
    return job


async def annotation(job: SimulatedJob, value: str = "recover-success", timeout: float = 15) -> JournalEntry:
    """Wait for the simulated ClusterD to write PodGroup annotation ProcessRecoverStatus
    = ``value``: the real server's own verdict on a cycle, the end of it a test can see
    from outside the bridge; then for the bridge to have handled the reports that led
    to it (``reports_handled``)."""
    entry = await job.sim.wait_for(lambda e: e.kind == "annotation" and e.name == "ProcessRecoverStatus"
                                   and e.detail.get("value") == value, timeout=timeout)
    await reports_handled(job)
    return entry


async def reports_handled(job: SimulatedJob, timeout: float = 10) -> None:
    """Wait until the bridge's event loop has handled every report the controller gave
    (its metrics and flight recorder then show them). ClusterD may act on a report --
    queue it, end the cycle, write its verdict -- before it answers the call, and the
    wire hands a report to the loop once it has nothing left to send (or when the loop
    catches up before reacting to ClusterD: bridge/job/reports/relay.py)."""
    if job.bridge is None:
        return
    wire = job.bridge.link.wire
    await eventually(lambda: wire.handed_all(), timeout, what="the bridge's loop handled every controller report")


class RecordingNotifier(Notifier):
    """Every sd_notify message, in order, as systemd would receive them; the watchdog
    armed with a short interval so the daemon's tick pings often (a test can then see
    that pings stop, which a disarmed watchdog could never show)."""

    def __init__(self) -> None:
        super().__init__({})
        self.watchdog_interval = 0.1
        self.messages: list[dict[str, Any]] = []

    def notify(self, **fields: str | int) -> bool:
        self.messages.append(dict(fields))
        return True

    @property
    def statuses(self) -> list[str]:
        """The STATUS= lines, in order."""
        return [str(m["status"]) for m in self.messages if "status" in m]

    def pings(self) -> int:
        return sum(1 for m in self.messages if "watchdog" in m)
