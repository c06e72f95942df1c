"""``python -m bridge.node.keeper --dir DIR -- COMMAND...``: run one job's bridge and
record how it ended in ``DIR/exit.json``; ``--dir DIR --record-exit``: only record it, from
the ``$EXIT_CODE``/``$EXIT_STATUS`` systemd gives an ``ExecStopPost=`` command.

Why a keeper: the bridge must outlive the node service (the controller cannot adopt
running ranks), so the service is often not the bridge's parent and cannot ``wait`` for
its exit code; yet what happens next depends on that code (75 and 76 get a fresh bridge,
2 never does, docs/node-service.md). The keeper is the bridge's parent for its whole
life, in the same session and unit; it forwards SIGTERM, SIGINT and SIGHUP to the
bridge, writes the bridge's pid and start time (``child.json``, so a bridge whose keeper
was killed is still recognised) and, at the end, its exit (``exit.json``, atomically),
then exits with the same code (128 + signal for a bridge killed by a signal).

Under systemd (the ``systemd`` launcher) no keeper process runs: the bridge is the
unit's main process, so it is the process systemd watches (``WATCHDOG_PID``, its pings,
its SIGTERM), and systemd, its parent, hands its exit to ``--record-exit`` run as the
unit's ``ExecStopPost=``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bridge.core.files import write_atomically
from bridge.node.procs import start_ticks

EXIT_FILE = "exit.json"
CHILD_FILE = "child.json"


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomic: a reader sees the old file or the whole new one."""
    write_atomically(path, json.dumps(data), mode=0o644)


def exit_from_systemd(env: Mapping[str, str]) -> tuple[int, int] | None:
    """(code, signal) from an ``ExecStopPost=`` command's environment (systemd.exec(5):
    ``EXIT_CODE`` is exited, killed or dumped; ``EXIT_STATUS`` the status or the signal's
    name); None when the main process never ran (no ``EXIT_CODE``)."""
    kind, status = env.get("EXIT_CODE", ""), env.get("EXIT_STATUS", "")
    if kind == "exited" and status.isdigit():
        return int(status), 0
    if kind in ("killed", "dumped"):
        try:
            number = int(status) if status.isdigit() else int(signal.Signals["SIG" + status.removeprefix("SIG")])
        except KeyError:
            return None
        return 128 + number, number
    return None


def record_exit(directory: Path, env: Mapping[str, str]) -> int:
    """Write ``exit.json`` from systemd's account of the main process; always 0 (an
    ``ExecStopPost=`` failure would only add noise to the unit's result)."""
    found = exit_from_systemd(env)
    if found is not None:
        code, signum = found
        write_json(directory / EXIT_FILE, {"code": code, "signal": signum, "at": time.time(),
                                           "result": env.get("SERVICE_RESULT", "")})
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bridge.node.keeper")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--record-exit", action="store_true",
                        help="record the exit systemd reports to an ExecStopPost= command, and run nothing")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.record_exit:
        return record_exit(Path(args.dir), os.environ)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command")
    directory = Path(args.dir)
    (directory / EXIT_FILE).unlink(missing_ok=True)
    pending: list[int] = []
    children: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, _frame: object) -> None:
        if not children:
            pending.append(signum)  # before the bridge exists: delivered once it does
            return
        try:
            children[0].send_signal(signum)
        except OSError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    children.append(child)
    for signum in pending:
        child.send_signal(signum)
    write_json(directory / CHILD_FILE, {"pid": child.pid, "start": start_ticks(child.pid), "keeper": os.getpid()})
    returncode = child.wait()
    code = 128 - returncode if returncode < 0 else returncode
    write_json(directory / EXIT_FILE, {"code": code, "signal": -returncode if returncode < 0 else 0,
                                       "pid": child.pid, "at": time.time()})
    return code


if __name__ == "__main__":
    sys.exit(main())
