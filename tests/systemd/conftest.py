"""The systemd tier: the shipped units on a real systemd (``sdns.py``). Where it cannot run
(not root, no ``unshare``, no systemd, no ``../shared/systemd``) its tests are not
collected and the run's summary says so in one line (tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .sdns import Systemd, ensure_venv, missing

WHY_NOT = missing()
HERE = Path(__file__).resolve().parent


def pytest_ignore_collect(collection_path: Path) -> bool | None:
    if WHY_NOT and collection_path.resolve().parent == HERE and collection_path.name.startswith("test_"):
        return True
    return None


@pytest.fixture
def systemd(tmp_path: Path) -> Iterator[Systemd]:
    """A freshly booted systemd with the shipped units installed; its journal is saved as
    ``journal.txt`` in the test's directory, pass or fail."""
    instance = Systemd(tmp_path / "systemd-ns")
    try:
        instance.boot(ensure_venv())
        yield instance
    finally:
        instance.stop(tmp_path / "journal.txt")
