"""Node hooks: only plain decimal node ranks reach the operator's command.

A signal's ``nodeRankIds`` are strings from the network; ``--help`` there once reached
the hook command as an option. Each test runs a real command that records its argv.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bridge.hooks import NodeHooks, split_node_ranks
from bridge.metrics import BridgeMetrics


def recorder(tmp_path: Path) -> tuple[list[str], Path]:
    record = tmp_path / "argv"
    script = "import sys, json; open(sys.argv[1], 'w').write(json.dumps(sys.argv[2:]))"
    return [sys.executable, "-c", script, str(record)], record


@pytest.mark.parametrize("rank, good", [
    ("0", True), ("17", True), ("0123", True), ("9" * 10, True),
    ("--help", False), ("-1", False), ("+1", False), ("1.0", False), (" 1", False), ("1\n", False),
    ("\uff11", False), ("\u0661", False), ("", False), ("9" * 11, False), ("1;rm", False),
])
def test_only_plain_decimal_ranks_are_good(rank: str, good: bool) -> None:
    assert split_node_ranks([rank]) == (([rank], []) if good else ([], [rank]))


async def test_bad_ranks_are_left_out_counted_and_the_hook_runs_with_the_good(tmp_path: Path) -> None:
    import json

    command, record = recorder(tmp_path)
    metrics = BridgeMetrics()
    hooks = NodeHooks(command, 30.0, metrics)
    result = await hooks.run("fault_nodes_restart", ["3", "--help", "7", "\uff18", "-rf"])
    assert result == "ok"
    assert json.loads(record.read_text()) == ["fault_nodes_restart", "3", "7"]
    assert metrics.sample("tft_bridge_bad_inputs_total", {"kind": "hook_node_rank"}) == 3
    assert metrics.sample("tft_bridge_hook_runs_total", {"hook": "fault_nodes_restart", "result": "ok"}) == 1


async def test_when_every_rank_is_bad_the_hook_does_not_run(tmp_path: Path) -> None:
    command, record = recorder(tmp_path)
    metrics = BridgeMetrics()
    result = await NodeHooks(command, 30.0, metrics).run("fault_nodes_exit", ["--help"])
    assert result == "refused"
    assert not record.exists()
    assert metrics.sample("tft_bridge_bad_inputs_total", {"kind": "hook_node_rank"}) == 1
    assert metrics.sample("tft_bridge_hook_runs_total", {"hook": "fault_nodes_exit", "result": "refused"}) == 1


async def test_no_ranks_at_all_still_runs_the_hook_with_the_action(tmp_path: Path) -> None:
    import json

    command, record = recorder(tmp_path)
    assert await NodeHooks(command, 30.0, BridgeMetrics()).run("pre exit process", []) == "ok"
    assert json.loads(record.read_text()) == ["pre exit process"]


async def test_no_hook_configured_still_counts_bad_ranks() -> None:
    metrics = BridgeMetrics()
    assert await NodeHooks((), 30.0, metrics).run("fault_nodes_exit", ["1", "x"]) == "no_hook"
    assert metrics.sample("tft_bridge_bad_inputs_total", {"kind": "hook_node_rank"}) == 1


async def test_run_command_passes_trusted_arguments_unchanged(tmp_path: Path) -> None:
    import json

    command, record = recorder(tmp_path)
    assert await NodeHooks(command, 30.0, BridgeMetrics()).run_command("ranktable_changed", ["/var/lib/x/hccl.json"]) == "ok"
    assert json.loads(record.read_text()) == ["ranktable_changed", "/var/lib/x/hccl.json"]
