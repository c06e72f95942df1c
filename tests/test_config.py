"""Configuration: TOML + MindCluster environment, one clear error per bad key."""

from __future__ import annotations

from pathlib import Path

import pytest

from bridge.config import ConfigError, build_config, load_config

MINIMAL = {"job_id": "job-1"}


def problems(raw: dict, env: dict | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        build_config(raw, env or {})
    return caught.value.problems


def test_defaults_are_safe() -> None:
    config = build_config(MINIMAL, {})
    assert config.clusterd.address == "127.0.0.1:8899"
    assert config.clusterd.tls is False
    assert config.clusterd.grpc_keepalive >= 10
    assert config.controller.module == "mindio_ttp.controller_ttp"
    assert config.metrics.address == "127.0.0.1"


def test_mindcluster_environment_is_read() -> None:
    env = {
        "MINDX_TASK_ID": "uid-123", "MINDX_SERVER_IP": "10.0.0.5", "POD_IP": "192.0.2.7", "TTP_PORT": "8123",
        "WORLD_SIZE": "16", "PROCESS_RECOVER": "on", "HIGH_AVAILABILITY": "retry,elastic-training",
        "MINDIO_WAIT_MINDX_TIME": "60",
    }
    config = build_config({}, env)
    assert config.job_id == "uid-123"
    assert config.clusterd.address == "10.0.0.5:8899"
    c = config.controller
    assert (c.bind_ip, c.port, c.world_size, c.enable_arf, c.enable_zit, c.wait_mindx_time) == (
        "192.0.2.7", 8123, 16, True, True, 60)


def test_ipv6_clusterd_address_from_environment() -> None:
    assert build_config(MINIMAL, {"MINDX_SERVER_IP": "fd00::5"}).clusterd.address == "[fd00::5]:8899"


def test_file_overrides_environment() -> None:
    config = build_config({"job_id": "from-file", "controller": {"world_size": 4}}, {"MINDX_TASK_ID": "env", "WORLD_SIZE": "16"})
    assert config.job_id == "from-file"
    assert config.controller.world_size == 4


def test_every_problem_is_reported_once_by_key() -> None:
    found = problems({
        "controller": {"port": 80, "world_size": 0, "bind_ip": "0.0.0.0", "module": "nope", "colour": "red"},
        "clusterd": {"address": "nohostport", "grpc_keepalive": 3, "rpc_timeout": "soon"},
        "metrics": {"certfile": "/x"},
        "bogus": 1,
    })
    joined = "\n".join(found)
    for key in ("job_id: missing", "controller.port", "controller.world_size", "controller.bind_ip",
                "controller.module", "controller.colour: unknown key", "clusterd.address",
                "clusterd.grpc_keepalive", "clusterd.rpc_timeout: expected a number", "metrics.certfile",
                "bogus: unknown key"):
        assert key in joined, key
    assert len(found) == 11


def test_bad_environment_values_name_the_key() -> None:
    found = problems({}, {"MINDX_TASK_ID": "j", "WORLD_SIZE": "many", "MINDIO_WAIT_MINDX_TIME": "0"})
    assert any(p.startswith("controller.world_size: expected an integer, got 'many'") for p in found)
    assert any(p.startswith("controller.wait_mindx_time: must be in 1..3600") for p in found)


def test_tls_files_must_exist(tmp_path: Path) -> None:
    found = problems({"job_id": "j", "clusterd": {"tls": True, "ca_file": str(tmp_path / "missing.pem")}})
    assert any("clusterd.ca_file: no such file" in p for p in found)
    half = problems({"job_id": "j", "clusterd": {"cert_file": __file__}})
    assert any("give both for mutual TLS" in p for p in half)


def test_hook_commands_accept_strings_and_lists() -> None:
    assert build_config({"job_id": "j", "hooks": {"node_command": "/bin/echo -n"}}, {}).hooks.node_command == ("/bin/echo", "-n")
    assert build_config({"job_id": "j", "hooks": {"node_command": ["a", "b c"]}}, {}).hooks.node_command == ("a", "b c")
    assert problems({"job_id": "j", "hooks": {"node_command": 5}})


def test_load_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "none.toml", {})
    bad = tmp_path / "bad.toml"
    bad.write_text("job_id = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad, {})
    good = tmp_path / "good.toml"
    good.write_text('job_id = "j"\n[controller]\nworld_size = 8\nmodule = "stub"\n')
    assert load_config(good, {}).controller.world_size == 8


def test_example_config_is_valid() -> None:
    example = Path(__file__).parent.parent / "systemd" / "example-job.toml"
    if not example.exists():
        pytest.skip("example config not written yet")
    assert load_config(example, {}).job_id
