"""A ``mindio_ttp`` built for another CPython: the start-up error names both Pythons and the file.

The real controller's compiled module is per CPython version; on a node with several
Pythons the bridge installed under the wrong one used to fail with only "No module named
'..._ttp_cxx'" (docs/install.md says which Python to use)."""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.job.host import controller_abi
from bridge.job.host.controller import StartupError, load_controller_module

from .mindio_fakes import other_python_tag, working_package, wrong_python_package
from .processes import ROOT, reap, spawn_bridge

RUNNING = f"{platform.python_implementation()} {platform.python_version()}"


def _take_mindio_modules() -> dict[str, object]:
    taken = {n: m for n, m in sys.modules.items() if n == "mindio_ttp" or n.startswith("mindio_ttp.")}
    for name in taken:
        del sys.modules[name]
    return taken


@pytest.fixture
def on_path(tmp_path: Path) -> Iterator[Path]:
    """``tmp_path`` on sys.path for the test, with no ``mindio_ttp`` imported before (an
    earlier test's installed stub would answer the import) and none left after."""
    earlier = _take_mindio_modules()
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        _take_mindio_modules()
        sys.modules.update(earlier)  # type: ignore[arg-type]


def test_start_up_error_names_running_python_and_the_module_found(on_path: Path) -> None:
    compiled = wrong_python_package(on_path)
    _, built_for = other_python_tag()
    with pytest.raises(StartupError) as caught:
        load_controller_module("mindio_ttp.controller_ttp")
    message = str(caught.value)
    assert message.startswith("cannot import the MindIO TFT controller 'mindio_ttp.controller_ttp': "
                              "No module named 'mindio_ttp._ttp_cxx'")
    assert f"{compiled.name} (built for {built_for} {platform.machine()})" in message
    assert f"mindio_ttp at {on_path / 'mindio_ttp'}" in message
    assert f"this is {RUNNING} ({sys.executable}, extension tag cpython-" in message


def test_module_for_this_python_present_blames_nothing(on_path: Path) -> None:
    """A loadable compiled module next to a foreign one: the mismatch is not the cause,
    and the error must not send the operator after the wrong Python."""
    compiled = wrong_python_package(on_path)
    (compiled.parent / compiled.name.replace(other_python_tag()[0], controller_abi.running_python()
                                             .rsplit("extension tag ", 1)[1].rstrip(")"))).write_bytes(b"")
    assert controller_abi.mismatch(controller_abi.package_directory("mindio_ttp")) == ""


def test_not_installed_still_names_the_running_python() -> None:
    with pytest.raises(StartupError) as caught:
        load_controller_module("mindio_ttp_not_there.controller_ttp")
    assert f"(under {RUNNING} ({sys.executable}" in str(caught.value)
    assert "Install mindio_ttp" in str(caught.value)


def test_working_controller_loads(on_path: Path) -> None:
    init = working_package(on_path)
    assert load_controller_module("mindio_ttp.controller_ttp").__file__ == str(init)


def test_tags_are_read_from_file_names(tmp_path: Path) -> None:
    for name in ("_a.cpython-311-aarch64-linux-gnu.so", "_b.abi3.so", "libc_helper.so"):
        (tmp_path / name).write_bytes(b"")
    found = {m.path.name: m for m in controller_abi.compiled_modules(tmp_path)}
    assert found["_a.cpython-311-aarch64-linux-gnu.so"].built_for == "CPython 3.11 aarch64"
    assert found["_b.abi3.so"].tag == "abi3" and found["_b.abi3.so"].loadable
    assert found["libc_helper.so"].tag == "" and found["libc_helper.so"].loadable


def test_bridge_run_exits_1_naming_both_pythons(tmp_path: Path) -> None:
    """The daemon as systemd starts it, with the foreign build first on PYTHONPATH."""
    packages = tmp_path / "site"
    compiled = wrong_python_package(packages)
    config = tmp_path / "job.toml"
    config.write_text("""
job_id = "job-abi"
[clusterd]
address = "127.0.0.1:1"
[controller]
module = "mindio_ttp.controller_ttp"
[metrics]
port = 0
""")
    process = spawn_bridge("run", "--config", str(config),
                           env={"PYTHONPATH": f"{packages}{os.pathsep}{ROOT}"})
    try:
        output, _ = process.communicate(timeout=60)
    finally:
        reap(process)
    assert process.returncode == 1, output
    assert compiled.name in output and other_python_tag()[1] in output
    assert f"this is {RUNNING}" in output
