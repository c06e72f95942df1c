"""The operator's hook command for node-level actions ClusterD asks for.

``NodeHooks`` runs ``hooks.node_command`` under ``hooks.timeout`` (or logs the request)
for ``fault_nodes_exit``, ``fault_nodes_restart``, ``pre exit process``, and
``save_and_exit`` or a ``recover`` that name nodes, on the signal path: signals after it
wait for it. The command gets the action and the node ranks as arguments, the whole
signal in ``TFT_BRIDGE_*`` variables (``HookSignal.environment``: control characters
removed, cut at ``MAX_ENV_TEXT``; fault ranks beyond ``MAX_ENV_FAULT_RANKS`` only counted)
and as one JSON document on stdin (``HookSignal.document``). Only plain decimal node
ranks pass (``split_node_ranks``; others counted in
``tft_bridge_bad_inputs_total{kind="hook_node_rank"}``); with none left, or none named,
the hook does not run. Why the whole signal: docs/operations.md, "Node hooks".
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from bridge.job.metrics import BridgeMetrics

log = logging.getLogger(__name__)

#: A node rank is a non-negative integer; ten digits is far beyond any cluster.
MAX_RANK_DIGITS = 10
_RANK = re.compile(rf"[0-9]{{1,{MAX_RANK_DIGITS}}}")
BAD_RANK_KIND = "hook_node_rank"
#: Longest network string put into one environment variable, in bytes (ClusterD's own
#: longest, extraParams, is far shorter; the controller takes at most 1023).
MAX_ENV_TEXT = 1023
#: Most fault ranks put into ``TFT_BRIDGE_FAULT_RANKS`` (about 12 bytes each, well under
#: the kernel's 128 KiB for one variable); stdin always carries all of them.
MAX_ENV_FAULT_RANKS = 8192
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def env_text(value: str) -> str:
    """A network string fit for an environment variable: no control characters (a NUL
    cannot be passed at all), at most ``MAX_ENV_TEXT`` bytes of UTF-8."""
    return _CONTROL.sub("", value).encode()[:MAX_ENV_TEXT].decode(errors="ignore")


@dataclass(frozen=True)
class HookSignal:
    """What ClusterD's signal says beyond the node ranks (module docstring)."""

    job_id: str = ""
    uuid: str = ""
    signal_type: str = ""
    actions: tuple[str, ...] = ()
    strategy: str = ""
    extra_params: str = ""
    #: global rank -> fault type (0 UCE, 1 process or other, 2 HCCL), as decoded
    fault_ranks: Mapping[int, int] = field(default_factory=dict)

    def document(self, action: str, node_ranks: Sequence[str]) -> dict[str, object]:
        """The JSON document the hook reads on stdin."""
        return {
            "action": action, "job_id": self.job_id, "uuid": self.uuid, "signal_type": self.signal_type,
            "actions": list(self.actions), "strategy": self.strategy, "extra_params": self.extra_params,
            "node_ranks": [int(rank) for rank in node_ranks],
            "fault_ranks": [{"rank": rank, "type": kind} for rank, kind in sorted(self.fault_ranks.items())],
        }

    def environment(self, action: str, node_ranks: Sequence[str]) -> dict[str, str]:
        """The ``TFT_BRIDGE_*`` variables (module docstring)."""
        faults = sorted(self.fault_ranks.items())
        listed = ",".join(f"{rank}:{kind}" for rank, kind in faults) if len(faults) <= MAX_ENV_FAULT_RANKS else ""
        return {
            "TFT_BRIDGE_ACTION": action,
            "TFT_BRIDGE_ACTIONS": env_text(",".join(self.actions)),
            "TFT_BRIDGE_SIGNAL_TYPE": env_text(self.signal_type),
            "TFT_BRIDGE_STRATEGY": env_text(self.strategy),
            "TFT_BRIDGE_EXTRA_PARAMS": env_text(self.extra_params),
            "TFT_BRIDGE_UUID": env_text(self.uuid),
            "TFT_BRIDGE_JOB_ID": env_text(self.job_id),
            "TFT_BRIDGE_NODE_RANKS": ",".join(node_ranks),
            "TFT_BRIDGE_FAULT_RANKS": listed,
            "TFT_BRIDGE_FAULT_RANK_COUNT": str(len(faults)),
        }


def hook_inputs(signal: HookSignal, action: str, node_ranks: Sequence[str]) -> tuple[bytes, dict[str, str]]:
    """The hook's stdin (the JSON document) and its ``TFT_BRIDGE_*`` environment."""
    document = json.dumps(signal.document(action, node_ranks), separators=(",", ":")).encode()
    return document, signal.environment(action, node_ranks)


def split_node_ranks(node_rank_ids: Sequence[object]) -> tuple[list[str], list[object]]:
    """The node ranks that are plain decimal integers (as given), and the others."""
    good: list[str] = []
    bad: list[object] = []
    for rank in node_rank_ids:
        (good if isinstance(rank, str) and _RANK.fullmatch(rank) else bad).append(rank)  # type: ignore[arg-type]
    return good, bad


class NodeHooks:
    """Runs the configured node command for one action at a time, on the event loop."""
    def __init__(self, command: Sequence[str], timeout: float, metrics: BridgeMetrics) -> None:
        self.command = tuple(command)
        self.timeout = timeout
        self.metrics = metrics

    async def run(self, action: str, node_rank_ids: Sequence[object], signal: HookSignal | None = None) -> str:
        """Run the hook for ``action`` with the valid node ranks and what else ``signal``
        says (arguments, environment, stdin: module docstring); the result label (ok,
        failed, timeout, no_hook, error, refused, no_node)."""
        label = action.replace(" ", "_")
        if not node_rank_ids:
            log.info("ClusterD's %r names no node: no node hook to run", action)
            self.metrics.hook_runs.labels(label, "no_node").inc()
            return "no_node"
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
            faults = sorted((signal or HookSignal()).fault_ranks)
            shown = ",".join(map(str, faults[:16])) + (f" and {len(faults) - 16} more" if len(faults) > 16 else "")
            log.warning("ClusterD asks for %r on node ranks %s (fault ranks %s); no hooks.node_command is configured",
                        action, ",".join(good) or "(none)", shown or "(none)")
            self.metrics.hook_runs.labels(label, "no_hook").inc()
            return "no_hook"
        # Off the event loop: a whole job's fault ranks (100 000) take the loaded machine
        # about 0.2 s to write out, and the loop feeds ClusterD's keep-alive watchdog.
        stdin, environment = await asyncio.to_thread(hook_inputs, signal or HookSignal(), action, good)
        return await self.run_command(action, good, environment, stdin)

    async def run_command(self, action: str, arguments: Sequence[str], environment: Mapping[str, str] | None = None,
                          stdin: bytes | None = None) -> str:
        """Run the command with ``action`` and trusted ``arguments`` (e.g. the rank table's
        configured path), ``environment`` added to the bridge's own and ``stdin`` written
        to it; the result label (ok, failed, timeout, no_hook, error)."""
        label = action.replace(" ", "_")
        if not self.command:
            self.metrics.hook_runs.labels(label, "no_hook").inc()
            return "no_hook"
        argv = [*self.command, action, *arguments]
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                env=None if environment is None else {**os.environ, **environment},
            )
        except OSError as error:
            log.error("cannot run hook %s: %s", argv[0], error)
            self.metrics.hook_runs.labels(label, "error").inc()
            return "error"
        try:
            # A hook that does not read stdin is fine: communicate() ignores the broken pipe.
            output, _ = await asyncio.wait_for(process.communicate(stdin), self.timeout)
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
