"""The orphaned-job marker: a job whose ranks are attached to a controller that died.

The controller cannot adopt running ranks (docs/mindio-controller.md section 4), so a
bridge that ends while its job trains leaves the job without fault tolerance. The rules
an operator sees are in docs/operations.md ("Orphaned jobs"); here:

* ``ControllerMarker``: ``controller.json`` in the job's state directory, written
  atomically when the controller starts, removed when a stop leaves no rank on a dead
  controller (``OrphanWatch.controller_stopped``).
* ``OrphanWatch``: a leftover marker at start-up is a suspicion (CRITICAL log line,
  ``tft_bridge_orphaned_job`` = 1, a STATUS= prefix) until a training rank connects to
  this controller; while it stands, a stop keeps the marker.
* ``sweep_stale_markers``: in the default state root only, other jobs' markers older than
  ``STALE_MARKER_AGE`` whose bridge process is gone are removed.

Nothing here restarts the job: the operator decides (docs/runbook.md). A marker that
cannot be written or read is logged and counted
(``tft_bridge_bad_inputs_total{kind="orphan_marker"}``); it never stops the bridge.
All of it runs on the event loop's thread (start-up, the tick, the stop).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prometheus_client import Gauge

from bridge.job.metrics import BridgeMetrics

log = logging.getLogger(__name__)

MARKER_NAME = "controller.json"
#: Other jobs' markers older than this, whose bridge process is gone, are removed.
STALE_MARKER_AGE = 7 * 86_400.0
GAUGE_NAME = "tft_bridge_orphaned_job"
BAD_INPUT_KIND = "orphan_marker"


def orphan_gauge(metrics: BridgeMetrics) -> Gauge:
    """The ``tft_bridge_orphaned_job`` gauge of this bridge's registry, created once."""
    gauge = getattr(metrics, "orphaned_job", None)
    if gauge is None:
        gauge = Gauge(GAUGE_NAME, "1 while the job may be orphaned: a previous controller of this job did not stop "
                                  "cleanly and no rank has connected to this one yet (the running ranks have no "
                                  "fault tolerance)", registry=metrics.registry)
        metrics.orphaned_job = gauge  # type: ignore[attr-defined]
    return gauge


class ControllerMarker:
    """The marker file itself: written atomically, read, removed. Never raises OSError."""

    def __init__(self, directory: Path, metrics: BridgeMetrics) -> None:
        self.path = directory / MARKER_NAME
        self._metrics = metrics

    def read(self) -> dict[str, Any] | None:
        """The leftover marker's content, ``{}`` when present but unreadable, None when absent."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as error:
            self._bad(f"cannot read the controller marker {self.path}: {error}; treating it as present")
            return {}
        try:
            content = json.loads(text)
        except ValueError as error:
            self._bad(f"the controller marker {self.path} is not JSON ({error}); treating it as present")
            return {}
        if not isinstance(content, dict):
            self._bad(f"the controller marker {self.path} is not a JSON object; treating it as present")
            return {}
        return content

    def write(self, content: Mapping[str, Any]) -> bool:
        """Write via a temporary file, fsync, rename: a crash mid-write never leaves half a file."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(prefix=".controller.", dir=self.path.parent)
            try:
                with os.fdopen(handle, "w", encoding="utf-8") as file:
                    json.dump(dict(content), file)
                    file.flush()
                    os.fsync(file.fileno())
                os.replace(temporary, self.path)
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise
            directory = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
            return True
        except OSError as error:
            self._bad(f"cannot write the controller marker {self.path}: {error}; a crash of this bridge "
                      "will not be detected as an orphaned job by the next one")
            return False

    def remove(self) -> bool:
        try:
            self.path.unlink(missing_ok=True)
            return True
        except OSError as error:
            self._bad(f"cannot remove the controller marker {self.path}: {error}; the next bridge will "
                      "report this job as possibly orphaned")
            return False

    def _bad(self, message: str) -> None:
        log.error("%s", message)
        self._metrics.bad_inputs.labels(BAD_INPUT_KIND).inc()


class OrphanWatch:
    """The orphaned-job suspicion of one bridge: found at start-up, cleared by a rank."""

    def __init__(self, marker: ControllerMarker, metrics: BridgeMetrics, job_id: str,
                 clock: Any = time.time) -> None:
        self.marker = marker
        self.job_id = job_id
        self.gauge = orphan_gauge(metrics)
        self.suspected = False
        self._clock = clock
        self.gauge.set(0)

    def check_leftover(self) -> bool:
        """At start-up, before this bridge's controller starts: True when a previous
        controller of this job did not stop cleanly (the job may be orphaned)."""
        previous = self.marker.read()
        if previous is None:
            return False
        self.suspected = True
        self.gauge.set(1)
        since = previous.get("started_at")
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(since)) if isinstance(since, (int, float)) else "?"
        log.critical(
            "job %s may be ORPHANED: a previous controller of this job (pid %s, started %s, listening on %s) did "
            "not stop cleanly (%s). If the job is still training, its ranks are attached to that dead controller, "
            "this controller will reject them, and the job has NO fault tolerance: its next fault hangs it. "
            "Restart the training job (docs/runbook.md, TftBridgeOrphanedJob). This clears once a rank connects "
            "to this controller.", self.job_id, previous.get("pid", "?"), when, previous.get("address", "?"),
            self.marker.path)
        return True

    def controller_started(self, address: str) -> None:
        """A controller of this job now runs: mark it until a clean stop."""
        self.marker.write({"job_id": self.job_id, "pid": os.getpid(), "address": address,
                           "started_at": self._clock(), "orphan_suspected": self.suspected})

    def poll(self, ranks_connected: bool) -> bool:
        """Called on every tick; True when the suspicion was just cleared."""
        if not self.suspected or not ranks_connected:
            return False
        self.suspected = False
        self.gauge.set(0)
        log.info("a training rank connected to this controller: job %s was restarted and is fault tolerant "
                 "again (no longer orphaned)", self.job_id)
        return True

    def status_prefix(self) -> str:
        return "JOB MAY BE ORPHANED (previous controller died; restart the job); " if self.suspected else ""

    def controller_stopped(self, *, job_ending: bool, ranks_connected: bool) -> None:
        """At the stop, after the destroy. ``job_ending``: killMaster or the controller
        ended on its own; ``ranks_connected``: the HA switch when the stop began."""
        if job_ending:
            self.marker.remove()
            return
        if ranks_connected or self.suspected:
            why = ("training ranks were still connected: they outlive this controller, and the next one will "
                   "not accept them" if ranks_connected else "the job may still be orphaned")
            log.warning("keeping the controller marker %s: %s; the next bridge for job %s will report the job "
                        "as possibly orphaned", self.marker.path, why, self.job_id)
            return
        self.marker.remove()


def _process_alive(pid: object) -> bool:
    """Whether ``pid`` names a running process on this node (unknown: assume it does)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. another user's process: it exists
        return True
    return True


def sweep_stale_markers(own: Path, metrics: BridgeMetrics, *, now: float | None = None,
                        max_age: float = STALE_MARKER_AGE) -> list[Path]:
    """Remove the markers of other jobs under ``own``'s parent (the state root) that are
    older than ``max_age`` and whose bridge process is not running; an emptied job
    directory goes too. Returns what was removed. Never raises OSError."""
    now = time.time() if now is None else now
    removed: list[Path] = []
    try:
        siblings = [path for path in own.parent.iterdir() if path.is_dir() and path != own]
    except OSError:
        return removed
    for directory in siblings:
        path = directory / MARKER_NAME
        try:
            age = now - path.stat().st_mtime
        except OSError:
            continue  # no marker (or unreadable: left alone)
        if age <= max_age:
            continue
        content = ControllerMarker(directory, metrics).read()
        if content and _process_alive(content.get("pid")):
            continue
        try:
            path.unlink()
        except OSError as error:
            log.warning("cannot remove the stale controller marker %s: %s", path, error)
            continue
        removed.append(path)
        log.info("removed the controller marker of job %s (%s), %.0f days old, whose bridge is gone: that job "
                 "will not come back to this node", (content or {}).get("job_id", directory.name), path, age / 86_400)
        try:
            directory.rmdir()  # only when nothing else (a flight record) is kept there
        except OSError:
            pass
    return removed
