"""``tft-bridge sim-clusterd``: the simulated ClusterD on its own, for people integrating
a client against ClusterD's real semantics without a cluster. Every RPC and signal is
logged; Ctrl-C (or SIGTERM) stops it. ``bridge/cli.py`` finds this module by name
(:func:`add_arguments`, :func:`cmd_sim_clusterd`); the gRPC server is imported only
when the command runs.

Started with only ``--job/--world-size/--devices-per-pod/--strategies/--keepalive`` it
answers with the real server's delays (docs/clusterd.md): a client tuned against a
faster peer would be too tight in production. ``--time-scale`` and the single-delay
flags are for tests that want it faster, and say so on the command line.

Commands on stdin, one per line (type them, or pipe/redirect them in), reach what a
client cannot trigger over gRPC: a device fault that only ClusterD's fault centre sees
(no business report), which on the real server gives preExitProcess after 10.85 s, or
20.80 s for a UCE hardware code. The grammar is :data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import selectors
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

from bridge.core.interrupts import capture_signals
from bridge.core.logs import setup_logging

if TYPE_CHECKING:  # the gRPC server is imported only when the command runs
    from bridge.sim.clusterd import SimClusterD
    from bridge.sim.clusterd_timings import Timings

log = logging.getLogger("tft_bridge.sim")

#: The stdin command grammar, also printed by ``help`` and in ``--help``.
COMMANDS = """\
commands on stdin (one per line):
  device-fault RANK[,RANK...] [uce]   a device fault only the fault centre sees: preExitProcess
                                      for those ranks after 10.85 s (uce: 20.80 s), no state change
  kill-master                         killMaster now, then reset (the stream ends with OK)
  sub-health RANK                     a sub-healthy NPU fault on RANK: with --hot-switch, a hot
                                      switch of its pod (hot switch; stop switch after 60 s)
  new-pod-running                     the running hot switch's backup pod runs (new pod running)
  help                                print this list"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``sim-clusterd`` options (kept here, next to what they configure)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = COMMANDS
    parser.add_argument("--listen", default="127.0.0.1:8899")
    parser.add_argument("--job", required=True, help="job id (the Recover jobId)")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--devices-per-pod", type=int, default=8)
    parser.add_argument("--strategies", default="retry,recover,dump,exit")
    parser.add_argument("--keepalive", type=float, metavar="SECONDS",
                        help="keep-alive interval (default: the real 5 s, times --time-scale)")
    parser.add_argument("--process-recover", choices=["on", "off"], default="on")
    parser.add_argument("--hot-switch", action="store_true",
                        help="the PodGroup label subHealthyStrategy=hotSwitch: sub-healthy faults start hot switches")
    parser.add_argument("--release", choices=["master", "7.3", "7.0"], default="master",
                        help="the ClusterD release to play: its keep-alive ping policy, fault centre and protocol "
                             "(docs/releases.md; default master)")
    faster = parser.add_argument_group("faster than the real server (for tests; default: real delays)")
    faster.add_argument("--time-scale", type=float, default=1.0, metavar="FACTOR",
                        help="multiply every delay of the real server by FACTOR (e.g. 0.01); "
                             "the flags below then override single delays")
    faster.add_argument("--phase-delay", type=float, metavar="SECONDS",
                        help="the sleep before globalFault after the flush, type-1 faults only (real: 10.0)")
    faster.add_argument("--flush-delay", type=float, metavar="SECONDS",
                        help="the fault flush before that sleep, type-1 faults only (real: 1.0)")
    faster.add_argument("--dump-exit-repeat", type=float, metavar="SECONDS",
                        help="between the first and the second exit/dump_exit (real: 80.0)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def timings_from(args: argparse.Namespace) -> Timings:
    from bridge.sim.clusterd_timings import REAL

    table = REAL.scaled(args.time_scale) if args.time_scale != 1.0 else REAL
    chosen = {"keepalive_interval": args.keepalive, "global_fault_delay": args.phase_delay,
              "flush_delay": args.flush_delay, "dump_exit_repeat": args.dump_exit_repeat}
    return replace(table, **{k: v for k, v in chosen.items() if v is not None})


def build(args: argparse.Namespace) -> SimClusterD:
    """The simulator the options describe (not started)."""
    from bridge.sim.clusterd import SimClusterD, SimJob
    from bridge.sim.clusterd_release import release

    strategies = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
    job = SimJob(args.job, world_size=args.world_size, devices_per_pod=args.devices_per_pod,
                 strategies=strategies, process_recover=args.process_recover == "on", hot_switch=args.hot_switch)
    return SimClusterD([job], timings=timings_from(args), release=release(args.release))


async def run_command(sim: SimClusterD, job_id: str, line: str) -> str:
    """Carry out one stdin command; returns what to log. Never raises for bad input."""
    words = line.split()
    if not words:
        return ""
    name, rest = words[0], words[1:]
    try:
        if name == "help":
            return COMMANDS
        if name == "device-fault" and rest and len(rest) <= 2 and rest[1:] in ([], ["uce"]):
            ranks = [int(rank) for rank in rest[0].split(",")]
            if any(rank < 0 for rank in ranks):
                raise ValueError("rank ids are >= 0")
            await sim.pre_exit(job_id, ranks, uce=rest[1:] == ["uce"])
            return f"device fault on ranks {ranks} scheduled"
        if name == "kill-master" and not rest:
            await sim.kill_master(job_id)
            return "killMaster started"
        if name == "sub-health" and len(rest) == 1 and rest[0].isdigit():
            return f"sub-healthy fault on rank {rest[0]}: {await sim.sub_health_fault(job_id, int(rest[0]))}"
        if name == "new-pod-running" and not rest:
            await sim.new_pod_running(job_id)
            return "the backup pod runs"
    except (ValueError, KeyError, RuntimeError) as error:
        return f"command {line.strip()!r} failed: {error}"
    return f"unknown command {line.strip()!r}; type help"


def _watchable(fd: int) -> bool:
    """Whether the event loop can wait on ``fd`` (a pipe, socket or terminal; not a
    regular file or /dev/null, which epoll refuses), and reading it will not stop the
    process: a background job that reads its terminal gets SIGTTIN."""
    try:
        if os.isatty(fd) and os.tcgetpgrp(fd) != os.getpgrp():
            return False
        with selectors.DefaultSelector() as probe:
            probe.register(fd, selectors.EVENT_READ)
    except (OSError, ValueError):
        return False
    return True


async def _read_commands(sim: SimClusterD, job_id: str) -> None:
    """Read stdin commands until EOF or cancellation. stdin that cannot be watched just
    means no commands (e.g. started in the background with stdin from /dev/null)."""
    if sys.stdin is None or not _watchable(sys.stdin.fileno()):
        log.debug("stdin cannot be watched: no commands")
        return
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while line := await reader.readline():
            answer = await run_command(sim, job_id, line.decode(errors="replace"))
            if answer:
                log.info("%s", answer)
    finally:
        transport.close()


async def serve(args: argparse.Namespace) -> int:
    from bridge.sim.journal import Journal, JournalEntry

    sim = build(args)

    def show(entry: JournalEntry) -> None:
        if entry.name != "keep-alive" or log.isEnabledFor(logging.DEBUG):
            log.info("%s", Journal.format(entry))

    sim.journal.add_listener(show)
    address = await sim.start(args.listen)
    strategies = ",".join(sim.jobs[args.job].strategies)
    log.info("simulated ClusterD %s for job %s listening on %s (strategies %s, process recovery %s, "
             "time scale %g); type help for commands", sim.release.version, args.job, address, strategies,
             args.process_recover, args.time_scale)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    commands = loop.create_task(_read_commands(sim, args.job))
    with capture_signals(stop.set):
        await stop.wait()
    commands.cancel()
    await asyncio.gather(commands, return_exceptions=True)
    await sim.stop()
    return 1 if sim.violations else 0


def cmd_sim_clusterd(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    return asyncio.run(serve(args))
