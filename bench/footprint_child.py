"""The measured process of ``bench_footprint.py``: the stub controller of one job, hosted
either by ``tft-bridge run`` (unchanged) or by MindCluster's synchronous client shape
(``baseline.SyncClient``), with the job's simulated ranks driven from stdin.

    python bench/footprint_child.py bridge CONFIG WORLD_SIZE
    python bench/footprint_child.py sync CLUSTERD_ADDRESS JOB CONTROLLER_PORT WORLD_SIZE

The stub controller lives in the hosting process, as the real one does, so the benchmark
cannot reach its ranks from outside; one thread of this process (on both sides, so both
carry it) reads commands, one per line, and answers on stdout, each answer after
``ANSWER``:

* ``ranks``: connect every rank to the stub (``training.connect_ranks``), answer ``ranks``;
* ``fault``: a UCE on rank 0, answer ``cycle CODE`` once the controller's
  ``report_result`` of that cycle has returned (``cycle timeout`` after ``CYCLE_TIMEOUT``);
* ``threads``: answer ``threads`` and the names of the process's Python threads (JSON).

The synchronous host also answers ``listening`` once its controller listens.

Both sides use the same stub timings (``FAST_TIMINGS``) and node agent (``DEVICES_PER_POD``
ranks restarted per pod), so what differs between them is the host alone.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

from bridge.sim import mindio_ttp

sys.path.insert(0, str(Path(__file__).parent))
from baseline import SyncClient  # noqa: E402

#: Ranks per pod, as the simulated ClusterD is told (``--devices-per-pod``).
DEVICES_PER_POD = 8
#: What every answer starts with: the bridge's own log lines share the pipe.
ANSWER = "footprint_child:"
#: Seconds a cycle may take before the answer says it did not end.
CYCLE_TIMEOUT = 120.0


def drive(world_size: int) -> None:
    """Carry out the stdin commands until EOF."""
    training = mindio_ttp.training
    for line in sys.stdin:
        command = line.strip()
        if command == "ranks":
            training.connect_ranks(range(world_size))
            print(f"{ANSWER} ranks", flush=True)
        elif command == "fault":
            done = len(training.callbacks("report_result"))
            training.inject_fault({0: 0})
            record = training.wait_callback("report_result", done + 1, timeout=CYCLE_TIMEOUT)
            print(f"{ANSWER} cycle {record.args[0] if record is not None else 'timeout'}", flush=True)
        elif command == "threads":
            names = sorted(thread.name for thread in threading.enumerate())
            print(f"{ANSWER} threads {json.dumps(names)}", flush=True)
        elif command:
            print(f"footprint_child: unknown command {command!r}", file=sys.stderr, flush=True)


def host_sync(address: str, job: str, port: int, world_size: int) -> int:
    """The stub controller under the synchronous client, until stdin ends."""
    from bridge.sim.mindio_ttp import controller_ttp as ttp

    os.environ.setdefault("MINDIO_WAIT_MINDX_TIME", "30")  # read at init, like the real controller
    client = SyncClient(address, job)
    client.register()
    ttp.tft_init_controller(-1, world_size, False, True, False)
    ttp.tft_start_controller("127.0.0.1", port, False, "")
    client.start_reader()
    print(f"{ANSWER} listening", flush=True)
    try:
        drive(world_size)
    finally:
        client.close()
        ttp.tft_destroy_controller()
    return 0


def main(argv: list[str]) -> int:
    mindio_ttp.install()
    training = mindio_ttp.training
    training.use_timings(mindio_ttp.FAST_TIMINGS)
    training.auto_step = True
    training.devices_per_pod = DEVICES_PER_POD
    side, *rest = argv
    if side == "bridge":
        from bridge import cli

        config, world_size = rest
        threading.Thread(target=drive, args=(int(world_size),), name="footprint-driver", daemon=True).start()
        return cli.main(["run", "--config", config])
    if side == "sync":
        address, job, port, world_size = rest
        return host_sync(address, job, int(port), int(world_size))
    print(f"footprint_child: unknown side {side!r} (bridge or sync)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
