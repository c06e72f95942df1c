"""The node service's configuration: one TOML file per node (``/etc/tft-bridge/node.toml``,
``systemd/node.example.toml``), holding only what a pod cannot say.

``[node]``, ``[kubernetes]`` and ``[metrics]`` configure the service itself; ``[bridge]``
is the template of every job's bridge configuration, in the job file's own sections
(``[bridge.clusterd]`` TLS, ``[bridge.hooks]``, ``[bridge.recorder]``, ...). The keys the
node service derives from the pod (the job id, the controller's address, port and world
size, the process-recovery switches, the state directory and the per-job metrics
endpoint) are refused in ``[bridge]``: one job's value there would be wrong for every
other job. Every problem is reported at once, one line per key, as ``check-config`` does.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from bridge.core.config import ConfigError, build_config, host_problem, read_toml
from bridge.node.selector import selector_problem

#: The opt-in label a job's pods carry (contrib/kubernetes/ascendjob-fragment.yaml).
DEFAULT_SELECTOR = "tft-bridge/enabled=true"

#: [bridge] keys the node service sets from the pod: never in the template.
PER_JOB_KEYS = frozenset({
    "job_id", "controller.bind_ip", "controller.port", "controller.world_size", "controller.enable_arf",
    "controller.enable_zit", "controller.state_directory", "metrics.enabled", "metrics.address", "metrics.port",
    "metrics.certfile", "metrics.keyfile", "metrics.client_cafile", "ranktable.job_id", "ranktable.path",
    "recorder.directory",
})


class NodeConfigError(ConfigError):
    """A problem in the node service's file: exit 2, every problem named."""
    title = "invalid node configuration"


@dataclass(frozen=True)
class NodeSection:
    """``[node]``: this node, which pods are served, and the service's waits and limits."""
    name: str = ""  # the Node's name; "" = $NODE_NAME, else the host name
    host_ip: str = ""  # the IP bridges bind; "" = each pod's status.hostIP
    host_ip_wait: float = 60.0  # a pod whose status.hostIP is not written yet: how long before it is refused
    selector: str = DEFAULT_SELECTOR  # the opt-in label selector
    state_root: str = "/var/lib/tft-bridge/node"  # one directory per job under it
    launcher: str = "auto"  # auto (systemd when it runs), systemd, session
    bridge_command: tuple[str, ...] = ()  # () = this Python, -m bridge.cli
    restart_delay: float = 5.0  # RestartSec= of the per-job unit contract
    start_limit_burst: int = 10  # StartLimitBurst=
    start_limit_interval: float = 600.0  # StartLimitIntervalSec=
    ranks_leave_wait: float = 60.0  # a job gone: how long its ranks may stay connected before the stop
    resolve_timeout: float = 2.0  # a MINDX_SERVER_IP name lookup
    tick: float = 0.5  # how often children and the pending stops are looked at
    refusal_retry: float = 600.0  # a job given up (bridge_config, bridge_failing) is tried again after this; 0 = never
    retention: float = 7 * 86400.0  # a finished job's directory is removed this long after its end; 0 = never


@dataclass(frozen=True)
class KubernetesSection:
    """``[kubernetes]``: how the service reaches the API server, with the deadline of each call."""
    server: str = ""  # a URL used without credentials (kubectl proxy, tests)
    kubeconfig: str = ""  # else a kubeconfig file; else the in-cluster service account
    context: str = ""
    request_timeout: float = 10.0
    connect_timeout: float = 5.0
    watch_timeout: int = 300


@dataclass(frozen=True)
class NodeMetricsSection:
    """``[metrics]``: the node's one endpoint (its own series and every bridge's)."""
    enabled: bool = True
    address: str = "127.0.0.1"
    port: int = 9464
    scrape_timeout: float = 2.0  # each job's own endpoint, read at every scrape of this one
    certfile: str = ""  # HTTPS with this certificate and key (both, or neither)
    keyfile: str = ""
    client_cafile: str = ""  # and client certificates signed by this CA required


@dataclass(frozen=True)
class NodeConfig:
    """The whole node file, validated; ``bridge`` is the template every job's configuration starts from."""
    node: NodeSection = field(default_factory=NodeSection)
    kubernetes: KubernetesSection = field(default_factory=KubernetesSection)
    metrics: NodeMetricsSection = field(default_factory=NodeMetricsSection)
    bridge: dict[str, Any] = field(default_factory=dict)  # the job template, validated
    log_level: str = "INFO"

    @property
    def node_name(self) -> str:
        return self.node.name or os.environ.get("NODE_NAME", "") or socket.gethostname()

    @property
    def node_name_source(self) -> str:
        """Where ``node_name`` came from, for a message that names it."""
        if self.node.name:
            return "node.name"
        return "$NODE_NAME" if os.environ.get("NODE_NAME") else "the host name (node.name and $NODE_NAME unset)"


_SECTIONS: dict[str, type] = {"node": NodeSection, "kubernetes": KubernetesSection, "metrics": NodeMetricsSection}


def _section(name: str, cls: type, raw: Any, problems: list[str]) -> Any:
    if not isinstance(raw, Mapping):
        problems.append(f"[{name}]: expected a table, got {raw!r}")
        return cls()
    known = {f.name: f for f in fields(cls)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        spec = known.get(key)
        if spec is None:
            problems.append(f"{name}.{key}: unknown key (known: {', '.join(sorted(known))})")
            continue
        kind = type(spec.default)
        if kind is tuple and isinstance(value, list) and all(isinstance(v, str) for v in value):
            values[key] = tuple(value)
        elif kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            values[key] = float(value)
        elif kind is int and isinstance(value, int) and not isinstance(value, bool):
            values[key] = value
        elif kind in (str, bool) and isinstance(value, kind):
            values[key] = value
        else:
            what = {tuple: "a list of strings", float: "a number", int: "an integer", str: "a string",
                    bool: "true or false"}[kind]
            problems.append(f"{name}.{key}: expected {what}, got {value!r}")
            continue
        bound = _BOUNDS.get(f"{name}.{key}")
        if bound is not None and not bound[0](values[key]):
            problems.append(f"{name}.{key}: {bound[1]}, got {value!r}")
            del values[key]
    return cls(**values)


#: Numeric keys and what they must be, with the reason an operator needs.
_BOUNDS: dict[str, tuple[Any, str]] = {
    "node.host_ip_wait": (lambda v: v >= 0, "must be 0 or more (seconds a pod may wait for its host IP)"),
    "node.tick": (lambda v: v > 0, "must be more than 0 (seconds between looks at the bridges; 0 is a busy loop)"),
    "node.restart_delay": (lambda v: v >= 0, "must be 0 or more (seconds before a failed bridge is restarted)"),
    "node.start_limit_burst": (lambda v: v >= 1, "must be at least 1 (starts allowed within start_limit_interval)"),
    "node.start_limit_interval": (lambda v: v > 0, "must be more than 0 (seconds)"),
    "node.ranks_leave_wait": (lambda v: v >= 0, "must be 0 or more (seconds a gone job's ranks may stay attached)"),
    "node.resolve_timeout": (lambda v: v > 0, "must be more than 0 (seconds a name lookup may take)"),
    "node.refusal_retry": (lambda v: v >= 0, "must be 0 (never) or more (seconds before a given-up job is tried "
                                             "again)"),
    "kubernetes.request_timeout": (lambda v: v > 0, "must be more than 0 (seconds: every API call's deadline)"),
    "kubernetes.connect_timeout": (lambda v: v > 0, "must be more than 0 (seconds)"),
    "kubernetes.watch_timeout": (lambda v: v > 0, "must be more than 0 (seconds a watch lasts before it is renewed)"),
    "metrics.port": (lambda v: 0 <= v <= 65535, "must be in 0..65535"),
    "metrics.scrape_timeout": (lambda v: v > 0, "must be more than 0 (seconds a bridge's endpoint may take)"),
}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _template_problems(template: Mapping[str, Any]) -> list[str]:
    problems = []
    for key, value in template.items():
        if isinstance(value, Mapping):
            problems += [f"bridge.{key}.{inner}: set by the node service from the pod, not here"
                         for inner in value if f"{key}.{inner}" in PER_JOB_KEYS]
        elif key in PER_JOB_KEYS:
            problems.append(f"bridge.{key}: set by the node service from the pod, not here")
    if problems:
        return problems
    sample = dict(template)
    sample["job_id"] = "template-check"
    try:
        build_config(sample, env={})
    except ConfigError as error:
        problems += [f"bridge: {line}" for line in error.problems]
    return problems


def build_node_config(raw: Mapping[str, Any]) -> NodeConfig:
    problems: list[str] = []
    sections: dict[str, Any] = {}
    template: dict[str, Any] = {}
    log_level = "INFO"
    for key, value in raw.items():
        if key in _SECTIONS:
            sections[key] = _section(key, _SECTIONS[key], value, problems)
        elif key == "bridge":
            if isinstance(value, Mapping):
                template = dict(value)
                problems += _template_problems(template)
            else:
                problems.append(f"[bridge]: expected a table, got {value!r}")
        elif key == "log_level":
            if isinstance(value, str) and value.upper() in LOG_LEVELS:
                log_level = value.upper()
            else:
                problems.append(f"log_level: expected one of {', '.join(LOG_LEVELS)}, got {value!r}")
        else:
            problems.append(f"{key}: unknown key (known: bridge, kubernetes, log_level, metrics, node)")
    config = NodeConfig(**sections, bridge=template, log_level=log_level)
    n = config.node
    if n.launcher not in ("auto", "systemd", "session"):
        problems.append(f"node.launcher: expected auto, systemd or session, got {n.launcher!r}")
    if n.host_ip and host_problem(n.host_ip, allow_unspecified=False):
        problems.append(f"node.host_ip: {host_problem(n.host_ip, allow_unspecified=False)}")
    if not Path(n.state_root).is_absolute():
        problems.append(f"node.state_root: expected an absolute path, got {n.state_root!r}")
    why = selector_problem(n.selector)
    if why is not None:
        problems.append(f"node.selector: {why} (the API server would refuse {n.selector!r}; e.g. "
                        f"{DEFAULT_SELECTOR!r}, 'a in (x,y)', '!key')")
    k = config.kubernetes
    if k.server and not k.server.startswith(("http://", "https://")):
        problems.append(f"kubernetes.server: expected an http:// or https:// URL (e.g. kubectl proxy's "
                        f"http://127.0.0.1:8001), got {k.server!r}")
    if k.kubeconfig and not Path(k.kubeconfig).is_absolute():
        problems.append(f"kubernetes.kubeconfig: expected an absolute path, got {k.kubeconfig!r}")
    m = config.metrics
    why = host_problem(m.address, allow_unspecified=False)
    if m.enabled and why:
        problems.append(f"metrics.address: {why}")
    problems += metrics_tls_problems(m)
    if problems:
        raise NodeConfigError(problems)
    return config


def metrics_tls_problems(m: NodeMetricsSection) -> list[str]:
    """The node endpoint's TLS keys, checked as the bridge's own [metrics] are."""
    problems = []
    if bool(m.certfile) != bool(m.keyfile):
        problems.append("metrics.certfile and metrics.keyfile: give both to serve HTTPS, or neither")
    elif m.enabled:
        for key in ("certfile", "keyfile", "client_cafile"):
            path = getattr(m, key)
            if path and not Path(path).is_file():
                problems.append(f"metrics.{key}: no such file {path!r}")
    if m.client_cafile and not m.certfile:
        problems.append("metrics.client_cafile: client certificates need HTTPS: set metrics.certfile and keyfile")
    return problems


def node_config_warnings(config: NodeConfig) -> list[str]:
    """Legal but unwise: said by ``--check`` and logged at start, not refused (as the
    bridge's ``check-config`` does)."""
    m = config.metrics
    if m.enabled and not m.client_cafile and not is_loopback(m.address):
        return [f"metrics.address: {m.address!r} is reachable from other hosts and the endpoint "
                f"{'takes any client' if m.certfile else 'serves plain HTTP'}: every job's recovery state is "
                f"readable there. Set metrics.certfile, metrics.keyfile and metrics.client_cafile (HTTPS with "
                f"client certificates), or bind 127.0.0.1 and scrape through an agent on the node"]
    return []


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def load_node_config(path: str | os.PathLike[str]) -> NodeConfig:
    return build_node_config(read_toml(path, NodeConfigError))
