"""The bridge's configuration: one frozen dataclass from a TOML file and the environment.

Precedence, lowest first: built-in defaults, the MindCluster environment variables a
training pod or an ``EnvironmentFile=`` provides, then the per-job TOML file, which is
the operator's explicit word. Every problem is collected and reported at once, one
line per key, so an operator fixes a bad file in one pass (``tft-bridge check-config``).
"""

from __future__ import annotations

import ipaddress
import os
import shlex
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

STUB_CONTROLLER = "stub"
REAL_CONTROLLER = "mindio_ttp.controller_ttp"
CLUSTERD_PORT = 8899


class ConfigError(ValueError):
    """Raised with every problem found; ``problems`` holds one message per key."""

    title = "invalid configuration"

    def __init__(self, problems: list[str]) -> None:
        super().__init__(f"{self.title}:\n  " + "\n  ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class ClusterDConfig:
    address: str = f"127.0.0.1:{CLUSTERD_PORT}"
    role: str = "tft-bridge"
    rpc_timeout: float = 5.0  # deadline of every unary call
    keepalive_interval: float = 5.0  # ClusterD's keep-alive cadence on the signal stream
    watchdog_intervals: float = 3.0  # silence of this many intervals = dead stream
    grpc_keepalive: float = 30.0  # HTTP/2 pings; ClusterD sends GOAWAY below 3 s, so >= 10
    reconnect_initial: float = 0.2
    reconnect_max: float = 30.0
    recheck_disabled: float = 60.0  # how often a 403 (process recovery off) is re-checked
    startup_wait: float = 10.0  # how long start-up waits for Init before starting the controller anyway
    tls: bool = False
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""


@dataclass(frozen=True)
class ControllerConfig:
    module: str = REAL_CONTROLLER  # or "stub" for the simulation in bridge.sim
    bind_ip: str = "127.0.0.1"
    port: int = 8000
    world_size: int = 1
    enable_local_copy: bool = False
    enable_arf: bool = False  # "recover": process-level online recovery
    enable_zit: bool = False  # downgrade / upgrade
    enable_tls: bool = False
    tls_info: str = ""
    wait_mindx_time: int = 30  # MINDIO_WAIT_MINDX_TIME: how long the controller waits for each answer
    pause_timeout: int = 600  # used when a pause_train signal carries timeout 0
    destroy_timeout: float = 30.0


@dataclass(frozen=True)
class HooksConfig:
    node_command: tuple[str, ...] = ()  # run with the action and node ranks as arguments
    timeout: float = 60.0


@dataclass(frozen=True)
class MetricsConfig:
    enabled: bool = True
    address: str = "127.0.0.1"
    port: int = 9464
    certfile: str = ""
    keyfile: str = ""
    client_cafile: str = ""


@dataclass(frozen=True)
class RankTableConfig:
    enabled: bool = False
    job_id: str = ""  # the pods' ``jobID`` label, not the owner UID Recover uses
    path: str = ""
    hook_command: tuple[str, ...] = ()


@dataclass(frozen=True)
class BridgeConfig:
    job_id: str
    clusterd: ClusterDConfig = field(default_factory=ClusterDConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    hooks: HooksConfig = field(default_factory=HooksConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    ranktable: RankTableConfig = field(default_factory=RankTableConfig)
    outbox_limit: int = 10_000
    log_level: str = "INFO"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_SECTIONS: dict[str, type] = {
    "clusterd": ClusterDConfig,
    "controller": ControllerConfig,
    "hooks": HooksConfig,
    "metrics": MetricsConfig,
    "ranktable": RankTableConfig,
}
_TOP_LEVEL = {"job_id", "outbox_limit", "log_level"}


def _from_environment(env: Mapping[str, str]) -> dict[str, Any]:
    """The MindCluster variables a training pod sets, as raw (unvalidated) TOML-shaped values."""
    raw: dict[str, Any] = {}

    def put(section: str | None, key: str, value: Any) -> None:
        (raw.setdefault(section, {}) if section else raw)[key] = value

    if "MINDX_TASK_ID" in env:
        put(None, "job_id", env["MINDX_TASK_ID"])
    if "MINDX_SERVER_IP" in env:
        host = env["MINDX_SERVER_IP"]
        put("clusterd", "address", f"[{host}]:{CLUSTERD_PORT}" if ":" in host else f"{host}:{CLUSTERD_PORT}")
    if "POD_IP" in env:
        put("controller", "bind_ip", env["POD_IP"])
    if "TTP_PORT" in env:
        put("controller", "port", env["TTP_PORT"])
    if "WORLD_SIZE" in env:
        put("controller", "world_size", env["WORLD_SIZE"])
    if "PROCESS_RECOVER" in env:
        put("controller", "enable_arf", env["PROCESS_RECOVER"].strip().lower() == "on")
    if "HIGH_AVAILABILITY" in env:
        put("controller", "enable_zit", "elastic-training" in env["HIGH_AVAILABILITY"])
    if "MINDIO_WAIT_MINDX_TIME" in env:
        put("controller", "wait_mindx_time", env["MINDIO_WAIT_MINDX_TIME"])
    return raw


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _coerce(name: str, value: Any, default: Any, problems: list[str]) -> Any:
    """Convert ``value`` to the type of ``default``; env values arrive as strings."""
    kind = type(default)
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind is int:
            if isinstance(value, bool) or isinstance(value, float):
                raise ValueError
            return int(value)
        if kind is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if kind is tuple:
            if isinstance(value, str):
                return tuple(shlex.split(value))
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                return tuple(value)
            raise ValueError
        if kind is str:
            if not isinstance(value, str):
                raise ValueError
            return value
    except ValueError:
        pass
    expected = {bool: "a boolean", int: "an integer", float: "a number", tuple: "a list of strings or a command line", str: "a string"}
    problems.append(f"{name}: expected {expected.get(kind, kind.__name__)}, got {value!r}")
    return default


def _build_section(name: str, cls: type, raw: Any, problems: list[str]) -> Any:
    if not isinstance(raw, Mapping):
        problems.append(f"[{name}]: expected a table, got {raw!r}")
        return cls()
    known = {f.name: f for f in fields(cls)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known:
            problems.append(f"{name}.{key}: unknown key (known: {', '.join(sorted(known))})")
            continue
        default = known[key].default
        values[key] = _coerce(f"{name}.{key}", value, default, problems)
    return cls(**values)


def _check_host_port(name: str, address: str, problems: list[str]) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        problems.append(f"{name}: expected HOST:PORT, got {address!r}")


def _validate(config: BridgeConfig, problems: list[str]) -> None:
    c, k = config.controller, config.clusterd
    if not config.job_id.strip():
        problems.append("job_id: missing (set it in the file or through MINDX_TASK_ID)")
    _check_host_port("clusterd.address", k.address, problems)
    if k.rpc_timeout <= 0:
        problems.append(f"clusterd.rpc_timeout: must be > 0, got {k.rpc_timeout}")
    if k.keepalive_interval <= 0:
        problems.append(f"clusterd.keepalive_interval: must be > 0, got {k.keepalive_interval}")
    if k.watchdog_intervals < 1:
        problems.append(f"clusterd.watchdog_intervals: must be >= 1, got {k.watchdog_intervals}")
    if k.grpc_keepalive < 10:
        problems.append(
            f"clusterd.grpc_keepalive: must be >= 10 s (ClusterD answers faster pings with GOAWAY), got {k.grpc_keepalive}"
        )
    if not 0 < k.reconnect_initial <= k.reconnect_max:
        problems.append("clusterd.reconnect_initial: must be > 0 and <= clusterd.reconnect_max")
    if k.recheck_disabled <= 0 or k.startup_wait < 0:
        problems.append("clusterd.recheck_disabled must be > 0 and clusterd.startup_wait >= 0")
    for key in ("ca_file", "cert_file", "key_file"):
        path = getattr(k, key)
        if path and not Path(path).is_file():
            problems.append(f"clusterd.{key}: no such file {path!r}")
    if bool(k.cert_file) != bool(k.key_file):
        problems.append("clusterd.cert_file and clusterd.key_file: give both for mutual TLS, or neither")
    if c.module not in (STUB_CONTROLLER, REAL_CONTROLLER):
        problems.append(f"controller.module: expected {REAL_CONTROLLER!r} or {STUB_CONTROLLER!r}, got {c.module!r}")
    try:
        ip = ipaddress.ip_address(c.bind_ip)
        if ip.is_unspecified:
            problems.append(f"controller.bind_ip: the controller refuses an all-zero address, got {c.bind_ip!r}")
    except ValueError:
        if not c.bind_ip.strip() or " " in c.bind_ip:
            problems.append(f"controller.bind_ip: expected an IP address or host name, got {c.bind_ip!r}")
    if not 1024 <= c.port <= 65535:
        problems.append(f"controller.port: must be in 1024..65535 (the controller's own limit), got {c.port}")
    if not 1 <= c.world_size <= 100_000:
        problems.append(f"controller.world_size: must be in 1..100000, got {c.world_size}")
    if not 1 <= c.wait_mindx_time <= 3600:
        problems.append(f"controller.wait_mindx_time: must be in 1..3600, got {c.wait_mindx_time}")
    if not 1 <= c.pause_timeout <= 3600:
        problems.append(f"controller.pause_timeout: must be in 1..3600, got {c.pause_timeout}")
    if c.destroy_timeout <= 0:
        problems.append(f"controller.destroy_timeout: must be > 0, got {c.destroy_timeout}")
    if config.hooks.timeout <= 0:
        problems.append(f"hooks.timeout: must be > 0, got {config.hooks.timeout}")
    m = config.metrics
    if not 0 <= m.port <= 65535:
        problems.append(f"metrics.port: must be in 0..65535, got {m.port}")
    if bool(m.certfile) != bool(m.keyfile):
        problems.append("metrics.certfile and metrics.keyfile: give both to serve HTTPS, or neither")
    r = config.ranktable
    if r.enabled and (not r.job_id or not r.path):
        problems.append("ranktable: enabled needs both ranktable.job_id (the jobID label) and ranktable.path")
    if config.outbox_limit < 16:
        problems.append(f"outbox_limit: must be >= 16, got {config.outbox_limit}")
    if config.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        problems.append(f"log_level: expected DEBUG, INFO, WARNING, ERROR or CRITICAL, got {config.log_level!r}")


def build_config(raw: Mapping[str, Any], env: Mapping[str, str] | None = None) -> BridgeConfig:
    """Validate a TOML-shaped mapping (layered over ``env``) into a ``BridgeConfig``."""
    layered = _merge(_from_environment(os.environ if env is None else env), raw)
    problems: list[str] = []
    sections: dict[str, Any] = {}
    for key, value in layered.items():
        if key in _SECTIONS:
            sections[key] = _build_section(key, _SECTIONS[key], value, problems)
        elif key not in _TOP_LEVEL:
            problems.append(f"{key}: unknown key (known: {', '.join(sorted(_TOP_LEVEL | set(_SECTIONS)))})")
    job_id = layered.get("job_id", "")
    if not isinstance(job_id, str):
        problems.append(f"job_id: expected a string, got {job_id!r}")
        job_id = ""
    top = {
        "outbox_limit": _coerce("outbox_limit", layered.get("outbox_limit", 10_000), 10_000, problems),
        "log_level": _coerce("log_level", layered.get("log_level", "INFO"), "INFO", problems),
    }
    config = BridgeConfig(job_id=job_id, **sections, **top)
    _validate(config, problems)
    if problems:
        raise ConfigError(problems)
    return config


def read_toml(path: str | os.PathLike[str], error: type[ConfigError] = ConfigError) -> dict[str, Any]:
    """A TOML file's contents; an unreadable or unparsable file raises ``error`` (a
    ConfigError kind) naming the file, like any other configuration problem."""
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except OSError as failure:
        raise error([f"{path}: cannot read: {failure.strerror or failure}"]) from failure
    except tomllib.TOMLDecodeError as failure:
        raise error([f"{path}: not valid TOML: {failure}"]) from failure


def load_config(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> BridgeConfig:
    """Read and validate a TOML file; unreadable or unparsable files are a ConfigError too."""
    return build_config(read_toml(path), env)
