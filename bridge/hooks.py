"""Operator hook commands for node-level actions ClusterD asks for.

``fault_nodes_exit``, ``fault_nodes_restart`` and ``pre exit process`` are not
controller calls: they ask that the training processes on some nodes exit or restart.
The bridge cannot know how a site does that, so it runs the operator's command with the
action and the node ranks as arguments, under a timeout, or logs the request.

The node ranks come from the signal's ``nodeRankIds``, strings ClusterD (or whatever
speaks its protocol) chose: ``--help`` there once reached the hook command as an option.
So only plain decimal integers (ASCII digits, at most ``MAX_RANK_DIGITS``) are passed on;
each other one is refused, counted in ``tft_bridge_bad_inputs_total{kind="hook_node_rank"}``
and summarised in one log line, and the hook still runs with the good ones, because the
nodes it names still need their action. When every rank was bad, the hook does not run
at all: a node command given no rank could read that as "every node".
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence

from .metrics import BridgeMetrics

log = logging.getLogger(__name__)

#: A node rank is a non-negative integer; ten digits is far beyond any cluster.
MAX_RANK_DIGITS = 10
_RANK = re.compile(rf"[0-9]{{1,{MAX_RANK_DIGITS}}}")
BAD_RANK_KIND = "hook_node_rank"


def split_node_ranks(node_rank_ids: Sequence[object]) -> tuple[list[str], list[object]]:
    """The node ranks that are plain decimal integers (as given), and the others."""
    good: list[str] = []
    bad: list[object] = []
    for rank in node_rank_ids:
        (good if isinstance(rank, str) and _RANK.fullmatch(rank) else bad).append(rank)  # type: ignore[arg-type]
    return good, bad


class NodeHooks:
    def __init__(self, command: Sequence[str], timeout: float, metrics: BridgeMetrics) -> None:
        self.command = tuple(command)
        self.timeout = timeout
        self.metrics = metrics

    async def run(self, action: str, node_rank_ids: Sequence[object]) -> str:
        """Run the hook for ``action`` with the valid node ranks; the result label (ok,
        failed, timeout, no_hook, error, refused)."""
        label = action.replace(" ", "_")
        good, bad = split_node_ranks(node_rank_ids)
        if bad:
            self.metrics.bad_inputs.labels(BAD_RANK_KIND).inc(len(bad))
            shown = ", ".join(repr(rank)[:40] for rank in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            log.error("ClusterD's %r names %d node rank(s) that are not plain decimal integers, left out of the "
                      "hook's arguments: %s", action, len(bad), shown)
            if not good:
                self.metrics.hook_runs.labels(label, "refused").inc()
                return "refused"
        if not self.command:
            log.warning("ClusterD asks for %r on node ranks %s; no hooks.node_command is configured",
                        action, ",".join(good) or "(none)")
            self.metrics.hook_runs.labels(label, "no_hook").inc()
            return "no_hook"
        return await self.run_command(action, good)

    async def run_command(self, action: str, arguments: Sequence[str]) -> str:
        """Run the command with ``action`` and trusted ``arguments`` (e.g. the rank table's
        configured path); the result label (ok, failed, timeout, no_hook, error)."""
        label = action.replace(" ", "_")
        if not self.command:
            self.metrics.hook_runs.labels(label, "no_hook").inc()
            return "no_hook"
        argv = [*self.command, action, *arguments]
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
