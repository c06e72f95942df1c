"""Starting a job's bridge so that it outlives the node service, and finding it again.

The controller cannot adopt running ranks (docs/mindio-controller.md section 4), so a
bridge that died with the node service would leave its job without fault tolerance.
Every bridge therefore runs outside the service's process tree, and is described by a
record in its job's state directory (``node.json``), which the next start of the service
reads to adopt it:

* ``systemd`` (where systemd runs and the service is root): a transient unit
  ``tft-bridge-job-<job id>.service`` per bridge (``systemd-run``) whose main process is
  the bridge itself, sandboxed as ``tft-bridge@.service`` is: its own cgroup, so a stop,
  restart or crash of ``tft-bridge-node.service`` leaves it alone; its output in the
  journal under its own identifier; systemd's watchdog on the bridge's own pings; its
  exit recorded by the unit's ``ExecStopPost=`` (``keeper.py --record-exit``).
* ``session`` (no systemd: containers, tests): the bridge under the keeper
  (``keeper.py``), a process in its own session, output appended to ``bridge.log`` in the
  state directory (set aside as ``bridge.log.1`` at a start that finds it over
  ``LOG_LIMIT``), identified by its pid *and* its start time (a pid alone is reused), with
  the boot id: after a reboot nothing is adopted.

Neither restarts a bridge by itself: the service decides (docs/node-service.md), and a
start of the service never restarts a running bridge.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Protocol

from bridge.core.state_dir import safe_component
from bridge.node.keeper import CHILD_FILE, EXIT_FILE, write_json
from bridge.node.procs import alive, boot_id, start_ticks

log = logging.getLogger("tft_bridge.node.launcher")

RECORD_FILE = "node.json"
LOG_FILE = "bridge.log"
#: A session bridge's log at its start past this size is kept as ``bridge.log.1`` (the one
#: before is dropped), so a job's directory holds at most two runs' worth beyond the limit.
LOG_LIMIT = 16 * 1024 * 1024
#: poll()'s answer for a bridge that ended without a recorded exit (killed with its keeper).
UNKNOWN_EXIT = -1
SYSTEMCTL_TIMEOUT = 10.0


@dataclass
class Record:
    """What the service knows of one running bridge; written before it is started."""

    job_id: str
    pod_uid: str
    namespace: str
    pod_name: str
    bind_ip: str
    port: int
    metrics_port: int
    launcher: str  # session or systemd
    unit: str = ""
    pid: int = 0  # the keeper's (session)
    start: int | None = None  # its start time in clock ticks since boot
    boot: str = ""
    started_at: float = 0.0

    @classmethod
    def load(cls, path: Path) -> Record | None:
        try:
            data = json.loads(path.read_text())
            known = {f.name for f in fields(cls)}
            return cls(**{k: v for k, v in data.items() if k in known})
        except (OSError, ValueError, TypeError) as error:
            log.warning("%s: unreadable bridge record (%s); not adopted", path, error)
            return None

    def save(self, directory: Path) -> None:
        write_json(directory / RECORD_FILE, asdict(self))


class BridgeProcess(Protocol):
    """One job's bridge as the service sees it, started or adopted; called on the service's loop."""
    record: Record

    def poll(self) -> int | None:
        """None while the bridge runs; else its exit code (128 + signal; UNKNOWN_EXIT)."""

    def terminate(self) -> None:
        """SIGTERM to the bridge: its own bounded stop follows (bridge/job/daemon.py)."""


class Launcher(Protocol):
    """Starts bridges outside the service's process tree, and adopts them from their record."""
    kind: str

    def start(self, directory: Path, record: Record, argv: Sequence[str]) -> BridgeProcess: ...

    def adopt(self, directory: Path, record: Record) -> BridgeProcess: ...


def read_exit(directory: Path) -> int:
    try:
        return int(json.loads((directory / EXIT_FILE).read_text())["code"])
    except (OSError, ValueError, KeyError, TypeError):
        return UNKNOWN_EXIT


def keeper_argv(directory: Path, argv: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "bridge.node.keeper", "--dir", str(directory), "--", *argv]


def _clear(directory: Path) -> None:
    for name in (EXIT_FILE, CHILD_FILE):
        (directory / name).unlink(missing_ok=True)


# --------------------------------------------------------------------------- session


class SessionBridge:
    """A bridge under its keeper, in a session of its own; ``popen`` None when adopted."""
    def __init__(self, directory: Path, record: Record, popen: subprocess.Popen[bytes] | None) -> None:
        self.directory = directory
        self.record = record
        self._popen = popen  # None: adopted, not our child

    def _child(self) -> tuple[int, int | None]:
        """The bridge of *this* record's keeper (child.json names its keeper): a later
        start in the same directory rewrites the file, and must never be taken for it."""
        try:
            data = json.loads((self.directory / CHILD_FILE).read_text())
            if int(data.get("keeper") or 0) != self.record.pid:
                return 0, None
            return int(data["pid"]), data.get("start")
        except (OSError, ValueError, KeyError, TypeError):
            return 0, None

    def poll(self) -> int | None:
        if self._popen is not None:
            if self._popen.poll() is None:
                return None
        elif self.record.boot == boot_id() and (alive(self.record.pid, self.record.start) or alive(*self._child())):
            return None  # the keeper runs, or its bridge still does although the keeper was killed
        return read_exit(self.directory)

    def terminate(self) -> None:
        if self._popen is not None and self._popen.poll() is None:
            self._popen.send_signal(signal.SIGTERM)
            return
        if self.record.boot != boot_id():
            return
        for pid, ticks in ((self.record.pid, self.record.start), self._child()):
            if alive(pid, ticks):
                try:
                    os.kill(pid, signal.SIGTERM)
                except OSError:
                    pass
                return


def rotate_log(path: Path, limit: int = LOG_LIMIT) -> None:
    """``path`` set aside as ``<path>.1`` when it is over ``limit`` bytes."""
    try:
        if path.stat().st_size > limit:
            os.replace(path, path.with_name(path.name + ".1"))
    except FileNotFoundError:
        pass


class SessionLauncher:
    """Bridges as processes in their own sessions (no systemd)."""

    kind = "session"

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self._env = dict(env) if env is not None else None

    def start(self, directory: Path, record: Record, argv: Sequence[str]) -> SessionBridge:
        _clear(directory)
        rotate_log(directory / LOG_FILE)
        with open(directory / LOG_FILE, "ab") as output:
            popen = subprocess.Popen(keeper_argv(directory, argv), stdin=subprocess.DEVNULL, stdout=output,
                                     stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                                     cwd=directory, env=self._env)
        record.launcher, record.pid, record.start = self.kind, popen.pid, start_ticks(popen.pid)
        record.boot, record.started_at = boot_id(), time.time()
        record.save(directory)
        return SessionBridge(directory, record, popen)

    def adopt(self, directory: Path, record: Record) -> SessionBridge:
        return SessionBridge(directory, record, None)


# --------------------------------------------------------------------------- systemd


def unit_name(job_id: str) -> str:
    return f"tft-bridge-job-{safe_component(job_id)}.service"


#: The transient unit's properties: systemd/tft-bridge@.service's contract (notify, the
#: watchdog on the bridge's own pings, the stop bound, the limits) and its sandbox, less
#: what the node service decides itself (Restart=no: it restarts by the exit code) and the
#: directories it names per job (``SystemdLauncher.command``). The bridge is the unit's
#: main process, as in tft-bridge@.service, so ``NotifyAccess=main`` lets it, and only it,
#: report READY and feed the watchdog.
UNIT_PROPERTIES = (
    "Type=notify", "NotifyAccess=main", "WatchdogSec=30s", "TimeoutStartSec=90s", "TimeoutStopSec=75s",
    "KillMode=mixed", "KillSignal=SIGTERM", "Restart=no", "LimitNOFILE=131072", "LimitRTPRIO=1",
    "Environment=PYTHONUNBUFFERED=1", "DynamicUser=yes", "User=tft-bridge", "UMask=0077",
    "NoNewPrivileges=yes", "CapabilityBoundingSet=", "AmbientCapabilities=", "ProtectSystem=strict",
    "ProtectHome=yes", "PrivateTmp=yes", "PrivateMounts=yes", "PrivateDevices=yes", "PrivateUsers=yes",
    "ProtectKernelTunables=yes", "ProtectKernelModules=yes", "ProtectKernelLogs=yes", "ProtectControlGroups=yes",
    "ProtectClock=yes", "ProtectHostname=yes", "ProtectProc=invisible",
    "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6", "RestrictNamespaces=yes", "RestrictRealtime=no",
    "RestrictSUIDSGID=yes", "LockPersonality=yes", "RemoveIPC=yes", "SystemCallArchitectures=native",
    "SystemCallFilter=@system-service", "SystemCallFilter=~@privileged @resources",
    "SystemCallFilter=sched_setscheduler sched_setaffinity", "SystemCallErrorNumber=EPERM",
)
#: Paths a transient unit's sandbox hides from the bridge: the setting, and what it hides.
HIDDEN_BY_SANDBOX = (("PrivateTmp=yes", ("/tmp", "/var/tmp")), ("ProtectHome=yes", ("/root", "/home", "/run/user")))


def hidden_by(path: str | os.PathLike[str], hidden: Sequence[tuple[str, Sequence[str]]] = HIDDEN_BY_SANDBOX) -> str:
    """The sandbox setting under which ``path`` (resolved) is not the host's, or ""."""
    resolved = os.path.realpath(path)
    for setting, prefixes in hidden:
        for prefix in prefixes:
            if resolved == prefix or resolved.startswith(prefix + "/"):
                return f"{setting} (it hides {prefix})"
    return ""


def sandbox_problems(paths: Mapping[str, str | os.PathLike[str]]) -> list[str]:
    """One line per path a bridge's unit (and the node service's own) cannot see as the
    host's: ``paths`` maps what the path is (``node.state_root``) to the path."""
    problems = []
    for what, path in paths.items():
        setting = hidden_by(path)
        if setting:
            problems.append(f"{what} {path} is hidden from the units by {setting}: a bridge there would fail to "
                            f"start (status=226/NAMESPACE or 203/EXEC) with no message of its own; use a path "
                            f"outside /tmp, /var/tmp, /root, /home and /run/user (for example "
                            f"/var/lib/tft-bridge/node for the state, /opt/tft-bridge/venv for the venv)")
    return problems


#: The service's own notification variables: never handed to systemctl or systemd-run,
#: whose messages on the service's socket systemd would take for the service's (or
#: refuse, logging "Got notification message from PID ...").
OWN_NOTIFY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def tool_env() -> dict[str, str]:
    """The environment for systemctl and systemd-run: the service's, less ``OWN_NOTIFY_ENV``."""
    return {key: value for key, value in os.environ.items() if key not in OWN_NOTIFY_ENV}


class SystemdBridge:
    """A bridge as a transient unit; its state read with ``systemctl is-active``, its exit from ``exit.json``."""
    def __init__(self, directory: Path, record: Record, systemctl: str) -> None:
        self.directory = directory
        self.record = record
        self._systemctl = systemctl

    def poll(self) -> int | None:
        try:
            result = subprocess.run([self._systemctl, "is-active", self.record.unit], capture_output=True,
                                    env=tool_env(), text=True, timeout=SYSTEMCTL_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired) as error:
            log.warning("systemctl is-active %s failed (%s); taken as running", self.record.unit, error)
            return None
        state = result.stdout.strip()
        if state in ("active", "activating", "deactivating", "reloading", "refreshing"):
            return None
        return read_exit(self.directory)

    def terminate(self) -> None:
        try:
            subprocess.run([self._systemctl, "stop", "--no-block", self.record.unit], capture_output=True,
                           env=tool_env(), timeout=SYSTEMCTL_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired) as error:
            log.error("systemctl stop %s failed: %s", self.record.unit, error)


class SystemdLauncher:
    """Bridges as transient systemd units (``systemd-run``)."""

    kind = "systemd"

    def __init__(self, env: Mapping[str, str] | None = None, systemd_run: str = "systemd-run",
                 systemctl: str = "systemctl") -> None:
        self._env = dict(env or {})
        self._systemd_run = systemd_run
        self._systemctl = systemctl

    def command(self, directory: Path, record: Record, argv: Sequence[str]) -> list[str]:
        """The bridge itself is the unit's main process (systemd watches it, signals it and
        reaps it); ``ExecStopPost=`` records its exit in ``exit.json`` (the unit is unloaded
        when it ends: ``--collect``). The job directory is handed to the unit's dynamic
        user as it starts (``+``: that one command runs as root, outside the sandbox)."""
        name = safe_component(record.job_id)
        where = shlex.quote(str(directory))
        command = [self._systemd_run, "--no-block", "--collect", f"--unit={record.unit}",
                   f"--description=tft-bridge for job {record.job_id} ({record.namespace}/{record.pod_name})",
                   f"--property=WorkingDirectory={directory}", f"--property=ReadWritePaths={directory}",
                   f"--property=RuntimeDirectory=tft-bridge/job-{name}",
                   f"--property=SyslogIdentifier=tft-bridge-job-{name}",
                   f"--property=ExecStartPre=+/bin/chown -R tft-bridge:tft-bridge {where}",
                   "--property=ExecStopPost=" + shlex.join([sys.executable, "-m", "bridge.node.keeper", "--dir",
                                                            str(directory), "--record-exit"])]
        command += [f"--property={p}" for p in UNIT_PROPERTIES]
        command += [f"--setenv={k}={v}" for k, v in sorted(self._env.items())]
        return [*command, "--", *argv]

    def start(self, directory: Path, record: Record, argv: Sequence[str]) -> SystemdBridge:
        _clear(directory)
        record.launcher, record.unit = self.kind, unit_name(record.job_id)
        record.boot, record.started_at = boot_id(), time.time()
        subprocess.run([self._systemctl, "reset-failed", record.unit], capture_output=True, env=tool_env(),
                       timeout=SYSTEMCTL_TIMEOUT)
        record.save(directory)
        result = subprocess.run(self.command(directory, record, argv), capture_output=True, text=True, env=tool_env(),
                                timeout=SYSTEMCTL_TIMEOUT)
        if result.returncode != 0:
            raise OSError(f"systemd-run {record.unit} failed: {result.stderr.strip()[:300]}")
        return SystemdBridge(directory, record, self._systemctl)

    def adopt(self, directory: Path, record: Record) -> SystemdBridge:
        return SystemdBridge(directory, record, self._systemctl)


def choose_launcher(kind: str, env: Mapping[str, str] | None = None) -> Launcher:
    """``auto``: systemd when it is the init system and the service may use it (root)."""
    if kind == "auto":
        kind = "systemd" if Path("/run/systemd/system").is_dir() and os.geteuid() == 0 \
            and shutil.which("systemd-run") else "session"
    if kind == "systemd":
        return SystemdLauncher(env)
    return SessionLauncher(env)


def adopt_launcher(record: Record, current: Launcher, env: Mapping[str, str] | None = None) -> Launcher:
    """The launcher a record was started with (a bridge keeps its kind across upgrades)."""
    if record.launcher == current.kind:
        return current
    return SystemdLauncher(env) if record.launcher == "systemd" else SessionLauncher(env)


def records(state_root: Path) -> list[tuple[Path, Record]]:
    found = []
    if not state_root.is_dir():
        return found
    for directory in sorted(state_root.iterdir()):
        path = directory / RECORD_FILE
        if path.is_file():
            record = Record.load(path)
            if record is not None:
                found.append((directory, record))
    return found

