"""The conformance tier's collection: sharded across processes, or left to CI's own stage.

``.ci/run`` runs the tier in a background stage beside the suite, in several pytest
processes at once (each scenario is mostly waiting on the real peers' own timers):
``TFT_BRIDGE_CONFORMANCE_SHARD=I/N`` keeps every N-th scenario from the I-th on. The
suite's own run gets ``TFT_BRIDGE_CONFORMANCE=separate`` and skips the real-peer
scenarios (tests/conformance/test_real_peers.py says so in one line, printed by tests/conftest.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def shard() -> tuple[int, int] | None:
    value = os.environ.get("TFT_BRIDGE_CONFORMANCE_SHARD", "")
    if not value:
        return None
    try:
        index, count = (int(part) for part in value.split("/"))
    except ValueError:
        raise pytest.UsageError(f"TFT_BRIDGE_CONFORMANCE_SHARD={value!r}: expected I/N, e.g. 0/3") from None
    if not 0 <= index < count:
        raise pytest.UsageError(f"TFT_BRIDGE_CONFORMANCE_SHARD={value!r}: I must be in 0..N-1")
    return index, count


@pytest.fixture
def peer_logs(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """Where a scenario's peers write their logs: ``$TFT_BRIDGE_CONFORMANCE_LOGS/<test>``
    when that is set (CI keeps them: pytest keeps only its last three temporary folders,
    and the tier's shards run side by side), else the test's temporary folder."""
    kept = os.environ.get("TFT_BRIDGE_CONFORMANCE_LOGS")
    workdir = Path(kept) / request.node.name if kept else tmp_path
    workdir.mkdir(parents=True, exist_ok=True)
    return workdir


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    chosen = shard()
    if chosen is None:
        return
    index, count = chosen
    scenarios = [item for item in items if "real_peers" in item.keywords]
    dropped = [item for position, item in enumerate(scenarios) if position % count != index]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item not in dropped]

