"""``python -m tests.chaos``: run chaos schedules and print the figures (see the package)."""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before gRPC loads: its INFO lines drown the figures

import argparse
import asyncio
import json
import logging
import platform
import shutil
import sys
import tempfile

from .runner import describe, replay_command, run_many, run_schedule, shrink
from .schedule import ENTRIES, Schedule, generate


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--seed", type=int, help="run the schedule of this seed")
    what.add_argument("--replay", metavar="JSON", help="run this schedule (as a failure printed it)")
    what.add_argument("--schedules", type=int, default=20, help="run this many schedules (default 20)")
    what.add_argument("--each", nargs="+", metavar="ENTRY:SEED",
                      help="run each of these schedules, printing one JSON line per outcome (the suite's workers)")
    parser.add_argument("--first-seed", type=int, default=0, help="the seed of the first of --schedules")
    parser.add_argument("--entry", choices=ENTRIES, help="only this entry point (default: drawn per seed)")
    parser.add_argument("--no-shrink", action="store_true", help="print failing schedules as drawn")
    parser.add_argument("--stop-after", type=int, help="stop after this many failing schedules")
    parser.add_argument("--dump", action="store_true", help="print both peers' records of a single schedule")
    parser.add_argument("-v", "--verbose", action="store_true", help="the bridge's warnings and errors too")
    args = parser.parse_args(argv)
    if args.schedules is not None and args.schedules < 1:
        parser.error("--schedules must be at least 1")
    return args


def _each(specs: list[str]) -> list[Schedule]:
    """``ENTRY:SEED`` -> the schedule ``generate(SEED, ENTRY)``; ValueError naming a bad one."""
    schedules = []
    for spec in specs:
        entry, _, seed = spec.partition(":")
        if entry not in ENTRIES or not seed.isdigit():
            raise ValueError(f"{spec!r} is not ENTRY:SEED with ENTRY one of {', '.join(ENTRIES)}")
        schedules.append(generate(int(seed), entry))
    return schedules


async def run_each(schedules: list[Schedule]) -> int:
    """One schedule after the other, as drawn (no shrinking); each outcome as one JSON line
    the moment it is known, so a reader can judge it while the next one runs."""
    failed = 0
    for schedule in schedules:
        outcome = await run_schedule(schedule)
        failed += outcome.failed
        print(json.dumps({"entry": schedule.entry, "seed": schedule.seed, "violations": outcome.violations,
                          "seconds": round(outcome.seconds, 1), "replay": replay_command(schedule)}), flush=True)
    return 1 if failed else 0


async def main_async(args: argparse.Namespace) -> int:
    if args.each is not None:
        try:
            schedules = _each(args.each)
        except ValueError as error:
            print(f"python -m tests.chaos: bad --each: {error}", file=sys.stderr)
            return 2
        return await run_each(schedules)
    if args.seed is not None or args.replay is not None:
        try:
            schedule = Schedule.from_json(args.replay) if args.replay else generate(args.seed, args.entry)
        except (ValueError, KeyError, TypeError) as error:
            print(f"python -m tests.chaos: bad schedule: {error!r}", file=sys.stderr)
            return 2
        print(f"schedule: {schedule.to_json()}")
        outcome = await run_schedule(schedule)
        print(describe(outcome))
        if args.dump:
            print("\n".join(outcome.trace))
        print(f"events injected: {dict(outcome.injected)}; skipped (trigger never came / could not apply): "
              f"{dict(outcome.skipped)}; {outcome.seconds:.1f} s")
        if outcome.failed and not args.no_shrink and args.replay is None:
            shrunk = await shrink(outcome)
            print(f"shrunk to {len(shrunk.schedule.events)} event(s); replay with:\n  {replay_command(shrunk.schedule)}")
        elif outcome.failed:
            print(f"replay with:\n  {replay_command(schedule)}")
        return 1 if outcome.failed else 0
    seeds = list(range(args.first_seed, args.first_seed + args.schedules))
    print(f"chaos: {len(seeds)} schedules, seeds {seeds[0]}..{seeds[-1]}, entry {args.entry or 'drawn per seed'}; "
          f"{platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    figures = await run_many(seeds, args.entry, do_shrink=not args.no_shrink, stop_after=args.stop_after)
    print(f"chaos: {figures['schedules']} schedules in {figures['seconds']:.0f} s "
          f"({figures['unrecoverable']} without a recovery path); by entry point: "
          + ", ".join(f"{k} {v}" for k, v in sorted(figures["entries"].items())))
    injected = figures["injected"]
    print(f"chaos: {sum(injected.values())} events injected: "
          + ", ".join(f"{k} {v}" for k, v in sorted(injected.items())))
    skipped = figures["skipped"]
    print(f"chaos: {sum(skipped.values())} events skipped (trigger never came, or nothing to apply to): "
          + (", ".join(f"{k} {v}" for k, v in sorted(skipped.items())) or "none"))
    marks = figures["marks"]
    print("chaos: resources " + "; ".join(f"{name}: {m.threads} threads, {m.fds} fds, {m.rss_kb / 1024:.1f} MB RSS"
                                          for name, m in marks.items()))
    violations = figures["violations"]
    print(f"chaos: {sum(violations.values())} violations"
          + (": " + ", ".join(f"{k} {v}" for k, v in sorted(violations.items())) if violations else ""))
    if figures["by_entry"]:
        print("chaos: violations by invariant and entry point: "
              + ", ".join(f"{k} {v}" for k, v in sorted(figures["by_entry"].items())))
    print(f"chaos: {len(figures['failures'])} failing schedules"
          + (": seeds " + " ".join(str(o.schedule.seed) for o, _ in figures["failures"]) if figures["failures"] else ""))
    return 1 if violations else 0


def main(argv: list[str]) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.WARNING if args.verbose else logging.CRITICAL,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # bridges keep their flight record under $STATE_DIRECTORY: a directory of the run's own
    state = None
    if "STATE_DIRECTORY" not in os.environ:
        os.environ["STATE_DIRECTORY"] = state = tempfile.mkdtemp(prefix="tft-chaos-state-")
    try:
        return asyncio.run(main_async(args))
    finally:
        if state is not None:
            shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
