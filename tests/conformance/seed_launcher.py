"""A training launcher written against the seed API, hosting the real MindIO controller.

The second entry point of the conformance tier (tests/conformance/peers.py,
``SeedLauncher``): what MindCluster's launchers do with ``mindx_elastic``'s
``recover_manager``, with the one import switched to ``bridge.recover_manager``. In the
order MindCluster uses (real-peers README): the client connects, registers its four
callbacks and subscribes, then the controller (rank -1, ``enable_arf``) listens; the
ranks connect after. It runs until SIGTERM (then it closes the manager and exits 0) or
until the controller ends the job.

What it forwarded is printed as ``LAUNCHER {json}`` lines: each callback the controller
made with its arguments and the seed function's return code, and each ClusterD RPC the
manager made with ClusterD's code (read from the client's RPC hook, as the flight
recorder reads it in the daemon).

usage: python -m tests.conformance.seed_launcher --clusterd HOST:PORT --job UID
       --world-size N --port TTP_PORT [--keepalive S]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

_print_lock = threading.Lock()  # callbacks come from the controller's thread, RPCs from the manager's loop


def emit(record: dict[str, Any]) -> None:
    with _print_lock:
        print("LAUNCHER " + json.dumps({"t": time.time(), **record}, default=str, sort_keys=True), flush=True)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def recorded(name: str, function: Callable[..., int]) -> Callable[..., int]:
    """The seed function, with its call and return code printed (never raising: it is
    what the controller calls back)."""

    def callback(*args: Any) -> int:
        rc = function(*args)
        emit({"kind": "callback", "name": name, "args": _plain(args), "rc": rc})
        return rc

    return callback


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="seed_launcher")
    parser.add_argument("--clusterd", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--keepalive", type=float, default=5.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from dataclasses import replace

    from bridge.recover_manager import DLRecoverManager, pb, report_process_fault, report_recover_status, report_recover_strategy, report_stop_complete

    import mindio_ttp.controller_ttp as ttp  # the real build: its folder is on PYTHONPATH

    info = pb.ClientInfo(ip="", port="", taskId=args.job, role="master agent")
    manager = DLRecoverManager(info, args.clusterd, secure_conn=False)
    # ClusterD's keep-alive cadence of this harness (-keepalive): the stream watchdog counts in it.
    manager.config = replace(manager.config, clusterd=replace(manager.config.clusterd, keepalive_interval=args.keepalive))
    manager.init_clusterd()
    status = manager.register(info)
    if status.code != 0:
        print(f"seed_launcher: ClusterD refused Register: {status.code} {status.info}", file=sys.stderr)
        return 1
    manager.start_subscribe()
    assert manager.link is not None

    def on_rpc(method: str, code: int | str, started: float, seconds: float) -> None:
        emit({"kind": "rpc", "method": method, "code": code})

    manager.link.client.on_rpc = on_rpc  # the manager's loop calls it, as it calls the flight recorder's
    for action, function in (("report_fault_ranks", report_process_fault), ("report_stop_complete", report_stop_complete),
                             ("report_strategies", report_recover_strategy), ("report_result", report_recover_status)):
        if ttp.tft_register_mindx_callback(action, recorded(action, function)) != 0:
            print(f"seed_launcher: tft_register_mindx_callback({action}) failed", file=sys.stderr)
            return 1
    ttp.tft_init_controller(-1, args.world_size, False, True, False)
    ttp.tft_start_controller("127.0.0.1", args.port, False, "")
    emit({"kind": "started", "port": args.port})

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(0.5):  # SIGTERM sets it; the wait wakes for the handler
        pass
    manager.close()
    emit({"kind": "closed"})
    os._exit(0)  # the controller's own threads are not ours to join


if __name__ == "__main__":
    sys.exit(main())
