"""The real peers as test fixtures: ClusterD's service code, a real MindIO TFT build, ranks.

A simulation earns trust only by failing where the real peer fails, so the conformance
tier runs the bridge between the real programs of ``real-peers/`` (its README): the
ClusterD harness (ClusterD's unmodified Recover/config/Fault services over a fake
Kubernetes, with an HTTP control API), the real controller (``mindio_ttp`` 7.3.0, for
CPython 3.11) hosted by either entry point, and ``fake_rank.py`` ranks on the real
processor library. Everything here is a child process in its own process group, killed
(the group) when the test ends, pass or fail; every wait polls with a deadline.

The parts, each usable alone (the sim-vs-real differential and the real-hop benchmark
build on them):

* ``ClusterDHarness``: either binary on loopback, its log kept with receive times,
  ``wait_log``, the control API (``state``, ``post``), ``kill`` (-9) and ``restart`` on
  the same port.
* ``BridgeDaemon`` (``tft-bridge run`` hosting the real controller) and
  ``SeedLauncher`` (a launcher on the seed API, tests/conformance/seed_launcher.py,
  hosting it itself): one ``Entry`` interface.
* ``Ranks``: fake ranks started, killed, restarted with ``RESTARTED=1``.
* ``NodeAgent``: MindCluster's node agent, as far as a process-level recovery needs it:
  restarts the ranks ClusterD names in ``write configmap faultList success``.
* ``transcript``: what happened, in order, from ClusterD's log, the controller's log and
  the bridge's flight recorder (tests/conformance/transcript.py), in a format a run
  against ``sim-clusterd`` and the stub controller can be put in too.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from bridge.sim.scenario import free_port

from ..conftest import eventually_sync
from ..processes import ROOT

#: Where to get the real peers, said once when the tier is skipped.
WHERE = ("the real peers (ClusterD harness, MindIO TFT build, fake_rank.py) were not found: they are "
         "built outside this repository (nothing of theirs is committed here; docs/testing.md, 'The "
         "conformance tier') and found through TFT_BRIDGE_REAL_PEERS, the directory holding bin/clusterd-harness")
#: The CPython the MindIO build was made for (its compiled modules are per version).
MINDIO_PYTHON = (3, 11)
#: The release each harness binary carries, by file name.
BINARIES = {"master": "bin/clusterd-harness", "7.3.2": "bin/clusterd-harness-v7.3.2"}
#: The ClusterD log line that closes a cycle (its state path), per release: the reset
#: function logs it (master controller.go:225, v7.3.2 :219).
CYCLE_CLOSE_LINE = {"master": 225, "7.3.2": 219}


def find_real_peers() -> Path | None:
    """``TFT_BRIDGE_REAL_PEERS``, else the first ``shared/real-peers`` found walking up from
    the repository root (``../shared/real-peers`` of a clone beside it, and of a worktree
    one level further down). None when neither holds the harness."""
    named = os.environ.get("TFT_BRIDGE_REAL_PEERS")
    candidates = [Path(named)] if named else [parent / "shared" / "real-peers" for parent in ROOT.parents]
    for candidate in candidates:
        if (candidate / BINARIES["master"]).is_file():
            return candidate.resolve()
    return None


def unavailable() -> str | None:
    """Why the tier cannot run here (one line), or None when it can."""
    peers = find_real_peers()
    if peers is None:
        return WHERE
    if sys.version_info[:2] != MINDIO_PYTHON:
        return (f"the real MindIO TFT build needs CPython {MINDIO_PYTHON[0]}.{MINDIO_PYTHON[1]}, this is "
                f"{sys.version_info[0]}.{sys.version_info[1]}: run the tier under 3.11")
    if not (peers / "mindio" / "mindio_ttp").is_dir() or not (peers / "fake_rank.py").is_file():
        return f"{peers} has no mindio/mindio_ttp or fake_rank.py: {WHERE}"
    return None


# --------------------------------------------------------------------------- processes
def _kill_group(process: subprocess.Popen[Any] | None, sig: int = signal.SIGKILL) -> None:
    if process is None or process.poll() is not None:
        return
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def _reap(process: subprocess.Popen[Any] | None, timeout: float = 10.0) -> int | None:
    """Kill the process's group (it was started in a session of its own) and collect it."""
    if process is None:
        return None
    _kill_group(process)
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


@dataclass
class LogLine:
    at: float  # time.monotonic() when the line was read
    text: str
    source: str = ""


class LogTail:
    """The lines a child process writes, kept with the monotonic time each was read (a
    reader thread per stream; the list is appended there and read by the test: guarded
    by ``_lock``). One tail can follow several processes in turn (a ClusterD restarted)."""

    def __init__(self, path: Path | None = None) -> None:
        self._lock = threading.Lock()
        self._lines: list[LogLine] = []
        self._file: IO[str] | None = path.open("a", encoding="utf-8") if path is not None else None
        self._readers: list[threading.Thread] = []

    def follow(self, stream: IO[str], source: str = "") -> None:
        reader = threading.Thread(target=self._read, args=(stream, source), daemon=True, name=f"tail-{source}")
        reader.start()
        self._readers.append(reader)

    def _read(self, stream: IO[str], source: str) -> None:
        for raw in stream:
            line = LogLine(time.monotonic(), raw.rstrip("\n"), source)
            with self._lock:
                self._lines.append(line)
                if self._file is not None:
                    self._file.write(f"{line.at:.6f} {source} {line.text}\n")
        stream.close()

    def mark(self) -> int:
        """An index: ``wait_for(..., after=mark)`` only sees lines written from now on."""
        with self._lock:
            return len(self._lines)

    def lines(self, after: int = 0) -> list[LogLine]:
        with self._lock:
            return self._lines[after:]

    def find(self, pattern: str | re.Pattern[str], after: int = 0) -> list[tuple[int, re.Match[str]]]:
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        found = []
        for index, line in enumerate(self.lines(after), start=after):
            match = regex.search(line.text)
            if match:
                found.append((index, match))
        return found

    def wait_for(self, pattern: str | re.Pattern[str], after: int = 0, timeout: float = 30.0,
                 what: str | None = None) -> tuple[int, re.Match[str]]:
        """The first line from ``after`` on matching ``pattern`` (its index and match)."""
        return eventually_sync(lambda: next(iter(self.find(pattern, after)), None), timeout,
                               what or f"a log line matching {getattr(pattern, 'pattern', pattern)!r}")

    def close(self, timeout: float = 5.0) -> None:
        for reader in self._readers:
            reader.join(timeout)
        if self._file is not None:
            with self._lock:
                self._file.close()
                self._file = None

    def text(self) -> str:
        return "\n".join(f"{line.at:.3f} {line.source} {line.text}" for line in self.lines())


#: Every process group started here and maybe still running: what ``kill_all`` ends when
#: the test process itself is stopped (CI's stage budget SIGTERMs it, and a process
#: group of its own escapes that signal). Guarded by ``_spawned_lock``.
_spawned: list[subprocess.Popen[str]] = []
_spawned_lock = threading.Lock()


def _spawn(argv: Sequence[str], env: dict[str, str], cwd: Path, tail: LogTail, source: str) -> subprocess.Popen[str]:
    with _spawned_lock:
        process = subprocess.Popen(list(argv), cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
        _spawned[:] = [p for p in _spawned if p.poll() is None] + [process]
    assert process.stdout is not None
    tail.follow(process.stdout, source)
    return process


def kill_all() -> None:
    """SIGKILL every process group started here that still runs."""
    with _spawned_lock:
        processes = list(_spawned)
    for process in processes:
        _kill_group(process)


def kill_all_on_sigterm() -> None:
    """When this test process is sent SIGTERM, kill every peer it started, then die of
    the signal as it would have: no ClusterD, controller or rank outlives a stopped run."""
    def handler(signum: int, frame: object) -> None:
        kill_all()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, handler)


# --------------------------------------------------------------------------- ClusterD
@dataclass
class HarnessOptions:
    """The flags of one ClusterD harness (real-peers README, "ClusterD")."""

    job_uid: str = "conformance-job-1"
    nodes: int = 2
    devs: int = 2
    strategies: str = "retry,recover,dump"
    keepalive: int = 1
    annotations: dict[str, str] = field(default_factory=dict)
    platform: str | None = None  # -platform: the PodGroup's ProcessRecoverStrategy annotation
    plat_result: str | None = None  # -plat-result: its ProcessResultFault annotation
    mindio_wait: int | None = None
    release: str = "master"

    @property
    def world_size(self) -> int:
        return self.nodes * self.devs

    def argv(self, binary: Path, port: int, ctl_port: int) -> list[str]:
        argv = [str(binary), "-addr", f"127.0.0.1:{port}", "-job-uid", self.job_uid, "-nodes", str(self.nodes),
                "-devs", str(self.devs), "-strategies", self.strategies, "-keepalive", str(self.keepalive),
                "-ctl", f"127.0.0.1:{ctl_port}"]
        if self.annotations:
            argv += ["-anno", ",".join(f"{k}={v}" for k, v in self.annotations.items())]
        if self.platform is not None:
            argv += ["-platform", self.platform]
        if self.plat_result is not None:
            argv += ["-plat-result", self.plat_result]
        if self.mindio_wait is not None:
            argv += ["-mindio-wait", str(self.mindio_wait)]
        return argv


LISTENING = re.compile(r"^HARNESS listening (127\.0\.0\.1:(\d+))")


class ClusterDHarness:
    """One ClusterD harness process, restartable on the same port (it keeps no state on
    disk: kill -9 and a restart is a ClusterD restart). Its log, across restarts, is
    ``log`` (lines with the time they were read)."""

    def __init__(self, peers: Path, options: HarnessOptions, workdir: Path, *, port: int = 0) -> None:
        self.binary = peers / BINARIES[options.release]
        self.options = options
        self.workdir = workdir
        self.port = port  # 0 until the first `listening` line: then the one every restart reuses
        self.ctl_port = free_port()  # the control API prints no port it picked, so one is chosen here
        self.log = LogTail(workdir / "clusterd.log")
        self.process: subprocess.Popen[str] | None = None
        self.incarnations = 0
        self._incarnation_mark = 0

    def incarnation_mark(self) -> int:
        """Where the running ClusterD's log begins (``after=`` for its own lines only)."""
        return self._incarnation_mark

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> ClusterDHarness:
        mark = self._incarnation_mark = self.log.mark()
        self.incarnations += 1
        self.process = _spawn(self.options.argv(self.binary, self.port, self.ctl_port), dict(os.environ),
                              self.workdir, self.log, f"clusterd#{self.incarnations}")
        _, match = self.log.wait_for(LISTENING, mark, timeout, "ClusterD's `HARNESS listening` line")
        self.port = int(match.group(2))
        return self

    def kill(self) -> None:
        """kill -9: ClusterD dies with every stream and cache it had."""
        _reap(self.process)

    def restart(self, timeout: float = 30.0) -> ClusterDHarness:
        """A new ClusterD on the same port (the old one killed first if it still runs)."""
        self.kill()
        return self.start(timeout)

    def stop(self) -> None:
        _kill_group(self.process, signal.SIGTERM)
        if self.process is not None:
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                pass
        _reap(self.process)
        self.log.close()

    # -- the log
    def wait_log(self, pattern: str | re.Pattern[str], after: int = 0, timeout: float = 30.0,
                 what: str | None = None) -> tuple[int, re.Match[str]]:
        return self.log.wait_for(pattern, after, timeout, what)

    def cycle_paths(self, after: int = 0) -> list[str]:
        """Every closed cycle's state path, in order (the reset function's `action path`
        line; the bare ``{INIT}`` of the reset every Subscribe does is no cycle)."""
        line = CYCLE_CLOSE_LINE[self.options.release]
        paths = [m.group(1) for _, m in self.log.find(rf"controller\.go:{line}\s+jobId=\S+'s action path = \{{(.*)\}}",
                                                      after)]
        return [path for path in paths if path != "INIT"]

    def fault_lists(self, after: int = 0) -> list[list[int]]:
        """The rank lists of every `write configmap faultList success` line: the ranks
        MindCluster's node agent restarts for a process-level recovery."""
        return [parse_fault_list(m.group(1)) for _, m in self.log.find(FAULT_LIST, after)]

    # -- the control API
    def _request(self, method: str, path: str, query: dict[str, Any] | None = None) -> Any:
        url = f"http://127.0.0.1:{self.ctl_port}{path}"
        if query:
            url += "?" + urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
        request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
        with urllib.request.urlopen(request, timeout=10) as answer:  # loopback; a deadline all the same
            return json.loads(answer.read() or b"null")

    def post(self, path: str, **query: Any) -> Any:
        """``POST path?query`` (``/fault/device``, ``/pod/restart``, ``/pg/annotate`` ...)."""
        return self._request("POST", path, query)

    def fault_device(self, rank: int, code: str | None = None, level: str | None = None) -> Any:
        """An NPU fault on ``rank``'s device, as the device plugin reports it (default code
        80C98000, level RestartNPU): only the fault centre sees it."""
        return self.post("/fault/device", rank=rank, code=code, level=level)

    def fault_clear(self, rank: int | None = None) -> Any:
        return self.post("/fault/clear", rank=rank)

    def pod_restart(self, rank: int, delay: float | None = None) -> Any:
        """Delete the pod of ``rank`` and create it again ``delay`` s later (a new uid)."""
        return self.post("/pod/restart", rank=rank, delay=delay)

    def state(self) -> dict[str, Any]:
        """``GET /state``: the PodGroup's annotations and labels, the pods."""
        result: dict[str, Any] = self._request("GET", "/state")
        return result

    def annotation(self, key: str) -> str | None:
        annotations = (self.state().get("podgroup") or {}).get("annotations") or {}
        value: str | None = annotations.get(key)
        return value

    def wait_annotation(self, key: str, predicate: Callable[[str | None], bool] = bool,
                        timeout: float = 60.0) -> str | None:
        def held() -> _Held | None:
            value = self.annotation(key)
            return _Held(value) if predicate(value) else None

        return eventually_sync(held, timeout, f"PodGroup annotation {key}", interval=0.2).value


@dataclass
class _Held:
    """A value ``eventually_sync`` can return even when it is falsy."""

    value: Any

    def __bool__(self) -> bool:
        return True


FAULT_LIST = re.compile(r"write configmap faultList success, (\{.*\})")


def parse_fault_list(payload: str) -> list[int]:
    """The ranks of a reset-config ConfigMap's `RankList` (entries ``{"RankId": 2, ...}``,
    or bare ranks)."""
    data = json.loads(payload)
    return sorted(int(entry["RankId"] if isinstance(entry, dict) else entry) for entry in data.get("RankList") or [])


# --------------------------------------------------------------------------- ranks
class Ranks:
    """The job's training ranks: one ``fake_rank.py`` process each, on the real processor
    library, connected to the controller on ``ttp_port``. Every event a rank has is
    appended to one shared timeline file (JSONL)."""

    def __init__(self, peers: Path, world_size: int, ttp_port: int, workdir: Path, *, devs: int = 2,
                 step_sleep: float = 0.2, python: str = sys.executable) -> None:
        self.peers = peers
        self.world_size = world_size
        self.devs = devs
        self.ttp_port = ttp_port
        self.step_sleep = step_sleep
        self.python = python
        self.timeline_path = workdir / "ranks.jsonl"
        self.log = LogTail(workdir / "ranks.log")
        self.workdir = workdir
        self.processes: dict[int, subprocess.Popen[str]] = {}  # the live process of each rank
        self.retired: list[subprocess.Popen[str]] = []  # killed ones, reaped at close
        self.starts: dict[int, int] = {}  # how many times each rank was started
        self._lock = threading.Lock()  # the node agent's thread restarts ranks too

    def pod_ranks(self, pod: int) -> list[int]:
        """The ranks of pod ``pod`` (rank r is on pod r // devs), as a whole-node restart takes them."""
        return list(range(pod * self.devs, (pod + 1) * self.devs))

    def start(self, ranks: Iterable[int] | None = None, *, restarted: bool = False, fault_rank: int = -1,
              fault_step: int = 8, fault_kind: str = "none") -> None:
        for rank in range(self.world_size) if ranks is None else ranks:
            env = {**os.environ, "MINDIO_PKG_DIR": str(self.peers / "mindio"), "FAULT_RANK": str(fault_rank),
                   "FAULT_STEP": str(fault_step), "FAULT_KIND": fault_kind, "STEP_SLEEP": str(self.step_sleep),
                   "TIMELINE": str(self.timeline_path), "PYTHONUNBUFFERED": "1"}
            env.pop("RESTARTED", None)
            if restarted:
                env["RESTARTED"] = "1"
            with self._lock:
                self.starts[rank] = self.starts.get(rank, 0) + 1
                process = _spawn([self.python, str(self.peers / "fake_rank.py"), str(rank), str(self.world_size),
                                  str(self.ttp_port)], env, self.workdir, self.log, f"rank{rank}#{self.starts[rank]}")
                old = self.processes.get(rank)
                if old is not None:
                    self.retired.append(old)
                self.processes[rank] = process

    def kill(self, ranks: Iterable[int]) -> None:
        """kill -9, as a process dies or a node agent stops it."""
        for rank in ranks:
            with self._lock:
                process = self.processes.get(rank)
            _reap(process)

    def restart(self, ranks: Iterable[int]) -> None:
        """Kill them and start them again as restarted ranks (``RESTARTED=1``)."""
        ranks = list(ranks)
        self.kill(ranks)
        self.start(ranks, restarted=True)

    def alive(self, rank: int) -> bool:
        with self._lock:
            process = self.processes.get(rank)
        return process is not None and process.poll() is None

    def timeline(self) -> list[dict[str, Any]]:
        """Every rank's events (``registered``, ``caught``, ``cb_repair``, ``resumed`` ...)."""
        if not self.timeline_path.exists():
            return []
        events = []
        for line in self.timeline_path.read_text(encoding="utf-8").splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line being written
        return events

    def events(self, kind: str, rank: int | None = None) -> list[dict[str, Any]]:
        return [e for e in self.timeline() if e.get("kind") == kind and (rank is None or e.get("src") == f"rank{rank}")]

    def close(self) -> None:
        with self._lock:
            processes = [*self.processes.values(), *self.retired]
        for process in processes:
            _reap(process)
        self.log.close()


class NodeAgent:
    """MindCluster's node agent, for a process-level recovery: when ClusterD writes the
    reset ConfigMap's fault list (`write configmap faultList success`), the processes of
    the ranks it names are stopped and started again as restarted ranks. A thread of
    its own follows ClusterD's log; ``restarts`` lists each list it acted on."""

    def __init__(self, clusterd: ClusterDHarness, ranks: Ranks) -> None:
        self.clusterd = clusterd
        self.ranks = ranks
        self.restarts: list[list[int]] = []  # appended by the agent's thread, read by the test
        self.errors: list[BaseException] = []  # the same
        self._seen = 0  # ClusterD's log lines looked at so far (the agent's thread only)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="node-agent")

    def start(self) -> NodeAgent:
        self._seen = self.clusterd.log.mark()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.05):  # polling ClusterD's log (a list in this process)
            for index, match in self.clusterd.log.find(FAULT_LIST, self._seen):
                self._seen = index + 1
                ranks = parse_fault_list(match.group(1))
                if not ranks:
                    continue
                try:
                    self.ranks.restart(ranks)
                except BaseException as error:  # noqa: BLE001 - kept for the test to raise
                    self.errors.append(error)
                self.restarts.append(ranks)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        if self.errors:
            raise AssertionError(f"the node agent failed to restart ranks: {self.errors!r}")


# --------------------------------------------------------------------------- the entry points
CONTROLLER_LISTENING = re.compile(r"Start controller success! ip: \S+, port: (\d+)")


class Entry:
    """A process hosting the real controller and the bridge between it and ClusterD."""

    name = "entry"

    def __init__(self, peers: Path, clusterd: ClusterDHarness, workdir: Path, *, wait_mindx_time: int = 30,
                 ttp_port: int | None = None) -> None:
        self.peers = peers
        self.clusterd = clusterd
        self.workdir = workdir
        self.wait_mindx_time = wait_mindx_time
        self.ttp_port = ttp_port or free_port()
        self.log = LogTail(workdir / f"{self.name}.log")
        self.process: subprocess.Popen[str] | None = None

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(self.peers / "mindio")]),
                "MINDIO_WAIT_MINDX_TIME": str(self.wait_mindx_time), "TTP_LOG_STDOUT": "1",
                "PYTHONUNBUFFERED": "1"}

    def argv(self) -> list[str]:
        raise NotImplementedError

    def start(self, timeout: float = 60.0) -> Entry:
        """Start it, and wait until the controller listens and ClusterD has the job's
        subscription (the order MindCluster starts them in: the ranks come after)."""
        mark, cd_mark = self.log.mark(), self.clusterd.log.mark()
        self.process = _spawn(self.argv(), self.env(), ROOT, self.log, self.name)
        self.log.wait_for(CONTROLLER_LISTENING, mark, timeout, f"the real controller listening ({self.name})")
        self.clusterd.wait_log("receive Subscribe signal request", cd_mark, timeout, "the subscription at ClusterD")
        return self

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def wait_exit(self, timeout: float = 60.0) -> int:
        code: int = eventually_sync(lambda: _Held(self.exit_code()) if self.exit_code() is not None else None,
                                    timeout, f"{self.name} exiting").value
        return code

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM (an operator's stop) and its exit code."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)  # the process itself, as systemd signals the main PID
        return self.wait_exit(timeout)

    def kill(self) -> None:
        _reap(self.process)

    def close(self) -> None:
        _reap(self.process)
        self.log.close()

    def bridge_events(self) -> list[dict[str, Any]]:
        """What the bridge itself saw (callbacks, RPCs with ClusterD's codes, signals,
        notifies with their return codes, outcomes), in order."""
        raise NotImplementedError


class BridgeDaemon(Entry):
    """``tft-bridge run`` in its own process, with ``controller.module =
    "mindio_ttp.controller_ttp"`` and its flight recorder on (the bridge's side of the
    transcript is read back with ``tft-bridge history --json``). Configured as an
    operator would: every key at its default but the job's own (ClusterD's address and
    keep-alive cadence, the controller's port, world size and wait), loopback only."""

    name = "daemon"

    def __init__(self, peers: Path, clusterd: ClusterDHarness, workdir: Path, *, wait_mindx_time: int = 30,
                 ttp_port: int | None = None, extra_toml: str = "") -> None:
        super().__init__(peers, clusterd, workdir, wait_mindx_time=wait_mindx_time, ttp_port=ttp_port)
        self.config_path = workdir / "job.toml"
        self.recorder_dir = workdir / "recorder"
        self.extra_toml = extra_toml
        #: its STATE_DIRECTORY (systemd's StateDirectory=, one per job); a test that needs
        #: a short path (a unix socket's has at most 107 bytes) sets it before the start
        self.state_directory = workdir / "state"

    def write_config(self) -> Path:
        keepalive = self.clusterd.options.keepalive
        self.config_path.write_text(f"""\
job_id = "{self.clusterd.options.job_uid}"
[clusterd]
address = "{self.clusterd.address}"
keepalive_interval = {keepalive}
[controller]
module = "mindio_ttp.controller_ttp"
bind_ip = "127.0.0.1"
port = {self.ttp_port}
world_size = {self.clusterd.options.world_size}
enable_arf = true
wait_mindx_time = {self.wait_mindx_time}
[metrics]
port = 0
[recorder]
directory = "{self.recorder_dir}"
{self.extra_toml}""", encoding="utf-8")
        return self.config_path

    def env(self) -> dict[str, str]:
        # The unit's own state directory (systemd's StateDirectory=, one per job): the
        # orphaned-job marker of one scenario's daemon is no other scenario's business.
        return {**super().env(), "STATE_DIRECTORY": str(self.state_directory)}

    def argv(self) -> list[str]:
        self.write_config()
        return [sys.executable, "-m", "bridge.cli", "run", "--config", str(self.config_path)]

    def bridge_events(self) -> list[dict[str, Any]]:
        listing = _history(self.recorder_dir)
        events: list[dict[str, Any]] = []
        for cycle in sorted(listing.get("cycles", []), key=lambda c: c.get("started") or 0):
            detail = _history(self.recorder_dir, "--cycle", cycle["key"])
            for event in detail.get("events", []):
                events.append({**event, "cycle": cycle.get("uuid") or cycle["key"]})
        return events

    def cycles(self) -> list[dict[str, Any]]:
        """The flight recorder's cycles (outcome, strategy, fault ranks), oldest first."""
        return sorted(_history(self.recorder_dir).get("cycles", []), key=lambda c: c.get("started") or 0)


def _history(directory: Path, *args: str) -> dict[str, Any]:
    if not (directory / "recorder.sqlite3").exists():
        return {}
    done = subprocess.run([sys.executable, "-m", "bridge.cli", "history", "--state-dir", str(directory), "--json",
                           "--last", "1000", *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        return {}
    result: dict[str, Any] = json.loads(done.stdout)
    return result


class SeedLauncher(Entry):
    """A training launcher written against the seed API (``bridge.recover_manager``)
    hosting the real controller itself, in its own process
    (tests/conformance/seed_launcher.py). It writes what it forwarded and the bridge's
    RPC counts as JSON lines (``LAUNCHER {...}``) on its output."""

    name = "seed"

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "tests.conformance.seed_launcher", "--clusterd", self.clusterd.address,
                "--job", self.clusterd.options.job_uid, "--world-size", str(self.clusterd.options.world_size),
                "--port", str(self.ttp_port), "--keepalive", str(self.clusterd.options.keepalive)]

    def records(self) -> list[dict[str, Any]]:
        out = []
        for _, match in self.log.find(r"^LAUNCHER (\{.*\})$"):
            out.append(json.loads(match.group(1)))
        return out

    def bridge_events(self) -> list[dict[str, Any]]:
        return [r for r in self.records() if r.get("kind") in ("callback", "rpc", "outcome")]


ENTRIES: dict[str, type[Entry]] = {"daemon": BridgeDaemon, "seed": SeedLauncher}
