"""Which Python the MindIO TFT controller was built for, read from its files without importing it.

``compiled_modules`` lists the controller package's compiled modules with the CPython
version and machine each was built for; ``mismatch`` says, for the start-up error and
``tft-bridge --version``, "built for CPython 3.9, this is CPython 3.11" where a SWIG
module built for another interpreter would only fail with "No module named ...". The
package is found with ``importlib.util.find_spec`` on its top-level name, which executes
nothing (importing the controller registers an ``atexit`` destroy,
docs/mindio-controller.md section 1).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import platform
import re
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

#: The controller's top-level package (``mindio_ttp.controller_ttp`` lives in it).
PACKAGE = "mindio_ttp"

# _name.cpython-311-x86_64-linux-gnu.so, _name.abi3.so, _name.so
_TAG = re.compile(r"^[^.]+\.(?P<tag>[^.]+)\.so$")
_CPYTHON_TAG = re.compile(r"^cpython-(?P<major>\d)(?P<minor>\d+)(?P<flags>[a-z]*)-(?P<machine>[^-]+)-")
#: More compiled files than any controller build holds: the walk stays short on a
#: package directory that turns out to be something else.
_MAX_FILES = 200


@dataclass(frozen=True)
class CompiledModule:
    """One compiled extension file of the package and whether this Python can load it."""

    path: Path
    tag: str  # "cpython-39-x86_64-linux-gnu", "abi3", or "" for an untagged .so
    loadable: bool  # its suffix is one this interpreter imports

    @property
    def built_for(self) -> str:
        """The Python the tag names, e.g. "CPython 3.9 x86_64"; the tag itself otherwise."""
        match = _CPYTHON_TAG.match(self.tag)
        if match:
            return f"CPython {match['major']}.{match['minor']}{match['flags']} {match['machine']}"
        return self.tag or "an untagged .so"


def running_python() -> str:
    """This interpreter as an operator compares it with a build: "CPython 3.11.7
    (/usr/bin/python3, extension tag cpython-311-x86_64-linux-gnu)"."""
    soabi = sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag or "?"
    return f"{platform.python_implementation()} {platform.python_version()} ({sys.executable}, extension tag {soabi})"


def package_directory(package: str = PACKAGE) -> Path | None:
    """Where ``package`` would be imported from, found without executing it; None when
    it is not on ``sys.path`` (or its spec cannot even be found)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin).parent if spec.origin else None


def compiled_modules(directory: Path) -> list[CompiledModule]:
    """The compiled extension files under ``directory`` (the package), sorted by path."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    found: list[CompiledModule] = []
    try:
        for path in sorted(directory.rglob("*.so")):
            match = _TAG.match(path.name)
            found.append(CompiledModule(path, match["tag"] if match else "", _loadable(path.name, suffixes)))
            if len(found) >= _MAX_FILES:
                break
    except OSError:
        pass
    return found


def _loadable(name: str, suffixes: tuple[str, ...]) -> bool:
    """Whether this interpreter's import system can find a module in a file of this name:
    the name less one of its extension suffixes must be a bare module name. (``.so`` is
    one of them, so "ends with a suffix" alone would call every .so loadable.)"""
    return any(name.endswith(suffix) and "." not in name[: -len(suffix)] for suffix in suffixes)


def mismatch(directory: Path | None) -> str:
    """A sentence naming this Python and the package's compiled modules built for another
    one, or "" when there is none to blame (no package, or every module loadable)."""
    if directory is None:
        return ""
    modules = compiled_modules(directory)
    foreign = [m for m in modules if not m.loadable]
    if not foreign or any(m.loadable and m.tag for m in modules):
        return ""
    listed = ", ".join(f"{m.path.name} (built for {m.built_for})" for m in foreign[:4])
    more = f" and {len(foreign) - 4} more" if len(foreign) > 4 else ""
    return (f"{PACKAGE} at {directory} has compiled modules for another Python: {listed}{more}; "
            f"this is {running_python()}. Run the bridge under the Python {PACKAGE} was built for "
            "(install the bridge's wheel for that Python), or install a mindio_ttp built for this one")
