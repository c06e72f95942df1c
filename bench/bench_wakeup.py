"""The report path's thread hops under CPU load, per scheduling policy (issue 16).

    python bench/bench_wakeup.py [--loads 0,2,4] [--rounds 400] [--work 3000] [SETTING ...]

No gRPC, no bridge: the shape of its report path alone. A "controller" thread puts a
timestamp on a queue (a callback's put), does ``--work`` loop iterations holding the
GIL (the controller carrying on) and sleeps 2-6 ms; a hand-off thread takes it and wakes
an asyncio loop (``call_soon_threadsafe``), whose callback puts it on a second queue for
a "report" thread. Printed per setting and load: the put's block time and the time from
the put to each thread running, p50/p99/max in microseconds.

A setting names the policy of the hand-off, loop and report threads:
``batch`` (SCHED_BATCH; ``batch-20``: at nice -20), ``normal``, ``fifo`` (SCHED_FIFO 1
with SCHED_RESET_ON_FORK),
``nice-10``, ``slice100`` (the normal policy with a 100 us EEVDF slice request,
Linux >= 6.12, x86_64 only here). ``fifo`` and ``nice-10`` need privilege
(root, CAP_SYS_NICE or RLIMIT_RTPRIO). ``+pin`` after the hand-off's policy (e.g.
``batch+pin/fifo/fifo``): before each put the controller pins the hand-off thread to
the CPU it runs on, when that changed (session 6, not adopted: bench/README.md).
``+co`` (e.g. ``batch+co/fifo/fifo``): at its first put the controller pins itself to
the CPU it runs on and the hand-off thread there too, once (session 7: what
``bridge/affinity.py`` does, except that there the hand-off thread pins itself after
its batch). This
is what chose ``bridge/realtime.py``'s threads; ``bench_loaded.py`` measures the bridge
itself.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import multiprocessing
import os
import platform
import queue
import random
import sys
import threading
import time

DEFAULT_SETTINGS = ("batch/normal/normal", "normal/normal/normal", "batch/fifo/fifo", "fifo/fifo/fifo")
SCHED_SETATTR = {"x86_64": 314}  # the syscall number, for the slice request


class _SchedAttr(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint32), ("policy", ctypes.c_uint32), ("flags", ctypes.c_uint64),
                ("nice", ctypes.c_int32), ("priority", ctypes.c_uint32), ("runtime", ctypes.c_uint64),
                ("deadline", ctypes.c_uint64), ("period", ctypes.c_uint64)]


def apply(policy: str) -> None:
    """Put the calling thread under ``policy`` (see the module docstring)."""
    if policy.startswith("batch"):
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        if policy != "batch":  # batch-20: SCHED_BATCH at nice -20
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), int(policy[5:]))
    elif policy == "fifo":
        os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(1))
    elif policy.startswith("nice"):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), int(policy[4:]))
    elif policy.startswith("slice"):
        number = SCHED_SETATTR.get(platform.machine())
        if number is None:
            raise SystemExit(f"no sched_setattr number known for {platform.machine()}")
        attr = _SchedAttr(ctypes.sizeof(_SchedAttr), os.SCHED_OTHER, 0, 0, 0, int(policy[5:]) * 1000, 0, 0)
        if ctypes.CDLL(None, use_errno=True).syscall(number, 0, ctypes.byref(attr), 0) != 0:
            raise OSError(ctypes.get_errno(), "sched_setattr")
    elif policy != "normal":
        raise SystemExit(f"unknown policy {policy!r}")


def busy() -> None:
    while True:
        pass


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(setting: str, rounds: int, work: int) -> dict[str, list[float]]:
    handoff_policy, loop_policy, report_policy = setting.split("/")
    handoff_policy, pin = handoff_policy.removesuffix("+pin"), handoff_policy.endswith("+pin")
    handoff_policy, copin = handoff_policy.removesuffix("+co"), handoff_policy.endswith("+co")
    getcpu = ctypes.CDLL(None).sched_getcpu  # the benchmark's own, not the bridge's (GIL released)
    handoff_tid: list[int] = []
    loop = asyncio.new_event_loop()
    handoff_queue: queue.SimpleQueue[float | None] = queue.SimpleQueue()
    report_queue: queue.SimpleQueue[float | None] = queue.SimpleQueue()
    seen: dict[str, list[float]] = {"block": [], "hand-off": [], "loop": [], "report": []}

    def on_loop(put_at: float) -> None:
        seen["loop"].append(time.perf_counter() - put_at)
        report_queue.put(put_at)

    def handoff() -> None:
        apply(handoff_policy)
        handoff_tid.append(threading.get_native_id())
        while (put_at := handoff_queue.get()) is not None:
            seen["hand-off"].append(time.perf_counter() - put_at)
            loop.call_soon_threadsafe(on_loop, put_at)

    def report() -> None:
        apply(report_policy)
        while (put_at := report_queue.get()) is not None:
            seen["report"].append(time.perf_counter() - put_at)

    def controller() -> None:
        pinned = -1
        for _ in range(rounds):
            time.sleep(random.uniform(0.002, 0.006))
            put_at = time.perf_counter()
            if copin and handoff_tid and pinned < 0:
                pinned = getcpu()
                os.sched_setaffinity(0, (pinned,))
                os.sched_setaffinity(handoff_tid[0], (pinned,))
            if pin and handoff_tid and (cpu := getcpu()) != pinned:
                os.sched_setaffinity(handoff_tid[0], (cpu,))
                pinned = cpu
            handoff_queue.put(put_at)
            seen["block"].append(time.perf_counter() - put_at)
            total = 0
            for i in range(work):  # the controller carries on, holding the GIL
                total += i
        time.sleep(0.05)
        loop.call_soon_threadsafe(loop.stop)

    threads = [threading.Thread(target=target) for target in (handoff, report, controller)]
    for thread in threads:
        thread.start()
    before = os.sched_getscheduler(0), os.sched_getparam(0)
    apply(loop_policy)
    try:
        loop.run_forever()
    finally:
        os.sched_setscheduler(0, *before)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 0)
        handoff_queue.put(None)
        report_queue.put(None)
        for thread in threads:
            thread.join()
        loop.close()
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("settings", nargs="*", default=list(DEFAULT_SETTINGS),
                        help="hand-off/loop/report policies (default: %(default)s)")
    parser.add_argument("--loads", default="0,2,4", help="busy-process counts")
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--work", type=int, default=3000, help="loop iterations the controller runs after a put")
    parser.add_argument("--repeat", type=int, default=2, help="runs of every setting per load, alternated")
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores; {args.rounds} puts per run; microseconds from the put (block: the put itself)")
    for load in (int(n) for n in args.loads.split(",")):
        workers = [multiprocessing.Process(target=busy, daemon=True) for _ in range(load)]
        for worker in workers:
            worker.start()
        try:
            time.sleep(0.5)
            for _ in range(args.repeat):
                for setting in args.settings:
                    seen = run(setting, args.rounds, args.work)
                    cells = " | ".join(f"{name} {pct(v, 0.5) * 1e6:5.0f} {pct(v, 0.99) * 1e6:6.0f} "
                                       f"{max(v) * 1e6:6.0f}" for name, v in seen.items())
                    print(f"  {load} busy  {setting:<22} {cells}  (p50 p99 max)", flush=True)
        finally:
            for worker in workers:
                worker.terminate()
                worker.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
