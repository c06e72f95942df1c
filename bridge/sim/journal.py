"""The simulated ClusterD's journal: one ordered record of everything the server saw and did.

Tests assert on it instead of on timing: every RPC with its decoded request and the code
returned, every signal written to a stream, stream opens and ends, state-machine steps,
faults the server lost, PodGroup annotation writes and protocol violations. ``wait_for``
lets a test wait for an entry that may already exist or may come later, with a deadline,
so no test sleeps "long enough".
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

#: The kinds of entry the journal holds. ``report-late``: a report whose caller had
#: already given up (deadline or cancel) while it was blocked on a full slot was put
#: into the slot anyway, exactly as the real server's goroutine does. ``fault-centre``:
#: what ClusterD's fault centre scheduled or did on its own (a retry cycle started by a
#: UCE/HCCL report, a preExitProcess for a device fault or an unknown fault type, the
#: stale globalFault of a cycle a reset aborted during its wait). ``report-blocked``: a
#: Report* call found its one-slot buffer full and now waits inside the server until the
#: slot drains (its ``rpc`` entry then says 0) or a reset closes it (599); a test that
#: resets a job to see the 599 waits for this entry instead of sleeping. ``kube``: a
#: Kubernetes operation ClusterD asked for that the simulation has no pods to perform (a
#: hot switch's backup pod, an old pod's or the first pod's deletion). ``stuck``: a flow
#: that moves nowhere until the next reset, as the real one does. ``platform``: a step of
#: platform mode's PodGroup exchange (bridge/sim/clusterd_platform.py). ``fault-list``:
#: a publication of the fault centre's retry records and what the Recover service made of
#: it (``new-faults``, ``no-new-faults``, ``event-add-fail``, ``retry-record``,
#: ``retry-record-expired``; bridge/sim/clusterd_retry.py).
KINDS: frozenset[str] = frozenset(
    {"rpc", "signal", "stream-open", "stream-end", "state", "fault-lost", "violation",
     "annotation", "report-late", "report-blocked", "fault-centre", "kube", "stuck",
     "om", "om-stream-open", "om-stream-end", "om-notify", "om-response", "platform", "fault-list"}
)

Predicate = Callable[["JournalEntry"], bool]

#: A reset reason that is one of the state machine's events (``recoverSuccess``,
#: ``notifyFail: ...``), not a cause from outside it (``new subscriber``).
_EVENT_WORD = re.compile(r"^([a-z][A-Za-z]*)(?::|$)")


@dataclass(frozen=True)
class JournalEntry:
    """One thing the simulated server saw or did.

    ``name``: the RPC method (``"ReportStopComplete"``, ``"config.Register"``), the
    signalType, the state name, or the annotation key. ``code``: the ``Status.code``
    returned by an RPC, the gRPC status value of an ended stream, else None.
    ``detail``: the decoded request or signal (see ``SimClusterD`` for the keys).
    """

    seq: int
    at: float
    kind: str
    name: str
    job_id: str
    code: int | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)


class Journal:
    """Append-only list of :class:`JournalEntry` with waiters and listeners."""

    def __init__(self) -> None:
        self.entries: list[JournalEntry] = []
        self._seq = itertools.count()
        self._waiters: list[tuple[Predicate, asyncio.Future[JournalEntry]]] = []
        self._listeners: list[Callable[[JournalEntry], None]] = []

    def __iter__(self) -> Iterator[JournalEntry]:
        return iter(list(self.entries))

    def __len__(self) -> int:
        return len(self.entries)

    def add_listener(self, listener: Callable[[JournalEntry], None]) -> None:
        """Call ``listener(entry)`` for every new entry (the CLI prints them)."""
        self._listeners.append(listener)

    def record(self, kind: str, name: str, job_id: str, code: int | None = None,
               **detail: Any) -> JournalEntry:
        if kind not in KINDS:
            raise ValueError(f"unknown journal kind {kind!r}")
        entry = JournalEntry(next(self._seq), time.monotonic(), kind, name, job_id, code, detail)
        self.entries.append(entry)
        for predicate, future in list(self._waiters):
            if not future.done() and predicate(entry):
                future.set_result(entry)
        self._waiters = [(p, f) for p, f in self._waiters if not f.done()]
        for listener in list(self._listeners):
            listener(entry)
        return entry

    # ------------------------------------------------------------------ queries

    def select(self, kind: str | None = None, name: str | None = None,
               job_id: str | None = None) -> list[JournalEntry]:
        return [
            e for e in self.entries
            if (kind is None or e.kind == kind)
            and (name is None or e.name == name)
            and (job_id is None or e.job_id == job_id)
        ]

    def rpcs(self, name: str | None = None, job_id: str | None = None) -> list[JournalEntry]:
        return self.select("rpc", name, job_id)

    def signals(self, signal_type: str | None = None, job_id: str | None = None,
                include_keepalive: bool = False) -> list[JournalEntry]:
        return [
            e for e in self.select("signal", signal_type, job_id)
            if include_keepalive or signal_type == "keep-alive" or e.name != "keep-alive"
        ]

    def states(self, job_id: str | None = None) -> list[str]:
        """The state names entered, in order (the real server's "action path")."""
        return [e.name for e in self.select("state", None, job_id)]

    def action_paths(self, job_id: str | None = None) -> list[tuple[str, float]]:
        """Each closed cycle's state path as the real server's reset function logs it
        (``controller.go`` ``action path = {...}``), with the time it closed:
        ``State(the event that left it)-->...``, ending ``-->INIT`` when the state
        machine itself went back to INIT (a success), at the last state when a reset cut
        it (a stream end). A reset with no cycle in progress (a Subscribe's) and a cycle
        lost with a restarted server (entry ``clusterd-restarted``) are none."""
        paths: list[tuple[str, float]] = []
        states: list[tuple[str, str]] = []  # (state, the event that led into it) since the last INIT
        for entry in self.select("state"):
            if entry.name == "clusterd-restarted":
                states = []
                continue
            if job_id is not None and entry.job_id != job_id:
                continue
            event = str(entry.detail.get("event") or "")
            if entry.name != "INIT":
                states.append((entry.name, event))
                continue
            if states:
                parts = ["INIT"]
                for state, led_by in states:
                    parts[-1] += f"({led_by})"
                    parts.append(state)
                word = _EVENT_WORD.match(event)  # a reset's reason that is a state-machine event
                if word:
                    parts[-1] += f"({word.group(1)})"
                    parts.append("INIT")
                paths.append(("-->".join(parts), entry.at))
            states = []
        return paths

    def first(self, predicate: Predicate) -> JournalEntry | None:
        return next((e for e in self.entries if predicate(e)), None)

    async def wait_for(self, predicate: Predicate, timeout: float = 5.0) -> JournalEntry:
        """The first entry, past or future, matching ``predicate``; ``TimeoutError`` after
        ``timeout`` seconds, naming the last entries to make the failure readable."""
        found = self.first(predicate)
        if found is not None:
            return found
        future: asyncio.Future[JournalEntry] = asyncio.get_running_loop().create_future()
        self._waiters.append((predicate, future))
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            tail = "\n  ".join(self.format(e) for e in self.entries[-8:])
            raise TimeoutError(
                f"no journal entry matched within {timeout} s; last entries:\n  {tail}"
            ) from None
        finally:
            self._waiters = [(p, f) for p, f in self._waiters if f is not future]

    # ------------------------------------------------------------------ display

    @staticmethod
    def format(entry: JournalEntry) -> str:
        """One readable line, e.g. ``#12   job-1 signal globalFault uuid=.. faults=0:1,1:1``."""
        parts = [f"#{entry.seq:<4} {entry.job_id or '-'} {entry.kind} {entry.name}"]
        if entry.code is not None:
            parts.append(f"code={entry.code}")
        for key, value in entry.detail.items():
            if value is None or value is False or value in ("", [], {}, ()):
                continue
            if key == "timeout" and value == 0:
                continue
            if key == "faults" and isinstance(value, Mapping):
                value = ",".join(f"{r}:{t}" for r, t in value.items())
            parts.append(f"{key}={value}")
        return " ".join(str(p) for p in parts)
