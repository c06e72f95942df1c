"""The seed client API (``mindx_elastic.recover_manager``) on the per-job bridge's engine.

``DLRecoverManager`` (``init_clusterd``, ``register``, ``start_subscribe``, ``close``) and
the report functions ``report_stop_complete``, ``report_recover_strategy``,
``report_recover_status`` and ``report_process_fault``, with the seed's signatures and
int codes (``bridge.job.session.codes.Code``). Underneath: a ``bridge.job.assembly.Link``
around the caller's controller (``ControllerHost(..., external=True)``: never started or
destroyed here), whose loop runs on the thread ``tft-recover-manager``.

Invariants: the report functions are the controller's callbacks, so they never block
(unless given ``wait=SECONDS``) and never raise: 0 once queued, 400 before a manager is
subscribed, 499 for bad input. Methods raise ``RecoverManagerError`` subclasses. Where
and why it differs from MindCluster's client: docs/seed-api.md.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bridge._version import __version__
from bridge import faults as codec
from bridge._proto import recover_pb2
from bridge.job.session.clusterd import RpcFailure, client_info
from bridge.job.session.codes import Code
from bridge.core.config import ClusterDConfig, build_config, config_warnings
from bridge.job.host.controller import ControllerHost, load_controller_module, wait_time_from_environment
from bridge.job.side_services import SideServices
from bridge.job.reports.controller_flow import ControllerFlow
from bridge.job.assembly import Link, finish
from bridge.job.metrics import BridgeMetrics
from bridge.job.reports.kinds import report_of

log = logging.getLogger(__name__)

__all__ = [
    "CertificateError", "ClusterDError", "ClusterDUnavailable", "DLRecoverManager", "ProcessRecoveryOff",
    "RecoverManagerError", "__version__", "pb", "report_process_fault", "report_recover_status",
    "report_recover_strategy", "report_stop_complete",
]


class RecoverManagerError(Exception):
    """Base of every exception this module raises."""


class CertificateError(RecoverManagerError):
    """A certificate named for the secure connection is missing or unreadable."""


class ClusterDUnavailable(RecoverManagerError):
    """ClusterD could not be reached within the deadline."""


class ClusterDError(RecoverManagerError):
    """ClusterD refused ``method`` with ``code``."""
    def __init__(self, method: str, code: int) -> None:
        super().__init__(f"ClusterD {method} answered {Code.describe(code)}")
        self.code = code


class ProcessRecoveryOff(ClusterDError):
    """Init answered 403: process-level recovery is off for this job."""


@dataclass
class SeedClientInfo:
    """The seeds' ``ClientInfo``: ``ip`` and ``port`` are reserved and unused; ``taskId``
    is the job id. The live message sent to ClusterD has only ``jobId`` and ``role``."""

    ip: str = ""
    port: str = ""
    taskId: str = ""  # noqa: N815 - the seed's field name
    role: str = ""
    jobId: str = ""  # noqa: N815 - accepted too, as the live message spells it


#: ``pb.ClientInfo`` in the seed's shape and ``pb.Status`` as ClusterD returns it.
pb = SimpleNamespace(ClientInfo=SeedClientInfo, Status=recover_pb2.Status)


def _job_id(info: Any) -> str:
    job_id = getattr(info, "jobId", "") or getattr(info, "taskId", "")
    if not isinstance(job_id, str) or not job_id:
        raise ValueError(f"ClientInfo carries no job id (taskId or jobId): {info!r}")
    return job_id


def _check_readable(path: str, what: str) -> None:
    try:
        Path(path).read_bytes()
    except OSError as error:
        raise CertificateError(f"{what} {path!r} cannot be read: {error.strerror or error}") from error


_current: DLRecoverManager | None = None
_current_lock = threading.Lock()


class DLRecoverManager:
    """One job's connection to ClusterD, as the seed API describes it."""

    def __init__(self, info: Any, server_addr: str, secure_conn: bool = True, cert_path: str = "", *,
                 client_cert: str = "", client_key: str = "", controller_module: str = "mindio_ttp.controller_ttp",
                 rpc_timeout: float = 5.0) -> None:
        global _current
        self.job_id = _job_id(info)
        self.role = getattr(info, "role", "") or "recover-manager"
        if secure_conn:
            for path, what in ((cert_path, "CA bundle"), (client_cert, "client certificate"), (client_key, "client key")):
                if path:
                    _check_readable(path, what)
            if bool(client_cert) != bool(client_key):
                raise CertificateError("mutual TLS needs both client_cert and client_key")
        self.rpc_timeout = rpc_timeout
        self.controller_module = controller_module
        # The controller the caller starts reads its wait from this process's environment;
        # the daemon's rule that one reconnect back-off sleep is at most half that wait
        # (config.py) holds here too, and a wait ClusterD cannot meet is warned about.
        wait = wait_time_from_environment()
        self.config = build_config({
            "job_id": self.job_id,
            "clusterd": {"address": server_addr, "role": self.role, "rpc_timeout": rpc_timeout, "tls": secure_conn,
                         "ca_file": cert_path if secure_conn else "", "cert_file": client_cert if secure_conn else "",
                         "key_file": client_key if secure_conn else "",
                         "reconnect_max": min(ClusterDConfig.reconnect_max, wait / 2)},
            "controller": {"wait_mindx_time": wait},
            "metrics": {"enabled": False},
        }, env={})
        for warning in config_warnings(self.config):
            log.warning("configuration: %s", warning)
        self.metrics = BridgeMetrics()
        self.link: Link | None = None  # from start_subscribe() on
        self.side: SideServices | None = None  # with the link; its tasks run on the manager's loop
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tft-recover-manager", daemon=True)
        self._thread.start()
        self.subscribed = False
        self._run(self._open_client())
        with _current_lock:
            _current = self

    # ------------------------------------------------------------------ plumbing
    def _run(self, coroutine: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    async def _open_client(self) -> None:
        from bridge.job.session.clusterd import ClusterDClient

        self._client = ClusterDClient(self.config.clusterd, self.metrics)
        await self._client.open()

    def _unary(self, method: str, payload: bytes) -> int:
        try:
            return int(self._run(self._client.call(method, payload), self.rpc_timeout + 5))
        except RpcFailure as failure:
            raise ClusterDUnavailable(f"ClusterD {failure.method} failed: {failure.status} {failure.detail}") from None

    # ------------------------------------------------------------------ the seed API
    def init_clusterd(self) -> None:
        """Init: prepares ClusterD's state for the job. Raises on anything but 0."""
        code = self._unary("/Recover/Init", client_info(self.job_id, self.role))
        if code == Code.ProcessRescheduleOff:
            raise ProcessRecoveryOff("Init", code)
        if code != Code.OK:
            raise ClusterDError("Init", code)

    def register(self, request: Any) -> recover_pb2.Status:
        """Register the job of ``request``; ClusterD's Status (code 0 on success)."""
        job_id = _job_id(request)
        payload = client_info(job_id, getattr(request, "role", "") or self.role)
        try:
            return self._run(self._client.call_status("/Recover/Register", payload), self.rpc_timeout + 5)
        except RpcFailure as failure:
            raise ClusterDUnavailable(f"ClusterD Register failed: {failure.status} {failure.detail}") from None

    def start_subscribe(self) -> None:
        """Start the job's signal subscription (and report delivery) in the background."""
        if self.subscribed:
            return
        module = load_controller_module(self.controller_module)
        self.link = self._run(self._start_link(ControllerHost(module, self.config.controller, external=True)))
        self.subscribed = True

    async def _start_link(self, controller: ControllerHost) -> Link:
        link = Link(self.config, self.metrics, controller,
                    # The caller's controller read its wait from this process's environment
                    # at its own init; the gate assumes that wait, not a default.
                    ControllerFlow(wait_timeout=wait_time_from_environment(),
                                   on_desync=self.metrics.count_desync),
                    on_kill_master=lambda: None)  # the caller's process: its launcher decides (logged)
        await link.start()
        self.side = SideServices(self.config, link, self.metrics, report_fault=False)
        self.side.start()
        return link

    def close(self, timeout: float = 10.0) -> None:
        """Stop the subscription and delivery; the controller is left to its owner."""
        global _current
        with _current_lock:
            if _current is self:
                _current = None
        if self._loop.is_closed():
            return
        try:
            self._run(self._shutdown(), timeout)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
            if not self._thread.is_alive():
                # The loop's default executor (the link's to_thread calls) and its selector
                # outlive a loop that is only stopped: a launcher that closes a manager per
                # job incarnation would keep a thread and three descriptors of each.
                self._loop.run_until_complete(self._loop.shutdown_default_executor())
                self._loop.close()

    async def _shutdown(self) -> None:
        if self.link is not None:
            side = self.side
            # as the daemon: the side services end right before the destroy, channel still open
            await self.link.stop(before_destroy=side.stop if side is not None else lambda: None)
            if side is not None:
                await finish(side.tasks.values())
        await self._client.close()

    def submit(self, link: Link, callback: str, args: tuple[Any, ...], wait: float | None) -> int:
        waiter: Future[int] | None = Future() if wait else None
        link.sink(report_of(callback, args, time.monotonic(), waiter))
        if waiter is None:
            return Code.OK
        try:
            return int(waiter.result(wait))
        except FutureTimeout:
            return Code.WaitReportTimeout


def _submit(callback: str, args: tuple[Any, ...], wait: float | None) -> int:
    """Never raises: these are controller callbacks, where an exception kills the job."""
    try:
        manager = _current
        link = manager.link if manager is not None else None
        if manager is None or link is None:
            log.error("%s: no DLRecoverManager is subscribed for this process; report not sent", callback)
            return Code.UnRegistry
        return manager.submit(link, callback, args, wait)
    except Exception:  # noqa: BLE001
        log.exception("%s failed", callback)
        return Code.ClientError


def _valid_faults(fault_ranks: Any, where: str) -> bool:
    try:
        codec.merge_faults(fault_ranks)
        return True
    except (TypeError, ValueError) as error:
        log.error("%s: bad fault_ranks: %s", where, error)
        return False


def report_process_fault(fault_ranks: Mapping[int, int], fault_codes: Mapping[int, str] | None = None, *,
                         wait: float | None = None) -> int:
    """Report faulty ranks (the controller's report_fault_ranks)."""
    if not _valid_faults(fault_ranks, "report_process_fault"):
        return Code.ClientError
    return _submit("report_fault_ranks", (fault_ranks, fault_codes or {}), wait)


def report_stop_complete(code: int, msg: str, fault_ranks: Mapping[int, int], *, wait: float | None = None) -> int:
    """Report that training stopped (answers the cycle's stop_train)."""
    if not isinstance(code, int) or isinstance(code, bool) or not _valid_faults(fault_ranks, "report_stop_complete"):
        return Code.ClientError
    return _submit("report_stop_complete", (code, str(msg), fault_ranks), wait)


def report_recover_strategy(fault_ranks: Mapping[int, int], strategy_list: Sequence[str], *,
                            wait: float | None = None) -> int:
    """Report the strategies the controller offers (answers the cycle's globalFault)."""
    if isinstance(strategy_list, str) or not all(isinstance(s, str) for s in strategy_list) or \
            not _valid_faults(fault_ranks, "report_recover_strategy"):
        return Code.ClientError
    return _submit("report_strategies", (fault_ranks, list(strategy_list)), wait)


def report_recover_status(code: int, msg: str, fault_ranks: Mapping[int, int], strategy: str, *,
                          wait: float | None = None) -> int:
    """Report the outcome of a strategy (answers the cycle's changeStrategy)."""
    if not isinstance(code, int) or isinstance(code, bool) or not isinstance(strategy, str) or \
            not _valid_faults(fault_ranks, "report_recover_status"):
        return Code.ClientError
    return _submit("report_result", (code, str(msg), fault_ranks, strategy), wait)
