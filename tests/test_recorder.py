"""The flight recorder: cycles grouped from the flow, written by its own thread to a
bounded SQLite store that survives restarts and never takes the bridge down."""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from bridge.core.config import ConfigError, build_config
from bridge.job.reports.controller_flow import ControllerFlow
from bridge.job.metrics import BridgeMetrics
from bridge.job.recorder import INLINE_FAULTS, Recorder, RecorderWriter
from bridge.core.recorder_config import RecorderConfig, problems, OtelConfig, state_directory
from bridge.job.recorder.store import find_cycle, last_cycles, open_reader

from .conftest import eventually_sync


class Clock:
    """A hand-driven monotonic clock: phase and wait arithmetic is checked exactly."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def make(tmp_path: Path, **overrides: object) -> tuple[Recorder, RecorderWriter, ControllerFlow, Clock, BridgeMetrics]:
    metrics = BridgeMetrics()
    config = RecorderConfig(**{"max_cycles": 1000, **overrides})  # type: ignore[arg-type]
    writer = RecorderWriter(config, tmp_path, metrics, poll=0.01, idle_poll=0.01)
    clock = Clock()
    flow = ControllerFlow(clock=clock)
    recorder = Recorder("job-1", flow, writer, clock=clock)
    return recorder, writer, flow, clock, metrics


def stored(path: Path) -> list:
    db = open_reader(path)
    try:
        return last_cycles(db, 100)
    finally:
        db.close()


def run_retry_cycle(recorder: Recorder, flow: ControllerFlow, clock: Clock, uuid: str = "u-1",
                    result: int = 0, repeat: bool = False) -> None:
    """One retry recovery as the daemon would report it: each hook after the flow moved.
    ``repeat``: ClusterD starts it by itself, repeating a retry that succeeded."""
    if not repeat:
        flow.on_callback("report_fault_ranks")
        recorder.callback("report_fault_ranks", clock(), faults={5: 0, 6: 1})
        recorder.rpc("ReportProcessFault", 0, clock(), 0.002)
    clock.advance(1.0)  # ClusterD decides: 1 s
    recorder.signal("stop_train", uuid, ["stop_train"], ranks=2)
    if repeat:
        recorder.repeated()  # the dispatcher's RepeatedCycles told it, before the notify
    flow.notified("stop_train", uuid)
    recorder.notify("stop_train", 0, clock(), 0.001)
    clock.advance(2.0)  # ranks stop: 2 s
    flow.on_callback("report_stop_complete", code=0)
    recorder.callback("report_stop_complete", clock(), code=0)
    recorder.rpc("ReportStopComplete", 0, clock(), 0.002)
    clock.advance(3.0)
    recorder.signal("globalFault", uuid, ["on_global_rank"])
    flow.notified("on_global_rank", uuid)
    recorder.notify("on_global_rank", 0, clock(), 0.001)
    clock.advance(0.5)
    flow.on_callback("report_strategies", strategies=("retry", "exit"))
    recorder.callback("report_strategies", clock(), strategies=["retry", "exit"])
    clock.advance(0.25)
    recorder.signal("changeStrategy", uuid, ["change_strategy"], strategy="retry")
    flow.notified("change_strategy", uuid, "retry")
    recorder.notify("change_strategy", 0, clock(), 0.001, strategy="retry")
    clock.advance(4.0)
    flow.on_callback("report_result", code=result, strategy="retry")
    recorder.callback("report_result", clock(), code=result, strategy="retry")
    recorder.rpc("ReportRecoverStatus", 0, clock(), 0.003)


def test_a_retry_cycle_is_one_record_with_phases_waits_and_outcome(tmp_path: Path) -> None:
    recorder, writer, flow, clock, _ = make(tmp_path)
    run_retry_cycle(recorder, flow, clock)
    assert recorder.current is None, "the result RPC after a successful result closes the cycle"
    writer.stop()
    (cycle,) = stored(writer.path)
    assert (cycle.uuid, cycle.outcome, cycle.strategy, cycle.opened_by) == ("u-1", "success", "retry", "fault")
    assert cycle.ended - cycle.started == pytest.approx(10.75)
    phases = {p["name"]: p["seconds"] for p in cycle.summary["phases"]}
    assert phases == pytest.approx({"fault_to_stop": 3.0, "stop_to_strategy": 3.5, "strategy_to_result": 4.25})
    waits = cycle.summary["waits"]
    # ClusterD: 1 s before stop_train + 3 s before globalFault + 0.25 s before the strategy.
    assert waits["clusterd"] == pytest.approx(4.25)
    # Ranks: stopping 2 - 0.001, reporting 0.5 - 0.001, repairing 4 - 0.001.
    assert waits["ranks"] == pytest.approx(6.497)
    assert waits["controller"] == pytest.approx(0.003)
    assert cycle.summary["faults"]["by_type"] == {"uce": 1, "other": 1}
    assert cycle.summary["faults"]["ranks"] == "5:0,6:1"
    db = open_reader(writer.path)
    (full,) = find_cycle(db, "u-1")
    kinds = [e["kind"] for e in full.events]
    assert kinds.count("rpc") == 3 and kinds.count("signal") == 3 and kinds.count("notify") == 3
    assert kinds[-1] == "outcome"
    assert [e["code"] for e in full.events if e["kind"] == "rpc"] == [0, 0, 0]
    assert find_cycle(db, "u-")[0].key == full.key, "a uuid prefix finds the cycle too"


def test_a_failed_retry_stays_one_cycle_until_the_final_result(tmp_path: Path) -> None:
    recorder, writer, flow, clock, _ = make(tmp_path)
    run_retry_cycle(recorder, flow, clock, result=405)
    assert recorder.current is not None, "405: the controller goes back to wait for a new strategy"
    recorder.signal("globalFault", "u-2", ["on_global_rank"])  # ClusterD moved on to a new uuid
    flow.notified("on_global_rank", "u-2")
    recorder.notify("on_global_rank", 0, clock(), 0.001)
    flow.on_callback("report_strategies", strategies=("recover",))
    recorder.callback("report_strategies", clock(), strategies=["recover"])
    recorder.signal("changeStrategy", "u-2", ["change_strategy"], strategy="recover")
    flow.notified("change_strategy", "u-2", "recover")
    recorder.notify("change_strategy", 0, clock(), 0.001, strategy="recover")
    flow.on_callback("report_result", code=0, strategy="recover")
    recorder.callback("report_result", clock(), code=0, strategy="recover")
    recorder.rpc("ReportRecoverStatus", 0, clock(), 0.001)
    writer.stop()
    (cycle,) = stored(writer.path)
    assert (cycle.outcome, cycle.strategy, cycle.uuid, cycle.uuids) == ("success", "recover", "u-2", ["u-1", "u-2"])
    names = [p["name"] for p in cycle.summary["phases"]]
    assert names == ["fault_to_stop", "stop_to_strategy", "strategy_to_result", "result_to_strategy",
                     "strategy_to_result"]


def test_a_signal_refused_while_idle_is_its_own_not_forwarded_cycle(tmp_path: Path) -> None:
    recorder, writer, flow, clock, _ = make(tmp_path)
    recorder.signal("changeStrategy", "u-9", ["change_strategy"], strategy="retry")
    recorder.refused("unexpected_step", "changeStrategy", "u-9", ["change_strategy"], "controller at idle")
    recorder.refused("foreign_job", "stop_train", "x", ["stop_train"])  # same cycle while it lingers
    clock.advance(recorder.grace)  # the grace itself is the behaviour under test
    recorder.tick()
    assert recorder.current is None
    recorder.refused("foreign_job", "stop_train", "x", ["stop_train"])  # no cycle: not this job's history
    writer.stop()
    (cycle,) = stored(writer.path)
    assert cycle.outcome == "not_forwarded"
    assert cycle.summary["refusals"] == 2


def test_a_fault_clusterd_never_answers_is_unfinished_at_stop_and_interrupted_after_a_crash(tmp_path: Path) -> None:
    recorder, writer, flow, clock, _ = make(tmp_path)
    flow.on_callback("report_fault_ranks")
    recorder.callback("report_fault_ranks", clock(), faults={3: 1})
    recorder.dropped("fault", None, "shutdown")
    recorder.close()
    writer.stop()
    (cycle,) = stored(writer.path)
    assert cycle.outcome == "unfinished" and cycle.summary["drops"] == 1

    # A crash: the cycle opened and its events were written, but it never closed.
    recorder, writer, flow, clock, _ = make(tmp_path)
    flow.on_callback("report_fault_ranks")
    recorder.callback("report_fault_ranks", clock(), faults={4: 0})
    writer.start()
    eventually_sync(lambda: writer.written >= 1, 10, what="the open cycle's event written")
    writer._stop.set()  # the thread ends without a close of the cycle, like a killed bridge
    writer._thread.join(5)
    _, restarted, *_ = make(tmp_path)
    restarted.start()
    eventually_sync(lambda: restarted.store.is_open, 10, what="the store re-opened after the restart")
    restarted.stop()
    cycles = stored(restarted.path)
    assert [c.outcome for c in cycles] == ["unfinished", "interrupted"], "a restart keeps the history"


def test_the_store_keeps_the_last_n_cycles(tmp_path: Path) -> None:
    recorder, writer, flow, clock, _ = make(tmp_path, max_cycles=5)
    for n in range(12):
        run_retry_cycle(recorder, flow, clock, uuid=f"u-{n}")
        writer._drain()  # written batch by batch, as the thread would
    writer.stop()
    assert [c.uuid for c in stored(writer.path)] == [f"u-{n}" for n in range(7, 12)]


def test_the_store_stays_under_its_size_bound(tmp_path: Path) -> None:
    recorder, writer, flow, clock, _ = make(tmp_path, max_mb=0.25)
    faults = {rank: 0 for rank in range(INLINE_FAULTS)}  # the largest inline summary: ~600 bytes an event
    for n in range(150):
        flow.on_callback("report_fault_ranks")
        for _ in range(10):
            recorder.callback("report_fault_ranks", clock(), faults=faults)
        recorder.close()
        flow.on_callback("report_result", code=0)
        writer._drain()
    assert writer.store.used_bytes() <= 0.25 * 1024 * 1024
    assert writer.store.trimmed > 0
    writer.stop()
    cycles = stored(writer.path)
    assert 1 < len(cycles) < 150
    assert os.path.getsize(writer.path) < 2 * 0.25 * 1024 * 1024, "freed pages go back to the file system"


def test_an_unwritable_directory_is_counted_and_never_raises(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    metrics = BridgeMetrics()
    writer = RecorderWriter(RecorderConfig(), blocker / "state", metrics, poll=0.01, idle_poll=0.01)
    flow = ControllerFlow()
    recorder = Recorder("job-1", flow, writer)
    writer.start()
    flow.on_callback("report_fault_ranks")
    recorder.callback("report_fault_ranks", time.monotonic(), faults={1: 0})
    eventually_sync(lambda: metrics.sample("tft_bridge_recorder_errors_total", {"reason": "unwritable"}) >= 1, 10,
                    what="the unwritable store counted")
    recorder.close()
    writer.stop()
    assert not writer.alive


def test_a_dying_writer_thread_tells_its_owner_and_a_stop_does_not(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    died = threading.Event()
    writer = RecorderWriter(RecorderConfig(), tmp_path, BridgeMetrics(), poll=0.01, idle_poll=0.01, on_died=died.set)
    writer.start()
    eventually_sync(lambda: writer.store.is_open, 10, what="the store open")
    writer.stop()
    assert not writer.alive and not died.is_set()

    def broken() -> None:
        raise RuntimeError("a bug in the writer")

    writer = RecorderWriter(RecorderConfig(), tmp_path, BridgeMetrics(), poll=0.01, idle_poll=0.01, on_died=died.set)
    monkeypatch.setattr(writer, "_ensure_store", broken)
    writer.start()
    assert died.wait(10), "the owner was not told"
    assert not writer.alive


def test_a_full_disk_is_counted_and_the_store_recovers(tmp_path: Path) -> None:
    recorder, writer, flow, clock, metrics = make(tmp_path)
    writer._ensure_store()
    (pages,) = writer.store._db.execute("PRAGMA page_count").fetchone()
    writer.store._db.execute(f"PRAGMA max_page_count={pages + 2}")  # the "disk" has two pages left
    big = {rank: 1 for rank in range(INLINE_FAULTS)}
    flow.on_callback("report_fault_ranks")
    for _ in range(200):
        recorder.callback("report_fault_ranks", clock(), faults=big)
    writer._drain()
    assert metrics.sample("tft_bridge_recorder_errors_total", {"reason": "disk_full"}) == 1
    writer.store._db.execute("PRAGMA max_page_count=1073741823")  # space freed
    run_retry_cycle(recorder, flow, clock, uuid="after")
    writer.stop()
    assert any(c.uuid == "after" for c in stored(writer.path))


def test_a_full_queue_drops_and_counts_without_blocking(tmp_path: Path) -> None:
    recorder, writer, flow, clock, metrics = make(tmp_path, queue_limit=100)
    flow.on_callback("report_fault_ranks")
    for _ in range(150):
        recorder.callback("report_fault_ranks", clock(), faults={1: 0})
    assert metrics.sample("tft_bridge_recorder_errors_total", {"reason": "queue_full"}) == 51  # 1 open + 99 events
    recorder.close()  # the close passes the full queue: the cycle and its outcome are never lost
    writer.stop()
    (cycle,) = stored(writer.path)
    assert cycle.outcome == "unfinished"


def test_large_fault_maps_keep_the_metrics_counts_and_are_never_walked_again(tmp_path: Path) -> None:
    recorder, writer, flow, clock, metrics = make(tmp_path, max_events_per_cycle=10)
    faults = {rank: rank % 3 for rank in range(30_000)}
    flow.on_callback("report_fault_ranks")
    recorder.callback("report_fault_ranks", clock(), faults=faults, by_type=metrics.count_faults(faults))
    assert writer._items[-1][4]["faults"] == {"ranks": 30_000, "by_type": {"uce": 10_000, "other": 10_000,
                                                                            "hccl": 10_000}}
    recorder.callback("report_fault_ranks", clock(), faults=dict.fromkeys(range(100), 2))  # no counts given
    assert writer._items[-1][4]["faults"] == {"ranks": 100, "by_type": {}, "approximate": True}
    for _ in range(20):
        recorder.callback("report_fault_ranks", clock(), faults={1: 0})
    recorder.close()
    writer.stop()
    (cycle,) = stored(writer.path)
    assert cycle.summary["faults"]["by_type"] == {"uce": 10_000, "other": 10_000, "hccl": 10_000}
    assert cycle.summary["faults"]["approximate"] is True
    assert cycle.events_dropped == 12


def test_the_store_is_readable_while_the_writer_holds_it(tmp_path: Path) -> None:
    recorder, writer, flow, clock, _ = make(tmp_path)
    writer.start()
    run_retry_cycle(recorder, flow, clock)
    flow.on_callback("report_fault_ranks")
    recorder.callback("report_fault_ranks", clock(), faults={9: 2})  # a second cycle, still open
    eventually_sync(lambda: writer.closed == 1 and writer.written >= 13, 10, what="both cycles written")
    cycles = stored(writer.path)
    assert [c.outcome for c in cycles] == ["success", None]
    assert cycles[1].events[0]["faults"]["by_type"] == {"hccl": 1}
    writer.stop()


def test_configuration_bounds_and_the_state_directory() -> None:
    assert problems(RecorderConfig(), OtelConfig()) == []
    with pytest.raises(ConfigError) as raised:
        build_config({"job_id": "j", "recorder": {"max_cycles": 0, "max_mb": float("nan")}}, {})
    assert any(p.startswith("recorder.max_cycles: must be in 1..1000000") for p in raised.value.problems)
    assert any(p.startswith("recorder.max_mb: expected a finite number") for p in raised.value.problems)
    found = problems(RecorderConfig(), OtelConfig(enabled=True, endpoint="http://x:4317", headers=("bad header",)))
    assert any(p.startswith("otel.endpoint") for p in found)
    assert any(p.startswith("otel.headers") for p in found)
    assert state_directory(RecorderConfig(), "job-1", {"STATE_DIRECTORY": "/var/lib/tft-bridge/j1"}) == \
        Path("/var/lib/tft-bridge/j1")
    assert state_directory(RecorderConfig(), "a/../b", {}) == Path("/var/lib/tft-bridge/a_.._b")
    assert state_directory(RecorderConfig(directory="/srv/x"), "j", {"STATE_DIRECTORY": "/y"}) == Path("/srv/x")


def test_sqlite_wal_mode_is_set(tmp_path: Path) -> None:
    _, writer, *_ = make(tmp_path)
    writer._ensure_store()
    writer.stop()
    (mode,) = sqlite3.connect(writer.path).execute("PRAGMA journal_mode").fetchone()
    assert mode == "wal"


def test_a_signal_repeated_after_its_cycle_closed_joins_that_cycle(tmp_path: Path) -> None:
    recorder, writer, flow, clock, _ = make(tmp_path)
    run_retry_cycle(recorder, flow, clock, uuid="u-1")
    assert recorder.current is None
    clock.advance(3.0)
    recorder.signal("changeStrategy", "u-1", ["change_strategy"], strategy="retry")  # ClusterD repeats itself
    recorder.refused("unexpected_step", "changeStrategy", "u-1", ["change_strategy"])
    assert recorder.current is None
    recorder.signal("changeStrategy", "u-other", ["change_strategy"], strategy="retry")  # not a repeat
    recorder.refused("unexpected_step", "changeStrategy", "u-other", ["change_strategy"])
    recorder.close()
    writer.stop()
    first, second = stored(writer.path)
    db = open_reader(writer.path)
    (full,) = find_cycle(db, "u-1")
    assert [e["kind"] for e in full.events][-2:] == ["signal", "refused"], "the repeat is a late event of u-1"
    assert (first.uuid, first.outcome) == ("u-1", "success")
    assert (second.uuid, second.outcome) == ("u-other", "not_forwarded")


def test_a_dump_then_its_exit_notice_is_one_dump_cycle(tmp_path: Path) -> None:
    recorder, writer, flow, clock, _ = make(tmp_path)
    flow.on_callback("report_fault_ranks")
    recorder.callback("report_fault_ranks", clock(), faults={5: 1})
    recorder.signal("saveAndExit", "", ["save_and_exit"])
    flow.notified("save_and_exit", "stream-1")
    recorder.notify("save_and_exit", 0, clock(), 0.001)
    flow.on_callback("report_result", code=0, strategy="dump")
    recorder.callback("report_result", clock(), code=0, strategy="dump")
    recorder.signal("changeStrategy", "", ["change_strategy"], strategy="exit", params="dump_exit")
    flow.notified("change_strategy", "stream-1", "exit")
    recorder.notify("change_strategy", 0, clock(), 0.001, strategy="exit")
    clock.advance(recorder.grace + 0.01)  # the grace itself is the behaviour under test
    recorder.tick()
    writer.stop()
    (cycle,) = stored(writer.path)
    assert (cycle.outcome, cycle.strategy) == ("exit", "dump")


def test_a_signal_that_asks_the_controller_for_nothing_does_not_absorb_the_next_fault(tmp_path: Path) -> None:
    recorder, writer, flow, clock, _ = make(tmp_path)
    recorder.signal("notify", "u-log", ["new pod running"])  # log-only: no notify, no refusal
    clock.advance(recorder.grace)  # the grace itself is the behaviour under test
    recorder.tick()
    clock.advance(recorder.grace)
    recorder.tick()
    run_retry_cycle(recorder, flow, clock, uuid="u-2")
    writer.stop()
    first, second = stored(writer.path)
    assert (first.uuid, first.outcome) == ("u-log", "not_forwarded")
    assert (second.uuid, second.outcome, second.opened_by) == ("u-2", "success", "fault")


def test_a_repeated_retry_cycle_closes_as_a_repeat_not_a_failure(tmp_path: Path) -> None:
    """ClusterD v7.3.2 runs a retry cycle that succeeded again; the controller fails it
    with 499. The record says repeat_after_success, and the success stays a success."""
    recorder, writer, flow, clock, _ = make(tmp_path)
    run_retry_cycle(recorder, flow, clock, uuid="u-1")
    clock.advance(0.7)
    run_retry_cycle(recorder, flow, clock, uuid="u-2", result=499, repeat=True)
    recorder.close()
    writer.stop()
    first, second = stored(writer.path)
    assert (first.uuid, first.outcome) == ("u-1", "success")
    assert (second.uuid, second.outcome) == ("u-2", "repeat_after_success")
    db = open_reader(writer.path)
    (full,) = find_cycle(db, "u-2")
    repeat = [e for e in full.events if e["kind"] == "repeat"]
    assert repeat and repeat[0]["of"] == "u-1"


def test_the_history_names_a_repeat() -> None:
    from bridge.job.recorder.model import describe

    line = describe({"kind": "repeat", "t": 0.0, "of": "u-1"})
    assert line.startswith("REPEAT of the retry cycle u-1 that succeeded")


def test_the_idle_writer_wakes_no_more_than_once_a_second_and_polls_again_while_events_come(tmp_path: Path) -> None:
    """An idle bridge must not wake the node more than MindCluster's client does: after a
    wake-up that found nothing the writer waits ``idle_poll`` (at least a second), and
    once events come it polls at ``poll`` again, so a cycle is batched as before."""
    writer = RecorderWriter(RecorderConfig(), tmp_path, BridgeMetrics())  # the daemon's defaults
    waits: list[float] = []

    class Stop:  # the writer's stop event, counting its waits; an event arrives in the second
        stopped = False

        def is_set(self) -> bool:
            return self.stopped

        def wait(self, timeout: float) -> bool:
            waits.append(timeout)
            if len(waits) == 2:
                writer._items.append(("open", "c-1", "controller", 1.0, "job-1"))
            self.stopped = len(waits) == 4
            return self.stopped

    writer._stop = Stop()  # type: ignore[assignment]
    writer._run()
    assert waits == [writer.poll, writer.idle_poll, writer.poll, writer.idle_poll]
    assert writer.idle_poll >= 1.0 > writer.poll
