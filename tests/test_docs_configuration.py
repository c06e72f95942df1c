"""docs/configuration.md states every key the code reads, and only those.

An operator looks a key up on that page, not in the dataclasses. The keys, defaults and
ranges here come from the code itself (the configuration dataclasses, ``RANGES``,
``ENVIRONMENT``, the platform policy's ``Rules``, the variables the modules read from
their environment), so a key added, removed, renamed or re-ranged in code fails until the
page says the same. The page's tables are parsed simply: one row per key, the key in
backticks in the first column.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from bridge.core.config import ENVIRONMENT, RANGES, BridgeConfig
from bridge.platform.policy import Rules

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "configuration.md"
_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|(.*)\|\s*$")


def sections(text: str) -> dict[str, dict[str, list[str]]]:
    """Level-2 heading -> {first-column key: the row's other cells}."""
    found: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for line in text.splitlines():
        if line.startswith("## "):
            current = found.setdefault(line[3:].strip(), {})
            continue
        match = _ROW.match(line)
        if match and current is not None:
            key = match.group(1)
            assert key not in current, f"docs/configuration.md lists {key!r} twice"
            current[key] = [cell.strip() for cell in match.group(2).split("|")]
    return found


@pytest.fixture(scope="module")
def page() -> dict[str, dict[str, list[str]]]:
    return sections(PAGE.read_text(encoding="utf-8"))


def job_file_defaults() -> dict[str, Any]:
    """Every key of the job file with its default (``dataclasses.MISSING`` when required),
    walked from ``BridgeConfig`` and its section dataclasses."""
    keys: dict[str, Any] = {}
    for field in dataclasses.fields(BridgeConfig):
        factory = field.default_factory
        if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
            for inner in dataclasses.fields(factory):
                keys[f"{field.name}.{inner.name}"] = inner.default
        else:
            keys[field.name] = field.default
    return keys


def as_toml(value: Any) -> Any:
    """A default as the TOML value that expresses it (tuples and sets are arrays)."""
    if isinstance(value, (frozenset, set)):
        return sorted(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def page_value(cell: str, key: str) -> Any:
    match = re.fullmatch(r"`(.+)`", cell)
    assert match, f"{key}: the default {cell!r} is not a TOML value in backticks"
    return tomllib.loads(f"value = {match.group(1)}")["value"]


ENV_READ = re.compile(r"""(?:environ|env)(?:\.get\(|\[)\s*["']([A-Z][A-Z0-9_]*)["']""")
#: Reads a training pod's container environment from its spec (the node service), not the
#: bridge's own process environment: those variables are documented in docs/node-service.md.
POD_SPEC_READER = ROOT / "bridge" / "node" / "podspec.py"


def environment_read_by_modules() -> set[str]:
    """Variables the bridge's modules read by name from their process environment.

    ``bridge/sim`` is left out: it is the stand-in for the peers and reads what they read.
    """
    names: set[str] = set()
    for path in (ROOT / "bridge").rglob("*.py"):
        if "sim" in path.relative_to(ROOT / "bridge").parts or path == POD_SPEC_READER:
            continue
        names.update(ENV_READ.findall(path.read_text(encoding="utf-8")))
    return names


def test_the_node_service_page_names_every_pod_variable_it_reads() -> None:
    read = set(ENV_READ.findall(POD_SPEC_READER.read_text(encoding="utf-8")))
    assert {"MINDX_TASK_ID", "TTP_PORT"} <= read  # the scan itself works
    page = (ROOT / "docs" / "node-service.md").read_text(encoding="utf-8")
    missing = sorted(name for name in read if f"`{name}`" not in page)
    assert not missing, f"pod variables bridge/node/podspec.py reads and docs/node-service.md does not name: {missing}"


def test_the_page_lists_exactly_the_job_file_keys(page: dict[str, dict[str, list[str]]]) -> None:
    documented = set(page["Job file keys"])
    code = set(job_file_defaults())
    assert not code - documented, f"keys the code has and docs/configuration.md lacks: {sorted(code - documented)}"
    assert not documented - code, f"keys docs/configuration.md lists and the code lacks: {sorted(documented - code)}"


def test_each_documented_default_is_the_codes(page: dict[str, dict[str, list[str]]]) -> None:
    rows = page["Job file keys"]
    for key, default in job_file_defaults().items():
        cell = rows[key][0]
        if default is dataclasses.MISSING:
            assert cell == "(required)", f"{key}: required in code, the page says {cell!r}"
            continue
        assert page_value(cell, key) == as_toml(default), f"{key}: the page says {cell}, the code {default!r}"


def test_each_documented_range_is_the_codes(page: dict[str, dict[str, list[str]]]) -> None:
    for key, cells in page["Job file keys"].items():
        cell = cells[1]
        if key not in RANGES:
            assert cell == "-", f"{key}: no range in bridge.core.config.RANGES, the page says {cell!r}"
            continue
        match = re.fullmatch(r"([0-9.]+)\.\.([0-9.]+)", cell)
        assert match, f"{key}: range {cell!r} is not low..high"
        low, high, _why = RANGES[key]
        assert (float(match.group(1)), float(match.group(2))) == (low, high), \
            f"{key}: the page says {cell}, the code {low:g}..{high:g}"


def test_the_page_lists_exactly_the_mindcluster_variables(page: dict[str, dict[str, list[str]]]) -> None:
    rows = page["MindCluster environment variables"]
    assert set(rows) == set(ENVIRONMENT), \
        f"page {sorted(rows)} against bridge.core.config.ENVIRONMENT {sorted(ENVIRONMENT)}"
    for variable, key in ENVIRONMENT.items():
        assert rows[variable][0] == f"`{key}`", f"{variable} sets {key}, the page says {rows[variable][0]}"


def test_the_page_lists_exactly_the_process_environment(page: dict[str, dict[str, list[str]]]) -> None:
    read = environment_read_by_modules() - set(ENVIRONMENT)
    assert "STATE_DIRECTORY" in read and "NOTIFY_SOCKET" in read  # the scan itself works
    documented = set(page["Process environment"])
    assert not read - documented, f"variables read in bridge/ and missing from the page: {sorted(read - documented)}"
    assert not documented - read, f"variables on the page that bridge/ never reads: {sorted(documented - read)}"


def test_the_page_lists_exactly_the_platform_policy_keys(page: dict[str, dict[str, list[str]]]) -> None:
    rows = page["Platform policy keys"]
    code = {field.name: field.default for field in dataclasses.fields(Rules)}
    assert set(rows) == set(code), f"page {sorted(rows)} against Rules {sorted(code)}"
    for key, default in code.items():
        assert page_value(rows[key][0], key) == as_toml(default), f"{key}: the page says {rows[key][0]}"
