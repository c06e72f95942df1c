"""The bridge's side services around the link, started and stopped with it.

What ClusterD asks of the job beyond the recovery path: its operator (OM) requests
(``om.py``); what ClusterD's fault centre saw for the job, for the flight recorder
(``faultinfo.py``); faults an operator or a node agent hands to the bridge
(``local_reports.py``). Each is a loop of its own over the link's ClusterD channel; none of them
touches the report path. They start once the link runs and stop right before the
controller is destroyed (``Link.stop``'s ``before_destroy``), while the channel is still
open, so no stream of theirs sees the channel close under it.

Both entry points run them: the daemon (``daemon.py``) and the seed API
(``recover_manager.py``), which leaves out ``report-fault``: that command finds the
socket through the bridge's configuration file and checks ranks against its world size,
and a seed-API launcher has neither (``report_fault=False``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from bridge.core.config import BridgeConfig
from bridge.job.assembly import Link, spawn
from bridge.job.metrics import BridgeMetrics
from bridge.job.session.fault_centre import FaultInfoReader
from bridge.job.reports.operator_faults import LocalReports
from bridge.job.session.operator_actions import OmResponder
from bridge.core.state_dir import state_directory


class SideServices:
    """Owns the side loops of one bridge run; ``tasks`` are supervised by the daemon."""

    def __init__(self, config: BridgeConfig, link: Link, metrics: BridgeMetrics, *, report_fault: bool = True) -> None:
        self.om = OmResponder(config.job_id, link.client, metrics, ready=link.session.live.wait)
        self.fault_info = FaultInfoReader(config.job_id, link.client, metrics, ready=link.session.live.wait,
                                          on_info=link.recorder.clusterd_faults)
        self.local_reports: LocalReports | None = None
        if report_fault:
            directory = state_directory(config.controller.state_directory, config.job_id)
            self.local_reports = LocalReports(config.job_id, config.controller.world_size, directory, link.sink,
                                              metrics, accepting=lambda: link.controller.started,
                                              live=link.session.live.is_set, step=lambda: link.flow.step)
        self.tasks: dict[str, asyncio.Task[Any]] = {}

    def start(self) -> None:
        self.tasks["om"] = spawn("om", self.om.run())
        self.tasks["fault-info"] = spawn("fault-info", self.fault_info.run())
        if self.local_reports is not None:
            self.tasks["local-reports"] = spawn("local-reports", self.local_reports.run())

    def stop(self) -> None:
        self.om.stop()
        self.fault_info.stop()
        if self.local_reports is not None:
            self.local_reports.stop()
