"""``tft-bridge sim-clusterd``: the simulated ClusterD on its own, for people integrating
a client against ClusterD's real semantics without a cluster. Every RPC and signal is
logged; Ctrl-C (or SIGTERM) stops it."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from ..cli import setup_logging
from .clusterd import SimClusterD, SimJob
from .journal import Journal, JournalEntry

log = logging.getLogger("tft_bridge.sim")


async def serve(args: argparse.Namespace) -> int:
    strategies = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
    job = SimJob(args.job, world_size=args.world_size, devices_per_pod=args.devices_per_pod,
                 strategies=strategies, process_recover=args.process_recover == "on")
    sim = SimClusterD([job], keepalive_interval=args.keepalive, global_fault_delay=args.phase_delay)

    def show(entry: JournalEntry) -> None:
        if entry.name != "keep-alive" or log.isEnabledFor(logging.DEBUG):
            log.info("%s", Journal.format(entry))

    sim.journal.add_listener(show)
    address = await sim.start(args.listen)
    log.info("simulated ClusterD for job %s listening on %s (strategies %s, process recovery %s)",
             args.job, address, ",".join(strategies), args.process_recover)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await sim.stop()
    return 1 if sim.violations else 0


def cmd_sim_clusterd(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    return asyncio.run(serve(args))
