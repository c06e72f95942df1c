"""The controller-step tracker: what may be forwarded when (mindio-tft-controller.md 3-4)."""

from __future__ import annotations

from bridge.flow import ControllerFlow, Step


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


def test_progress_counts_callbacks() -> None:
    flow = ControllerFlow()
    flow.on_callback("report_fault_ranks")
    flow.on_callback("report_fault_ranks")
    assert flow.progress == 2
