"""A job's bridge configuration, built from its pod and the node's template, and written
where the bridge reads it: ``<state dir>/bridge.toml``, made by the service, never by
hand. The file is the whole configuration (the bridge is started with no MindCluster
variable in its environment), so ``tft-bridge check-config`` on it shows exactly what
the bridge runs with.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bridge.core.config import BridgeConfig, build_config
from bridge.core.files import write_atomically
from bridge.node.podspec import JobSpec

CONFIG_NAME = "bridge.toml"


def job_raw(spec: JobSpec, template: Mapping[str, Any], state_dir: Path, metrics_port: int) -> dict[str, Any]:
    """The TOML-shaped configuration of ``spec``'s bridge: the template, then the pod's word."""
    raw: dict[str, Any] = copy.deepcopy(dict(template))
    raw["job_id"] = spec.job_id
    clusterd = raw.setdefault("clusterd", {})
    clusterd.setdefault("address", spec.clusterd_address)
    controller = raw.setdefault("controller", {})
    controller.update(bind_ip=spec.bind_ip, port=spec.port, world_size=spec.world_size,
                      state_directory=str(state_dir))
    if spec.enable_arf is not None:
        controller["enable_arf"] = spec.enable_arf
    if spec.enable_zit is not None:
        controller["enable_zit"] = spec.enable_zit
    if spec.wait_mindx_time is not None:
        controller["wait_mindx_time"] = spec.wait_mindx_time
    if spec.pause_timeout is not None:
        controller["pause_timeout"] = spec.pause_timeout
    raw.setdefault("recorder", {})["directory"] = str(state_dir)  # the flight recorder beside the marker
    raw["metrics"] = {"enabled": True, "address": "127.0.0.1", "port": metrics_port}
    return raw


def validated(raw: Mapping[str, Any]) -> BridgeConfig:
    """The configuration the bridge will load (ConfigError with every problem otherwise);
    no environment layered: the file is complete."""
    return build_config(raw, env={})


def write_job_config(state_dir: Path, raw: Mapping[str, Any]) -> Path:
    """Write ``raw`` as ``state_dir/bridge.toml`` atomically (a bridge never reads half a file)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / CONFIG_NAME
    write_atomically(path, "# Written by tft-bridge node from the job's pod; do not edit (rewritten at each start).\n"
                     + dumps(raw), mode=0o644)
    return path


def dumps(raw: Mapping[str, Any]) -> str:
    """TOML for the shapes a bridge configuration has: scalars, lists of strings, and one
    level of tables (a recorder's ``[recorder]`` and ``[otel]`` included)."""
    lines = [f"{key} = {_value(value)}" for key, value in raw.items() if not isinstance(value, Mapping)]
    for key, value in raw.items():
        if isinstance(value, Mapping):
            lines.append(f"\n[{_key(key)}]")
            for inner, item in value.items():
                if isinstance(item, Mapping):
                    raise ValueError(f"{key}.{inner}: nested tables are not part of a bridge configuration")
                lines.append(f"{_key(inner)} = {_value(item)}")
    return "\n".join(lines) + "\n"


def _key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() and key.isascii() else _string(key)


def _string(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    escaped = "".join(ch if ch >= " " and ch != "\x7f" else f"\\u{ord(ch):04x}" for ch in escaped)
    return f'"{escaped}"'


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} has no TOML form the bridge accepts")
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(item) for item in value) + "]"
    raise ValueError(f"cannot write {value!r} as TOML")
