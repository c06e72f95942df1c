"""Configuration: TOML + MindCluster environment, one clear error per bad key.

Every value that is not a number of a sane size, or not a valid
value, is refused with exit 2 and named by its key, or by the environment variable it
came from; the tests below run each case through ``build_config`` and the CLI ones
through ``tft-bridge check-config`` and ``tft-bridge run`` as real processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from bridge.core.config import ENVIRONMENT, RANGES, ClusterDConfig, ConfigError, ControllerConfig, build_config, config_warnings, load_config, range_text, _SECTIONS

MINIMAL = {"job_id": "job-1"}
EXAMPLE = Path(__file__).parent.parent / "systemd" / "example-job.toml"


def problems(raw: dict, env: dict | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        build_config(raw, env or {})
    return caught.value.problems


def one_problem(raw: dict, env: dict | None = None) -> str:
    found = problems(raw, env)
    assert len(found) == 1, found
    return found[0]


def test_defaults_are_safe() -> None:
    config = build_config(MINIMAL, {})
    assert config.clusterd.address == "127.0.0.1:8899"
    assert config.clusterd.tls is False
    assert config.clusterd.grpc_keepalive >= 10
    assert config.controller.module == "mindio_ttp.controller_ttp"
    assert config.metrics.address == "127.0.0.1"


def test_default_back_off_cannot_use_up_the_controllers_wait() -> None:
    # One back-off sleep must leave room in the controller's wait for ClusterD's decision
    # (a 30 s reconnect_max against the default 30 s wait did not).
    assert ClusterDConfig().reconnect_max <= ControllerConfig().wait_mindx_time / 2


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


@pytest.mark.parametrize("env, expected", [
    ({"MS_WORKER_NUM": "8"}, 8),  # a MindSpore job has no WORLD_SIZE
    ({"WORLD_SIZE": "16", "MS_WORKER_NUM": "8"}, 16),  # WORLD_SIZE wins where both are set
    ({"WORLD_SIZE": "", "MS_WORKER_NUM": "8"}, 8),  # TaskD: WORLD_SIZE or MS_WORKER_NUM (empty is absent)
    ({}, 1),
])
def test_world_size_falls_back_to_ms_worker_num(env: dict[str, str], expected: int) -> None:
    assert build_config(MINIMAL, env).controller.world_size == expected


def test_a_bad_ms_worker_num_names_its_variable() -> None:
    found = problems(MINIMAL, {"MS_WORKER_NUM": "eight"})
    assert found == ["controller.world_size (from environment variable MS_WORKER_NUM): "
                     "expected an integer in ASCII digits, got 'eight'"]


@pytest.mark.parametrize("value, expected", [
    ("120", 300), ("1", 2), ("3", 7),  # 2.5 times, rounded down as TaskD's int() does
    ("2880", 7200), ("100000", 7200),  # TaskD's ceiling, 120 minutes
    ("0", 600), ("-5", 600),  # not positive: TaskD's default
    (" 200 ", 500),  # surrounding blanks are tolerated like every integer from the environment
])
def test_the_pause_default_is_derived_from_hccl_connect_timeout(value: str, expected: int) -> None:
    assert build_config(MINIMAL, {"HCCL_CONNECT_TIMEOUT": value}).controller.pause_timeout == expected


def test_without_hccl_connect_timeout_the_pause_default_is_taskds() -> None:
    assert build_config(MINIMAL, {}).controller.pause_timeout == 600


def test_a_bad_hccl_connect_timeout_names_its_variable_and_the_file_overrides_it() -> None:
    found = problems(MINIMAL, {"HCCL_CONNECT_TIMEOUT": "\uff11\uff12\uff10"})
    assert found == ["controller.pause_timeout (from environment variable HCCL_CONNECT_TIMEOUT): "
                     "expected an integer in ASCII digits, got '\uff11\uff12\uff10'"]
    file = {**MINIMAL, "controller": {"pause_timeout": 900}}
    assert build_config(file, {"HCCL_CONNECT_TIMEOUT": "x"}).controller.pause_timeout == 900


@pytest.mark.parametrize("value, expected", [
    ("on", "127.0.0.1:8899"),  # TaskD's exact test: the node-local proxy, whatever MINDX_SERVER_IP says
    ("off", "10.0.0.5:8899"), ("", "10.0.0.5:8899"), ("ON", "10.0.0.5:8899"), ("1", "10.0.0.5:8899"),
])
def test_local_proxy_enable_points_at_the_node_local_proxy(value: str, expected: str) -> None:
    env = {"MINDX_SERVER_IP": "10.0.0.5", "LOCAL_PROXY_ENABLE": value}
    assert build_config(MINIMAL, env).clusterd.address == expected


@pytest.mark.parametrize("value, expected", [("on", True), ("ON", True), ("off", False), ("", False),
                                             ("true", True), ("0", False)])
def test_process_recover_on_and_off(value: str, expected: bool) -> None:
    assert build_config(MINIMAL, {"PROCESS_RECOVER": value}).controller.enable_arf is expected


def test_ipv6_clusterd_address_from_environment() -> None:
    assert build_config(MINIMAL, {"MINDX_SERVER_IP": "fd00::5"}).clusterd.address == "[fd00::5]:8899"


def test_file_overrides_environment() -> None:
    config = build_config({"job_id": "from-file", "controller": {"world_size": 4}}, {"MINDX_TASK_ID": "env", "WORLD_SIZE": "16"})
    assert config.job_id == "from-file"
    assert config.controller.world_size == 4


def test_a_bad_environment_value_the_file_overrides_is_not_blamed() -> None:
    config = build_config({"job_id": "j", "controller": {"world_size": 4}}, {"WORLD_SIZE": "many"})
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


def test_bad_environment_values_name_the_variable() -> None:
    found = problems({}, {"MINDX_TASK_ID": "j", "WORLD_SIZE": "many", "MINDIO_WAIT_MINDX_TIME": "0"})
    assert any(p.startswith("controller.world_size (from environment variable WORLD_SIZE): "
                            "expected an integer in ASCII digits, got 'many'") for p in found), found
    assert any(p.startswith("controller.wait_mindx_time (from environment variable MINDIO_WAIT_MINDX_TIME): "
                            "must be in 1..3600") for p in found), found


def _kind(key: str) -> type:
    section, name = key.split(".")
    return type(getattr(_SECTIONS[section](), name))


FLOAT_KEYS = sorted(k for k in RANGES if "." in k and _kind(k) is float)


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_floats_are_refused_by_key(key: str, value: float) -> None:
    section, name = key.split(".")
    line = one_problem({**MINIMAL, section: {name: value}})
    assert line.startswith(f"{key}: expected a finite number"), line


@pytest.mark.parametrize("key", sorted(k for k in RANGES if "." in k))
def test_huge_numbers_are_refused_by_key(key: str) -> None:
    section, name = key.split(".")
    found = problems({**MINIMAL, section: {name: 1e300 if _kind(key) is float else 10**30}})
    assert any(p.startswith(f"{key}: must be in ") for p in found), found


@pytest.mark.parametrize("key, value", [("rpc_timeout", "nan"), ("keepalive_interval", "nan"),
                                        ("grpc_keepalive", "inf"), ("reconnect_max", "inf"),
                                        ("rpc_timeout", "1_0"), ("rpc_timeout", "\uff15")])
def test_number_strings_that_python_would_take_are_refused(key: str, value: str) -> None:
    line = one_problem({**MINIMAL, "clusterd": {key: value}})
    assert line.startswith(f"clusterd.{key}: expected a number, got {value!r}"), line


def test_every_numeric_key_has_a_range_and_the_example_documents_it() -> None:
    numeric = {f"{section}.{f.name}" for section, cls in _SECTIONS.items() for f in fields(cls)
               if type(f.default) in (int, float)} | {"outbox_limit"}
    assert numeric == set(RANGES)
    text = EXAMPLE.read_text()
    for key in RANGES:
        assert range_text(key) in text, f"systemd/example-job.toml does not document the range of {key}"


@pytest.mark.parametrize("variable, value", [("WORLD_SIZE", "\uff11\uff16"), ("WORLD_SIZE", "1_6"),
                                             ("WORLD_SIZE", "\u0661\u0666"), ("TTP_PORT", "8\u0660\u0660\u0660"),
                                             ("MINDIO_WAIT_MINDX_TIME", "30.0")])
def test_integers_from_the_environment_are_ascii_decimals(variable: str, value: str) -> None:
    line = one_problem({}, {"MINDX_TASK_ID": "j", variable: value})
    assert line.startswith(f"{ENVIRONMENT[variable]} (from environment variable {variable}): "
                           "expected an integer in ASCII digits"), line


def test_garbage_process_recover_is_refused_not_silently_off() -> None:
    line = one_problem(MINIMAL, {"PROCESS_RECOVER": "garbage"})
    assert line.startswith("controller.enable_arf (from environment variable PROCESS_RECOVER): expected a boolean"), line


@pytest.mark.parametrize("address", ["0.0.0.0", "::", "", "  ", "not a host", "999.1.1.1"])
def test_metrics_address_is_never_every_interface_or_garbage(address: str) -> None:
    line = one_problem({**MINIMAL, "metrics": {"address": address}})
    assert line.startswith("metrics.address: "), line


@pytest.mark.parametrize("address", ["127.0.0.1", "::1", "10.0.0.21", "localhost", "node-7.example.com"])
def test_metrics_address_accepts_loopback_node_ips_and_names(address: str) -> None:
    assert build_config({**MINIMAL, "metrics": {"address": address}}, {}).metrics.address == address


@pytest.mark.parametrize("bind_ip", ["999.1.1.1", "0.0.0.0", "::", "a b", "-x", "1.2.3", " 10.0.0.1"])
def test_bad_bind_ip_is_refused(bind_ip: str) -> None:
    assert one_problem({**MINIMAL, "controller": {"bind_ip": bind_ip}}).startswith("controller.bind_ip: ")


def test_bad_pod_ip_names_the_variable() -> None:
    assert one_problem(MINIMAL, {"POD_IP": "999.1.1.1"}).startswith(
        "controller.bind_ip (from environment variable POD_IP): ")


@pytest.mark.parametrize("host", ["not a host", "999.1.1.1", "", "bad_host!"])
def test_bad_mindx_server_ip_names_the_variable(host: str) -> None:
    line = one_problem(MINIMAL, {"MINDX_SERVER_IP": host})
    assert line.startswith("clusterd.address (from environment variable MINDX_SERVER_IP): "), line


@pytest.mark.parametrize("address", ["clusterd.default.svc:8899", "[fd00::5]:8899", "10.0.0.5:8899"])
def test_good_clusterd_addresses(address: str) -> None:
    assert build_config({**MINIMAL, "clusterd": {"address": address}}, {}).clusterd.address == address


@pytest.mark.parametrize("address", ["fd00::5:8899", "[not-v6]:8899", "host:0", "host:\uff18"])
def test_bad_clusterd_addresses(address: str) -> None:
    assert one_problem({**MINIMAL, "clusterd": {"address": address}}).startswith("clusterd.address: ")


def test_reconnect_max_must_leave_most_of_the_controllers_wait() -> None:
    line = one_problem({**MINIMAL, "clusterd": {"reconnect_max": 20.0}, "controller": {"wait_mindx_time": 30}})
    assert "clusterd.reconnect_max = 20" in line and "controller.wait_mindx_time = 30" in line, line
    from_env = one_problem({**MINIMAL, "clusterd": {"reconnect_max": 10.0}}, {"MINDIO_WAIT_MINDX_TIME": "10"})
    assert "controller.wait_mindx_time (from environment variable MINDIO_WAIT_MINDX_TIME) = 10" in from_env
    assert build_config({**MINIMAL, "clusterd": {"reconnect_max": 15.0}}, {}).clusterd.reconnect_max == 15.0


def test_reconnect_initial_above_max() -> None:
    line = one_problem({**MINIMAL, "clusterd": {"reconnect_initial": 6.0, "reconnect_max": 5.0}})
    assert line.startswith("clusterd.reconnect_initial: must be <= clusterd.reconnect_max"), line


def test_tls_files_must_exist(tmp_path: Path) -> None:
    found = problems({"job_id": "j", "clusterd": {"tls": True, "ca_file": str(tmp_path / "missing.pem")}})
    assert any("clusterd.ca_file: no such file" in p for p in found)
    half = problems({"job_id": "j", "clusterd": {"cert_file": __file__}})
    assert any("give both for mutual TLS" in p for p in half)
    metrics = problems({"job_id": "j", "metrics": {"certfile": __file__, "keyfile": str(tmp_path / "k")}})
    assert metrics == [f"metrics.keyfile: no such file {str(tmp_path / 'k')!r}"]
    assert one_problem({"job_id": "j", "metrics": {"client_cafile": __file__}}).startswith("metrics.client_cafile: ")


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


def test_a_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    latin = tmp_path / "latin1.toml"
    latin.write_bytes('job_id = "caf\u00e9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 0xe9 at offset 13\)"):
        load_config(latin, {})


def test_example_config_is_valid() -> None:
    assert load_config(EXAMPLE, {}).job_id


# ------------------------------------------------------------------------- through the CLI

def cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ENVIRONMENT}
    return subprocess.run([sys.executable, "-m", "bridge.cli", *argv], capture_output=True, text=True, timeout=60,
                          env={**clean, **(env or {})})


CLI_CASES = [
    ("grpc_keepalive_inf", b'[clusterd]\ngrpc_keepalive = inf\n', {}, "clusterd.grpc_keepalive: expected a finite number"),
    ("reconnect_max_inf", b'[clusterd]\nreconnect_max = inf\n', {}, "clusterd.reconnect_max: expected a finite number"),
    ("rpc_timeout_nan", b'[clusterd]\nrpc_timeout = nan\n', {}, "clusterd.rpc_timeout: expected a finite number"),
    ("huge", b'[controller]\ndestroy_timeout = 1e300\n', {}, "controller.destroy_timeout: must be in"),
    ("every_interface", b'[metrics]\naddress = "0.0.0.0"\n', {}, "metrics.address: never the unspecified address"),
    ("latin1", 'job_id = "caf\u00e9"\n'.encode("latin-1"), {}, "not UTF-8 text"),
    ("full_width", b'', {"WORLD_SIZE": "\uff11\uff16"}, "(from environment variable WORLD_SIZE)"),
    ("process_recover", b'', {"PROCESS_RECOVER": "garbage"}, "(from environment variable PROCESS_RECOVER)"),
    ("server_ip", b'', {"MINDX_SERVER_IP": "not a host"}, "(from environment variable MINDX_SERVER_IP)"),
]


@pytest.mark.parametrize("command", ["check-config", "run"])
@pytest.mark.parametrize("name, body, env, expected", CLI_CASES, ids=[case[0] for case in CLI_CASES])
def test_cli_exits_2_naming_the_key(tmp_path: Path, command: str, name: str, body: bytes, env: dict[str, str],
                                    expected: str) -> None:
    path = tmp_path / f"{name}.toml"
    path.write_bytes((b'' if name == "latin1" else b'job_id = "j"\n') + body)
    argv = ["check-config", str(path)] if command == "check-config" else ["run", "--config", str(path)]
    done = cli(*argv, env=env)
    assert done.returncode == 2, done.stderr
    assert expected in done.stderr, done.stderr
    assert "Traceback" not in done.stderr + done.stdout


def test_the_old_hand_off_mode_still_loads_wake_warns_and_a_wrong_one_is_named() -> None:
    """An upgrade must not stop a bridge whose configuration names the hand-off of an
    earlier release; "wake" is warned about, since it no longer does anything."""
    wake = build_config({**MINIMAL, "controller": {"handoff": "wake"}}, {})
    assert any('controller.handoff = "wake"' in line and "ignored" in line for line in config_warnings(wake))
    assert not any("handoff" in line for line in config_warnings(build_config(MINIMAL, {})))
    problem = one_problem({**MINIMAL, "controller": {"handoff": "fast"}})
    assert problem.startswith("controller.handoff") and "'thread'" in problem and "'fast'" in problem


def test_controller_pin_cpu_is_on_by_default_and_takes_only_a_boolean() -> None:
    assert build_config(MINIMAL, {}).controller.pin_cpu is True
    assert build_config({**MINIMAL, "controller": {"pin_cpu": False}}, {}).controller.pin_cpu is False
    message = one_problem({**MINIMAL, "controller": {"pin_cpu": "sometimes"}})
    assert "controller.pin_cpu" in message and "boolean" in message


# ------------------------------------------------------------------------- warnings

WAIT_WARNING = "controller.wait_mindx_time (MINDIO_WAIT_MINDX_TIME) = {} s is not longer than the 11 s ClusterD"


@pytest.mark.parametrize("source", ["file", "environment"])
@pytest.mark.parametrize("wait, warned", [(10, True), (11, True), (12, False), (30, False)])
def test_check_config_warns_when_the_wait_cannot_outlast_clusterds_type1_delay(
        tmp_path: Path, source: str, wait: int, warned: bool) -> None:
    """ClusterD sends a type-1 fault's globalFault 11 s after the StopComplete, whatever
    the job says; measured: a wait of 10 s reached the controller and every type-1 cycle
    ended in EXIT. Legal, so a warning on stderr, exit 0, the configuration still printed."""
    path = tmp_path / "job.toml"
    body = 'job_id = "j"\n[clusterd]\nreconnect_max = 2.0\n'
    env: dict[str, str] = {}
    if source == "file":
        body += f"[controller]\nwait_mindx_time = {wait}\n"
    else:
        env["MINDIO_WAIT_MINDX_TIME"] = str(wait)
    path.write_text(body)
    done = cli("check-config", str(path), env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["controller"]["wait_mindx_time"] == wait
    warning = WAIT_WARNING.format(wait)
    assert (warning in done.stderr) == warned, done.stderr
    if warned:
        assert done.stderr.startswith("warning: ") and "ends in EXIT" in done.stderr
    else:
        assert done.stderr == ""


def test_the_default_wait_draws_no_warning() -> None:
    assert config_warnings(build_config(MINIMAL, {})) == []
