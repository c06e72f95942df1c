"""``tft-bridge history``: read back the flight recorder of a running or stopped bridge.

At 3 a.m. the on-call engineer needs one timeline per recovery that neither ClusterD's
logs nor the controller's show: what the controller reported and when, what ClusterD
answered, what was forwarded or refused and why, and who the time went to. So:

* no arguments but a unit's name or config: the last cycles as a table (start, fault
  ranks, strategy, outcome, duration, phase durations, who was waited on);
* ``--cycle UUID`` (ClusterD's uuid, the bridge's own key for cycles without one, or a
  prefix of either): that cycle's full timeline, phase by phase;
* ``--json``: the same for tools.

It opens the store read-only (``bridge.job.recorder.store.open_reader``): it never needs
write access to the unit's state directory and never disturbs the bridge writing it.
A unit's store is found from its config file (``--config /etc/tft-bridge/job1.toml``
looks in ``/var/lib/tft-bridge/job1``, the unit's ``StateDirectory=``) or given
directly (``--state-dir``). Exit codes: 0 shown, 1 no such cycle, 2 no store / bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

from bridge.core.recorder_config import STATE_ROOT, STORE_NAME, RecorderConfig, candidate_directories
from bridge.job.recorder.model import PARTIES, boundary, clusterd_faults_text, describe, faults_text, in_time_order, summarise
from bridge.job.recorder.store import CycleRow, find_cycle, last_cycles, open_reader


def add_history_parser(commands: Any) -> None:
    history = commands.add_parser(
        "history", help="the flight recorder: the last recovery cycles, or one cycle's timeline",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = history.add_mutually_exclusive_group()
    where.add_argument("--state-dir", metavar="DIR", help="the unit's state directory (or the store file itself)")
    where.add_argument("--config", metavar="FILE", help="the job's config file; its unit's store is found from it")
    history.add_argument("--cycle", metavar="UUID", help="one cycle's full timeline (uuid, key, or a prefix)")
    history.add_argument("--last", type=int, default=20, metavar="N", help="how many cycles the table shows (20)")
    history.add_argument("--json", action="store_true", help="machine-readable output")
    history.set_defaults(func=cmd_history)


class HistoryError(Exception):
    """No store to read, with where it was looked for."""


def find_store(state_dir: str | None, config_path: str | None, env: dict[str, str] | None = None) -> Path:
    env = dict(os.environ) if env is None else env
    if state_dir:
        path = Path(state_dir)
        path = path if path.is_file() else path / STORE_NAME
        if not path.is_file():
            raise HistoryError(f"no flight-recorder store at {path}")
        return path
    tried: list[Path] = []
    if config_path:
        recorder, job_id = _recorder_of(config_path)
        tried = [d / STORE_NAME for d in candidate_directories(recorder, job_id, config_path)]
    elif env.get("STATE_DIRECTORY"):
        tried = [Path(env["STATE_DIRECTORY"].split(":")[0]) / STORE_NAME]
    else:
        found = sorted(STATE_ROOT.glob(f"*/{STORE_NAME}")) if STATE_ROOT.is_dir() else []
        if len(found) == 1:
            return found[0]
        units = ", ".join(p.parent.name for p in found) or "none found"
        raise HistoryError(f"say which bridge: --config /etc/tft-bridge/JOB.toml or --state-dir DIR "
                           f"(stores under {STATE_ROOT}: {units})")
    for path in tried:
        if path.is_file():
            return path
    raise HistoryError("no flight-recorder store at " + " or ".join(str(p) for p in tried)
                       + " (is the recorder enabled, and may this user read the unit's state directory?)")


def _recorder_of(config_path: str) -> tuple[RecorderConfig, str]:
    """The [recorder] section and job id of a job's config file. Only where the store is
    matters here, so a config that is invalid only without its unit's environment (the
    job id often comes from /etc/tft-bridge/%i.env, which an operator's shell lacks) is
    read as plain TOML instead."""
    from bridge.core.config import ConfigError, load_config, read_toml

    try:
        config = load_config(config_path)
        return config_recorder(config), config.job_id
    except ConfigError as error:
        try:
            raw = read_toml(config_path)
        except ConfigError:
            raise HistoryError(str(error)) from None
    section = raw.get("recorder") if isinstance(raw.get("recorder"), dict) else {}
    directory = section.get("directory", "")
    job_id = raw.get("job_id", "")
    return (RecorderConfig(directory=directory if isinstance(directory, str) else ""),
            job_id if isinstance(job_id, str) else "")


def config_recorder(config: Any) -> RecorderConfig:
    """The [recorder] section of a loaded BridgeConfig (defaults when it has none)."""
    recorder = getattr(config, "recorder", None)
    return recorder if isinstance(recorder, RecorderConfig) else RecorderConfig()


# --------------------------------------------------------------------------- formatting

def _analysed(row: CycleRow, now: float) -> dict[str, Any]:
    """The stored summary, or for a cycle still open the same analysis up to now."""
    if row.summary is not None:
        return row.summary
    return summarise(row.events, row.started, _ended(row, now), row.opened_by)


def _ended(row: CycleRow, now: float) -> float:
    """A closed cycle's end; for one still open, now (or its last event, if later)."""
    if row.ended is not None:
        return row.ended
    return max([now, row.started] + [e["t"] for e in row.events])


def _strategy(row: CycleRow, summary: dict[str, Any]) -> str:
    return row.strategy or summary.get("strategy") or "-"


def _seconds(value: float) -> str:
    if value >= 120:
        return f"{value / 60:.1f}m"
    if value >= 10:
        return f"{value:.0f}s"
    return f"{value:.1f}s" if value >= 0.1 else f"{value * 1000:.0f}ms"


def _phase_text(summary: dict[str, Any]) -> str:
    short = {"fault_to_stop": "stop", "stop_to_strategy": "strat", "strategy_to_result": "result"}
    return " ".join(f"{short.get(p['name'], p['name'])}={_seconds(p['seconds'])}" for p in summary.get("phases", []))


def _waits_text(summary: dict[str, Any]) -> str:
    waits = summary.get("waits", {})
    total = sum(waits.values()) or 1.0
    ranked = sorted(((v, k) for k, v in waits.items() if v > 0), reverse=True)
    return " ".join(f"{k} {v / total:.0%}" for v, k in ranked[:3]) or "-"


def cycle_json(row: CycleRow, now: float, with_events: bool) -> dict[str, Any]:
    data = row.as_dict()
    data["open"] = row.ended is None
    data["duration"] = _ended(row, now) - row.started
    data["summary"] = _analysed(row, now)
    data["strategy"] = row.strategy or data["summary"].get("strategy") or None
    if with_events:
        data["events"] = row.events
    return data


def cause_text(cause: dict[str, Any] | None) -> str:
    """What ClusterD's fault centre saw (bridge/job/session/fault_centre.py), or "-" when it said nothing."""
    return "-" if not cause else f"ClusterD: {clusterd_faults_text(cause)}"


def table(rows: list[CycleRow], now: float) -> str:
    header = ("START", "CYCLE", "FAULTS", "STRATEGY", "OUTCOME", "DURATION", "PHASES", "WAITED FOR")
    lines = [header]
    for row in rows:
        summary = _analysed(row, now)
        duration = _ended(row, now) - row.started
        lines.append((
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row.started)),
            (row.uuid or row.key)[:36],
            faults_text(summary.get("faults")),
            _strategy(row, summary),
            row.outcome or "open",
            _seconds(duration),
            _phase_text(summary),
            _waits_text(summary),
        ))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(str(cell).ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def timeline(row: CycleRow, now: float) -> str:
    summary = _analysed(row, now)
    ended = _ended(row, now)
    out = [
        f"cycle {row.uuid or '(no ClusterD uuid)'}  key {row.key}  job {row.job}",
        f"  started   {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(row.started))}."
        f"{int(row.started % 1 * 1000):03d}  (opened by {row.opened_by})",
        f"  outcome   {row.outcome or 'open'}  strategy {_strategy(row, summary)}  duration {_seconds(ended - row.started)}",
        f"  faults    {faults_text(summary.get('faults'))}",
        f"  cause     {cause_text(summary.get('clusterd_faults'))}",
        *([f"  re-report {', '.join(summary['rereports'])}: ClusterD skipped the fault report, the bridge "
           "reported it once more"] if summary.get("rereports") else []),
        "  waited    " + ", ".join(f"{p} {_seconds(summary['waits'].get(p, 0.0))}" for p in PARTIES),
    ]
    if len(row.uuids) > 1:
        out.append(f"  uuids     {' -> '.join(row.uuids)}")
    if row.events_dropped:
        out.append(f"  ({row.events_dropped} events beyond the per-cycle limit were not kept)")
    out.append("")
    phases = list(summary.get("phases", []))
    index = 0
    if phases:
        out.append(f"  ---- {phases[0]['name']} ({_seconds(phases[0]['seconds'])})")
    for event in in_time_order(row.events):
        out.append(f"  +{event['t'] - row.started:9.3f}s  {describe(event)}")
        if boundary(event) and index + 1 < len(phases):
            index += 1
            out.append(f"  ---- {phases[index]['name']} ({_seconds(phases[index]['seconds'])})")
    return "\n".join(out)


# --------------------------------------------------------------------------- command

def cmd_history(args: argparse.Namespace) -> int:
    try:
        path = find_store(args.state_dir, args.config)
        db = open_reader(path)
    except HistoryError as error:
        print(f"tft-bridge history: {error}", file=sys.stderr)
        return 2
    except (OSError, sqlite3.Error) as error:
        print(f"tft-bridge history: cannot read the store: {error}", file=sys.stderr)
        return 2
    now = time.time()
    try:
        if args.cycle:
            rows = find_cycle(db, args.cycle)
            if not rows:
                print(f"tft-bridge history: no cycle {args.cycle!r} in {path}", file=sys.stderr)
                return 1
            if args.json:
                print(json.dumps([cycle_json(r, now, True) for r in rows] if len(rows) > 1
                                 else cycle_json(rows[0], now, True), indent=2))
            else:
                print("\n\n".join(timeline(r, now) for r in rows))
            return 0
        rows = last_cycles(db, max(1, args.last))
        if args.json:
            print(json.dumps({"store": str(path), "cycles": [cycle_json(r, now, False) for r in rows]}, indent=2))
        elif not rows:
            print(f"no recovery cycles recorded yet in {path}")
        else:
            print(table(rows, now))
            print(f"\n{len(rows)} cycle(s) from {path}; one cycle's timeline: tft-bridge history --cycle UUID"
                  + (f" --state-dir {path.parent}" if args.state_dir else f" --config {args.config}"
                     if args.config else ""))
        return 0
    except sqlite3.Error as error:
        print(f"tft-bridge history: cannot read {path}: {error}", file=sys.stderr)
        return 2
    finally:
        db.close()
