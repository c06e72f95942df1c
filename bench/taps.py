"""Taps into a running simulated job's bridge for the benchmarks: where a report was when,
and the controller's callbacks to call directly. Nothing of the product changes; what
the bridge keeps private is reached from here, never given a hook in ``bridge/``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bridge.job.reports.kinds import REPORT_METHODS
from bridge.sim.scenario import SimulatedJob


def registered_callback(job: SimulatedJob, name: str) -> Callable[..., int]:
    """The callback the bridge registered with the stub controller for ``name``, to call
    as the controller's thread would."""
    callback = job.training.registry.registered(name)
    assert callback is not None, f"the bridge registered no {name}"
    return callback


class StampedCallable:
    """A report channel's callable that notes (method name, time) when each call goes on
    the wire in ``wire``, and when its answer is back in ``answered``."""

    def __init__(self, call: Any, name: str, wire: list[tuple[str, float]],
                 answered: list[tuple[str, float]] | None = None) -> None:
        self.call, self.name, self.wire, self.answered = call, name, wire, answered

    def __call__(self, payload: bytes, timeout: float) -> Any:
        self.wire.append((self.name, time.monotonic()))
        try:
            return self.call(payload, timeout=timeout)
        finally:
            if self.answered is not None:
                self.answered.append((self.name, time.monotonic()))

    def future(self, payload: bytes, timeout: float) -> Any:
        self.wire.append((self.name, time.monotonic()))
        pending = self.call.future(payload, timeout=timeout)
        if self.answered is not None:
            answered = self.answered
            pending.add_done_callback(lambda _: answered.append((self.name, time.monotonic())))
        return pending


def stamp_report_calls(job: SimulatedJob, wire: list[tuple[str, float]],
                       answered: list[tuple[str, float]] | None = None,
                       wrap: Callable[[Any, str], None] | None = None) -> None:
    """Stamp every Report* call of a subscribed bridge as it goes on the wire (and, with
    ``answered``, as its answer is back). ``wrap(callable, name)`` runs on each of the
    report channel's callables first (e.g. a call-start stamp inside it)."""
    assert job.bridge is not None
    wire_ = job.bridge.link.wire
    for method in REPORT_METHODS:
        name = method.rsplit("/", 1)[1]
        callable_ = wire_._callables[method]
        if wrap is not None:
            wrap(callable_, name)
        wire_._callables[method] = StampedCallable(callable_, name, wire, answered)


def wire_log(job: SimulatedJob) -> list[tuple[str, float]]:
    """(method name, time.monotonic()) as each Report* call of the bridge goes on the wire."""
    wire: list[tuple[str, float]] = []
    stamp_report_calls(job, wire)
    return wire
