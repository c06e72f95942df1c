"""The conformance tier's module-level skip, for real-peer scenario modules beside
test_real_peers.py: skipped without the real peers, and in the suite's own run when CI
runs the tier in its own stage (``TFT_BRIDGE_CONFORMANCE=separate``)."""

from __future__ import annotations

import os

import pytest

from .peers import unavailable


def skip_unless_the_tier_runs_here() -> None:
    reason = unavailable()
    if reason is None and os.environ.get("TFT_BRIDGE_CONFORMANCE") == "separate":
        reason = "the real-peer scenarios run in CI's conformance stage (.ci/conformance), not in this run"
    if reason is not None:
        pytest.skip(f"conformance tier: {reason}", allow_module_level=True)
