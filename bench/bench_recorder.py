"""Does the flight recorder delay reports or notifies? ``bench_relay.py``'s own phases,
run twice in one process -- recorder off, then on (writing to a temporary directory) --
and their figures side by side.

    python bench/bench_recorder.py [--full] [--phases callbacks,signals] [--sizes 16,1000]

By default ``bench_relay``'s smallest setting (``--quick``). The recorder's loop-side
cost is one tuple appended per event; its writer thread runs on its own clock and
commits to SQLite. What this shows is whether that thread's work (JSON, SQLite, the
GIL it takes) shows up in the bridge's latencies: callback block time, callback -> wire,
callback -> server, and ClusterD signal -> controller notify.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import bench_relay  # noqa: E402
from baseline import pct  # noqa: E402

from bridge.sim.scenario import SimulatedJob  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="bench_relay's full rounds instead of --quick")
    parser.add_argument("--phases", default="callbacks,signals")
    parser.add_argument("--sizes", default="", help="fault-map sizes (default: bench_relay's)")
    args = parser.parse_args()
    if args.sizes:
        bench_relay.SIZES = tuple(int(s) for s in args.sizes.split(","))
    figures: dict[str, list[tuple[str, list[float]]]] = {"off": [], "on": []}  # in print order
    original_row = bench_relay.row
    original_job = bench_relay.SimulatedJob
    mode = ["off"]
    recorders: list[Any] = []

    current = [""]  # which part of bench_relay is running: a fault-map size, or signals
    original_callbacks, original_signals = bench_relay.measure_callbacks, bench_relay.measure_signals

    async def measure_callbacks(sim: Any, callback: Any, size: int, *a: Any, **kw: Any) -> Any:
        current[0] = f"{size} ranks"
        return await original_callbacks(sim, callback, size, *a, **kw)

    async def measure_signals(*a: Any, **kw: Any) -> Any:
        current[0] = "signal"
        return await original_signals(*a, **kw)

    def row(label: str, values: list[float], unit: float, suffix: str) -> str:
        figures[mode[0]].append((f"{current[0]}: {label.strip()} [{suffix}]", [v / unit for v in values]))
        return original_row(label, values, unit, suffix)

    with tempfile.TemporaryDirectory(prefix="bench-recorder-") as directory:

        class Job(SimulatedJob):
            """bench_relay's job, with the recorder on or off as this run says."""

            def __init__(self, *a: Any, **kw: Any) -> None:
                overrides = dict(kw.pop("config_overrides", None) or {})
                overrides["recorder"] = {"enabled": mode[0] == "on", "directory": directory}
                super().__init__(*a, config_overrides=overrides, **kw)

            async def start(self) -> None:
                await super().start()
                if self.bridge is not None and hasattr(self.bridge, "recording"):
                    recorders.append(self.bridge.recording)

        bench_relay.row = row
        bench_relay.SimulatedJob = Job
        bench_relay.measure_callbacks, bench_relay.measure_signals = measure_callbacks, measure_signals
        try:
            for mode[0] in ("off", "on"):
                print(f"\n======== recorder {mode[0]} ========", flush=True)
                asyncio.run(bench_relay.main_async(not args.full, args.phases))
        finally:
            bench_relay.row = original_row
            bench_relay.SimulatedJob = original_job
            bench_relay.measure_callbacks, bench_relay.measure_signals = original_callbacks, original_signals
        written = sum(r.writer.written for r in recorders if r.writer is not None)
        print(f"\nrecorder on: {written} events written to {directory}")

    print("\n======== side by side: recorder off -> on ========")
    print(f"  {'figure':<70} {'p50 off':>10} {'p50 on':>10} {'p99 off':>10} {'p99 on':>10}")
    # bench_relay prints the same rows for each fault-map size, in the same order both times.
    for (label, off), (label_on, on) in zip(figures["off"], figures["on"]):
        assert label == label_on, (label, label_on)
        print(f"  {label:<70} {pct(off, 0.5):10.1f} {pct(on, 0.5):10.1f} {pct(off, 0.99):10.1f} {pct(on, 0.99):10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
