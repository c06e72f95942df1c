"""``python -m tests.chaos.bridge_process CONFIG RECORDS``: ``tft-bridge run``, unchanged,
in a process of its own, with the training job of its stub controller driven from outside.

The stub controller lives in the bridge's process (as the real one does), so a chaos
schedule that SIGTERMs or SIGKILLs a real bridge cannot reach the ranks through the
stub's Python API. This process adds two threads to ``tft-bridge run``: one connects the
job's ranks once the controller runs and takes fault injections from stdin (one JSON
object per line), the other appends the stub's observation log to RECORDS (one JSON
line per record, flushed every 20 ms, so a SIGKILL loses at most the last few). Nothing
else differs: the CLI, the config, the signal handling and the bounded exit are the
product's.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

from bridge import cli
from bridge.sim import mindio_ttp

from .schedule import CONTROLLER_TIMINGS, DEVICES_PER_POD, WORLD_SIZE

FLUSH_INTERVAL = 0.02


def _jsonable(value: Any) -> Any:
    """Records hold dicts with int keys and tuples: kept readable as ``repr`` too."""
    return repr(value)


def write_records(path: str) -> None:
    training = mindio_ttp.training
    written = 0
    with open(path, "a", encoding="utf-8") as out:
        while True:
            with training.cond:
                fresh = training.events[written:]
                written += len(fresh)
            for record in fresh:
                out.write(json.dumps({"t": record.t, "kind": record.kind, "name": record.name,
                                      "args": _jsonable(record.args), "result": _jsonable(record.result)}) + "\n")
            out.flush()
            time.sleep(FLUSH_INTERVAL)  # the log's flush cadence, not a wait for anything


def drive_training() -> None:
    training = mindio_ttp.training
    while training.controller is None or str(training.state) != "NORMAL":
        time.sleep(0.01)  # polls for the controller the bridge starts; no event to wait on across the CLI
    training.connect_ranks(range(WORLD_SIZE))
    for line in sys.stdin:
        try:
            command = json.loads(line)
            if command.get("fault"):
                faults = {int(r): int(t) for r, t in command["fault"].items()}
                connected = {r: t for r, t in faults.items()
                             if r in training.ranks and training.ranks[r].connected and training.ranks[r].fault is None}
                if connected:
                    training.inject_fault(connected)
            if "destroy_delay" in command:
                training.destroy_delay = float(command["destroy_delay"])
        except (ValueError, KeyError, TypeError) as error:
            print(f"bridge_process: bad command {line!r}: {error}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    config, records = argv
    mindio_ttp.install()
    training = mindio_ttp.training
    training.use_timings(CONTROLLER_TIMINGS)
    training.auto_step = True
    # The node agent restarts whole pods, the simulated ClusterD's (harness.sim_job), as
    # on the other entry points: a controller told fewer ranks than ClusterD named hangs.
    training.devices_per_pod = DEVICES_PER_POD
    threading.Thread(target=write_records, args=(records,), name="chaos-records", daemon=True).start()
    threading.Thread(target=drive_training, name="chaos-training", daemon=True).start()
    return cli.main(["run", "--config", config])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
