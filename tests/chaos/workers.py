"""The suite's fixed schedules run by a few worker processes at once.

A schedule runs on one event loop against process-wide state (the stub controller of
the seed entry point is one per process), so schedules never share a process; but one
spends most of its seconds waiting on ClusterD's and the controller's timers (about 7%
of a CPU), so several processes side by side finish the fixed set in a fraction of the
time one takes. Each worker is ``python -m tests.chaos --each ...``, which prints one JSON
line per outcome as soon as it is known; the suite's test of a schedule waits for that
line, or for its worker's end, and judges the outcome as if it had run it itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bridge.core.listen_ports import SLICE_ENV, child_slice

#: worker processes; schedules are dealt to them in turn, so results come in test order
WORKERS = 4


class ChaosWorkers:
    """Runs ``schedules`` ((entry, seed) pairs) in ``workers`` processes from the start."""

    def __init__(self, schedules: list[tuple[str, int]], root: Path, workers: int = WORKERS) -> None:
        self._cond = threading.Condition()
        self._outcomes: dict[tuple[str, int], dict[str, Any]] = {}
        self._ended: dict[int, tuple[int, str]] = {}  # worker index -> (exit status, stderr) once it ended
        self._owner: dict[tuple[str, int], int] = {}
        shards = [shard for shard in (schedules[i::workers] for i in range(workers)) if shard]
        self._processes: list[subprocess.Popen[str]] = []
        self._readers: list[threading.Thread] = []
        for index, shard in enumerate(shards):
            for pair in shard:
                self._owner[pair] = index
            # Each worker picks its ports from its own part of this process's slice: the
            # workers run side by side and cannot see each other's picks (the node
            # schedules, last in every shard, run together and bind the same node IPs).
            process = subprocess.Popen(
                [sys.executable, "-m", "tests.chaos", "--each", *(f"{entry}:{seed}" for entry, seed in shard)],
                cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                env={**os.environ, "PYTHONPATH": str(root), SLICE_ENV: child_slice(index + 1, len(shards))})
            self._processes.append(process)
            reader = threading.Thread(target=self._read, args=(index, process), name=f"chaos-worker-{index}",
                                      daemon=True)
            reader.start()
            self._readers.append(reader)

    def _read(self, index: int, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None and process.stderr is not None
        for line in process.stdout:
            try:
                outcome = json.loads(line)
                key = (str(outcome["entry"]), int(outcome["seed"]))
            except (ValueError, KeyError, TypeError):
                continue  # not an outcome line
            with self._cond:
                self._outcomes[key] = outcome
                self._cond.notify_all()
        errors = process.stderr.read()
        status = process.wait()
        with self._cond:
            self._ended[index] = (status, errors)
            self._cond.notify_all()

    def outcome(self, entry: str, seed: int, timeout: float) -> dict[str, Any]:
        """The outcome of one schedule; AssertionError when its worker ended without it or
        it did not come within ``timeout`` seconds."""
        key = (entry, seed)
        index = self._owner[key]
        deadline = time.monotonic() + timeout
        with self._cond:
            while key not in self._outcomes:
                if index in self._ended:
                    status, errors = self._ended[index]
                    raise AssertionError(f"the chaos worker running {entry}:{seed} ended without its outcome "
                                         f"(exit {status}); its stderr:\n{errors[-4000:]}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"no outcome of {entry}:{seed} within {timeout:.0f} s")
                self._cond.wait(remaining)
            return self._outcomes[key]

    def close(self) -> None:
        """Stop every worker (and what it started) and reap it."""
        for process in self._processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for process in self._processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait(10)
        for reader in self._readers:
            reader.join(10)
