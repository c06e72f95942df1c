"""``tft-bridge --version``: what an operator pastes into a ticket.

``report()`` returns its text: the release, the codec in use (and why not the compiled
one), the interpreter and machine, and whether ``mindio_ttp.controller_ttp`` imports and
from where. The controller is imported only in a child interpreter bounded by
``PROBE_TIMEOUT``, never in this process (importing it registers an ``atexit`` destroy,
docs/mindio-controller.md section 1); this process locates it with ``find_spec``, which
executes nothing.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys

from bridge._version import __version__
from bridge.job.host import controller_abi
from bridge import faults as codec

#: The child import of the controller: a real one finishes in well under a second; a
#: hang (a broken shared library, a lock) must not hang ``--version``.
PROBE_TIMEOUT = 20.0

CONTROLLER_MODULE = "mindio_ttp.controller_ttp"

_PROBE = """
import json, sys
name = sys.argv[1]
sys.path[:] = json.loads(sys.argv[2])  # the reporting process's path: the same mindio_ttp
try:
    module = __import__(name, fromlist=["_"])
except BaseException as error:  # SystemExit too: report it, never die without a line
    print(json.dumps({"ok": False, "error": f"{type(error).__name__}: {error}"}))
else:
    print(json.dumps({"ok": True, "file": getattr(module, "__file__", None) or "?"}))
"""


def codec_line() -> str:
    if codec.IMPLEMENTATION == "c":
        return f"codec: compiled ({codec._impl.__file__})"
    return f"codec: pure Python ({codec.FALLBACK_REASON or 'reason unknown'})"


def python_line() -> str:
    return f"python: {controller_abi.running_python()}"


def platform_line() -> str:
    libc, libc_version = platform.libc_ver()
    libc_text = f"{libc} {libc_version}" if libc else "libc unknown (not glibc?)"
    return f"platform: {platform.system()} {platform.release()} {platform.machine()}, {libc_text}"


def controller_line(module: str = CONTROLLER_MODULE, timeout: float = PROBE_TIMEOUT) -> str:
    """Whether the controller imports (in a child interpreter), from where, and, when it
    does not, whether its compiled modules were built for another Python."""
    package = module.partition(".")[0]
    directory = controller_abi.package_directory(package)
    if directory is None:
        return f"{package}: not installed for this Python (not found on sys.path)"
    try:
        probe = subprocess.run([sys.executable, "-c", _PROBE, module, json.dumps(sys.path)],
                               capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"{package}: found at {directory}, but importing {module} did not finish within {timeout:.0f} s"
    except OSError as error:
        return f"{package}: found at {directory}; the import probe could not run ({error})"
    try:
        # The last line: the controller's own import may print before it.
        result = json.loads(probe.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        # No report at all: the interpreter died in the import (a crash in the SWIG module).
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return (f"{package}: found at {directory}, but importing {module} killed the interpreter "
                f"(exit {probe.returncode}: {last})")
    if result["ok"]:
        return f"{package}: {module} imports, from {result['file']}"
    line = f"{package}: found at {directory}, but {module} does not import: {result['error']}"
    wrong_python = controller_abi.mismatch(directory)
    return f"{line}. {wrong_python}" if wrong_python else line


def report() -> str:
    return "\n".join([f"tft-bridge {__version__}", codec_line(), python_line(), platform_line(), controller_line()])
