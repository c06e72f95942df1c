"""``tft-bridge run`` with the stub controller and its simulated ranks, for the node
service's tests (its ``node.bridge_command``): the bridge a node service starts is a
separate process, so its ranks and their faults are driven from inside it. The ranks
of the configured world size connect once the controller runs; writing a rank number
into ``inject-fault`` in the bridge's working directory (the job's state directory)
makes that rank report a UCE, as a training process would. ``NODE_STUB_RANKS=0``: no
rank ever connects (the chaos runner's bridges, whose stops then wait for none).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from bridge.cli import main
from bridge.core.config import read_toml
from bridge.sim import mindio_ttp
from bridge.sim.mindio_ttp import training

TRIGGER = Path("inject-fault")


def drive(world_size: int) -> None:
    while training.controller is None:
        time.sleep(0.05)
    training.connect_ranks(range(world_size))
    while not TRIGGER.exists():
        time.sleep(0.05)
    rank = int(TRIGGER.read_text().strip() or "0")
    TRIGGER.unlink()
    training.inject_fault({rank: 0})


if __name__ == "__main__":
    config = read_toml(sys.argv[sys.argv.index("--config") + 1])
    training.use_timings(mindio_ttp.FAST_TIMINGS)
    training.auto_step = True  # training steps on its own, as a job does
    if os.environ.get("NODE_STUB_RANKS", "1") != "0":
        threading.Thread(target=drive, args=(int(config["controller"]["world_size"]),), name="ranks",
                         daemon=True).start()
    sys.exit(main(sys.argv[1:]))
