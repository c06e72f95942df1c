"""MindCluster's synchronous client hosting a real MindIO TFT controller, as a process.

bench_conformance.py measures the bridge against this on the real peers: the client
shape of ``baseline.SyncClient`` (every callback makes its blocking Report* call before
it returns; a reader thread notifies the controller inline), around the real
``mindio_ttp.controller_ttp`` (its folder on PYTHONPATH) instead of the stub. The reader
subscribes first, then the controller (rank -1, ``enable_arf``) listens, the order
MindCluster uses (real-peers README). It runs until SIGTERM.

usage: python bench/sync_launcher.py --clusterd HOST:PORT --job UID --world-size N --port TTP_PORT
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from baseline import SyncClient  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sync_launcher")
    parser.add_argument("--clusterd", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)

    import mindio_ttp.controller_ttp as ttp  # the real build: its folder is on PYTHONPATH

    client = SyncClient(args.clusterd, args.job, ttp)
    client.register()
    client.start_reader()
    ttp.tft_init_controller(-1, args.world_size, False, True, False)
    ttp.tft_start_controller("127.0.0.1", args.port, False, "")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(0.5):  # SIGTERM sets it; the wait wakes for the handler
        pass
    client.close()
    for error in client.errors:
        print(f"sync_launcher: {error}", file=sys.stderr)
    os._exit(0)  # the controller's own threads are not ours to join


if __name__ == "__main__":
    sys.exit(main())
