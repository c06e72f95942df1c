"""The job's side services: the loops over the link's ClusterD channel beside the report path.

Three parts, none touching the report path: the operator (OM) actions ClusterD hands
the job (``session/operator_actions.py``), what ClusterD's fault centre saw for the job,
for the flight recorder (``session/fault_centre.py``), and the faults an operator or a
node agent hands to the bridge (``reports/operator_faults.py``). Started once the link
runs, stopped right before the controller's destroy, while the channel is still open, so
no stream of theirs sees the channel close under it (docs/architecture.md).

Both entry points run them: the daemon and the seed API (``recover_manager.py``), which
leaves out ``report-fault`` (``report_fault=False``: that command finds the socket through
the bridge's configuration file and checks ranks against its world size; a seed-API
launcher has neither).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Protocol

from bridge.core.config import BridgeConfig
from bridge.core.state_dir import state_directory
from bridge.job.assembly import Link, spawn
from bridge.job.metrics import BridgeMetrics
from bridge.job.reports.operator_faults import LocalReports
from bridge.job.session.fault_centre import FaultCentreReader
from bridge.job.session.operator_actions import OperatorActions


class SidePart(Protocol):
    """A loop of the event loop: ``run()`` until ``stop()``."""

    def run(self) -> Coroutine[Any, Any, None]: ...

    def stop(self) -> None: ...


class SideServices:
    """The side parts of one bridge run. ``start()`` (on the event loop) spawns each
    part's ``run()`` in the order of ``parts``; ``tasks`` (name -> task) are supervised by
    the caller, whose ``finish`` awaits them; ``stop()`` tells the parts to stop, in reverse
    order. Built once the link runs (``link.session``, ``link.recorder`` exist)."""

    def __init__(self, config: BridgeConfig, link: Link, metrics: BridgeMetrics, *, report_fault: bool = True) -> None:
        self.operator_actions = OperatorActions(config.job_id, link.client, metrics, ready=link.session.live.wait)
        self.fault_centre = FaultCentreReader(config.job_id, link.client, metrics, ready=link.session.live.wait,
                                              on_info=link.recorder.clusterd_faults)
        self.local_reports: LocalReports | None = None
        #: (task name, part), in start order.
        self.parts: list[tuple[str, SidePart]] = [("om", self.operator_actions), ("fault-info", self.fault_centre)]
        if report_fault:
            directory = state_directory(config.controller.state_directory, config.job_id)
            self.local_reports = LocalReports(config.job_id, config.controller.world_size, directory, link.sink,
                                              metrics, accepting=lambda: link.controller.started,
                                              live=link.session.live.is_set, step=lambda: link.flow.step)
            self.parts.append(("local-reports", self.local_reports))
        self.tasks: dict[str, asyncio.Task[Any]] = {}

    def start(self) -> None:
        for name, part in self.parts:
            self.tasks[name] = spawn(name, part.run())

    def stop(self) -> None:
        for _, part in reversed(self.parts):
            part.stop()
