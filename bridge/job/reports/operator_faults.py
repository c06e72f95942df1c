"""Faults handed to the running bridge by an operator or a node agent (``tft-bridge report-fault``).

``LocalReports`` serves ``report-fault.sock`` in the job's state directory (mode 0600,
bound in a private directory and renamed into place) on the event loop; ``request`` is
the command's client. One JSON line per connection, at most ``MAX_REQUEST`` bytes within
``READ_TIMEOUT``: ``{"job_id", "faults": "RANK:TYPE,..."}``, answered by one JSON line,
``{"ok": true, "faults", "live"}`` or ``{"ok": false, "reason", "error"}``. Accepted faults
enter through the controller's callback entry, so the report path's rules apply
unchanged; a request for another job, bad faults, a rank outside the world or a
controller that cannot take them (``step_refusal``) is refused with its reason, counted
in ``tft_bridge_local_fault_reports_total{result}`` and logged (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bridge import faults as codec
from bridge.job.reports.controller_flow import Step
from bridge.job.metrics import BridgeMetrics
from bridge.job.reports.kinds import ReportSink, report_of

log = logging.getLogger(__name__)

SOCKET_NAME = "report-fault.sock"
MAX_REQUEST = 64 * 1024
READ_TIMEOUT = 5.0
FAULT_TYPES = (0, 1, 2)


class RequestError(ValueError):
    """A refused request: ``reason`` is the metric label, the message what was wrong."""
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def step_refusal(step: Step) -> str | None:
    """Why a handed fault must not go in at the controller's ``step``, or None.

    The fault goes through the controller's own callback path, so the bridge's flow
    tracker takes it as the controller's report. Paused by ClusterD (an operator pause),
    the real controller still waits for ``continue``; the tracker would move on to wait
    for a stop and refuse that continue, and ClusterD would kill the job when its wait
    ran out. Dumping or exiting, the job is ending. Anywhere else the report joins the
    flow as a controller's report would (outside the steps where the controller reports
    faults itself it counts one ``tft_bridge_flow_desync_total``)."""
    if step in (Step.PAUSE_SENT, Step.PAUSED):
        return ("training is paused by ClusterD (an operator pause): the report would make the bridge refuse the "
                "pause's continue; hand it over once training resumes")
    if step in (Step.DUMPING, Step.EXITING, Step.EXITED):
        return "the controller is saving or exiting: the job is ending"
    return None


def parse_request(raw: bytes, job_id: str, world_size: int) -> dict[int, int]:
    """The faults of one request line, or RequestError naming what was wrong."""
    try:
        request = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RequestError("bad_input", f"the request is not a JSON line: {error}") from None
    if not isinstance(request, dict) or not isinstance(request.get("faults"), str) \
            or not isinstance(request.get("job_id"), str):
        raise RequestError("bad_input", 'the request must be {"job_id": "...", "faults": "RANK:TYPE,..."}')
    if request["job_id"] != job_id:
        raise RequestError("wrong_job", f"this bridge serves job {job_id!r}, not {request['job_id'][:128]!r}")
    faults = parse_faults(request["faults"], world_size)
    return faults


def parse_faults(text: str, world_size: int) -> dict[int, int]:
    """``RANK:TYPE[,...]`` with types 0 (UCE), 1 (other), 2 (HCCL) and ranks in the world."""
    try:
        faults = codec.parse_faults(text)
    except (ValueError, TypeError) as error:
        raise RequestError("bad_input", f"fault string {text[:200]!r}: {error}") from None
    if not faults:
        raise RequestError("bad_input", "no fault given: expected RANK:TYPE[,RANK:TYPE...]")
    for rank, fault_type in faults.items():
        if fault_type not in FAULT_TYPES:
            raise RequestError("bad_input", f"rank {rank}: fault type {fault_type} is not 0 (UCE), 1 (other) or "
                                            "2 (HCCL)")
        if world_size and not 0 <= rank < world_size:
            raise RequestError("bad_input", f"rank {rank} is outside the job's world (0..{world_size - 1})")
    return faults


def bind_private(path: Path) -> socket.socket:
    """A listening unix socket at ``path`` with mode 0600, never reachable with wider
    rights: bound in a fresh 0700 directory beside it, chmod-ed, then renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # mode 0700; a staged path no longer than the final one (a unix socket path has at
    # most 107 bytes: a long state directory fails here, logged, rather than at a client)
    private = Path(tempfile.mkdtemp(prefix=".rf", dir=path.parent))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        staged = private / "s"
        sock.bind(str(staged))
        os.chmod(staged, 0o600)
        sock.listen(16)
        os.replace(staged, path)
    except BaseException:
        sock.close()
        raise
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(private)
    sock.setblocking(False)
    return sock


def bridge_running(path: Path, timeout: float = 1.0) -> bool:
    """Whether a bridge answers on the socket at ``path`` (a leftover file does not)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(timeout)
    try:
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


class LocalReports:
    """The socket's server, on the event loop. ``sink`` is the controller's callback
    entry (``Link.sink``); ``accepting()`` says whether the controller runs (a fault for a
    controller that is not running would be reported for ranks nobody recovers);
    ``step()`` is the controller's flow step (``step_refusal``)."""

    def __init__(self, job_id: str, world_size: int, directory: Path, sink: ReportSink,
                 metrics: BridgeMetrics, *, accepting: Callable[[], bool], live: Callable[[], bool],
                 step: Callable[[], Step]) -> None:
        self.job_id = job_id
        self.world_size = world_size
        self.path = directory / SOCKET_NAME
        self.sink = sink
        self.metrics = metrics
        self.accepting = accepting
        self.live = live
        self.step = step
        self._server: asyncio.AbstractServer | None = None
        self._stopped = asyncio.Event()

    async def run(self) -> None:
        """Serve until ``stop()``. Another bridge answering on the path keeps this one
        from taking it over (logged; this bridge runs on without the socket)."""
        if self.path.exists() and bridge_running(self.path):
            log.error("another bridge answers on %s: this one does not serve tft-bridge report-fault", self.path)
            await self._stopped.wait()
            return
        try:
            sock = bind_private(self.path)
        except OSError as error:
            log.error("cannot serve tft-bridge report-fault at %s: %s", self.path, error)
            await self._stopped.wait()
            return
        self._server = await asyncio.start_unix_server(self._serve, sock=sock, limit=MAX_REQUEST)
        log.info("tft-bridge report-fault: listening on %s", self.path)
        try:
            await self._stopped.wait()
        finally:
            self._server.close()
            await self._server.wait_closed()
            with contextlib.suppress(OSError):
                self.path.unlink()

    def stop(self) -> None:
        self._stopped.set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                raw = await asyncio.wait_for(reader.readline(), READ_TIMEOUT)
            except (asyncio.TimeoutError, asyncio.LimitOverrunError, ValueError):
                raw = b""
            answer = self._answer(raw)
            writer.write(json.dumps(answer).encode() + b"\n")
            await asyncio.wait_for(writer.drain(), READ_TIMEOUT)
        except (OSError, asyncio.TimeoutError) as error:
            log.warning("tft-bridge report-fault: the client went away: %s", error)
        finally:
            writer.close()

    def _answer(self, raw: bytes) -> dict[str, Any]:
        try:
            if not raw.endswith(b"\n"):
                raise RequestError("bad_input", f"no complete request line within {READ_TIMEOUT:.0f} s and "
                                                f"{MAX_REQUEST} bytes")
            faults = parse_request(raw, self.job_id, self.world_size)
            if not self.accepting():
                raise RequestError("refused", "the controller is not running (process-level recovery off, or the "
                                              "bridge is starting or stopping): nothing would recover these ranks")
            if (refusal := step_refusal(self.step())) is not None:
                raise RequestError("refused", refusal)
        except RequestError as error:
            self.metrics.local_reports.labels(error.reason).inc()
            if error.reason == "bad_input":
                self.metrics.bad_inputs.labels("report_fault_request").inc()
            log.warning("tft-bridge report-fault refused (%s): %s", error.reason, error)
            return {"ok": False, "reason": error.reason, "error": str(error)}
        text = codec.format_faults(faults)
        live = self.live()
        log.warning("tft-bridge report-fault: reporting %s to ClusterD as the controller's fault report%s", text,
                    "" if live else " (queued until the ClusterD subscription is live)")
        self.sink(report_of("report_fault_ranks", (faults, {}), time.monotonic()))
        self.metrics.local_reports.labels("accepted").inc()
        return {"ok": True, "faults": text, "live": live}


def target(config_path: str, job_id: str = "") -> tuple[str, list[Path], int]:
    """The job id (``job_id`` wins), the directories its bridge's socket may be in (the
    configured state directory, else the unit's ``StateDirectory=tft-bridge/%i`` named
    after the config file, then the job-id fallback) and the world size (0: unknown). A
    config valid only with the unit's environment is read as plain TOML."""
    from bridge.core.config import ConfigError, load_config, read_toml
    from bridge.core.state_dir import STATE_ROOT, safe_component

    try:
        config = load_config(config_path)
        job_id = job_id or config.job_id
        configured, world_size = config.controller.state_directory, config.controller.world_size
    except ConfigError as error:
        raw = read_toml(config_path)  # a ConfigError here: the file itself is unreadable
        controller = raw.get("controller") if isinstance(raw.get("controller"), dict) else {}
        job_id = job_id or (raw.get("job_id") if isinstance(raw.get("job_id"), str) else "")
        configured = controller.get("state_directory", "") if isinstance(controller.get("state_directory"), str) \
            else ""
        size = controller.get("world_size", 0)
        world_size = size if isinstance(size, int) and not isinstance(size, bool) else 0
        if not job_id:
            raise ValueError(f"cannot tell the job id from {config_path} ({error}): pass --job-id") from None
    if configured:
        return job_id, [Path(configured)], world_size
    directories = [STATE_ROOT / Path(config_path).stem]
    if STATE_ROOT / safe_component(job_id) not in directories:
        directories.append(STATE_ROOT / safe_component(job_id))
    return job_id, directories, world_size


def request(path: Path, job_id: str, faults: str, timeout: float = READ_TIMEOUT + 2) -> dict[str, Any]:
    """The client side: one request, its answer (OSError when nothing answers)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall(json.dumps({"job_id": job_id, "faults": faults}).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    answer: dict[str, Any] = json.loads(data) if data else {"ok": False, "reason": "refused",
                                                             "error": "the bridge closed the connection"}
    return answer
