"""The node service's unit and example configuration: ``systemd-analyze verify`` clean,
the keys the never-orphan rule depends on present, and the example file loading."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bridge.core.config import read_toml
from bridge.node.config import NodeConfigError, build_node_config, load_node_config

from .test_systemd_unit import ROOT, last, needs_systemd_analyze, parse_unit, systemd_quote, verify_problems

UNIT = ROOT / "systemd" / "tft-bridge-node.service"
EXAMPLE = ROOT / "systemd" / "node.example.toml"


@needs_systemd_analyze
def test_verify_is_clean(tmp_path: Path) -> None:
    text = UNIT.read_text().replace("ExecStart=/opt/tft-bridge/venv/bin/tft-bridge",
                                    f"ExecStart={systemd_quote(sys.executable)} -m bridge.cli")
    path = tmp_path / "tft-bridge-node.service"
    path.write_text(text)
    problems = verify_problems(path)
    assert not problems, problems


def test_a_stop_of_the_service_never_reaches_a_bridge() -> None:
    unit = parse_unit(UNIT.read_text())
    assert last(unit, "Service", "KillMode") == "process"  # session-launched bridges live in this cgroup
    assert last(unit, "Service", "RestartPreventExitStatus") == "2"
    assert last(unit, "Service", "Type") == "notify"
    assert "node --config /etc/tft-bridge/node.toml" in last(unit, "Service", "ExecStart")


def test_the_example_loads_and_every_per_job_key_is_refused() -> None:
    config = load_node_config(EXAMPLE)
    assert config.node.selector == "tft-bridge/enabled=true"
    assert config.bridge["controller"]["module"] == "mindio_ttp.controller_ttp"
    raw = read_toml(EXAMPLE)
    raw["bridge"]["controller"]["port"] = 8000
    raw["bridge"]["job_id"] = "x"
    raw["node"]["launcher"] = "docker"
    raw["node"]["surprise"] = 1
    with pytest.raises(NodeConfigError) as caught:
        build_node_config(raw)
    text = str(caught.value)
    for line in ("bridge.controller.port: set by the node service from the pod",
                 "bridge.job_id: set by the node service from the pod",
                 "node.launcher: expected auto, systemd or session, got 'docker'",
                 "node.surprise: unknown key"):
        assert line in text, text


def test_a_bad_bridge_template_is_refused_with_the_bridges_own_words() -> None:
    raw = read_toml(EXAMPLE)
    raw["bridge"]["clusterd"]["rpc_timeout"] = 0
    with pytest.raises(NodeConfigError) as caught:
        build_node_config(raw)
    assert "bridge: clusterd.rpc_timeout: must be in 0.1..300" in str(caught.value)


def test_a_transient_bridge_unit_is_named_for_its_job_and_runs_the_bridge_itself(tmp_path: Path) -> None:
    from bridge.node.launcher import Record, SystemdLauncher, unit_name

    record = Record(job_id="0f6c-uid", pod_uid="p", namespace="ns", pod_name="job-master-0", bind_ip="10.0.0.21",
                    port=8000, metrics_port=40000, launcher="systemd", unit=unit_name("0f6c-uid"))
    command = SystemdLauncher({"PYTHONUNBUFFERED": "1"}).command(tmp_path, record, ["tft-bridge", "run", "--config",
                                                                                    "x.toml"])
    assert command[:4] == ["systemd-run", "--no-block", "--collect", "--unit=tft-bridge-job-0f6c-uid.service"]
    assert "--property=Restart=no" in command  # the node service decides, by the exit code
    assert "--property=KillMode=mixed" in command and "--setenv=PYTHONUNBUFFERED=1" in command
    # The bridge is the main process: the one systemd watches, and the only one whose
    # notifications count; its exit is recorded after it by the keeper's --record-exit.
    assert command[command.index("--") + 1:] == ["tft-bridge", "run", "--config", "x.toml"]
    assert "--property=NotifyAccess=main" in command
    stop_post = [c for c in command if c.startswith("--property=ExecStopPost=")]
    assert len(stop_post) == 1 and stop_post[0].endswith(f"-m bridge.node.keeper --dir {tmp_path} --record-exit")


def test_the_exit_systemd_reports_is_recorded_as_the_keeper_would(tmp_path: Path) -> None:
    from bridge.node.keeper import main
    from bridge.node.launcher import read_exit

    cases = [({"EXIT_CODE": "exited", "EXIT_STATUS": "75"}, 75), ({"EXIT_CODE": "killed", "EXIT_STATUS": "KILL"}, 137),
             ({"EXIT_CODE": "dumped", "EXIT_STATUS": "ABRT"}, 134), ({}, -1)]
    for env, code in cases:
        (tmp_path / "exit.json").unlink(missing_ok=True)
        with pytest.MonkeyPatch.context() as patch:
            for key in ("EXIT_CODE", "EXIT_STATUS"):
                patch.delenv(key, raising=False)
            for key, value in env.items():
                patch.setenv(key, value)
            assert main(["--dir", str(tmp_path), "--record-exit"]) == 0
        assert read_exit(tmp_path) == code, env


def test_paths_the_units_sandbox_hides_are_named_with_the_setting() -> None:
    from bridge.node.launcher import sandbox_problems

    problems = sandbox_problems({"node.state_root": "/tmp/state", "the Python environment": "/root/venv",
                                 "node.bridge_command": "/opt/tft-bridge/venv/bin/tft-bridge"})
    assert len(problems) == 2
    assert problems[0].startswith("node.state_root /tmp/state is hidden from the units by PrivateTmp=yes")
    assert problems[1].startswith("the Python environment /root/venv is hidden from the units by ProtectHome=yes")


@needs_systemd_analyze
def test_the_transient_units_properties_are_valid_unit_keys(tmp_path: Path) -> None:
    """systemd-run takes the same keys as a unit file: one written from them verifies clean."""
    from bridge.node.launcher import UNIT_PROPERTIES

    lines = ["[Service]", f"ExecStart={systemd_quote(sys.executable)} -m bridge.cli run --config /tmp/x.toml",
             *UNIT_PROPERTIES]
    path = tmp_path / "tft-bridge-job-x.service"
    path.write_text("\n".join(lines) + "\n")
    problems = verify_problems(path)
    assert not problems, problems
