"""The ``[recorder]`` and ``[otel]`` sections of a job's configuration, and where the store lives.

``RecorderConfig`` and ``OtelConfig`` with their defaults, ``problems`` for their ranges,
and ``state_directory``: the unit's ``$STATE_DIRECTORY`` (systemd's
``StateDirectory=tft-bridge/%i``), else ``/var/lib/tft-bridge/<job_id>``. Reading a
configuration through this module imports neither sqlite3 nor OpenTelemetry.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from bridge.core.state_dir import STATE_ROOT, safe_component
from bridge.core.state_dir import state_directory as resolve_state_directory

STORE_NAME = "recorder.sqlite3"


@dataclass(frozen=True)
class RecorderConfig:
    enabled: bool = True
    directory: str = ""  # "" = $STATE_DIRECTORY (the unit's StateDirectory=), else /var/lib/tft-bridge/<job_id>
    max_cycles: int = 1000  # keep the last N cycles ...
    max_mb: float = 64.0  # ... or this many megabytes of store, whichever bound is hit first
    max_events_per_cycle: int = 5000  # a callback storm must not make one cycle fill the store
    queue_limit: int = 20_000  # events waiting for the writer thread; beyond this they are dropped and counted


@dataclass(frozen=True)
class OtelConfig:
    enabled: bool = False
    endpoint: str = "127.0.0.1:4317"  # gRPC: HOST:PORT; http/protobuf: http(s)://host:4318/v1/traces
    protocol: str = "grpc"  # "grpc" or "http/protobuf" (the two OTLP transports collectors serve)
    timeout: float = 5.0  # deadline of one export
    insecure: bool = True  # gRPC only: plaintext (a node-local collector); false = TLS
    ca_file: str = ""  # TLS (gRPC with insecure = false, or an https:// endpoint): the CA bundle; "" = the system's
    headers: tuple[str, ...] = ()  # "name=value" pairs sent with every export (e.g. an auth token)
    service_name: str = "tft-bridge"


#: Accepted range of each numeric key, with why (checked by ``problems``).
RANGES: dict[str, tuple[float, float, str]] = {
    "recorder.max_cycles": (1, 1_000_000, "cycles kept"),
    "recorder.max_mb": (0.1, 100_000, "megabytes of store"),
    "recorder.max_events_per_cycle": (10, 1_000_000, "events kept per cycle"),
    "recorder.queue_limit": (100, 10_000_000, "events waiting for the writer thread"),
    "otel.timeout": (0.1, 120, "seconds per export"),
}

_HEADER = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+=.*$")


def problems(recorder: RecorderConfig, otel: OtelConfig) -> list[str]:
    """Every problem with the two sections beyond the numeric ranges (``RANGES`` is
    merged into ``bridge.core.config.RANGES``, which checks those), one line per key."""
    found: list[str] = []
    if otel.protocol not in ("grpc", "http/protobuf"):
        found.append(f"otel.protocol: expected 'grpc' or 'http/protobuf', got {otel.protocol!r}")
    elif otel.enabled:
        if otel.protocol == "grpc":
            host, sep, port = otel.endpoint.rpartition(":")
            if "://" in otel.endpoint or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                found.append(f"otel.endpoint: the grpc protocol expects HOST:PORT, got {otel.endpoint!r}")
        elif not re.match(r"^https?://[^/\s]+(/\S*)?$", otel.endpoint):
            found.append(f"otel.endpoint: the http/protobuf protocol expects an http(s):// URL, got {otel.endpoint!r}")
    if otel.ca_file and not Path(otel.ca_file).is_file():
        found.append(f"otel.ca_file: no such file {otel.ca_file!r}")
    for header in otel.headers:
        if not _HEADER.match(header):
            found.append(f"otel.headers: expected \"name=value\", got {header!r}")
    if not otel.service_name.strip():
        found.append("otel.service_name: must not be empty")
    if otel.enabled and not recorder.enabled:
        found.append("otel.enabled: traces are built from the flight recorder's cycles; set recorder.enabled = true")
    if otel.enabled and not otel_installed():
        found.append("otel.enabled: the OTLP export needs the otel extra: pip install 'tft-bridge[otel]'")
    return found


def otel_installed() -> bool:
    """True when opentelemetry-proto is importable; checked without importing it."""
    import importlib.util

    try:
        return importlib.util.find_spec("opentelemetry.proto.collector.trace.v1") is not None
    except (ImportError, ValueError):
        return False


def header_pairs(otel: OtelConfig) -> list[tuple[str, str]]:
    """``headers`` as (lower-case name, value) pairs (gRPC metadata keys must be lower case)."""
    pairs = []
    for header in otel.headers:
        name, _, value = header.partition("=")
        pairs.append((name.strip().lower(), value.strip()))
    return pairs


def state_directory(recorder: RecorderConfig, job_id: str, env: Mapping[str, str] | None = None) -> Path:
    """Where the running bridge keeps its store (the rule of ``bridge/core/state_dir.py``)."""
    return resolve_state_directory(recorder.directory, job_id, env)


def candidate_directories(recorder: RecorderConfig, job_id: str, config_path: str | None) -> list[Path]:
    """Where ``tft-bridge history --config FILE`` looks, in order: the configured directory,
    else the unit's state directory (named after the config file, as the unit's
    ``/etc/tft-bridge/%i.toml`` and ``StateDirectory=tft-bridge/%i`` are), then the
    job-id fallback of a bridge run outside systemd."""
    if recorder.directory:
        return [Path(recorder.directory)]
    found: list[Path] = []
    if config_path:
        found.append(STATE_ROOT / Path(config_path).stem)
    job_dir = STATE_ROOT / safe_component(job_id)
    if job_id and job_dir not in found:
        found.append(job_dir)
    return found
