"""What happened in a run, in order, in one format whatever the peers were.

A run against the real peers and the same scenario against ``sim-clusterd`` and the stub
controller must be comparable step by step, so a transcript names nothing of either
implementation: a ``Step`` is one side's view of one thing.

* side ``clusterd``: what ClusterD received and decided. ``rpc`` (``Init``,
  ``Register``, ``Subscribe``, ``ReportProcessFault`` with its fault ranks,
  ``ReportStopComplete`` and ``ReportRecoverStatus`` with the status code reported and
  the strategy, ``ReportRecoverStrategy`` with the strategies), ``signal`` (the signal
  type, its fault ranks, its strategy), ``decision`` (the strategy chosen), ``outcome``
  (the ``ProcessRecoverStatus`` written), ``cycle`` (a closed cycle's state path),
  ``platform`` (platform mode's PodGroup exchange: ``wait-strategy``, ``strategy`` with
  the platform's strategy read and 508 if none came, ``confirm`` with the strategy
  re-read at the confirm step and 509 if unusable, ``confirm-failed`` (509), ``merge``
  with the merged fault ranks, ``rank-table-ready`` / ``rank-table-failed``).
* side ``controller``: what the controller did. ``callback`` (``report_fault_ranks``,
  ``report_stop_complete``, ``report_strategies``, ``report_result``, with fault ranks,
  code and strategy) and ``notify`` (``stop_train``, ``on_global_rank``,
  ``change_strategy`` with the strategy: ``retry``, ``recover``, ``downgrade``,
  ``upgrade``, ``dump``, ``exit``, ``continue``, ``migration``; ``prepare_action``).
* side ``bridge``: the bridge's own record: ``rpc`` with ClusterD's answer code,
  ``signal``, ``notify`` with the controller's return code, ``outcome``.
* side ``platform``: what a test did as the AI platform: ``annotate`` (the PodGroup
  annotations written, and how many signals ClusterD had sent by then).

Fault ranks are written ``"rank:type,..."`` sorted by rank, whatever the source wrote
(``{2:0}``, ``2:0``, ``[2:0, ]``, a Python dict). The parsers here read the real peers'
logs; a run on the simulations needs its own two parsers into the same steps.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .peers import CYCLE_CLOSE_LINE, LogLine


@dataclass(frozen=True)
class Step:
    side: str
    kind: str
    name: str
    faults: str = ""
    strategy: str = ""
    code: int | str | None = None
    detail: str = ""
    at: float = 0.0  # monotonic seconds when it was seen (log lines: when the line was read)

    def key(self) -> tuple[str, str, str, str, str, int | str | None]:
        """What a comparison looks at (not the time, not free text)."""
        return (self.side, self.kind, self.name, self.faults, self.strategy, self.code)

    def __str__(self) -> str:
        parts = [self.side, self.kind, self.name]
        if self.faults:
            parts.append(f"faults={self.faults}")
        if self.strategy:
            parts.append(f"strategy={self.strategy}")
        if self.code is not None:
            parts.append(f"code={self.code}")
        return " ".join(parts)


@dataclass(repr=False)
class Transcript:
    steps: list[Step] = field(default_factory=list)
    outcome: str | None = None  # the PodGroup's ProcessRecoverStatus at the end
    exit_code: int | None = None  # the entry's exit code, None while it runs
    #: other PodGroup annotations read at the end (those a scenario compares), None: absent
    annotations: dict[str, str | None] = field(default_factory=dict)

    def of(self, side: str, kind: str | None = None, name: str | None = None) -> list[Step]:
        return [s for s in self.steps
                if s.side == side and (kind is None or s.kind == kind) and (name is None or s.name == name)]

    def names(self, side: str, kind: str) -> list[str]:
        return [s.name for s in self.of(side, kind)]

    def signals(self) -> list[tuple[str, str, str]]:
        """ClusterD's signals in order: (type, fault ranks, strategy)."""
        return [(s.name, s.faults, s.strategy) for s in self.of("clusterd", "signal")]

    def notifies(self) -> list[str]:
        """The controller's notifies in order, ``change_strategy`` as ``change_strategy:S``."""
        return [f"{s.name}:{s.strategy}" if s.strategy else s.name for s in self.of("controller", "notify")]

    def cycle_paths(self) -> list[str]:
        return [s.detail for s in self.of("clusterd", "cycle")]

    def to_json(self) -> str:
        return json.dumps({"outcome": self.outcome, "exit_code": self.exit_code, "annotations": self.annotations,
                           "steps": [asdict(s) for s in self.steps]}, indent=1)

    def __repr__(self) -> str:  # what an assertion message shows
        return str(self)

    def __str__(self) -> str:
        lines = [f"outcome={self.outcome} exit_code={self.exit_code}"
                 + (f" annotations={self.annotations}" if self.annotations else "")]
        lines += [f"{s.at:10.3f} {s}" for s in self.steps]
        return "\n".join(lines)


_PAIR = re.compile(r"(\d+)\s*:\s*(\d+)")


def faults_text(value: Any) -> str:
    """``"rank:type,..."`` sorted by rank from a dict or any text of rank:type pairs."""
    if isinstance(value, Mapping):
        pairs = {int(k): int(v) for k, v in value.items()}
    else:
        pairs = {int(r): int(t) for r, t in _PAIR.findall(str(value))}
    return ",".join(f"{r}:{t}" for r, t in sorted(pairs.items()))


# --------------------------------------------------------------------------- ClusterD's log
_CD_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    # The Recover service's Init and Register; not the Fault service's own Register
    # ("fault service receive Register request", bridge/job/session/fault_centre.py), a side stream.
    (re.compile(r"(?<!fault )service receive (Init|Register) request"), "unary"),
    (re.compile(r"receive Subscribe signal request"), "subscribe"),
    (re.compile(r"receive ReportProcessFault, info=\{.*faultRanks=(\{[^}]*\})"), "fault"),
    (re.compile(r"receive ReportStopComplete, jobId=\S+, code=(-?\d+)"), "stop"),
    (re.compile(r"receive ReportRecoverStrategy, jobId=\S+, strategy=\[([^\]]*)\]"), "strategies"),
    (re.compile(r"receive ReportRecoverStatus, jobId=\S+, code=(-?\d+), info=.*, strategy=(\w*)"), "status"),
    (re.compile(r"signal enqueue, jobId=\S+, uuid=(\S*), signalType=(\w+), strategy=(\w*), faults=(\S*)"), "signal"),
    (re.compile(r"choose strategy:(\w+)"), "decision"),
    (re.compile(r"ProcessRecoverStatus=([\w-]+)"), "outcome"),
    # Platform mode (controller.go's platform-mode lines; the same in v7.3.2).
    (re.compile(r"start wait plat strategy ready"), "plat-wait"),
    (re.compile(r"finish wait plat strategy, jobId=\S+, pgName=\S+, strategy=(\w*), err=(.*)$"), "plat-strategy"),
    (re.compile(r"plat confirm strategy=(\w*), jobId=\S+, err=(.*)$"), "plat-confirm"),
    (re.compile(r"write confirm fault or wait plat result fault timeout|interacte with plat error"), "plat-failed"),
    (re.compile(r"plat merge faults=(\S*)"), "plat-merge"),
    (re.compile(r"finish wait plat rankTable ready, jobId=\S+, pgName=\S+, err=(.*)$"), "plat-rank-table"),
]
#: ClusterD's platform-mode codes: no usable strategy in time (508); confirm, result or
#: confirm-step strategy failed (509).
_PLAT_CODES = {"plat-strategy": 508, "plat-confirm": 509}
_NIL = "<nil>"


def clusterd_steps(lines: Iterable[LogLine], release: str = "master") -> list[Step]:
    """ClusterD's side from its run log (the harness's stdout)."""
    close = re.compile(rf"controller\.go:{CYCLE_CLOSE_LINE[release]}\s+jobId=\S+'s action path = \{{(.*)\}}")
    steps = []
    for line in lines:
        text = line.text
        match = close.search(text)
        if match:
            if match.group(1) != "INIT":  # the reset a Subscribe does: no cycle closed
                steps.append(Step("clusterd", "cycle", "closed", detail=match.group(1), at=line.at))
            continue
        for pattern, what in _CD_PATTERNS:
            match = pattern.search(text)
            if not match:
                continue
            if what == "unary":
                steps.append(Step("clusterd", "rpc", match.group(1), at=line.at))
            elif what == "subscribe":
                steps.append(Step("clusterd", "rpc", "Subscribe", at=line.at))
            elif what == "fault":
                steps.append(Step("clusterd", "rpc", "ReportProcessFault", faults=faults_text(match.group(1)), at=line.at))
            elif what == "stop":
                steps.append(Step("clusterd", "rpc", "ReportStopComplete", code=int(match.group(1)), at=line.at))
            elif what == "strategies":
                steps.append(Step("clusterd", "rpc", "ReportRecoverStrategy", detail=" ".join(match.group(1).split()),
                                  at=line.at))
            elif what == "status":
                steps.append(Step("clusterd", "rpc", "ReportRecoverStatus", code=int(match.group(1)),
                                  strategy=match.group(2), at=line.at))
            elif what == "signal":
                steps.append(Step("clusterd", "signal", match.group(2), faults=faults_text(match.group(4)),
                                  strategy=match.group(3), detail=match.group(1), at=line.at))
            elif what == "decision":
                steps.append(Step("clusterd", "decision", "strategy", strategy=match.group(1), at=line.at))
            elif what == "outcome":
                steps.append(Step("clusterd", "outcome", match.group(1), at=line.at))
            elif what == "plat-wait":
                steps.append(Step("clusterd", "platform", "wait-strategy", at=line.at))
            elif what in _PLAT_CODES:
                code = None if match.group(2).strip() == _NIL else _PLAT_CODES[what]
                steps.append(Step("clusterd", "platform", what.removeprefix("plat-"), strategy=match.group(1),
                                  code=code, at=line.at))
            elif what == "plat-failed":
                steps.append(Step("clusterd", "platform", "confirm-failed", code=509, at=line.at))
            elif what == "plat-merge":
                steps.append(Step("clusterd", "platform", "merge", faults=faults_text(match.group(1)), at=line.at))
            elif what == "plat-rank-table":
                ready = match.group(1).strip() == _NIL
                steps.append(Step("clusterd", "platform", "rank-table-ready" if ready else "rank-table-failed",
                                  at=line.at))
            break
    return steps


# --------------------------------------------------------------------------- the controller's log
_CALLBACK = re.compile(r"\[PYH ttp_mindx_api\.py:\d+\]\s+do action (report_\w+), arg=(.*)$")
_NOTIFY_RANKS = re.compile(r"Mindx notify (stop train|fault ranks), error_rank: \[(.*)\]")
_NOTIFY_STRATEGY = re.compile(r"Mindx calling notify do (.+?)(?: repair| switch)?\s*(?:\.\.\.)?$")
_STRATEGIES = {"retry": "retry", "ARF": "recover", "Downgrade": "downgrade", "upgrade": "upgrade", "DUMP": "dump",
               "EXIT": "exit", "Migration": "migration", "Continue": "continue"}


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return None


def controller_steps(lines: Iterable[LogLine]) -> list[Step]:
    """The real controller's side from its own log (``TTP_LOG_STDOUT=1``): each callback
    it made with its arguments, each notify it was given."""
    steps = []
    for line in lines:
        text = line.text
        match = _CALLBACK.search(text)
        if match:
            name, args = match.group(1), _literal(match.group(2))
            args = args if isinstance(args, tuple) else ()
            if name == "report_fault_ranks" and args:
                steps.append(Step("controller", "callback", name, faults=faults_text(args[0]), at=line.at))
            elif name == "report_stop_complete" and len(args) >= 3:
                steps.append(Step("controller", "callback", name, faults=faults_text(args[2]), code=args[0],
                                  at=line.at))
            elif name == "report_strategies" and len(args) >= 2:
                steps.append(Step("controller", "callback", name, faults=faults_text(args[0]),
                                  detail=" ".join(args[1]), at=line.at))
            elif name == "report_result" and len(args) >= 4:
                steps.append(Step("controller", "callback", name, faults=faults_text(args[2]), code=args[0],
                                  strategy=args[3], at=line.at))
            else:
                steps.append(Step("controller", "callback", name, detail=match.group(2), at=line.at))
            continue
        match = _NOTIFY_RANKS.search(text)
        if match:
            # The ranks this line lists are the ones new to the controller, not the ones it
            # was given (a globalFault of 2:1,3:1 after a stop on 2:1 logs [3:1, ]): left out.
            name = "stop_train" if match.group(1) == "stop train" else "on_global_rank"
            steps.append(Step("controller", "notify", name, at=line.at))
            continue
        match = _NOTIFY_STRATEGY.search(text)
        if match:
            word = match.group(1).split()[0]
            if word in ("HOT", "STOP"):
                steps.append(Step("controller", "notify", "prepare_action", detail=match.group(1), at=line.at))
            else:
                steps.append(Step("controller", "notify", "change_strategy", strategy=_STRATEGIES.get(word, word),
                                  at=line.at))
    return steps


# --------------------------------------------------------------------------- the bridge's record
def bridge_steps(events: Iterable[Mapping[str, Any]]) -> list[Step]:
    """The bridge's side: the daemon's flight recorder events (``tft-bridge history
    --json``) or the seed launcher's ``LAUNCHER`` records."""
    steps = []
    for event in events:
        kind = event.get("kind")
        at = float(event.get("t") or 0.0)
        if kind == "rpc":
            steps.append(Step("bridge", "rpc", str(event.get("method")), code=event.get("code"), at=at))
        elif kind == "signal":
            steps.append(Step("bridge", "signal", str(event.get("type")), strategy=str(event.get("strategy") or ""),
                              detail=str(event.get("uuid") or ""), at=at))
        elif kind == "notify":
            steps.append(Step("bridge", "notify", str(event.get("action")), strategy=str(event.get("strategy") or ""),
                              code=event.get("rc"), at=at))
        elif kind == "outcome":
            steps.append(Step("bridge", "outcome", str(event.get("outcome")), strategy=str(event.get("strategy") or ""),
                              at=at))
    return steps
