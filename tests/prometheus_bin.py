"""Finding Debian's ``prometheus`` package binaries (``promtool``, ``prometheus``) for tests.

CI (``.ci/run``) installs the package and sets ``BRIDGE_REQUIRE_PROMETHEUS=1``, so there a
missing binary is a failure; on a developer machine without it the test is skipped and
says why.
"""

from __future__ import annotations

import os
import shutil

import pytest

REQUIRE = "BRIDGE_REQUIRE_PROMETHEUS"


def required_binary(name: str) -> str:
    """The path of ``name``; skip the test without it, or fail when CI requires it."""
    path = shutil.which(name)
    if path:
        return path
    message = f"{name} not found on PATH (Debian package 'prometheus'; .ci/run installs it)"
    if os.environ.get(REQUIRE) == "1":
        pytest.fail(f"{message}, and {REQUIRE}=1 requires it")
    pytest.skip(f"{message}; set {REQUIRE}=1 to make this a failure")
