"""Reading a recorded cycle: its phases, whom the time was spent waiting for, its faults.

Pure functions over a cycle's events (dicts with ``t`` in Unix seconds and ``kind``),
shared by the writer (a closed cycle's summary), ``tft-bridge history`` and the OTLP
export, so all three tell the same story. Phases are cut where the controller's
callbacks cut them, as in ``tft_bridge_recovery_phase_duration_seconds``: a cycle starts
at the first fault report (or ClusterD's first signal), then ``stop``, ``strategy``,
``result``, ``exit``; a phase is named ``<from>_to_<to>``. Who holds the cycle:

* from a report ClusterD must answer until its next signal: **clusterd**;
* from a signal's arrival until its notify starts or it is refused: **bridge**;
* during the notify call: **controller**;
* from an accepted notify until the controller's next callback: **ranks**;
* a refused signal or notify hands the cycle back to whoever held it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PARTIES = ("clusterd", "bridge", "controller", "ranks")
_TYPE_NAMES = {0: "uce", 1: "other", 2: "hccl"}

#: Callbacks that end a phase, and the name of the point they mark.
_BOUNDARIES = {"report_stop_complete": "stop", "report_strategies": "strategy", "report_result": "result"}
#: Callbacks after which the next move is ClusterD's.
_CLUSTERD_TURN = frozenset({"report_stop_complete", "report_strategies", "report_result"})
#: Notifies after which the controller waits for its ranks.
_RANKS_TURN = frozenset({"stop_train", "pause_train", "on_global_rank", "change_strategy", "save_and_exit",
                         "hot switch", "stop switch"})


@dataclass(frozen=True)
class Phase:
    """One phase of a cycle: ``name`` (``<from>_to_<to>``) and its start and end in Unix seconds."""
    name: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.start)


def in_time_order(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Events by time. They are recorded when they complete, so a notify (stamped with
    its start) is recorded after the callbacks the controller made while it ran."""
    return sorted(events, key=lambda event: event["t"])


def boundary(event: dict[str, Any]) -> str | None:
    """The phase point ``event`` marks (stop, strategy, result, exit), or None."""
    if event["kind"] == "callback":
        return _BOUNDARIES.get(event.get("name", ""))
    if event["kind"] == "notify" and event.get("action") == "change_strategy" \
            and event.get("strategy") == "exit" and event.get("rc") == 0:
        return "exit"
    return None


def phases(events: list[dict[str, Any]], started: float, ended: float, opened_by: str = "fault") -> list[Phase]:
    """The cycle's phases in order (see the module docstring)."""
    found: list[Phase] = []
    mark, since = opened_by, started
    for event in in_time_order(events):
        point = boundary(event)
        if point is None:
            continue
        found.append(Phase(f"{mark}_to_{point}", since, event["t"]))
        mark, since = point, event["t"]
    if found and ended - since > 0.001 and mark not in ("result", "exit"):
        found.append(Phase(f"{mark}_to_end", since, ended))
    if not found:
        found.append(Phase(f"{mark}_to_end", since, ended))
    return found


def waits(events: list[dict[str, Any]], started: float, ended: float, opened_by: str = "fault") -> dict[str, float]:
    """Seconds of the cycle each party held it (see the module docstring)."""
    # (t, order, holder or None = give back, tag, notify start)
    marks: list[tuple[float, int, str | None, str, float]] = []
    for order, event in enumerate(in_time_order(events)):
        kind, t = event["kind"], event["t"]
        if kind == "callback" and event.get("name") in _CLUSTERD_TURN:
            marks.append((t, order, "clusterd", "callback", t))
        elif kind == "signal":
            marks.append((t, order, "bridge", "signal", t))
        elif kind == "refused":
            marks.append((t, order, None, "restore", t))
        elif kind == "notify":
            marks.append((t, order, "controller", "set", t))
            done = t + float(event.get("duration") or 0.0)
            if event.get("rc") == 0 and event.get("action") in _RANKS_TURN:
                marks.append((done, order, "ranks", "notify_end", t))
            else:
                marks.append((done, order, None, "notify_end", t))
    marks.sort(key=lambda m: (m[0], m[1]))
    totals = dict.fromkeys(PARTIES, 0.0)
    holder = "clusterd" if opened_by == "fault" else "bridge"
    before_signal = holder if opened_by == "fault" else "clusterd"
    at = started
    last_callback = float("-inf")
    for t, _, who, tag, since in marks:
        t = min(max(t, started), ended)
        totals[holder] += max(0.0, t - at)
        at = max(at, t)
        if tag == "signal":
            if holder != "bridge":
                before_signal = holder
            holder = "bridge"
        elif tag == "notify_end" and last_callback >= since:
            continue  # the controller already answered while the call ran: ClusterD's turn stands
        elif who is None:
            holder = before_signal
        else:
            holder = who
            if tag == "callback":
                last_callback = t
    totals[holder] += max(0.0, ended - at)
    return totals


def fault_summary(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Distinct fault ranks the controller reported in the cycle, by type (merged with
    ClusterD's rule: type 1 sticky, else the later type), listed when few. A report too
    large to list was counted only by type: then each type's largest count is given
    (a lower bound), marked approximate."""
    ranks: dict[int, int] = {}
    largest: dict[str, int] = {}
    reports = 0
    approximate = False
    for event in events:
        if event["kind"] != "callback" or event.get("name") != "report_fault_ranks":
            continue
        reports += 1
        faults = event.get("faults") or {}
        if faults.get("list") is None:
            approximate = True
        else:
            for item in str(faults["list"]).split(","):
                rank, _, kind = item.partition(":")
                if rank and ranks.get(int(rank)) != 1:
                    ranks[int(rank)] = int(kind)
        approximate = approximate or bool(faults.get("approximate"))
        for name, count in (faults.get("by_type") or {}).items():
            largest[name] = max(largest.get(name, 0), int(count))
    by_type: dict[str, int] = {}
    for kind in ranks.values():
        name = _TYPE_NAMES.get(kind, str(kind))
        by_type[name] = by_type.get(name, 0) + 1
    if approximate:
        by_type = {name: max(count, by_type.get(name, 0)) for name, count in largest.items()}
    summary: dict[str, Any] = {"reports": reports, "by_type": by_type}
    if ranks and not approximate and len(ranks) <= 64:
        summary["ranks"] = ",".join(f"{r}:{k}" for r, k in sorted(ranks.items()))
    if approximate:
        summary["approximate"] = True
    return summary


def clusterd_faults_text(info: dict[str, Any]) -> str:
    """"node-1 NPU 0: 80C98000 (RestartNPU)" -- one line for a log, the history, a trace."""
    if info.get("signal") == "unavailable":
        return "not available (this ClusterD release does not serve its Fault service)"
    if info.get("signal") == "normal" or not info.get("devices"):
        return "cleared (ClusterD sees no fault for the job)"
    parts = []
    for device in info["devices"]:
        name = f"{device.get('type') or 'NPU'} {device['device']}" if device.get("device") else "node"
        levels = f" ({','.join(device['levels'])})" if device.get("levels") else ""
        parts.append(f"{device['node']} {name}: {','.join(device.get('codes') or ['-'])}{levels}")
    more = f"; {info['more']} more device(s)" if info.get("more") else ""
    return "; ".join(parts) + more


def clusterd_cause(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What ClusterD's fault centre saw in the cycle (bridge/job/session/fault_centre.py): the last
    fault it published, else the last thing it said (cleared, unavailable); None when
    nothing was heard."""
    heard = [e for e in events if e["kind"] == "clusterd_faults"]
    faults = [e for e in heard if e.get("signal") == "fault" and e.get("devices")]
    chosen = (faults or heard or [None])[-1]
    if chosen is None:
        return None
    return {k: v for k, v in chosen.items() if k not in ("t", "kind")}


def summarise(events: list[dict[str, Any]], started: float, ended: float, opened_by: str) -> dict[str, Any]:
    """The analysis stored with a closed cycle (and computed for open ones)."""
    return {
        "faults": fault_summary(events),
        "phases": [{"name": p.name, "start": p.start, "seconds": round(p.seconds, 6)}
                   for p in phases(events, started, ended, opened_by)],
        "waits": {k: round(v, 6) for k, v in waits(events, started, ended, opened_by).items()},
        "strategy": last_strategy(events),
        "rpcs": sum(1 for e in events if e["kind"] == "rpc"),
        "refusals": sum(1 for e in events if e["kind"] == "refused"),
        "drops": sum(1 for e in events if e["kind"] == "dropped"),
        "clusterd_faults": clusterd_cause(events),
        "rereports": [e.get("reason") for e in events if e["kind"] == "rereport"],
    }


def last_strategy(events: list[dict[str, Any]]) -> str:
    """The strategy last given to (and accepted by) the controller, or last reported."""
    strategy = ""
    for event in events:
        if event["kind"] == "notify" and event.get("rc") == 0 and event.get("strategy"):
            strategy = event["strategy"]
        elif event["kind"] == "notify" and event.get("rc") == 0 and event.get("action") == "save_and_exit":
            strategy = "dump"
        elif event["kind"] == "callback" and event.get("name") == "report_result" and event.get("strategy"):
            strategy = event["strategy"]
    return strategy


def faults_text(faults: dict[str, Any] | None) -> str:
    """"2 ranks: uce 1, other 1 (5:0,6:1)" -- the table's fault column."""
    if not faults or not faults.get("by_type"):
        return "-"
    by_type = faults["by_type"]
    total = sum(by_type.values())
    kinds = ", ".join(f"{name} {count}" for name, count in sorted(by_type.items()))
    text = f"{total} rank{'s' if total != 1 else ''}: {kinds}"
    if faults.get("ranks") and len(faults["ranks"]) <= 24:
        text += f" ({faults['ranks']})"
    return text + (" ~" if faults.get("approximate") else "")


def describe(event: dict[str, Any]) -> str:
    """One timeline line's text for an event."""
    kind = event["kind"]
    if kind == "callback":
        parts = [f"controller {event.get('name')}"]
        if "code" in event:
            parts.append(f"code={event['code']}")
        faults = event.get("faults")
        if faults:
            parts.append(faults_text({**faults, "ranks": faults.get("list")}))
        if event.get("strategies"):
            parts.append(f"strategies={','.join(event['strategies'])}")
        if event.get("strategy"):
            parts.append(f"strategy={event['strategy']}")
        return " ".join(parts)
    if kind == "rpc":
        return f"ClusterD {event.get('method')} -> {event.get('code')} in {float(event.get('latency', 0)) * 1000:.1f} ms"
    if kind == "signal":
        extra = f" strategy={event['strategy']}" if event.get("strategy") else ""
        extra += f" params={event['params']}" if event.get("params") else ""
        extra += f" ranks={event['ranks']}" if event.get("ranks") else ""
        return f"ClusterD signal {event.get('type')} {event.get('actions')} uuid={event.get('uuid') or '-'}{extra}"
    if kind == "notify":
        strategy = f" {event['strategy']}" if event.get("strategy") else ""
        return (f"notify controller {event.get('action')}{strategy} -> {event.get('rc')} "
                f"in {float(event.get('duration', 0)) * 1000:.1f} ms")
    if kind == "refused":
        detail = f" ({event['detail']})" if event.get("detail") else ""
        return f"REFUSED {event.get('signal')} {event.get('actions')}: {event.get('reason')}{detail}"
    if kind == "dropped":
        return f"DROPPED {event.get('report')} report for cycle {event.get('cycle') or '-'}: {event.get('reason')}"
    if kind == "session":
        return f"ClusterD session {event.get('state')}"
    if kind == "uuid":
        return f"ClusterD cycle uuid changed {event.get('old')} -> {event.get('new')}"
    if kind == "outcome":
        return f"outcome {event.get('outcome')} (strategy {event.get('strategy') or '-'})"
    if kind == "hook":
        return f"node hook {event.get('action')} -> {event.get('result')}"
    if kind == "clusterd_faults":
        return f"ClusterD fault centre: {clusterd_faults_text(event)}"
    if kind == "rereport":
        how = "again" if event.get("reason") == "record_held" else "as process faults"
        return (f"RE-REPORTED {faults_text({**event, 'ranks': event.get('list')})} {how}: ClusterD had answered "
                f"the fault report OK and started no recovery ({event.get('reason')})")
    if kind == "repeat":
        return (f"REPEAT of the retry cycle {event.get('of') or '-'} that succeeded: ClusterD runs it again "
                f"(its fault centre kept the repaired fault), no new fault")
    return f"{kind} {({k: v for k, v in event.items() if k not in ('t', 'kind')})}"
