"""Makes the stub controller's ``tft_destroy_controller`` never return (it blocks for an
hour) while it holds the stub's lifecycle lock, which the module's ``atexit`` destroy
takes too -- as the real package registers ``tft_destroy_controller`` with ``atexit``
(docs/mindio-controller.md section 1) and its destroy can block far beyond any bound
mid-flow (section 6). Import it before ``bridge.cli.main(["run", ...])`` with
``controller.module = "stub"``: the bridge then loads this same stub.

With ``HANGING_CONTROLLER_REPAIR=<file>`` in the environment it also plays the training
job: once the controller runs, the ranks connect, one raises a UCE, and the retry repair
ClusterD then chooses lasts ten minutes; ``<file>`` is created when the controller is in
REPAIR -- a SIGTERM from then on arrives during a process-level repair, the case that hung.

Seen: a bridge that gave up on such a destroy then hung in that exit handler,
far past the unit's stop timeout."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from bridge.sim import mindio_ttp as _stub
from bridge.sim.mindio_ttp._constants import State

HANG_SECONDS = 3600.0
REPAIR_SECONDS = 600.0
WORLD_SIZE = 4

_stub.install()
_training = _stub.training
_training.destroy_delay = HANG_SECONDS  # destroy sleeps this long holding the lifecycle lock


def _play_the_job(signal_file: Path) -> None:
    """Connect the ranks, raise a fault, and say when the controller is repairing."""
    deadline = time.monotonic() + 60
    while _training.state is not State.NORMAL and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the stub from its own process: no event to wait on
    _training.retry_repair_time = REPAIR_SECONDS
    _training.connect_ranks(range(WORLD_SIZE))
    _training.step()  # a finished step: the controller can lock it and offer retry
    _training.inject_fault({1: 0})
    while _training.state is not State.REPAIR and time.monotonic() < deadline:
        time.sleep(0.05)
    if _training.state is State.REPAIR:
        signal_file.write_text("repairing\n")


_repair = os.environ.get("HANGING_CONTROLLER_REPAIR")
if _repair:
    threading.Thread(target=_play_the_job, args=(Path(_repair),), name="play-the-job", daemon=True).start()
