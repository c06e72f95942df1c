"""The controller-step tracker: what may be forwarded when (docs/mindio-controller.md 4-5)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from bridge.job.reports.controller_flow import ACCEPTS, ANY, CALLBACKS, EXPECTED, EXPIRY_MARGIN, FOLLOW, NOTIFIED, STAY, ControllerFlow, Step, outcome
from bridge.job.session.signals import PAUSE_TIMEOUT_MAX

from .conftest import eventually


def at_strategy(flow: ControllerFlow, offered: tuple[str, ...] = ("exit", "dump", "retry", "recover")) -> None:
    flow.on_callback("report_fault_ranks")
    flow.notified("stop_train", "U1")
    flow.on_callback("report_stop_complete", code=0)
    flow.notified("on_global_rank", "U1")
    flow.on_callback("report_fault_ranks")  # the second one of the same flow
    flow.on_callback("report_strategies", strategies=offered)


def test_normal_flow_gates_each_step() -> None:
    flow = ControllerFlow()
    assert flow.refusal("on_global_rank") == "unexpected_step"
    flow.on_callback("report_fault_ranks")
    assert flow.step is Step.AWAIT_STOP
    assert flow.refusal("stop_train") is None
    assert flow.refusal("change_strategy", "retry") == "unexpected_step"
    flow.notified("stop_train", "U1")
    assert flow.refusal("stop_train") == "unexpected_step"  # a duplicate would kill the flow
    flow.on_callback("report_stop_complete", code=0)
    assert flow.refusal("on_global_rank") is None
    flow.notified("on_global_rank", "U1")
    assert flow.refusal("on_global_rank") == "unexpected_step"
    flow.on_callback("report_fault_ranks")
    assert flow.step is Step.GLOBAL_SENT  # the second fault report is not a new flow
    flow.on_callback("report_strategies", strategies=("exit", "dump", "retry"))
    assert flow.refusal("change_strategy", "recover") == "strategy_not_offered"
    assert flow.refusal("change_strategy", "elastic-training") == "clusterd_only_strategy"
    assert flow.refusal("change_strategy", "bogus") == "unknown_strategy"
    assert flow.refusal("change_strategy", "retry") is None
    flow.notified("change_strategy", "U1", "retry")
    assert flow.refusal("change_strategy", "retry") == "unexpected_step"
    flow.on_callback("report_result", code=0, strategy="retry")
    assert flow.step is Step.IDLE
    assert flow.answering == "U1"


def test_retry_405_waits_for_global_fault_again() -> None:
    flow = ControllerFlow()
    at_strategy(flow)
    flow.notified("change_strategy", "U1", "retry")
    flow.on_callback("report_result", code=405, strategy="retry")
    assert flow.refusal("on_global_rank") is None
    assert flow.refusal("change_strategy", "recover") == "unexpected_step"


def test_failed_repair_allows_only_dump_or_exit() -> None:
    flow = ControllerFlow()
    at_strategy(flow)
    flow.notified("change_strategy", "U1", "recover")
    flow.on_callback("report_result", code=406, strategy="recover")
    assert flow.refusal("change_strategy", "recover") == "strategy_not_offered"
    assert flow.refusal("change_strategy", "dump") is None
    flow.notified("change_strategy", "U1", "dump")
    flow.on_callback("report_result", code=0, strategy="dump")
    assert flow.step is Step.EXITING
    assert flow.refusal("change_strategy", "exit") is None  # the dump_exit notice
    flow.notified("change_strategy", "U1", "exit")
    assert flow.refusal("change_strategy", "exit") == "unexpected_step"  # the repeated one, 80 s later


def test_exit_expects_no_result_and_one_notice() -> None:
    flow = ControllerFlow()
    at_strategy(flow)
    flow.notified("change_strategy", "U1", "exit")
    assert flow.step is Step.EXITING
    flow.notified("change_strategy", "U1", "exit")
    assert flow.step is Step.EXITED
    assert flow.refusal("stop_train") == "unexpected_step"


def test_clusterd_first_stop_is_not_answered_twice() -> None:
    flow = ControllerFlow()
    assert flow.refusal("stop_train") is None  # idle: a hardware fault seen by ClusterD first
    flow.notified("stop_train", "U2")
    flow.on_callback("report_fault_ranks")  # the controller still reports the faults
    assert flow.refusal("stop_train") == "unexpected_step"
    flow.on_callback("report_stop_complete", code=0)
    assert flow.step is Step.AWAIT_GLOBAL


def test_pause_then_continue() -> None:
    flow = ControllerFlow()
    assert flow.refusal("pause_train") is None
    flow.notified("pause_train", "P1")
    assert flow.refusal("change_strategy", "continue") == "unexpected_step"
    flow.on_callback("report_stop_complete", code=0)
    assert flow.step is Step.PAUSED
    assert flow.refusal("change_strategy", "retry") == "unexpected_step"
    assert flow.refusal("change_strategy", "continue") is None
    flow.notified("change_strategy", "P1", "continue")
    flow.on_callback("report_result", code=0, strategy="continue")
    assert flow.step is Step.IDLE


def test_pause_timeout_turns_into_a_fault_flow() -> None:
    flow = ControllerFlow()
    flow.notified("pause_train", "P1")
    flow.on_callback("report_stop_complete", code=0)
    flow.on_callback("report_result", code=406)
    flow.on_callback("report_fault_ranks")
    assert flow.step is Step.AWAIT_STOP


def test_stop_complete_404_means_exit() -> None:
    flow = ControllerFlow()
    flow.on_callback("report_fault_ranks")
    flow.notified("stop_train", "U")
    flow.on_callback("report_stop_complete", code=404)
    assert flow.step is Step.EXITING
    assert flow.refusal("on_global_rank") == "unexpected_step"


def test_invalid_strategy_result_means_exit() -> None:
    flow = ControllerFlow()
    at_strategy(flow)
    flow.notified("change_strategy", "U1", "retry")
    flow.on_callback("report_result", code=499, strategy="")
    assert flow.step is Step.EXITING


def test_downgrade_then_upgrade() -> None:
    flow = ControllerFlow()
    at_strategy(flow, ("exit", "dump", "recover", "downgrade", "upgrade"))
    flow.notified("change_strategy", "U1", "downgrade")
    flow.on_callback("report_result", code=201, strategy="downgrade")
    assert flow.step is Step.IDLE and flow.downgraded
    assert flow.refusal("change_strategy", "upgrade") is None
    assert flow.refusal("change_strategy", "retry") == "unexpected_step"


def test_a_wait_the_controller_has_timed_out_becomes_exiting() -> None:
    now = [100.0]
    flow = ControllerFlow(wait_timeout=30, clock=lambda: now[0])
    flow.on_callback("report_fault_ranks")
    now[0] += 20
    assert not flow.expire()
    now[0] += 20
    assert flow.refusal("stop_train") == "unexpected_step"
    assert flow.step is Step.EXITING


# --------------------------------------------------------------------------- wait limits

class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def paused_then_resumed(flow: ControllerFlow, pause: int) -> None:
    """A ClusterD pause of ``pause`` s, continued: the controller remembers the timeout."""
    flow.notified("pause_train", "P1", seconds=pause)
    flow.on_callback("report_stop_complete", code=0)
    flow.notified("change_strategy", "P1", "continue")
    flow.on_callback("report_result", code=0, strategy="continue")
    assert flow.step is Step.IDLE


def test_after_a_long_pause_a_stop_train_is_accepted_as_long_as_the_controller_waits_for_it() -> None:
    """Before: refused 35 s after the fault report, while the controller waited 900 s
    (max(last pause timeout, MINDIO_WAIT_MINDX_TIME)): the job was killed."""
    clock = Clock()
    flow = ControllerFlow(wait_timeout=30, clock=clock)
    paused_then_resumed(flow, 900)
    flow.on_callback("report_fault_ranks")  # a later fault, long after the pause
    clock.now += 600
    assert flow.refusal("stop_train") is None
    assert flow.wait_limit() == 900
    clock.now += 300 + EXPIRY_MARGIN + 1
    assert flow.refusal("stop_train") == "unexpected_step"
    assert flow.step is Step.EXITING and flow.expired_wait == 900  # what the daemon logs


def test_a_short_pause_does_not_shorten_the_stop_wait() -> None:
    clock = Clock()
    flow = ControllerFlow(wait_timeout=30, clock=clock)
    paused_then_resumed(flow, 5)
    flow.on_callback("report_fault_ranks")
    clock.now += 30 + EXPIRY_MARGIN - 1
    assert flow.refusal("stop_train") is None
    clock.now += 2
    assert flow.expire() and flow.step is Step.EXITING


def test_the_global_fault_time_lengthens_the_strategy_wait_only() -> None:
    """Before: change_strategy refused 35 s after the list although the controller waits
    max(on_global_rank time, MINDIO_WAIT_MINDX_TIME) = 120 s."""
    clock = Clock()
    flow = ControllerFlow(wait_timeout=30, clock=clock)
    flow.on_callback("report_fault_ranks")
    flow.notified("stop_train", "U1")
    flow.on_callback("report_stop_complete", code=0)
    flow.notified("on_global_rank", "U1", seconds=120)
    flow.on_callback("report_fault_ranks")
    flow.on_callback("report_strategies", strategies=("exit", "dump", "retry"))
    clock.now += 100
    assert flow.refusal("change_strategy", "retry") is None
    clock.now += 20 + EXPIRY_MARGIN + 1
    assert flow.refusal("change_strategy", "retry") == "unexpected_step"
    assert flow.step is Step.EXITING


def test_the_global_fault_time_does_not_lengthen_the_other_waits() -> None:
    clock = Clock()
    flow = ControllerFlow(wait_timeout=30, clock=clock)
    at_strategy(flow)
    flow.global_time = 600  # as if on_global_rank had said 600 s
    flow.notified("change_strategy", "U1", "retry")
    flow.on_callback("report_result", code=405, strategy="retry")
    assert flow.step is Step.AWAIT_GLOBAL and flow.wait_limit() == 30  # MindXReConfirmStrategy's wait
    flow.notified("on_global_rank", "U1", seconds=600)
    flow.on_callback("report_strategies", strategies=("exit", "recover"))
    flow.notified("change_strategy", "U1", "recover")
    flow.on_callback("report_result", code=406, strategy="recover")
    assert flow.step is Step.AWAIT_FINAL and flow.wait_limit() == 30  # WaitDumpOrExitStrategy's


def test_zit_and_hot_switch_lists_wait_only_the_configured_wait() -> None:
    """ZitHandleStrategy and StepFinishCallback wait MINDIO_WAIT_MINDX_TIME, whatever the
    on_global_rank time was."""
    flow = ControllerFlow(wait_timeout=30)
    at_strategy(flow, ("exit", "dump", "downgrade", "upgrade"))
    flow.notified("change_strategy", "U1", "downgrade")
    flow.on_callback("report_result", code=201, strategy="downgrade")
    flow.on_callback("report_fault_ranks")  # a new fault in DOWNGRADE
    flow.notified("stop_train", "U2")
    flow.on_callback("report_stop_complete", code=0)
    flow.notified("on_global_rank", "U2", seconds=900)
    flow.on_callback("report_strategies", strategies=("exit", "dump"))
    assert flow.step is Step.AWAIT_STRATEGY and flow.wait_limit() == 30
    hot = ControllerFlow(wait_timeout=30)
    hot.global_time = 900
    hot.on_callback("report_strategies", strategies=("migration",))
    assert hot.wait_limit() == 30
    failed_switch = ControllerFlow(wait_timeout=30)
    failed_switch.global_time = 900
    failed_switch.on_callback("report_strategies", strategies=("exit",))  # its pause failed
    assert failed_switch.wait_limit() == 30


async def test_the_dispatcher_gives_the_flow_the_times_it_passed_to_the_controller() -> None:
    """The limits come from the clamped arguments of the actual notify calls."""
    from .test_signals import Rig, signal

    clock = Clock()
    rig = Rig()
    rig.flow = rig.dispatcher.flow = ControllerFlow(wait_timeout=30, clock=clock)
    task = asyncio.create_task(rig.dispatcher.run())
    try:
        rig.send(signal("stopTrain", ["pause_train"], uuid="", timeout=2 ** 40))
        await eventually(lambda: rig.flow.step is Step.PAUSE_SENT, what="the pause forwarded")
        assert rig.flow.pause_timeout == PAUSE_TIMEOUT_MAX == rig.module.calls[-1][1][2]
        rig.flow.on_callback("report_stop_complete", code=0)
        rig.flow.on_callback("report_result", code=406)  # the pause timed out: a fault flow
        rig.flow.on_callback("report_fault_ranks")
        assert rig.flow.wait_limit() == PAUSE_TIMEOUT_MAX
        rig.send(signal("stopTrain", ["stop_train"], faults={5: 1}))
        await eventually(lambda: rig.flow.step is Step.STOP_SENT, what="the stop forwarded")
        rig.flow.on_callback("report_stop_complete", code=0)
        rig.send(signal("globalFault", ["on_global_rank"], faults={5: 1}, timeout=2 ** 40))
        await eventually(lambda: rig.flow.step is Step.GLOBAL_SENT, what="the global fault forwarded")
        assert rig.flow.global_time == 3600 == rig.module.calls[-1][1][1]
    finally:
        rig.dispatcher.stop()
        await asyncio.wait_for(task, 5)
        rig.dispatcher.close()


def test_progress_counts_callbacks() -> None:
    flow = ControllerFlow()
    flow.on_callback("report_fault_ranks")
    flow.on_callback("report_fault_ranks")
    assert flow.progress == 2


# --------------------------------------------------------------------------- the tables

#: Callback arguments that produce each outcome (checked against ``outcome`` below).
SAMPLES: dict[tuple[str, str], dict[str, object]] = {
    ("report_fault_ranks", ANY): {},
    ("report_strategies", ANY): {"strategies": ("exit", "dump", "retry")},
    ("report_stop_complete", "ok"): {"code": 0},
    ("report_stop_complete", "failed"): {"code": 404},
    ("report_result", "ok"): {"code": 0, "strategy": "retry"},
    ("report_result", "dump_ok"): {"code": 0, "strategy": "dump"},
    ("report_result", "downgrade_ok"): {"code": 0, "strategy": "downgrade"},
    ("report_result", "downgraded"): {"code": 201, "strategy": "downgrade"},
    ("report_result", "retry_failed"): {"code": 405, "strategy": "retry"},
    ("report_result", "invalid_strategy"): {"code": 499, "strategy": ""},
    ("report_result", "failed"): {"code": 406, "strategy": "recover"},
}


class Desyncs:
    def __init__(self) -> None:
        self.seen: list[tuple[str, Step]] = []

    def __call__(self, callback: str, step: Step) -> None:
        self.seen.append((callback, step))


def flow_at(step: Step, desyncs: Desyncs) -> ControllerFlow:
    flow = ControllerFlow(on_desync=desyncs)
    flow.step = step
    return flow


def test_samples_cover_every_outcome_of_every_table() -> None:
    for (callback, how), kwargs in SAMPLES.items():
        assert outcome(callback, kwargs.get("code"), str(kwargs.get("strategy", ""))) == how  # type: ignore[arg-type]
    assert set(FOLLOW) == set(SAMPLES)
    assert {(callback, how) for _, callback, how in EXPECTED} <= set(SAMPLES)
    assert {callback for callback, _ in FOLLOW} == set(CALLBACKS)


@pytest.mark.parametrize(("step", "callback", "how"), sorted(EXPECTED, key=str), ids=str)
def test_every_expected_row_moves_as_the_table_says_without_desync(step: Step, callback: str, how: str) -> None:
    desyncs = Desyncs()
    flow = flow_at(step, desyncs)
    flow.on_callback(callback, **SAMPLES[(callback, how)])  # type: ignore[arg-type]
    next_step = EXPECTED[(step, callback, how)]
    assert flow.step is (step if next_step is STAY else next_step)
    assert desyncs.seen == []


UNEXPECTED = sorted(
    ((step, callback, how) for step in Step for callback, how in FOLLOW if (step, callback, how) not in EXPECTED),
    key=str,
)


@pytest.mark.parametrize(("step", "callback", "how"), UNEXPECTED, ids=str)
def test_every_unexpected_callback_is_a_desync_and_the_flow_follows_the_controller(
    step: Step, callback: str, how: str
) -> None:
    desyncs = Desyncs()
    flow = flow_at(step, desyncs)
    flow.on_callback(callback, **SAMPLES[(callback, how)])  # type: ignore[arg-type]
    next_step = FOLLOW[(callback, how)]
    assert flow.step is (step if next_step is STAY else next_step)
    assert desyncs.seen == [(callback, step)]


def test_strategies_while_idle_is_a_desync_logged_and_followed(caplog: pytest.LogCaptureFixture) -> None:
    desyncs = Desyncs()
    flow = ControllerFlow(on_desync=desyncs)
    with caplog.at_level(logging.WARNING, logger="bridge.job.reports.controller_flow"):
        flow.on_callback("report_strategies", strategies=("exit", "retry"))
    assert desyncs.seen == [("report_strategies", Step.IDLE)]
    assert flow.step is Step.AWAIT_STRATEGY and flow.offered == ("exit", "retry")
    assert flow.refusal("change_strategy", "retry") is None  # the controller is the ground truth
    assert "desync" in caplog.text and "report_strategies" in caplog.text and "idle" in caplog.text


def test_a_normal_flow_has_no_desync() -> None:
    desyncs = Desyncs()
    flow = ControllerFlow(on_desync=desyncs)
    at_strategy(flow)
    flow.notified("change_strategy", "U1", "retry")
    flow.on_callback("report_result", code=0, strategy="retry")
    flow.notified("pause_train", "P1")
    flow.on_callback("report_stop_complete", code=0)
    flow.notified("change_strategy", "P1", "continue")
    flow.on_callback("report_result", code=0, strategy="continue")
    assert flow.step is Step.IDLE
    assert desyncs.seen == []


def test_a_downgraded_job_reporting_its_first_step_is_no_desync() -> None:
    """After 201 the controller trains the reduced job and, once it has stepped past the
    repair step, reports 0 for the downgrade (isNeedToReportResult_)."""
    desyncs = Desyncs()
    flow = ControllerFlow(on_desync=desyncs)
    at_strategy(flow, ("exit", "dump", "recover", "downgrade", "upgrade"))
    flow.notified("change_strategy", "U1", "downgrade")
    flow.on_callback("report_result", code=201, strategy="downgrade")
    flow.on_callback("report_result", code=0, strategy="downgrade")
    assert flow.step is Step.IDLE and flow.downgraded
    assert desyncs.seen == []


def test_a_desync_storm_logs_with_back_off_but_counts_every_one(caplog: pytest.LogCaptureFixture) -> None:
    desyncs = Desyncs()
    flow = ControllerFlow(on_desync=desyncs)
    flow.on_callback("report_fault_ranks")  # AWAIT_STOP
    with caplog.at_level(logging.WARNING, logger="bridge.job.reports.controller_flow"):
        for _ in range(1000):
            flow.on_callback("report_fault_ranks")
    assert len(desyncs.seen) == 1000
    # the log budget (bridge/core/log_budget.py): 4 lines per (callback, step) per minute
    assert len([r for r in caplog.records if "desync" in r.getMessage()]) == 4


def test_a_failing_desync_hook_never_reaches_the_controller(caplog: pytest.LogCaptureFixture) -> None:
    def broken(callback: str, step: Step) -> None:
        raise RuntimeError("metrics are gone")

    flow = ControllerFlow(on_desync=broken)
    with caplog.at_level(logging.ERROR, logger="bridge.job.reports.controller_flow"):
        flow.on_callback("report_result", code=0, strategy="retry")
    assert flow.step is Step.IDLE
    assert "desync hook failed" in caplog.text


def test_unknown_callback_changes_nothing_but_progress() -> None:
    desyncs = Desyncs()
    flow = ControllerFlow(on_desync=desyncs)
    flow.on_callback("report_something_new")
    assert flow.step is Step.IDLE and flow.progress == 1 and desyncs.seen == []


@pytest.mark.parametrize(("action", "strategy", "step"), [
    ("stop_train", "", Step.STOP_SENT),
    ("pause_train", "", Step.PAUSE_SENT),
    ("on_global_rank", "", Step.GLOBAL_SENT),
    ("save_and_exit", "", Step.DUMPING),
    ("change_strategy", "exit", Step.EXITING),
    ("change_strategy", "dump", Step.DUMPING),
    ("change_strategy", "retry", Step.REPAIRING),
    ("change_strategy", "continue", Step.REPAIRING),
    ("change_strategy", "migration", Step.REPAIRING),
    ("hot switch", "", Step.SWITCHING),
    ("stop switch", "", Step.IDLE),
])
def test_every_notified_row(action: str, strategy: str, step: Step) -> None:
    flow = ControllerFlow()
    flow.notified(action, "U", strategy)
    assert flow.step is step


def test_notified_table_has_a_row_for_every_forwarded_action() -> None:
    forwarded = set().union(*ACCEPTS.values())
    assert {action for action, _ in NOTIFIED} == forwarded


def desync_counter() -> tuple[ControllerFlow, list[tuple[str, Step]]]:
    seen: list[tuple[str, Step]] = []
    return ControllerFlow(wait_timeout=30, on_desync=lambda callback, step: seen.append((callback, step))), seen


def test_a_hot_switch_runs_to_migration_without_a_desync() -> None:
    """hot switch -> (the replacement ranks register) report_strategies(["migration"]) ->
    change_strategy migration -> report_result(0): every callback where it is expected."""
    flow, desyncs = desync_counter()
    assert flow.refusal("hot switch") is None
    flow.notified("hot switch", "stream:1")
    assert flow.step is Step.SWITCHING and flow.wait_limit() is None  # NORMAL waits for ranks, not ClusterD
    flow.on_callback("report_strategies", strategies=("migration",))
    assert flow.step is Step.AWAIT_STRATEGY and flow.wait_limit() == 30
    assert flow.refusal("change_strategy", "migration") is None
    flow.notified("change_strategy", "stream:1", "migration")
    flow.on_callback("report_result", code=0, strategy="migration")
    assert flow.step is Step.IDLE and desyncs == []


def test_a_hot_switch_whose_pause_failed_offers_exit_and_times_out_into_exiting() -> None:
    """ClusterD answers ["exit"] with no signal (it deletes the first pod): the
    controller's plain wait runs out into EXIT, and so does the flow; no desync."""
    clock = Clock()
    desyncs: list[tuple[str, Step]] = []
    flow = ControllerFlow(wait_timeout=30, clock=clock, on_desync=lambda c, s: desyncs.append((c, s)))
    flow.global_time = 900  # an earlier cycle's: not this wait's
    flow.notified("hot switch", "stream:1")
    flow.on_callback("report_strategies", strategies=("exit",))
    assert flow.step is Step.AWAIT_STRATEGY and flow.wait_limit() == 30
    assert flow.refusal("change_strategy", "migration") == "strategy_not_offered"
    clock.now += 30 + EXPIRY_MARGIN + 1
    assert flow.expire() and flow.step is Step.EXITING and desyncs == []


def test_a_failed_migration_waits_for_dump_or_exit() -> None:
    flow, desyncs = desync_counter()
    flow.notified("hot switch", "stream:1")
    flow.on_callback("report_strategies", strategies=("migration",))
    flow.notified("change_strategy", "stream:1", "migration")
    flow.on_callback("report_result", code=406, strategy="migration")
    assert flow.step is Step.AWAIT_FINAL and desyncs == []


def test_stop_switch_is_taken_only_while_a_switch_waits() -> None:
    """Latched in the controller's one wake-up slot: given outside a switch, the next
    fault flow's first wait would consume it as the wrong event."""
    flow = ControllerFlow(wait_timeout=30)
    assert flow.refusal("stop switch") == "unexpected_step"
    flow.notified("hot switch", "stream:1")
    assert flow.refusal("hot switch") == "unexpected_step"
    assert flow.refusal("stop switch") is None
    flow.notified("stop switch", "stream:1")
    assert flow.step is Step.IDLE and flow.refusal("stop switch") == "unexpected_step"


def test_a_fault_while_a_switch_waits_starts_the_fault_flow() -> None:
    flow, desyncs = desync_counter()
    flow.notified("hot switch", "stream:1")
    flow.on_callback("report_fault_ranks")
    assert flow.step is Step.AWAIT_STOP and desyncs == []


def test_the_module_docstring_table_is_the_expected_table() -> None:
    """The docstring's table is what a reader trusts: it must say what EXPECTED does."""
    import bridge.job.reports.controller_flow

    lines = (bridge.job.reports.controller_flow.__doc__ or "").splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("=====")]
    header = lines[rules[0]]
    starts = [0] + [i + 1 for i, ch in enumerate(header) if ch == " " and header[i + 1] == "="]
    documented: dict[tuple[Step, str, str], Step | None] = {}
    for line in lines[rules[1] + 1:rules[2]]:
        step, callback, outcomes, nexts = (line[a:b].strip() for a, b in zip(starts, [*starts[1:], None]))
        names = [o.strip() for o in outcomes.split("/")]
        if nexts.startswith("(stays"):
            targets: list[Step | None] = [STAY] * len(names)
        else:
            targets = [Step[n.split("(")[0].strip()] for n in nexts.split("(")[0].split("/")]
            targets = targets * len(names) if len(targets) == 1 else targets
        for name, target in zip(names, targets, strict=True):
            documented[(Step[step], callback, name)] = target
    assert documented == EXPECTED
