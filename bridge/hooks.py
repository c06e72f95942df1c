"""Operator hook commands for node-level actions ClusterD asks for.

``fault_nodes_exit``, ``fault_nodes_restart`` and ``pre exit process`` are not
controller calls: they ask that the training processes on some nodes exit or restart.
The bridge cannot know how a site does that, so it runs the operator's command with the
action and the node ranks as arguments, under a timeout, or logs the request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from .metrics import BridgeMetrics

log = logging.getLogger(__name__)


class NodeHooks:
    def __init__(self, command: Sequence[str], timeout: float, metrics: BridgeMetrics) -> None:
        self.command = tuple(command)
        self.timeout = timeout
        self.metrics = metrics

    async def run(self, action: str, node_rank_ids: Sequence[str]) -> str:
        """Run the hook for ``action``; the result label (ok, failed, timeout, no_hook, error)."""
        label = action.replace(" ", "_")
        if not self.command:
            log.warning("ClusterD asks for %r on node ranks %s; no hooks.node_command is configured",
                        action, ",".join(node_rank_ids) or "(none)")
            self.metrics.hook_runs.labels(label, "no_hook").inc()
            return "no_hook"
        argv = [*self.command, action, *node_rank_ids]
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
            )
        except OSError as error:
            log.error("cannot run hook %s: %s", argv[0], error)
            self.metrics.hook_runs.labels(label, "error").inc()
            return "error"
        try:
            output, _ = await asyncio.wait_for(process.communicate(), self.timeout)
        except asyncio.TimeoutError:
            process.kill()
            await process.wait()
            log.error("hook %s %s timed out after %.0f s and was killed", argv[0], action, self.timeout)
            self.metrics.hook_runs.labels(label, "timeout").inc()
            return "timeout"
        result = "ok" if process.returncode == 0 else "failed"
        text = output.decode(errors="replace").strip()[-2000:]
        log.log(logging.INFO if result == "ok" else logging.ERROR, "hook %s %s exited %s%s",
                argv[0], action, process.returncode, f": {text}" if text else "")
        self.metrics.hook_runs.labels(label, result).inc()
        return result
