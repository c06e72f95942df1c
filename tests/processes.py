"""Running the bridge as a real process in a test, and never leaving one behind.

Shared because the tests that need a real process (SIGTERM, SIGKILL, exit codes, a hung
destroy: things an in-process bridge cannot show) each wrote the same launch and the same
clean-up, and a copy that forgets the clean-up leaks a bridge holding its ports into every
later test of the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def spawn_bridge(*argv: str, code: str | None = None, env: dict[str, str] | None = None,
                 quiet: bool = False, stdin: int | None = None) -> subprocess.Popen[str]:
    """``python -m bridge.cli ARGV`` (or ``python -c CODE ARGV``) from the repository root,
    with the repository on PYTHONPATH (``code`` may import ``tests.*``) and stdout and
    stderr merged into one text pipe, or thrown away with ``quiet``: a process whose
    output nobody reads must not write into a pipe, it would block once the pipe is full.
    ``stdin=subprocess.PIPE`` gives the test a pipe to command the process through."""
    command = [sys.executable, "-c", code] if code is not None else [sys.executable, "-m", "bridge.cli"]
    output = subprocess.DEVNULL if quiet else subprocess.PIPE
    return subprocess.Popen([*command, *argv], cwd=ROOT, stdin=stdin, stdout=output, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def reap(*processes: subprocess.Popen[str] | None) -> None:
    """Kill whichever of ``processes`` still runs and collect it (for a ``finally``: a test
    that failed half-way leaves no process, no port and no pipe behind)."""
    for process in processes:
        if process is not None and process.poll() is None:
            process.kill()
            process.communicate()
