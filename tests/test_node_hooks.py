"""Node hooks: only plain decimal node ranks reach the operator's command.

A signal's ``nodeRankIds`` are strings from the network; ``--help`` there once reached
the hook command as an option. Each test runs a real command that records its argv.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from bridge.job.session.node_hooks import MAX_ENV_FAULT_RANKS, MAX_ENV_TEXT, HookSignal, NodeHooks, split_node_ranks
from bridge.job.metrics import BridgeMetrics


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


async def test_a_signal_naming_no_node_runs_no_hook(tmp_path: Path) -> None:
    """TaskD messages each named node's agent, so none; recover-in-place's globalFault
    carries fault_nodes_exit with no node on purpose (no pod is to exit)."""
    command, record = recorder(tmp_path)
    metrics = BridgeMetrics()
    assert await NodeHooks(command, 30.0, metrics).run("fault_nodes_exit", [], HookSignal(fault_ranks={5: 1})) == "no_node"
    assert not record.exists()
    assert metrics.sample("tft_bridge_hook_runs_total", {"hook": "fault_nodes_exit", "result": "no_node"}) == 1


async def test_no_hook_configured_still_counts_bad_ranks() -> None:
    metrics = BridgeMetrics()
    assert await NodeHooks((), 30.0, metrics).run("fault_nodes_exit", ["1", "x"]) == "no_hook"
    assert metrics.sample("tft_bridge_bad_inputs_total", {"kind": "hook_node_rank"}) == 1


async def test_run_command_passes_trusted_arguments_unchanged(tmp_path: Path) -> None:
    import json

    command, record = recorder(tmp_path)
    assert await NodeHooks(command, 30.0, BridgeMetrics()).run_command("ranktable_changed", ["/var/lib/x/hccl.json"]) == "ok"
    assert json.loads(record.read_text()) == ["ranktable_changed", "/var/lib/x/hccl.json"]


# --------------------------------------------------------------------------- the whole signal

def signal_recorder(tmp_path: Path) -> tuple[list[str], Path]:
    """A hook that records its argv, its stdin and the TFT_BRIDGE_* variables the bridge
    gave it (those this test process already had, e.g. CI's own, are inherited, not given)."""
    record = tmp_path / "signal.json"
    inherited = sorted(key for key in os.environ if key.startswith("TFT_BRIDGE_"))
    script = ("import json, os, sys; json.dump({'argv': sys.argv[2:], 'stdin': sys.stdin.read(), "
              f"'env': {{k: v for k, v in os.environ.items() if k.startswith('TFT_BRIDGE_') and k not in {inherited!r}}}}}, "
              "open(sys.argv[1], 'w'))")
    return [sys.executable, "-c", script, str(record)], record


IN_PLACE = HookSignal(job_id="job-1", uuid="U-1", signal_type="changeStrategy",
                      actions=("change_strategy", "fault_nodes_restart"), strategy="recover",
                      extra_params="recover-in-place", fault_ranks={6: 1, 5: 0})


async def test_the_hook_gets_the_whole_signal_in_its_environment_and_on_stdin(tmp_path: Path) -> None:
    import json

    command, record = signal_recorder(tmp_path)
    assert await NodeHooks(command, 30.0, BridgeMetrics()).run("fault_nodes_restart", ["1"], IN_PLACE) == "ok"
    seen = json.loads(record.read_text())
    assert seen["argv"] == ["fault_nodes_restart", "1"]
    assert json.loads(seen["stdin"]) == {
        "action": "fault_nodes_restart", "job_id": "job-1", "uuid": "U-1", "signal_type": "changeStrategy",
        "actions": ["change_strategy", "fault_nodes_restart"], "strategy": "recover",
        "extra_params": "recover-in-place", "node_ranks": [1],
        "fault_ranks": [{"rank": 5, "type": 0}, {"rank": 6, "type": 1}],
    }
    assert seen["env"] == {
        "TFT_BRIDGE_ACTION": "fault_nodes_restart", "TFT_BRIDGE_ACTIONS": "change_strategy,fault_nodes_restart",
        "TFT_BRIDGE_SIGNAL_TYPE": "changeStrategy", "TFT_BRIDGE_STRATEGY": "recover",
        "TFT_BRIDGE_EXTRA_PARAMS": "recover-in-place", "TFT_BRIDGE_UUID": "U-1", "TFT_BRIDGE_JOB_ID": "job-1",
        "TFT_BRIDGE_NODE_RANKS": "1", "TFT_BRIDGE_FAULT_RANKS": "5:0,6:1", "TFT_BRIDGE_FAULT_RANK_COUNT": "2",
    }


async def test_network_strings_reach_the_environment_without_control_characters(tmp_path: Path) -> None:
    """A NUL cannot be passed in an environment variable at all (the hook would not
    start); stdin's JSON carries the string as it came."""
    import json

    command, record = signal_recorder(tmp_path)
    odd = HookSignal(extra_params="a\x00b\nc" + "x" * 5000, fault_ranks={0: 1})
    assert await NodeHooks(command, 30.0, BridgeMetrics()).run("fault_nodes_exit", ["0"], odd) == "ok"
    seen = json.loads(record.read_text())
    assert seen["env"]["TFT_BRIDGE_EXTRA_PARAMS"] == ("abc" + "x" * 5000)[:MAX_ENV_TEXT]
    assert json.loads(seen["stdin"])["extra_params"] == odd.extra_params


async def test_too_many_fault_ranks_for_the_environment_are_all_on_stdin(tmp_path: Path) -> None:
    import json

    command, record = signal_recorder(tmp_path)
    many = HookSignal(fault_ranks={rank: 1 for rank in range(MAX_ENV_FAULT_RANKS + 1)})
    assert await NodeHooks(command, 30.0, BridgeMetrics()).run("fault_nodes_exit", ["0"], many) == "ok"
    seen = json.loads(record.read_text())
    assert seen["env"]["TFT_BRIDGE_FAULT_RANKS"] == ""
    assert seen["env"]["TFT_BRIDGE_FAULT_RANK_COUNT"] == str(MAX_ENV_FAULT_RANKS + 1)
    assert len(json.loads(seen["stdin"])["fault_ranks"]) == MAX_ENV_FAULT_RANKS + 1


# --------------------------------------------------------------------------- the shipped example hook

EXAMPLE = Path(__file__).resolve().parent.parent / "contrib" / "node-action"


def example_hook(tmp_path: Path) -> tuple[list[str], Path]:
    """contrib/node-action with templates that append what they were asked to a file."""
    log = tmp_path / "actions"
    append = tmp_path / "append.py"
    append.write_text("import sys\nopen(sys.argv[1], 'a').write(' '.join(sys.argv[2:]) + '\\n')\n")
    run = f"{sys.executable} {append} {log}"
    return [sys.executable, str(EXAMPLE), "--restart-rank", f"{run} restart {{rank}} {{type}}",
            "--stop-rank", f"{run} stop-rank {{rank}}", "--stop-node", f"{run} stop-node {{node}}"], log


async def test_the_example_hook_restarts_only_the_fault_ranks(tmp_path: Path) -> None:
    """Node 1 holds ranks 4-7 and only 5 and 6 faulted: 4 and 7 keep running."""
    command, log = example_hook(tmp_path)
    assert await NodeHooks(command, 30.0, BridgeMetrics()).run("fault_nodes_restart", ["1"], IN_PLACE) == "ok"
    assert log.read_text().splitlines() == ["restart 5 0", "restart 6 1"]


async def test_the_example_hook_restarts_nothing_when_no_fault_rank_is_named(tmp_path: Path) -> None:
    command, log = example_hook(tmp_path)
    metrics = BridgeMetrics()
    assert await NodeHooks(command, 30.0, metrics).run("fault_nodes_restart", ["1"], HookSignal()) == "failed"
    assert not log.exists()
    assert metrics.sample("tft_bridge_hook_runs_total", {"hook": "fault_nodes_restart", "result": "failed"}) == 1


@pytest.mark.parametrize("action, signal, expected", [
    ("fault_nodes_exit", HookSignal(fault_ranks={4: 1, 5: 1}), ["stop-rank 4", "stop-rank 5"]),
    ("pre exit process", HookSignal(), ["stop-node 1", "stop-node 3"]),
    ("save_and_exit", HookSignal(fault_ranks={4: 1}), ["stop-node 1", "stop-node 3"]),
    ("change_strategy", HookSignal(strategy="recover", fault_ranks={4: 1}), ["stop-node 1", "stop-node 3"]),
])
async def test_the_example_hook_stops_ranks_or_nodes(tmp_path: Path, action: str, signal: HookSignal,
                                                      expected: list[str]) -> None:
    command, log = example_hook(tmp_path)
    assert await NodeHooks(command, 30.0, BridgeMetrics()).run(action, ["1", "3"], signal) == "ok"
    assert log.read_text().splitlines() == expected
