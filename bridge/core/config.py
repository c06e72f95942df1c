"""The per-job bridge's configuration: one frozen ``BridgeConfig`` from a TOML file and the environment.

``load_config(path, env)`` applies built-in defaults, then the MindCluster environment
variables, then the TOML file (the operator's explicit word). Every value is checked
(finite, inside ``RANGES``, ASCII decimals, IP literals or host names, cross-key limits)
and every problem is reported at once in one ``ConfigError``, one line per key, naming
the environment variable a value came from. ``config_warnings`` lists legal values that
cannot work with the real peers. Pure: no I/O besides reading the file. Keys, ranges and
the peer fact behind each rule: docs/configuration.md.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from bridge.core.recorder_config import RANGES as RECORDER_RANGES
from bridge.core.recorder_config import OtelConfig, RecorderConfig
from bridge.core.recorder_config import problems as recorder_problems

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

STUB_CONTROLLER = "stub"
REAL_CONTROLLER = "mindio_ttp.controller_ttp"
CLUSTERD_PORT = 8899
#: ClusterD's address behind its node-local proxy (TaskD: ``LOCAL_PROXY_ENABLE=on``).
LOCAL_PROXY_ADDRESS = f"127.0.0.1:{CLUSTERD_PORT}"
#: TaskD's pause timeout when a pause_train carries 0 and HCCL_CONNECT_TIMEOUT is unset
#: or not positive (``SWITCH_NIC_DEFAULT_TIMEOUT``), and its ceiling for the derived one
#: (``SWITCH_NIC_MAX_TIMEOUT``, 120 minutes); seconds.
PAUSE_DEFAULT = 600
PAUSE_MAX = 7200
#: The longest a stop waits for the controller's last reports (``ClusterDConfig.drain_timeout``).
MAX_DRAIN_TIMEOUT = 5.0


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
    grpc_keepalive: float = 30.0  # HTTP/2 pings while the stream is open; see the module docstring
    reconnect_initial: float = 0.2
    reconnect_max: float = 10.0  # at most half the controller's wait: see the module docstring
    recheck_disabled: float = 60.0  # how often a 403 (process recovery off) is re-checked
    startup_wait: float = 10.0  # how long start-up waits for Init before starting the controller anyway
    # ClusterD's fault centre: how long it keeps publishing a reported UCE/HCCL fault
    # after the rank's last report, and how often it publishes (bridge/job/reports/refault.py).
    retry_record_hold: float = 10.0
    fault_centre_period: float = 1.0
    tls: bool = False
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""

    @property
    def drain_timeout(self) -> float:
        """How long a stop waits for the last reports to reach ClusterD, and after the
        controller ended for the stream to come back: one RPC deadline, at most
        ``MAX_DRAIN_TIMEOUT`` seconds."""
        return min(MAX_DRAIN_TIMEOUT, self.rpc_timeout)


#: ``controller.handoff`` values: accepted and ignored (the old hand-off modes).
HANDOFF_MODES = ("thread", "wake")


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
    # Used when a pause_train signal carries timeout 0: TaskD's own default, or derived
    # from HCCL_CONNECT_TIMEOUT as TaskD derives it (``pause_timeout_from_hccl``).
    pause_timeout: int = PAUSE_DEFAULT
    destroy_timeout: float = 30.0
    # Where the orphaned-job marker lives (bridge/job/session/orphan.py): "" = $STATE_DIRECTORY (the
    # unit's StateDirectory=), else /var/lib/tft-bridge/<job_id>.
    state_directory: str = ""
    # At a stop while training ranks are still counted connected: how long to wait for the
    # controller to notice they are gone (its heartbeat loss, ~8-10 s), so that the usual
    # teardown -- ranks killed, then the bridge stopped -- leaves no orphan marker. A stop
    # while the job really trains on takes this much longer. 0: do not wait.
    rank_loss_wait: float = 12.0
    # Accepted for configurations written for earlier releases, and ignored: the
    # controller's callbacks feed the report wire directly (bridge/job/reports/relay.py); "wake" warns.
    handoff: str = "thread"
    # SCHED_FIFO priority of the event loop and the report wire's calls (bridge/job/sched/realtime.py):
    # they then run the moment they wake, also when the node's cores are busy; 0 leaves
    # them under the normal policy. The unit allows 1 (LimitRTPRIO=1).
    realtime_priority: int = 1
    # Pin the controller's callback thread and the report wire to the CPU the
    # controller first calls back on (bridge/job/sched/affinity.py): every wake-up of the wire
    # is then local, and a report reaches the loop when the callback's thread goes back
    # to waiting instead of after a busy process's slice on another CPU. Within the
    # unit's CPUAffinity=; false leaves both free to move.
    pin_cpu: bool = True


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
    recorder: RecorderConfig = field(default_factory=RecorderConfig)  # the flight recorder (bridge/job/recorder/)
    otel: OtelConfig = field(default_factory=OtelConfig)  # optional OTLP trace export (bridge/job/recorder/otel.py)
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
    "recorder": RecorderConfig,
    "otel": OtelConfig,
}
_TOP_LEVEL = {"job_id", "outbox_limit", "log_level"}

#: The accepted range of every numeric key, inclusive, with the reason for its bounds.
#: systemd/example-job.toml documents each one; a test checks both stay complete.
RANGES: dict[str, tuple[float, float, str]] = {
    "outbox_limit": (16, 10_000_000, "reports kept while ClusterD is away"),
    "clusterd.rpc_timeout": (0.1, 300, "seconds; a unary RPC on a LAN"),
    "clusterd.keepalive_interval": (0.01, 600, "seconds; ClusterD's own cadence is 5 s"),
    "clusterd.watchdog_intervals": (1, 100, "keep-alive intervals of silence"),
    "clusterd.grpc_keepalive": (10, 3600, "seconds, and at least twice clusterd.keepalive_interval: pings "
                                          "that do not follow a ClusterD write get GOAWAY too_many_pings"),
    "clusterd.reconnect_initial": (0.001, 60, "seconds, and at most clusterd.reconnect_max"),
    "clusterd.reconnect_max": (0.01, 1800, "seconds, and at most half of controller.wait_mindx_time"),
    "clusterd.recheck_disabled": (0.1, 86_400, "seconds"),
    "clusterd.startup_wait": (0, 3600, "seconds; keep TimeoutStartSec above it"),
    "clusterd.retry_record_hold": (0.001, 600, "seconds; ClusterD's own is 10 s"),
    "clusterd.fault_centre_period": (0.001, 60, "seconds; ClusterD's own is 1 s"),
    "controller.port": (1024, 65535, "the controller's own limit; the unit grants no capabilities"),
    "controller.world_size": (1, 100_000, "training ranks"),
    "controller.wait_mindx_time": (1, 3600, "seconds; the controller's own limit"),
    "controller.pause_timeout": (1, PAUSE_MAX, "seconds; TaskD's own ceiling for a derived pause"),
    "controller.destroy_timeout": (0.1, 600, "seconds; keep TimeoutStopSec above it"),
    "controller.rank_loss_wait": (0, 120, "seconds; at least the controller's ~10 s heartbeat loss, 0 = off"),
    "controller.realtime_priority": (0, 99, "SCHED_FIFO priority, 0 = off; above 1 needs a higher LimitRTPRIO="),
    "hooks.timeout": (0.1, 3600, "seconds"),
    "metrics.port": (0, 65535, "0 picks a free port"),
    **RECORDER_RANGES,  # recorder.*, otel.*: defined beside their code (bridge/core/recorder_config.py)
}

#: Environment variable -> the key it sets (docs/configuration.md lists them).
ENVIRONMENT: dict[str, str] = {
    "MINDX_TASK_ID": "job_id",
    "MINDX_SERVER_IP": "clusterd.address",
    "POD_IP": "controller.bind_ip",
    "TTP_PORT": "controller.port",
    "WORLD_SIZE": "controller.world_size",
    "MS_WORKER_NUM": "controller.world_size",
    "PROCESS_RECOVER": "controller.enable_arf",
    "HIGH_AVAILABILITY": "controller.enable_zit",
    "MINDIO_WAIT_MINDX_TIME": "controller.wait_mindx_time",
    "HCCL_CONNECT_TIMEOUT": "controller.pause_timeout",
    "LOCAL_PROXY_ENABLE": "clusterd.address",
}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


class _Problems:
    """Collects problems; a key whose value came from the environment is named with its variable."""

    def __init__(self, from_env: Mapping[str, str]) -> None:
        self.from_env = from_env  # dotted key -> environment variable, only where the file did not override
        self.lines: list[str] = []

    def name(self, key: str) -> str:
        variable = self.from_env.get(key)
        return f"{key} (from environment variable {variable})" if variable else key

    def add(self, key: str, message: str) -> None:
        self.lines.append(f"{self.name(key)}: {message}")

    def plain(self, line: str) -> None:
        self.lines.append(line)


def _from_environment(env: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """The MindCluster variables a training pod sets, as raw (unvalidated) TOML-shaped
    values, and which dotted key each variable set."""
    raw: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def put(variable: str, value: Any) -> None:
        key = ENVIRONMENT[variable]
        section, _, name = key.rpartition(".")
        (raw.setdefault(section, {}) if section else raw)[name] = value
        sources[key] = variable

    for variable in ("MINDX_TASK_ID", "POD_IP", "TTP_PORT", "WORLD_SIZE", "MINDIO_WAIT_MINDX_TIME"):
        if variable in env:
            put(variable, env[variable])
    if not env.get("WORLD_SIZE") and "MS_WORKER_NUM" in env:  # a MindSpore job (TaskD: WORLD_SIZE or this)
        put("MS_WORKER_NUM", env["MS_WORKER_NUM"])
    if env.get("LOCAL_PROXY_ENABLE") == "on":  # TaskD's exact test; the proxy wins over MINDX_SERVER_IP
        put("LOCAL_PROXY_ENABLE", LOCAL_PROXY_ADDRESS)
    elif "MINDX_SERVER_IP" in env:
        host = env["MINDX_SERVER_IP"].strip()
        put("MINDX_SERVER_IP", f"[{host}]:{CLUSTERD_PORT}" if ":" in host else f"{host}:{CLUSTERD_PORT}")
    if "HCCL_CONNECT_TIMEOUT" in env:
        pause = pause_timeout_from_hccl(env["HCCL_CONNECT_TIMEOUT"])
        if pause is not None:
            put("HCCL_CONNECT_TIMEOUT", pause)
    if "PROCESS_RECOVER" in env:
        put("PROCESS_RECOVER", env["PROCESS_RECOVER"])  # a string: _coerce refuses what is not on/off
    if "HIGH_AVAILABILITY" in env:
        put("HIGH_AVAILABILITY", "elastic-training" in env["HIGH_AVAILABILITY"])  # taskd's own test: contains
    return raw, sources


def pause_timeout_from_hccl(value: str) -> int | str | None:
    """The pause timeout TaskD derives from ``HCCL_CONNECT_TIMEOUT`` (its
    ``get_hccl_switch_nic_timeout``): 2.5 times it, at most ``PAUSE_MAX``. A pause that
    ClusterD sends with timeout 0 is a NIC switch's or an operator's: it must outlast
    HCCL's own reconnect. None where TaskD falls back to its default (0 or negative);
    the text itself where it is not an integer, so that the check names the variable."""
    text = value.strip()
    if not _INT.fullmatch(text):
        return value
    seconds = int(text)
    if seconds <= 0:
        return None
    return min(seconds * 5 // 2, PAUSE_MAX)


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _overridden(raw: Mapping[str, Any], key: str) -> bool:
    section, _, name = key.rpartition(".")
    table = raw.get(section) if section else raw
    return isinstance(table, Mapping) and name in table


def _coerce(name: str, value: Any, default: Any, problems: _Problems) -> Any:
    """Convert ``value`` to the type of ``default``; env values arrive as strings."""
    kind = type(default)
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in _TRUE:
                return True
            if isinstance(value, str) and value.strip().lower() in _FALSE:
                return False
            raise ValueError
        if kind is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            if isinstance(value, str) and _INT.fullmatch(value.strip()):  # ASCII digits only, no "1_000"
                return int(value.strip())
            raise ValueError
        if kind is float:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, str):
                if not _FLOAT.fullmatch(value.strip()):
                    raise ValueError
                value = float(value.strip())
            number = float(value)  # a TOML int or float; a huge int raises OverflowError
            if not math.isfinite(number):
                problems.add(name, f"expected a finite number, got {value!r}")
                return default
            return number
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
    except (ValueError, TypeError, OverflowError):
        pass
    expected = {bool: "a boolean (on/off, true/false, yes/no, 1/0)", int: "an integer in ASCII digits",
                float: "a number", tuple: "a list of strings or a command line", str: "a string"}
    problems.add(name, f"expected {expected.get(kind, kind.__name__)}, got {value!r}")
    return default


def _build_section(name: str, cls: type, raw: Any, problems: _Problems) -> Any:
    if not isinstance(raw, Mapping):
        problems.plain(f"[{name}]: expected a table, got {raw!r}")
        return cls()
    known = {f.name: f for f in fields(cls)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known:
            problems.add(f"{name}.{key}", f"unknown key (known: {', '.join(sorted(known))})")
            continue
        default = known[key].default
        values[key] = _coerce(f"{name}.{key}", value, default, problems)
    return cls(**values)


def host_problem(host: str, *, allow_unspecified: bool = True) -> str | None:
    """Why ``host`` is neither an IP literal nor a valid host name, or None if it is one."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        if ip.is_unspecified and not allow_unspecified:
            return f"never the unspecified address {host!r} (every interface): use loopback or this node's IP"
        return None
    if not host:
        return "empty (an empty address means every interface)" if not allow_unspecified else "empty"
    name = host[:-1] if host.endswith(".") else host
    labels = name.split(".")
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        return f"expected an IP address or host name, got {host!r}"
    if labels[-1].isdigit():
        return f"not a valid IP address (and a host name cannot end in a number), got {host!r}"
    return None


def _check_host_port(key: str, address: str, problems: _Problems) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        problems.add(key, f"expected HOST:PORT, got {address!r}")
        return
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            problems.add(key, f"[{host}] is not an IPv6 address, in {address!r}")
        return
    if ":" in host:
        problems.add(key, f"write an IPv6 host in brackets, [addr]:port, got {address!r}")
        return
    why = host_problem(host)
    if why:
        problems.add(key, f"host {why}")


def range_text(key: str) -> str:
    """``low..high`` of a numeric key, as the messages and systemd/example-job.toml write it."""
    low, high, _ = RANGES[key]
    return "..".join(str(int(v)) if v == int(v) else f"{v:g}" for v in (low, high))


def _check_ranges(config: BridgeConfig, problems: _Problems) -> None:
    for key, (low, high, why) in RANGES.items():
        section, _, name = key.rpartition(".")
        value = getattr(getattr(config, section) if section else config, name)
        if not low <= value <= high:  # also false for nan, which _coerce already refused
            problems.add(key, f"must be in {range_text(key)} ({why}), got {value!r}")


def _validate(config: BridgeConfig, problems: _Problems) -> None:
    c, k = config.controller, config.clusterd
    if not config.job_id.strip():
        problems.add("job_id", "missing (set it in the file or through MINDX_TASK_ID)")
    _check_host_port("clusterd.address", k.address, problems)
    _check_ranges(config, problems)
    if k.reconnect_initial > k.reconnect_max:
        problems.add("clusterd.reconnect_initial", f"must be <= clusterd.reconnect_max ({k.reconnect_max:g}), "
                     f"got {k.reconnect_initial:g}")
    if RANGES["clusterd.grpc_keepalive"][0] <= k.grpc_keepalive < 2 * k.keepalive_interval:  # once per key
        problems.plain(
            f"{problems.name('clusterd.grpc_keepalive')} = {k.grpc_keepalive:g} and "
            f"{problems.name('clusterd.keepalive_interval')} = {k.keepalive_interval:g}: clusterd.grpc_keepalive "
            f"must be at least twice clusterd.keepalive_interval, or a ping can come before ClusterD wrote "
            f"anything, which ClusterD releases enforcing gRPC's default ping policy count as abuse "
            f"(GOAWAY too_many_pings)")
    if k.reconnect_max > c.wait_mindx_time / 2:
        problems.plain(
            f"{problems.name('clusterd.reconnect_max')} = {k.reconnect_max:g} and "
            f"{problems.name('controller.wait_mindx_time')} = {c.wait_mindx_time}: clusterd.reconnect_max must be "
            f"at most half of controller.wait_mindx_time, or one back-off sleep after a ClusterD restart can "
            f"use up the controller's whole wait for ClusterD's decision")
    for key in ("ca_file", "cert_file", "key_file"):
        path = getattr(k, key)
        if path and not Path(path).is_file():
            problems.add(f"clusterd.{key}", f"no such file {path!r}")
    if bool(k.cert_file) != bool(k.key_file):
        problems.plain("clusterd.cert_file and clusterd.key_file: give both for mutual TLS, or neither")
    if c.handoff not in HANDOFF_MODES:
        problems.add("controller.handoff", f"expected one of {', '.join(map(repr, HANDOFF_MODES))}, got {c.handoff!r}")
    if c.module not in (STUB_CONTROLLER, REAL_CONTROLLER):
        problems.add("controller.module", f"expected {REAL_CONTROLLER!r} or {STUB_CONTROLLER!r}, got {c.module!r}")
    why = host_problem(c.bind_ip, allow_unspecified=False)
    if why:
        problems.add("controller.bind_ip", why if "got" in why else f"{why}; the controller refuses it")
    m = config.metrics
    why = host_problem(m.address, allow_unspecified=False)
    if why:
        problems.add("metrics.address", why)
    if bool(m.certfile) != bool(m.keyfile):
        problems.plain("metrics.certfile and metrics.keyfile: give both to serve HTTPS, or neither")
    for key in ("certfile", "keyfile", "client_cafile") if bool(m.certfile) == bool(m.keyfile) else ():
        path = getattr(m, key)
        if path and not Path(path).is_file():
            problems.add(f"metrics.{key}", f"no such file {path!r}")
    if m.client_cafile and not m.certfile:
        problems.add("metrics.client_cafile", "client certificates need HTTPS: set metrics.certfile and keyfile")
    r = config.ranktable
    if r.enabled and (not r.job_id or not r.path):
        problems.plain("ranktable: enabled needs both ranktable.job_id (the jobID label) and ranktable.path")
    for line in recorder_problems(config.recorder, config.otel):
        problems.plain(line)
    if config.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        problems.add("log_level", f"expected DEBUG, INFO, WARNING, ERROR or CRITICAL, got {config.log_level!r}")


#: ClusterD's delay from ReportStopComplete to globalFault once a type-1 fault is in the
#: cycle: 1 s flush + 10 s, fixed in its code (docs/clusterd.md section 6). Seconds.
CLUSTERD_TYPE1_GLOBAL_FAULT_DELAY = 11


def config_warnings(config: BridgeConfig) -> list[str]:
    """Legal values that the real peers make fail (module docstring): one line each,
    naming the key, its value and why. A warning, not an error: the job still starts."""
    lines: list[str] = []
    wait = config.controller.wait_mindx_time
    if wait <= CLUSTERD_TYPE1_GLOBAL_FAULT_DELAY:
        lines.append(
            f"controller.wait_mindx_time (MINDIO_WAIT_MINDX_TIME) = {wait} s is not longer than the "
            f"{CLUSTERD_TYPE1_GLOBAL_FAULT_DELAY} s ClusterD always takes from a stop-complete to its globalFault "
            f"for a process (type-1) fault (1 s flush + 10 s, not configurable): the controller's wait for that "
            f"globalFault runs out first, so every process-fault recovery of this job ends in EXIT. Give it more "
            f"than {CLUSTERD_TYPE1_GLOBAL_FAULT_DELAY} s plus the time ClusterD may be away (default 30)")
    if config.controller.handoff == "wake":
        lines.append('controller.handoff = "wake" is no longer supported and is ignored: the controller\'s callbacks '
                     "feed the report wire's thread directly (docs/architecture.md); remove the key")
    return lines


def build_config(raw: Mapping[str, Any], env: Mapping[str, str] | None = None) -> BridgeConfig:
    """Validate a TOML-shaped mapping (layered over ``env``) into a ``BridgeConfig``."""
    from_env, sources = _from_environment(os.environ if env is None else env)
    layered = _merge(from_env, raw)
    problems = _Problems({key: var for key, var in sources.items() if not _overridden(raw, key)})
    sections: dict[str, Any] = {}
    for key, value in layered.items():
        if key in _SECTIONS:
            sections[key] = _build_section(key, _SECTIONS[key], value, problems)
        elif key not in _TOP_LEVEL:
            problems.add(key, f"unknown key (known: {', '.join(sorted(_TOP_LEVEL | set(_SECTIONS)))})")
    job_id = layered.get("job_id", "")
    if not isinstance(job_id, str):
        problems.add("job_id", f"expected a string, got {job_id!r}")
        job_id = ""
    top = {
        "outbox_limit": _coerce("outbox_limit", layered.get("outbox_limit", 10_000), 10_000, problems),
        "log_level": _coerce("log_level", layered.get("log_level", "INFO"), "INFO", problems),
    }
    config = BridgeConfig(job_id=job_id, **sections, **top)
    _validate(config, problems)
    if problems.lines:
        raise ConfigError(problems.lines)
    return config


def read_toml(path: str | os.PathLike[str], error: type[ConfigError] = ConfigError) -> dict[str, Any]:
    """A TOML file's contents; an unreadable, non-UTF-8 or unparsable file raises ``error``
    (a ConfigError kind) naming the file, like any other configuration problem."""
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except OSError as failure:
        raise error([f"{path}: cannot read: {failure.strerror or failure}"]) from failure
    except UnicodeDecodeError as failure:
        bad = failure.object[failure.start:failure.start + 1].hex()
        raise error([f"{path}: not UTF-8 text (byte 0x{bad} at offset {failure.start}); TOML files are UTF-8"]) from failure
    except tomllib.TOMLDecodeError as failure:
        raise error([f"{path}: not valid TOML: {failure}"]) from failure


def load_config(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> BridgeConfig:
    """Read and validate a TOML file; unreadable or unparsable files are a ConfigError too."""
    return build_config(read_toml(path), env)
