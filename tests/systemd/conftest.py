"""The systemd tier: the shipped units on a real systemd (``sdns.py``). Skipped in one line
where it cannot run (not root, no ``unshare``, no systemd, no ``../shared/systemd``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .sdns import Systemd, ensure_venv, missing

WHY_NOT = missing()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if WHY_NOT:
        for item in items:
            if "tests/systemd/" in str(item.fspath):
                item.add_marker(pytest.mark.skip(reason=f"systemd tier skipped: {WHY_NOT}"))


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
