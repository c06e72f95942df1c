"""The rank table subscription (``config.Config``): validate, then write atomically.

ClusterD pushes a full snapshot on subscribe and on every change, with no de-duplication
and no keep-alive; a second Register for the job ends the current stream, and every
stream end needs Register again before re-subscribing. Consumers read the file at any
moment, so a table lands on disk only whole (temp file, fsync, rename, mode 0640), only
when it changed, and a bad table never replaces the last good one.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

from bridge._proto import config_pb2
from bridge.job.session.clusterd import ClusterDClient, RpcFailure, client_info
from bridge.job.session.codes import Code
from bridge.core.files import write_atomically
from bridge.core.config import ClusterDConfig, RankTableConfig
from bridge.job.session.node_hooks import NodeHooks
from bridge.job.metrics import BridgeMetrics
from bridge.job.session.stream_loop import Outcome, StreamLoop, Subscription

log = logging.getLogger(__name__)

VERSIONS = ("1.0", "1.2")
REGISTER = "/config.Config/Register"
SUBSCRIBE = "/config.Config/SubscribeRankTable"


class RankTableError(ValueError):
    """A table that must not be written; the message says what is wrong and where."""


def _digits(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.isascii() or not value.isdigit():
        raise RankTableError(f"{where}: expected a number as a string, got {value!r}")
    return value


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise RankTableError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise RankTableError(f"{where}: expected a list, got {type(value).__name__}")
    return value


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RankTableError(f"{where}: expected an object, got {type(value).__name__}")
    return value


def validate_rank_table(text: str) -> dict[str, Any]:
    """Parse and check a global rank table against seed 002's schema (versions 1.0 and
    1.2); the parsed table, or RankTableError naming the first problem."""
    try:
        table = json.loads(text)
    except (json.JSONDecodeError, TypeError) as error:
        raise RankTableError(f"not valid JSON: {error}") from error
    table = _object(table, "rank table")
    version = table.get("version")
    if version not in VERSIONS:
        raise RankTableError(f"version: expected one of {', '.join(VERSIONS)}, got {version!r}")
    if table.get("status") != "completed":
        raise RankTableError(f"status: expected 'completed', got {table.get('status')!r}")
    ranks: set[str] = set()
    groups = _list(table.get("server_group_list"), "server_group_list")
    for g, group in enumerate(groups):
        where = f"server_group_list[{g}]"
        group = _object(group, where)
        _digits(group.get("group_id"), f"{where}.group_id")
        _digits(group.get("server_count"), f"{where}.server_count")
        if "deploy_server" in group:
            _digits(group["deploy_server"], f"{where}.deploy_server")
        for s, server in enumerate(_list(group.get("server_list"), f"{where}.server_list")):
            swhere = f"{where}.server_list[{s}]"
            server = _object(server, swhere)
            _text(server.get("server_id"), f"{swhere}.server_id")
            if "server_ip" in server:
                _text(server["server_ip"], f"{swhere}.server_ip")
            for d, device in enumerate(_list(server.get("device", []), f"{swhere}.device")):
                dwhere = f"{swhere}.device[{d}]"
                device = _object(device, dwhere)
                for key in ("device_id", "device_logical_id"):
                    _digits(device.get(key), f"{dwhere}.{key}")
                _text(device.get("device_ip"), f"{dwhere}.device_ip")
                rank = _digits(device.get("rank_id"), f"{dwhere}.rank_id")
                if rank in ranks:
                    raise RankTableError(f"{dwhere}.rank_id: rank {rank} appears twice")
                ranks.add(rank)
                if "super_device_id" in device:
                    if version != "1.2":
                        raise RankTableError(f"{dwhere}.super_device_id: only version 1.2 has super devices")
                    _digits(device["super_device_id"], f"{dwhere}.super_device_id")
        if "super_pod_list" in group:
            if version != "1.2":
                raise RankTableError(f"{where}.super_pod_list: only version 1.2 has super pods")
            for p, pod in enumerate(_list(group["super_pod_list"], f"{where}.super_pod_list")):
                pwhere = f"{where}.super_pod_list[{p}]"
                pod = _object(pod, pwhere)
                _digits(pod.get("super_pod_id"), f"{pwhere}.super_pod_id")
                for s, server in enumerate(_list(pod.get("server_list"), f"{pwhere}.server_list")):
                    _text(_object(server, f"{pwhere}.server_list[{s}]").get("server_id"),
                          f"{pwhere}.server_list[{s}].server_id")
    return table


class RankTableSubscriber(Subscription[config_pb2.RankTableStream]):
    """Register -> SubscribeRankTable -> write, again after every stream end (``run``
    until ``stop()``, on the event loop)."""

    def __init__(self, config: RankTableConfig, clusterd: ClusterDConfig, metrics: BridgeMetrics,
                 *, hook_timeout: float = 60.0) -> None:
        self.config = config
        self.path = Path(config.path)
        # Its own channel: never competes with the Recover stream. ClusterD writes on this
        # stream only when the table changes, so its pings come 5.5 minutes apart.
        self.client = ClusterDClient(clusterd, metrics, quiet_stream=True)
        self.metrics = metrics
        self.hooks = NodeHooks(config.hook_command, hook_timeout, metrics)  # hooks.timeout of the job config
        self.current: dict[str, Any] | None = self._load_existing()
        self._info = client_info(config.job_id, clusterd.role)
        self.loop: StreamLoop[config_pb2.RankTableStream] = StreamLoop(
            "rank_table", self.client, SUBSCRIBE, self._info, config_pb2.RankTableStream.FromString)

    def _load_existing(self) -> dict[str, Any] | None:
        try:
            return validate_rank_table(self.path.read_text(encoding="utf-8"))
        except (OSError, RankTableError):
            return None

    def stop(self) -> None:
        self.loop.stop()

    async def handle(self, message: config_pb2.RankTableStream) -> str:
        """Validate and maybe write one pushed table; the result label."""
        if message.jobId != self.config.job_id:
            return self._reject(f"table for job {message.jobId!r}, not {self.config.job_id!r}")
        try:
            table = validate_rank_table(message.rankTable)
        except RankTableError as error:
            return self._reject(str(error))
        if table == self.current:
            self.metrics.ranktable_updates.labels("unchanged").inc()
            return "unchanged"
        try:
            await asyncio.to_thread(write_atomically, self.path, message.rankTable)
        except OSError as error:
            log.error("cannot write the rank table to %s: %s", self.path, error)
            self.metrics.ranktable_updates.labels("write_failed").inc()
            return "write_failed"
        self.current = table
        self.metrics.ranktable_updates.labels("written").inc()
        log.info("rank table version %s written to %s", table["version"], self.path)
        if self.config.hook_command:
            await self.hooks.run_command("ranktable_changed", [str(self.path)])
        return "written"

    def _reject(self, reason: str) -> str:
        self.metrics.ranktable_updates.labels("rejected").inc()
        self.metrics.bad_inputs.labels("rank_table").inc()
        log.error("rank table rejected, keeping the last good one: %s", reason)
        return "rejected"

    async def run(self) -> None:
        """Open the channel, subscribe until ``stop()``, close the channel."""
        await self.client.open()
        try:
            await self.loop.run(self)
        finally:
            await self.client.close()

    async def prepare(self) -> Outcome | None:
        """Register before every subscription: every stream end needs it again."""
        try:
            code = await self.client.call(REGISTER, self._info)
        except RpcFailure as failure:
            log.warning("rank table Register failed: %s %s", failure.status, failure.detail)
            return Outcome.FAILED
        if code != Code.OK:
            log.warning("rank table Register answered %s", Code.describe(code))
            return Outcome.FAILED
        return None
