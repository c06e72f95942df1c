"""Fake ``mindio_ttp`` packages on disk, shaped like the real one (docs/mindio-controller.md
section 1): a package whose ``controller_ttp`` imports a compiled SWIG module.

The real compiled module is built for one CPython version and machine; a Python of another
version does not even see ``_ttp_cxx.cpython-39-x86_64-linux-gnu.so`` and the import fails
with "No module named ...". ``wrong_python_package`` reproduces exactly that with a file of
the real name pattern (its bytes are never loaded, as they would not be for the real one).
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

CONTROLLER_INIT = """
import os
import mindio_ttp._ttp_cxx  # the SWIG module: fails when built for another Python
"""

WORKING_CONTROLLER_INIT = """
import os
marker = os.environ.get("FAKE_MINDIO_IMPORT_MARKER")
if marker:  # which process imported the controller (the version report must not)
    with open(marker, "a") as f:
        f.write(f"{os.getpid()}\\n")
def tft_register_mindx_callback(action, func):
    return 0
"""


def other_python_tag() -> tuple[str, str]:
    """A CPython extension tag for this machine but another minor version, and the
    "CPython 3.N" it names."""
    minor = 9 if sys.version_info[:2] != (3, 9) else 8
    return f"cpython-3{minor}-{platform.machine()}-linux-gnu", f"CPython 3.{minor}"


def wrong_python_package(base: Path) -> Path:
    """``base/mindio_ttp`` whose compiled module is for another CPython; returns the .so."""
    package = base / "mindio_ttp"
    (package / "controller_ttp").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "controller_ttp" / "__init__.py").write_text(CONTROLLER_INIT)
    tag, _ = other_python_tag()
    compiled = package / f"_ttp_cxx.{tag}.so"
    compiled.write_bytes(b"\x7fELF not really a shared object")
    return compiled


def working_package(base: Path) -> Path:
    """``base/mindio_ttp`` whose controller imports; returns the controller's __init__.py."""
    package = base / "mindio_ttp"
    (package / "controller_ttp").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    init = package / "controller_ttp" / "__init__.py"
    init.write_text(WORKING_CONTROLLER_INIT)
    return init


def crashing_package(base: Path) -> None:
    """``base/mindio_ttp`` whose controller kills the interpreter while importing (as a
    SWIG module built against another libstdc++ can)."""
    package = base / "mindio_ttp"
    (package / "controller_ttp").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "controller_ttp" / "__init__.py").write_text(
        "import os, sys\nsys.stderr.write('Fatal: simulated crash in the SWIG module\\n')\nos._exit(134)\n")
