"""``tft-bridge --version`` as an operator runs it: a real process, its report line by line."""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

import bridge
import bridge.faults

from .mindio_fakes import crashing_package, other_python_tag, working_package, wrong_python_package

pytestmark = pytest.mark.timeout(90)


def version(*, pythonpath: Path | None = None, env: dict[str, str] | None = None,
            code: str | None = None) -> dict[str, str]:
    """The report of a real ``python -m bridge.cli --version`` (or ``python -c CODE``),
    run from a directory without a ``bridge`` of its own, as {first word: rest of line}."""
    environment = {k: v for k, v in os.environ.items() if k not in ("BRIDGE_NO_EXTENSIONS", "PYTHONPATH")}
    # The package under test wherever it is imported from (a source tree, an installed wheel).
    paths = [str(pythonpath)] if pythonpath else []
    paths.append(str(Path(bridge.__file__).resolve().parent.parent))
    environment["PYTHONPATH"] = os.pathsep.join(paths)
    environment.update(env or {})
    command = [sys.executable, "-c", code] if code else [sys.executable, "-m", "bridge.cli", "--version"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, env=environment, cwd="/")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"tft-bridge {bridge.__version__}"
    return {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in lines[1:]}


def test_report_names_codec_python_and_platform() -> None:
    report = version()
    if bridge.faults.IMPLEMENTATION == "c":
        assert report["codec"].startswith("compiled (") and "faults/_c." in report["codec"]
    else:
        assert report["codec"].startswith("pure Python (") and "reason unknown" not in report["codec"]
    python = report["python"]
    assert python.startswith(f"{platform.python_implementation()} {platform.python_version()} (")
    assert sys.executable in python
    assert f"cpython-{sys.version_info[0]}{sys.version_info[1]}" in python
    assert platform.machine() in report["platform"]
    libc, libc_version = platform.libc_ver()
    assert f"{libc} {libc_version}" in report["platform"]
    if importlib.util.find_spec("mindio_ttp") is None:  # a node with the real controller reports it instead
        assert report["mindio_ttp"] == "not installed for this Python (not found on sys.path)"


def test_pure_python_because_forced_says_so() -> None:
    report = version(env={"BRIDGE_NO_EXTENSIONS": "1"})
    assert report["codec"] == "pure Python (BRIDGE_NO_EXTENSIONS='1' is set)"


@pytest.mark.c_extension
def test_pure_python_because_the_extension_failed_names_its_error() -> None:
    """The compiled module is present but cannot load (a wheel for another machine, a
    broken copy): the report carries the import error, not only "python"."""
    code = """
import sys
class Broken:
    def find_spec(self, name, path=None, target=None):
        if name == "bridge.faults._c":
            raise ImportError("undefined symbol: PyFake_Missing (simulated)")
sys.meta_path.insert(0, Broken())
import warnings
warnings.simplefilter("ignore")
from bridge.cli import main
main(["--version"])
"""
    report = version(code=code)
    assert report["codec"] == ("pure Python (the compiled codec bridge.faults._c failed to import: "
                               "undefined symbol: PyFake_Missing (simulated))")


def test_controller_that_imports_is_reported_with_its_file_and_not_imported_here(tmp_path: Path) -> None:
    init = working_package(tmp_path)
    marker = tmp_path / "imported-by"
    code = f"""
import os, sys
from bridge.cli import main
try:
    main(["--version"])
finally:
    print("reporter-pid:", os.getpid())
    print("in-reporter:", "mindio_ttp.controller_ttp" in sys.modules)
"""
    report = version(pythonpath=tmp_path, env={"FAKE_MINDIO_IMPORT_MARKER": str(marker)}, code=code)
    assert report["mindio_ttp"] == f"mindio_ttp.controller_ttp imports, from {init}"
    importers = marker.read_text().split()
    assert len(importers) == 1 and importers[0] != report["reporter-pid"]  # a child imported it
    assert report["in-reporter"] == "False"


def test_controller_built_for_another_python_names_both(tmp_path: Path) -> None:
    compiled = wrong_python_package(tmp_path)
    _, built_for = other_python_tag()
    line = version(pythonpath=tmp_path)["mindio_ttp"]
    assert line.startswith(f"found at {tmp_path / 'mindio_ttp'}, but mindio_ttp.controller_ttp does not import: "
                           "ModuleNotFoundError: No module named 'mindio_ttp._ttp_cxx'")
    assert f"{compiled.name} (built for {built_for} {platform.machine()})" in line
    assert f"this is {platform.python_implementation()} {platform.python_version()}" in line


def test_controller_whose_import_kills_the_interpreter_is_reported(tmp_path: Path) -> None:
    """The report survives it (the import ran in a child) and says how the child ended."""
    crashing_package(tmp_path)
    line = version(pythonpath=tmp_path)["mindio_ttp"]
    assert line == (f"found at {tmp_path / 'mindio_ttp'}, but importing mindio_ttp.controller_ttp killed the "
                    "interpreter (exit 134: Fatal: simulated crash in the SWIG module)")
