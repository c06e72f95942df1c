"""Fault-codec benchmark: ns per rank for the C and Python implementations and for the
per-item protobuf baseline the existing MindCluster client uses, all measured in one run,
taking turns.

    python bench/bench_faults.py [--quick]

Targets, every figure and the figure it is compared with taken in the same run:
  * at every size, every C operation >= 10x faster than its Python twin;
  * at 10 000 ranks, wire encoding >= 150x faster than the per-item baseline, and every
    C operation under 50 ns/rank;
  * at 100 000 ranks (the largest jobs' fault storms), every C operation's ns/rank within
    1.5x of its ns/rank at 1 000, the two sizes taking turns: the cost per rank stays flat
    as the job grows.
Exit status 1 when a target is missed, so the figures can gate a change. Printed beside the
growth, not gated: the same maps with their key objects made one after another, and
CPython's own C loops over the same maps (``max`` reading every key, ``dict(zip(...))``
building a dict of them), what the machine and the interpreter make of the larger map.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Callable

from bridge.faults import _python as py_codec
from bridge._proto import recover_pb2 as pb

try:
    from bridge.faults import _c as c_codec
except ImportError:  # pragma: no cover
    sys.exit("the C extension is not built: pip install -e . with a compiler available")

SIZES = (16, 1_000, 10_000, 100_000)
TARGET_SIZE = 10_000
ENCODE_RATIO = 150  # the fault path's encode against the per-item protobuf baseline, same run
PYTHON_RATIO = 10  # every C operation against its Python twin, at every size
NS_PER_RANK = 50  # every C operation at TARGET_SIZE
FLAT_SIZE, FLAT_FROM, FLAT_RATIO = 100_000, 1_000, 1.5  # ns/rank at FLAT_SIZE against FLAT_FROM


def fault_map(n: int, seed: int = 7) -> dict[int, int]:
    """n distinct ranks from a job ten times larger, in the random order a controller sees.

    The key objects are the ones ``random.sample`` picks from its pool of 10n ints, so
    they lie scattered over that pool's memory, as the keys of a map that a long-running
    process built up lie wherever its heap had room: above the CPU's cache, reading them
    is part of what is measured."""
    rng = random.Random(seed)
    ranks = rng.sample(range(n * 10), n)
    return {rank: rng.choice((0, 1, 1, 2)) for rank in ranks}


#: The operations whose input is a map of the caller's key objects (parse and decode make their own).
KEYED = ("format", "merge", "encode")


def contiguous(faults: dict[int, int]) -> dict[int, int]:
    """The same map in the same order, its key objects made again one after another (as a
    map built in one go has them), so that reading them is not a cache miss each."""
    return {int(str(rank)): fault_type for rank, fault_type in faults.items()}


def baseline_encode(job_id: str, faults: dict[int, int]) -> bytes:
    """How the existing client builds a fault report: one message object per rank."""
    request = pb.ProcessFaultRequest(jobId=job_id)
    for rank, fault_type in faults.items():
        request.faultRanks.append(pb.FaultRank(rankId=str(rank), faultType=str(fault_type)))
    return request.SerializeToString()


def _loops_for(call: Callable[[], object]) -> int:
    """Calls per timed repeat: enough to swamp timer resolution (~20 ms a repeat)."""
    loops = 1
    while True:
        start = time.perf_counter()
        for _ in range(loops):
            call()
        if time.perf_counter() - start > 0.02 or loops >= 1 << 20:
            return loops
        loops *= 2


def ns_per_rank(calls: dict[str, Callable[[], object]], n: int | dict[str, int], budget: float) -> dict[str, float]:
    """Best of several repeats of each call, the calls taking turns repeat by repeat for
    ``budget`` seconds each: a ratio compares figures taken under the same conditions,
    not one measured in a quiet second and the other in a noisy one (this VM's speed
    drifts within a run). ``n``: the ranks of every call, or of each call by name."""
    ranks = n if isinstance(n, dict) else dict.fromkeys(calls, n)
    loops = {name: _loops_for(call) for name, call in calls.items()}
    best = {name: float("inf") for name in calls}
    deadline = time.perf_counter() + budget * len(calls)
    while True:
        for name, call in calls.items():
            count = loops[name]
            start = time.perf_counter()
            for _ in range(count):
                call()
            best[name] = min(best[name], (time.perf_counter() - start) / count)
        if time.perf_counter() >= deadline:
            return {name: seconds / ranks[name] * 1e9 for name, seconds in best.items()}


def cpython_references(faults: dict[int, int]) -> dict[str, Callable[[], object]]:
    """CPython's own C loops over the same map, for scale: ``max`` reads every key object
    once (what format and encode must do), ``dict(zip(...))`` builds a dict of its entries
    (what merge, parse and decode must return). How these grow from FLAT_FROM to FLAT_SIZE
    ranks is the machine's and the interpreter's, not the codec's."""
    keys, types = list(faults), list(faults.values())
    return {"read keys": lambda: max(keys), "build dict": lambda: dict(zip(keys, types))}


def operations(codec, faults: dict[int, int]) -> dict[str, Callable[[], object]]:
    text = py_codec.format_faults(faults)
    items = list(faults.items())
    half_a, half_b = dict(items[::2]), dict(items[1::2])
    signal = pb.ProcessManageSignal(
        uuid="u", signalType="globalFault",
        faultRanks=[pb.FaultRank(rankId=str(r), faultType=str(t)) for r, t in items],
    ).SerializeToString()
    return {
        "format": lambda: codec.format_faults(faults),
        "parse": lambda: codec.parse_faults(text),
        "merge": lambda: codec.merge_faults(half_a, half_b),
        "encode": lambda: codec.encode_process_fault_request("job", faults),
        "decode": lambda: codec.decode_signal_faults(signal),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter measurements")
    args = parser.parse_args()
    budget = 0.1 if args.quick else 0.4
    misses: list[str] = []
    print(f"{'ranks':>7} {'op':<7} {'C ns/rank':>10} {'Py ns/rank':>11} {'Py/C':>7} {'base ns/rank':>13} {'base/C':>7}")
    for n in SIZES:
        faults = fault_map(n)
        assert c_codec.encode_process_fault_request("job", faults) == baseline_encode("job", faults)
        c_ops, py_ops = operations(c_codec, faults), operations(py_codec, faults)
        for op in c_ops:
            timed = {"c": c_ops[op], "py": py_ops[op]}
            if op == "encode":
                timed["base"] = lambda: baseline_encode("job", faults)
            figures = ns_per_rank(timed, n, budget)
            c_ns, py_ns, base = figures["c"], figures["py"], figures.get("base", 0.0)
            base_cell, base_ratio = (f"{base:13.1f}", f"{base / c_ns:6.1f}x") if op == "encode" else ("", "")
            print(f"{n:>7} {op:<7} {c_ns:10.1f} {py_ns:11.1f} {py_ns / c_ns:6.1f}x {base_cell:>13} {base_ratio:>7}")
            if py_ns / c_ns < PYTHON_RATIO:
                misses.append(f"{n} ranks, {op}: C only {py_ns / c_ns:.1f}x faster than Python (target {PYTHON_RATIO}x)")
            if n == TARGET_SIZE:
                if c_ns >= NS_PER_RANK:
                    misses.append(f"{n} ranks, {op}: C {c_ns:.1f} ns/rank (target < {NS_PER_RANK})")
                if op == "encode" and base / c_ns < ENCODE_RATIO:
                    misses.append(f"{n} ranks, encode: only {base / c_ns:.1f}x faster than the baseline "
                                  f"(target {ENCODE_RATIO}x)")
    print(f"\nC ns/rank at {FLAT_SIZE:,} ranks against {FLAT_FROM:,}, the two taking turns (target <= {FLAT_RATIO}x);")
    print(f"not gated, the same {FLAT_SIZE:,}-rank map with its key objects made again one after another:")
    large_map = fault_map(FLAT_SIZE)
    small, large = operations(c_codec, fault_map(FLAT_FROM)), operations(c_codec, large_map)
    packed = operations(c_codec, contiguous(large_map))
    for op in small:
        timed = {"small": small[op], "large": large[op]}
        if op in KEYED:
            timed["packed"] = packed[op]
        figures = ns_per_rank(timed, {"small": FLAT_FROM, "large": FLAT_SIZE, "packed": FLAT_SIZE}, budget)
        growth = figures["large"] / figures["small"]
        packed_cell = (f"   contiguous keys {figures['packed']:6.1f}  {figures['packed'] / figures['small']:4.2f}x"
                       if op in KEYED else "")
        print(f"  {op:<7} {figures['small']:6.1f} -> {figures['large']:6.1f}  {growth:4.2f}x{packed_cell}")
        if growth > FLAT_RATIO:
            misses.append(f"{op}: {growth:.2f}x the ns/rank at {FLAT_SIZE:,} ranks as at {FLAT_FROM:,} "
                          f"(target {FLAT_RATIO}x)")
    print("  CPython's own loops over the same maps, for scale (not gated):")
    small_refs, large_refs = cpython_references(fault_map(FLAT_FROM)), cpython_references(large_map)
    packed_refs = cpython_references(contiguous(large_map))
    for name in small_refs:
        figures = ns_per_rank({"small": small_refs[name], "large": large_refs[name], "packed": packed_refs[name]},
                              {"small": FLAT_FROM, "large": FLAT_SIZE, "packed": FLAT_SIZE}, budget)
        print(f"  {name:<10} {figures['small']:6.1f} -> {figures['large']:6.1f}  {figures['large'] / figures['small']:4.2f}x"
              f"   contiguous keys {figures['packed']:6.1f}  {figures['packed'] / figures['small']:4.2f}x")
    print()
    if misses:
        print("targets MISSED:\n  " + "\n  ".join(misses))
        return 1
    print(f"targets met: every C op >= {PYTHON_RATIO}x Python at every size; at {TARGET_SIZE:,} ranks encode >= "
          f"{ENCODE_RATIO}x baseline and every C op < {NS_PER_RANK} ns/rank; ns/rank at {FLAT_SIZE:,} ranks "
          f"within {FLAT_RATIO}x of {FLAT_FROM:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
