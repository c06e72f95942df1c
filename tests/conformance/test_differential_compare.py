"""The differential's comparison, without the real peers (runs in every suite run).

tests/conformance/test_real_differential.py fails only where ``differences`` says the two
transcripts differ: what it must catch (a fault rank, a code, a strategy list, an
extra step, the outcome, the exit code) and what it must let through (times, uuids,
the interleaving of kinds a peer logs from different threads, the bridge's calls that
never reached a ClusterD) are pinned here.
"""

from __future__ import annotations

from dataclasses import replace

from .differential import SCENARIOS, differences, report
from .transcript import Step, Transcript


def _run(*, fault: str = "2:1", code: int = 0, offered: str = "exit dump recover", uuid: str = "u1",
         swap: bool = False, refused_inits: int = 0, outcome: str = "recover-success", exit_code: int = 0,
         extra: Step | None = None) -> Transcript:
    stop = Step("clusterd", "signal", "stopTrain", faults=fault, detail=uuid, at=2.0)
    answer = Step("clusterd", "rpc", "ReportStopComplete", code=code, at=2.1)
    steps = [Step("clusterd", "rpc", "Subscribe", at=0.5),
             Step("clusterd", "rpc", "ReportProcessFault", faults=fault, at=1.0),
             *([answer, stop] if swap else [stop, answer]),
             Step("clusterd", "rpc", "ReportRecoverStrategy", detail=offered, at=3.0),
             Step("controller", "callback", "report_strategies", faults=fault, detail=offered, at=3.0),
             *[Step("bridge", "rpc", "Init", code="UNAVAILABLE", at=1.5) for _ in range(refused_inits)],
             Step("bridge", "rpc", "Init", code=0, at=1.9),
             Step("clusterd", "outcome", outcome, at=4.0)]
    if extra is not None:
        steps.append(extra)
    return Transcript(steps, outcome, exit_code)


def test_the_same_run_has_no_difference() -> None:
    assert differences(_run(), _run()) == []


def test_what_legitimately_differs_is_let_through() -> None:
    later = _run(uuid="another-uuid", swap=True, refused_inits=3)
    later.steps = [replace(step, at=step.at + 100) for step in later.steps]
    assert differences(_run(), later) == []


def test_a_fault_rank_a_code_or_an_offered_list_that_differs_is_caught() -> None:
    assert differences(_run(), _run(fault="2:1,3:1"))[0].startswith("clusterd rpc #2: real clusterd rpc "
                                                                  "ReportProcessFault faults=2:1 | sim")
    assert any("ReportStopComplete" in line and "code=499" in line for line in differences(_run(), _run(code=499)))
    found = differences(_run(), _run(offered="exit dump"))
    assert [line.split(":")[0] for line in found] == ["clusterd rpc #4", "controller callback #1"]


def test_an_extra_step_the_outcome_and_the_exit_code_are_caught() -> None:
    extra = Step("controller", "callback", "report_fault_ranks", faults="1:1")
    assert differences(_run(), _run(extra=extra)) == [
        "controller callback #2: real (nothing) | sim controller callback report_fault_ranks faults=1:1"]
    assert differences(_run(), _run(outcome="recover-failed"))[-1] == (
        "ProcessRecoverStatus: real recover-success | sim recover-failed")
    assert differences(_run(), _run(exit_code=76)) == ["exit code: real 0 | sim 76"]


def test_a_platform_write_after_a_signal_and_a_podgroup_that_differs_are_caught() -> None:
    """A ClusterD that went on without the platform had sent a signal by its write; a
    confirm written differently (or not at all) shows in the PodGroup at the end."""
    write = Step("platform", "annotate", "ProcessRecoverStrategy=recover", detail="after 0 signal(s)")
    found = differences(_run(extra=write), _run(extra=replace(write, detail="after 1 signal(s)")))
    assert found == ["platform annotate #1: real platform annotate ProcessRecoverStrategy=recover "
                     "[after 0 signal(s)] | sim platform annotate ProcessRecoverStrategy=recover [after 1 signal(s)]"]
    real, sim = _run(), _run()
    real.annotations, sim.annotations = {"ProcessConfirmFault": "2:1"}, {"ProcessConfirmFault": None}
    assert differences(real, sim) == ["PodGroup ProcessConfirmFault: real '2:1' | sim None"]


def test_the_report_prints_both_transcripts() -> None:
    found = differences(_run(), _run(code=499))
    text = report(SCENARIOS[0], "master", _run(), _run(code=499), found)
    assert "--- clusterd rpc: real | sim" in text
    assert "! clusterd rpc ReportStopComplete code=0" in text and "code=499" in text


def test_the_call_clusterd_is_killed_on_may_end_either_way_but_only_before_the_reconnect() -> None:
    """ClusterD -9'd right after it received the stop-complete: the bridge's record of
    that call is code 0 or a gRPC status by timing (seen on the real peers: the answer
    lost), so it is left out before the reconnect; after it, it is compared."""
    def bridge_calls(*names: str, code: int = 0) -> Transcript:
        return Transcript([Step("bridge", "rpc", name, code=code) for name in names], "recover-success", 0)

    answered = bridge_calls("ReportProcessFault", "ReportStopComplete", "Init", "Register", "ReportStopComplete")
    lost = bridge_calls("ReportProcessFault", "Init", "Register", "ReportStopComplete")
    assert differences(lost, answered)[0].startswith("bridge rpc #2")  # not in a scenario without an outage
    assert differences(lost, answered, outage=True) == []
    after = bridge_calls("ReportProcessFault", "Init", "Register")
    assert differences(lost, after, outage=True)[0].startswith("bridge rpc #4")
