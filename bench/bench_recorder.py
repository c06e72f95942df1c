"""Does the flight recorder delay reports or notifies? ``bench_relay.py``'s own phases,
run twice in one process -- recorder off, then on (writing to a temporary directory) --
and their figures side by side.

    python bench/bench_recorder.py [--full] [--repeat N] [--phases callbacks,signals] [--sizes 16,1000]

By default ``bench_relay``'s smallest setting (``--quick``). The recorder's loop-side
cost is one tuple appended per event; its writer thread runs on its own clock and
commits to SQLite. What this shows is whether that thread's work (JSON, SQLite, the
GIL it takes) shows up in the bridge's latencies: callback block time, callback -> wire,
callback -> server, and ClusterD signal -> controller notify. ``--repeat N`` alternates
off/on N times and pools each side's samples, so a burst of load on a shared machine
does not land on one side only.
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


def hook_costs(n: int = 20_000) -> None:
    """What each recorder hook costs the event loop, alone: the part of a report's or a
    notify's latency the recorder adds (the writer thread is not running here)."""
    import time

    from bridge.job.reports.controller_flow import ControllerFlow
    from bridge.job.metrics import BridgeMetrics
    from bridge.job.recorder import Recorder, RecorderWriter
    from bridge.core.recorder_config import RecorderConfig

    with tempfile.TemporaryDirectory(prefix="bench-recorder-hooks-") as directory:
        metrics = BridgeMetrics()
        writer = RecorderWriter(RecorderConfig(queue_limit=10 * n), Path(directory), metrics)
        flow = ControllerFlow()
        recorder = Recorder("bench", flow, writer)
        flow.on_callback("report_fault_ranks")  # a cycle stays open: every event lands in it
        node = {rank: 0 for rank in range(8)}
        big = {rank: 0 for rank in range(100_000)}
        counts = {"uce": 100_000}
        cases: list[tuple[str, Any]] = [
            ("callback, 8-rank fault map", lambda: recorder.callback("report_fault_ranks", 0.0, faults=node,
                                                                     by_type={"uce": 8})),
            ("callback, 100 000-rank fault map", lambda: recorder.callback("report_fault_ranks", 0.0, faults=big,
                                                                           by_type=counts)),
            ("callback, result", lambda: recorder.callback("report_stop_complete", 0.0, code=0)),
            ("rpc", lambda: recorder.rpc("ReportProcessFault", 0, 0.0, 0.001)),
            ("signal", lambda: recorder.signal("stopTrain", "uuid-1", ["stop_train"], "", "", 8)),
            ("notify", lambda: recorder.notify("stop_train", 0, 0.0, 0.001)),
        ]
        print("recorder hooks on the event loop (each alone, no writer thread running)")
        for name, call in cases:
            samples = []
            for _ in range(n // 10):
                start = time.perf_counter()
                for _ in range(10):
                    call()
                samples.append((time.perf_counter() - start) / 10)
                if len(writer._items) > 5 * n:
                    writer._items.clear()
            samples.sort()
            print(f"  {name:<36} p50 {samples[len(samples) // 2] * 1e6:6.2f} us   "
                  f"p99 {samples[int(len(samples) * 0.99)] * 1e6:6.2f} us")
        writer._items.clear()
        writer.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="bench_relay's full rounds instead of --quick")
    parser.add_argument("--phases", default="callbacks,signals")
    parser.add_argument("--sizes", default="", help="fault-map sizes (default: bench_relay's)")
    parser.add_argument("--repeat", type=int, default=1, help="off/on pairs, samples pooled")
    parser.add_argument("--hooks-only", action="store_true", help="only the per-hook cost on the loop")
    args = parser.parse_args()
    hook_costs()
    if args.hooks_only:
        return 0
    if args.sizes:
        bench_relay.SIZES = tuple(int(s) for s in args.sizes.split(","))
    figures: dict[str, dict[str, list[float]]] = {"off": {}, "on": {}}  # mode -> figure -> samples, pooled
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
        key = f"{current[0]}: {label.strip()} [{suffix}]"
        figures[mode[0]].setdefault(key, []).extend(v / unit for v in values)
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
            for mode[0] in ("off", "on") * max(1, args.repeat):
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
    for label, off in figures["off"].items():
        on = figures["on"].get(label)
        if not on:
            continue
        print(f"  {label:<70} {pct(off, 0.5):10.1f} {pct(on, 0.5):10.1f} {pct(off, 0.99):10.1f} {pct(on, 0.99):10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
