"""The bridge process's footprint against world size: CPU, resident memory, threads and
open descriptors, idle, with the job's ranks connected, and through one recovery.

    python bench/bench_footprint.py [--quick] [--sizes 16,1000,10000] [--idle SECONDS] [--cycles N]
                                    [--sides bridge,sync]
    python bench/bench_footprint.py --controller real [--sizes ...] [--idle SECONDS]

For each world size, one side after the other:

* ``bridge``: ``tft-bridge run`` (``bench/footprint_child.py bridge``: the CLI unchanged,
  plus the thread that drives the stub's ranks) with the stub controller
  (``controller.module = "stub"``), the flight recorder and the metrics endpoint on, as
  the unit runs it;
* ``sync``: the anchor, the same stub controller under MindCluster's client shape
  (``baseline.SyncClient``: blocking Report* calls in the callbacks, a reader thread that
  notifies inline), the shape TaskD's manager gives the controller in a training pod;

each against ``tft-bridge sim-clusterd`` in a process of its own (real delays, keep-alive
every 5 s). Phases, each read from ``/proc/PID`` of the measured process only:

1. ``idle``: after it subscribed and the controller listens, ``--settle`` seconds, then
   ``--idle`` seconds: CPU seconds used in the window (as % of one core), context
   switches per second (every thread's, voluntary and involuntary), RSS, threads,
   descriptors at its end;
2. ``ranks``: every rank connected to the stub (``training.connect_ranks``) and one TCP
   connection per rank held open to the controller's port, as each real rank keeps one;
   then the same window;
3. ``cycle``: ``--cycles`` recoveries one after the other (a UCE on rank 0, retried),
   each measured from the fault to the controller's result (the next starts once the
   process is back on a new signal stream): CPU seconds and wall time summed, peak
   threads and descriptors (sampled every 50 ms), peak RSS (``VmHWM``).

The stub's ranks are Python objects in the measured process (the real controller's are
C++ state in the bridge's process too), and its NORMAL loop polls every 20 ms where the
real one polls every 2 s: the ``sync`` side carries the same stub, so the ``bridge/sync``
ratios and the ``bridge-sync`` differences are the bridge's own share. The TCP
connections only hold descriptors: the stub accepts them and reads nothing (the real
controller reads each rank's heartbeats), so the CPU of ``ranks`` has no per-connection
work in it. It also prints the measured process's sockets: what it listens on and which
ports it dials, the facts behind the port table in docs/operations.md.

``--controller real`` runs ``tft-bridge run`` unchanged with the real peers' MindIO TFT
build (``$TFT_BRIDGE_REAL_PEERS``, else ``shared/real-peers`` above the repository) and
measures the idle phase only: its ranks would be processes of the processor library,
which this benchmark does not start, and the synchronous anchor is bound to the stub.

Nothing here is gated: the figures are for sizing (``LimitNOFILE=``, a node's memory),
and the ratios say what the bridge adds to the controller MindCluster already hosts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bridge.core.config import REAL_CONTROLLER
from bridge.sim.scenario import free_port

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
JOB = "footprint-job"
sys.path.insert(0, str(BENCH))
from footprint_child import ANSWER, DEVICES_PER_POD  # noqa: E402  # the simulated ClusterD is told the same
TICK = os.sysconf("SC_CLK_TCK")
START_TIMEOUT = 60.0
SAMPLE_EVERY = 0.05  # seconds between samples during a cycle (its peaks)


# --------------------------------------------------------------------------- /proc


@dataclass
class Sample:
    cpu: float  # seconds of user + system time so far
    rss: int  # kB
    hwm: int  # kB, peak RSS so far
    threads: int
    fds: int
    switches: int = 0  # context switches (voluntary + involuntary) of every thread so far


def context_switches(pid: int) -> int:
    """Voluntary and involuntary context switches summed over the process's threads
    (``/proc/PID/task/*/status``): each is a wake-up or a preemption the process cost
    the node, which CPU seconds of an idle process hide."""
    return sum(switches_by_name(pid).values())


def switches_by_name(pid: int) -> Counter[str]:
    """``context_switches`` per thread name (``comm``: gRPC's ``event_engine``, Python's
    ``python``, the controller's ``AccWrk:N``...): which threads wake the node."""
    by_name: Counter[str] = Counter()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{task}/comm").read_text().strip()
            with open(f"/proc/{pid}/task/{task}/status") as lines:
                for line in lines:
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        by_name[name] += int(line.split()[1])
        except OSError:
            continue  # ended meanwhile
    return by_name


def sample(pid: int) -> Sample:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / TICK  # utime, stime: fields 14 and 15 of proc(5)
    status: dict[str, str] = {}
    with open(f"/proc/{pid}/status") as lines:
        for line in lines:
            key, _, value = line.partition(":")
            status[key] = value.strip()
    return Sample(cpu, int(status["VmRSS"].split()[0]), int(status["VmHWM"].split()[0]), int(status["Threads"]),
                  len(os.listdir(f"/proc/{pid}/fd")), context_switches(pid))


def thread_names(pid: int) -> Counter[str]:
    names: Counter[str] = Counter()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            names[Path(f"/proc/{pid}/task/{task}/comm").read_text().strip()] += 1
        except OSError:
            continue  # ended meanwhile
    return names


@dataclass
class Sockets:
    listening: set[int] = field(default_factory=set)  # local TCP ports
    dialed: Counter[int] = field(default_factory=Counter)  # remote port of each established connection it opened
    accepted: Counter[int] = field(default_factory=Counter)  # local port of each established connection it accepted
    unix: int = 0
    other: int = 0


def sockets(pid: int) -> Sockets:
    """The TCP and Unix sockets ``pid`` holds, from its descriptors and its network
    namespace's tables."""
    inodes: set[str] = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = Sockets()
    tcp: list[tuple[int, int, str]] = []  # (local port, remote port, state) of the process's sockets
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cells = row.split()
            if cells[9] in inodes:
                inodes.discard(cells[9])
                tcp.append((int(cells[1].rsplit(":", 1)[1], 16), int(cells[2].rsplit(":", 1)[1], 16), cells[3]))
    found.listening = {local for local, _, state in tcp if state == "0A"}
    for local, remote, state in tcp:
        if state != "01":
            continue
        if local in found.listening:
            found.accepted[local] += 1
        else:
            found.dialed[remote] += 1
    unix = set(Path(f"/proc/{pid}/net/unix").read_text().split())
    found.unix = sum(1 for inode in inodes if inode in unix)
    found.other = len(inodes) - found.unix
    return found


# --------------------------------------------------------------------------- processes


class Output:
    """A child's stdout, drained by a thread (a child writing into a full pipe blocks)."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, text: str, timeout: float, after: int = 0) -> str:
        """The first line from index ``after`` on that holds ``text``."""
        return self.lines[self.index_of(text, timeout, after)]

    def index_of(self, text: str, timeout: float, after: int = 0) -> int:
        """The index of the first line from ``after`` on that holds ``text``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for index in range(after, len(self.lines)):
                    if text in self.lines[index]:
                        return index
                left = deadline - time.monotonic()
                if left <= 0 or self.process.poll() is not None:
                    tail = "".join(self.lines[-20:])
                    raise RuntimeError(f"{text!r} not seen within {timeout:.0f} s "
                                       f"(exit code {self.process.poll()}); last lines:\n{tail}")
                self._cond.wait(left)


def spawn(*argv: str, stdin: int | None = None, path: tuple[Path, ...] = (),
          env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], Output]:
    """``python ARGV`` from the repository root, the repository (and ``path``) on
    PYTHONPATH, stdout and stderr into one drained pipe."""
    pythonpath = os.pathsep.join(str(p) for p in (ROOT, *path))
    process = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdin=stdin, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONPATH": pythonpath, "MINDIO_WAIT_MINDX_TIME": "30",
                                    **(env or {})})
    return process, Output(process)


def real_mindio() -> Path:
    """The real MindIO TFT build of the real peers (``$TFT_BRIDGE_REAL_PEERS``, else a
    ``shared/real-peers`` folder above the repository), as ``mindio/``."""
    given = os.environ.get("TFT_BRIDGE_REAL_PEERS")
    candidates = [Path(given)] if given else [parent / "shared" / "real-peers" for parent in ROOT.parents]
    for folder in candidates:
        if (folder / "mindio" / "mindio_ttp" / "controller_ttp").is_dir():
            return folder / "mindio"
    raise SystemExit("--controller real needs the real peers' MindIO TFT build (mindio/mindio_ttp): set "
                     "TFT_BRIDGE_REAL_PEERS to the real-peers folder")


def stop(process: subprocess.Popen[str] | None) -> None:
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(90)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def bridge_config(directory: Path, clusterd: str, controller_port: int, metrics_port: int, world_size: int,
                  module: str = "stub") -> Path:
    path = directory / "job.toml"
    path.write_text(f"""
job_id = "{JOB}"
[clusterd]
address = "{clusterd}"
[controller]
module = "{module}"
bind_ip = "127.0.0.1"
port = {controller_port}
world_size = {world_size}
enable_arf = true
rank_loss_wait = 0
state_directory = "{directory}/state"
[metrics]
port = {metrics_port}
[recorder]
directory = "{directory}/recorder"
""")
    return path


def connect_ranks(port: int, count: int) -> list[socket.socket]:
    """``count`` TCP connections to the controller's port, held open like the ranks' own."""
    held = []
    for _ in range(count):
        held.append(socket.create_connection(("127.0.0.1", port), timeout=30))
    return held


# --------------------------------------------------------------------------- one side


@dataclass
class Window:
    cpu: float  # seconds of CPU in the window
    seconds: float  # the window's wall time
    end: Sample
    threads_peak: int = 0
    fds_peak: int = 0
    outcome: str = ""
    switches: int = 0  # context switches in the window

    @property
    def load(self) -> float:
        """% of one core."""
        return 100 * self.cpu / self.seconds if self.seconds else 0.0


@dataclass
class Side:
    name: str
    world_size: int
    phases: dict[str, Window] = field(default_factory=dict)
    sockets: Sockets = field(default_factory=Sockets)
    threads: Counter[str] = field(default_factory=Counter)  # native thread names, with ranks connected
    python_threads: list[str] = field(default_factory=list)  # the Python threads' names, with ranks connected
    clusterd_port: int = 0
    controller_port: int = 0
    metrics_port: int = 0
    stop_seconds: float = 0.0
    exit_code: int | None = None


def window(pid: int, seconds: float) -> Window:
    first = sample(pid)
    started = time.monotonic()
    time.sleep(seconds)  # the measured window itself: the process is left alone in it
    last = sample(pid)
    return Window(last.cpu - first.cpu, time.monotonic() - started, last, last.threads, last.fds,
                  switches=last.switches - first.switches)


def cycles(pid: int, child: subprocess.Popen[str], output: Output, sim_output: Output, count: int) -> Window:
    """``count`` recoveries one after the other, each measured from the fault to the
    controller's result, sampled every ``SAMPLE_EVERY`` for the peaks; between two, the
    next waits (unmeasured) until the process is back on a new signal stream that has
    delivered its first keep-alive (ClusterD ends the stream after every cycle)."""
    assert child.stdin is not None
    cpu = seconds = 0.0
    threads = fds = 0
    outcomes: list[str] = []
    for _ in range(count):
        mark, sim_mark = len(output.lines), len(sim_output.lines)
        first = sample(pid)
        started = time.monotonic()
        child.stdin.write("fault\n")
        child.stdin.flush()
        answer: list[str] = []
        waiter = threading.Thread(
            target=lambda: answer.append(output.wait_for(f"{ANSWER} cycle ", 150, after=mark)), daemon=True)
        waiter.start()
        while waiter.is_alive():
            now = sample(pid)
            threads, fds = max(threads, now.threads), max(fds, now.fds)
            waiter.join(SAMPLE_EVERY)
        seconds += time.monotonic() - started
        last = sample(pid)
        cpu += last.cpu - first.cpu
        threads, fds = max(threads, last.threads), max(fds, last.fds)
        if not answer:
            break
        outcomes.append(answer[0].split()[-1])
        # Back on a new stream once it delivered its first message: a fault reported
        # before that waits for it (ClusterD loses faults no live subscription sees).
        opened = sim_output.index_of("stream-open SubscribeProcessManageSignal", 60, after=sim_mark)
        sim_output.wait_for("keep-alive", 60, after=opened)
    end = sample(pid)
    results = ",".join(sorted(set(outcomes))) + (f" ({len(outcomes)} of {count})" if len(outcomes) < count else "")
    return Window(cpu, seconds, end, threads, fds, results or "no answer")


def measure(name: str, world_size: int, args: argparse.Namespace) -> Side:
    side = Side(name, world_size)
    side.clusterd_port, side.controller_port = free_port(), free_port()
    clusterd = f"127.0.0.1:{side.clusterd_port}"
    sim = child = None
    held: list[socket.socket] = []
    with tempfile.TemporaryDirectory(prefix="tft-footprint-") as scratch:
        try:
            sim, sim_output = spawn("-m", "bridge.cli", "sim-clusterd", "--listen", clusterd, "--job", JOB,
                                    "--world-size", str(world_size), "--devices-per-pod", str(DEVICES_PER_POD),
                                    "--log-level", "DEBUG")  # DEBUG: its keep-alives are logged too
            sim_output.wait_for("simulated ClusterD", START_TIMEOUT)
            if name == "bridge" and args.controller == "real":
                side.metrics_port = free_port()
                config = bridge_config(Path(scratch), clusterd, side.controller_port, side.metrics_port, world_size,
                                       REAL_CONTROLLER)
                # tft-bridge run as it ships; the controller's log to stdout, not to files in the tree
                child, output = spawn("-m", "bridge.cli", "run", "--config", str(config), path=(real_mindio(),),
                                      env={"TTP_LOG_STDOUT": "1"})
            elif name == "bridge":
                side.metrics_port = free_port()
                config = bridge_config(Path(scratch), clusterd, side.controller_port, side.metrics_port, world_size)
                child, output = spawn(str(BENCH / "footprint_child.py"), "bridge", str(config), str(world_size),
                                      stdin=subprocess.PIPE)
            else:
                child, output = spawn(str(BENCH / "footprint_child.py"), "sync", clusterd, JOB,
                                      str(side.controller_port), str(world_size), stdin=subprocess.PIPE)
            # Subscribed once the stream delivered its first message (ClusterD's first
            # keep-alive, up to 5 s after the subscription): a fault before it would wait.
            opened = sim_output.index_of("stream-open SubscribeProcessManageSignal", START_TIMEOUT)
            sim_output.wait_for("keep-alive", START_TIMEOUT, after=opened)
            output.wait_for("controller listening" if name == "bridge" else f"{ANSWER} listening", START_TIMEOUT)
            time.sleep(args.settle)  # start-up's imports and first allocations end before the window
            side.phases["idle"] = window(child.pid, args.idle)
            if args.controller == "real":  # no ranks: the real controller's are processes of their own
                side.sockets = sockets(child.pid)
                side.threads = thread_names(child.pid)
                return finish(side, child)
            assert child.stdin is not None
            mark = len(output.lines)
            child.stdin.write("ranks\n")
            child.stdin.flush()
            output.wait_for(f"{ANSWER} ranks", START_TIMEOUT, after=mark)
            held = connect_ranks(side.controller_port, world_size)
            time.sleep(args.settle)
            side.phases["ranks"] = window(child.pid, args.idle)
            side.sockets = sockets(child.pid)
            side.threads = thread_names(child.pid)
            mark = len(output.lines)
            child.stdin.write("threads\n")
            child.stdin.flush()
            side.python_threads = json.loads(output.wait_for(f"{ANSWER} threads ", START_TIMEOUT, after=mark)
                                             .split(f"{ANSWER} threads ", 1)[1])
            if args.cycles:
                side.phases["cycle"] = cycles(child.pid, child, output, sim_output, args.cycles)
            for conn in held:
                conn.close()
            held = []
            return finish(side, child)
        finally:
            for conn in held:
                conn.close()
            stop(child)
            stop(sim)


def finish(side: Side, child: subprocess.Popen[str]) -> Side:
    """Stop the measured process as its host would (SIGTERM for the bridge, the end of
    its input for the synchronous host) and note how long that took."""
    started = time.monotonic()
    if side.name == "bridge":
        stop(child)
    else:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(90)
    side.stop_seconds = time.monotonic() - started
    side.exit_code = child.returncode
    return side


# --------------------------------------------------------------------------- report


def counted(names: Counter[str]) -> str:
    return ", ".join(f"{name} x{n}" if n > 1 else name for name, n in sorted(names.items()))


def mib(kb: int) -> str:
    return f"{kb / 1024:.1f}"


def print_side(side: Side) -> None:
    for phase, w in side.phases.items():
        peak = f" (peak {w.threads_peak} threads, {w.fds_peak} fds, wall {w.seconds:.1f} s, results {w.outcome})" \
            if phase == "cycle" else ""
        print(f"    {side.name:<6} {phase:<5} cpu {w.cpu:7.3f} s = {w.load:5.1f} % of a core   "
              f"rss {mib(w.end.rss):>6} MiB"
              f" (peak {mib(w.end.hwm):>6})   threads {w.end.threads:4d}   fds {w.end.fds:6d}"
              f"   switches {w.switches / w.seconds if w.seconds else 0.0:7.1f}/s{peak}")


def print_ratios(bridge: Side, sync: Side) -> None:
    for phase, ours in bridge.phases.items():
        theirs = sync.phases.get(phase)
        if theirs is None:
            continue
        ratio = f"{ours.cpu / theirs.cpu:5.2f}" if theirs.cpu > 0 else "  n/a"
        print(f"    bridge-sync {phase:<5} cpu {ours.cpu - theirs.cpu:+7.3f} s (x{ratio})   "
              f"rss {(ours.end.rss - theirs.end.rss) / 1024:+6.1f} MiB (x{ours.end.rss / theirs.end.rss:4.2f})   "
              f"threads {ours.end.threads - theirs.end.threads:+4d}   fds {ours.end.fds - theirs.end.fds:+6d}")


def print_sockets(side: Side) -> None:
    s = side.sockets
    named = {side.clusterd_port: "ClusterD", side.controller_port: "controller", side.metrics_port: "metrics"}

    def label(port: int) -> str:
        return f"{port} ({named[port]})" if port in named else str(port)

    listening = ", ".join(label(p) for p in sorted(s.listening)) or "none"
    dialed = ", ".join(f"{label(p)} x{n}" for p, n in sorted(s.dialed.items())) or "none"
    accepted = ", ".join(f"{label(p)} x{n}" for p, n in sorted(s.accepted.items())) or "none"
    print(f"    {side.name:<6} sockets: listens on {listening}; dials {dialed}; "
          f"accepted {accepted}; unix {s.unix}; other {s.other}")


def raise_descriptor_limit(world_size: int) -> None:
    """The benchmark holds one descriptor per rank, and so does the measured process
    (it inherits this limit, as the unit gives it ``LimitNOFILE=``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = world_size + 1024
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise SystemExit(f"world size {world_size} needs {need} descriptors; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="sizes 16,1000, a 3 s window")
    parser.add_argument("--sizes", help="world sizes, comma-separated (default 16,1000,10000)")
    parser.add_argument("--idle", type=float, help="seconds of each measured window (default 30)")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds before each window")
    parser.add_argument("--sides", default="bridge,sync", help="bridge, sync or both (default)")
    parser.add_argument("--controller", choices=["stub", "real"], default="stub",
                        help="real: the real peers' MindIO TFT build under tft-bridge run, idle only, no anchor "
                             "(TFT_BRIDGE_REAL_PEERS)")
    parser.add_argument("--cycles", type=int, help="recoveries measured one after the other (default 5, quick 2; "
                                                   "0: none)")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # progress, also into a file
    sizes = [int(s) for s in (args.sizes or ("16,1000" if args.quick else "16,1000,10000")).split(",")]
    if args.idle is None:
        args.idle = 3.0 if args.quick else 30.0
    if args.cycles is None:
        args.cycles = 2 if args.quick else 5
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not set(sides) <= {"bridge", "sync"}:
        parser.error("--sides takes bridge and/or sync")
    if args.controller == "real":
        sides = ["bridge"]
    raise_descriptor_limit(max(sizes))
    print(f"footprint of the process hosting the {args.controller} controller: windows of {args.idle:g} s after "
          f"{args.settle:g} s "
          f"of settling; CPU as % of one core; load average before: {os.getloadavg()[0]:.2f}")
    for world_size in sizes:
        print(f"\n  world size {world_size}")
        measured = {name: measure(name, world_size, args) for name in sides}
        for side in measured.values():
            print_side(side)
        if "bridge" in measured and "sync" in measured:
            print_ratios(measured["bridge"], measured["sync"])
        for side in measured.values():
            print_sockets(side)
        for side in measured.values():
            print(f"    {side.name:<6} threads: {counted(side.threads)}")
            if side.python_threads:
                print(f"    {side.name:<6} Python threads: {counted(Counter(side.python_threads))}")
        for side in measured.values():
            print(f"    {side.name:<6} stopped in {side.stop_seconds:.1f} s, exit code {side.exit_code}")
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
