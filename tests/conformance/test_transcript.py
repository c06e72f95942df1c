"""The conformance tier's readers of the real peers' logs, on lines the real peers wrote.

They run in every suite run (no peer needed): a parser that silently stops matching would
turn the tier's assertions into ones about empty lists. The lines are verbatim from a
run of a process-fault recovery between the real ClusterD harness and a real MindIO
build (2 pods x 2 ranks, rank 2 faulting).
"""

from __future__ import annotations

import pytest

from .peers import LogLine, parse_fault_list
from .transcript import bridge_steps, clusterd_steps, controller_steps, faults_text

CLUSTERD = """\
[2026-11-27 15:52:29.917860][INFO]     85      recover/fault_recover_service.go:572    service receive Init request, role=tft-bridge, jobId=conformance-restart
[2026-11-27 15:52:29.929922][INFO]     99      recover/fault_recover_service.go:666    receive Subscribe signal request, taskId=conformance-restart, rule=tft-bridge
[2026-11-27 15:52:29.930012][INFO]     91      fault/grpc_service.go:99    fault service receive Register request, jobId=conformance-restart, role=tft-bridge
[2026-11-27 15:52:29.930198][INFO]     99      recover/controller.go:225    jobId=conformance-restart's action path = {INIT}
[2026-11-27 15:52:30.944300][INFO]     93      recover/fault_recover_service.go:768    receive ReportProcessFault, info={jobId=conformance-restart, faultRanks={2:1}}
[2026-11-27 15:52:30.949395][INFO]     100     recover/controller.go:640    signal enqueue, jobId=conformance-restart, uuid=18EBF1CFBBD82552-67d17d1a6dd77be225238a2054d89d85, signalType=stopTrain, strategy=, faults=2:1
[2026-11-27 15:52:30.956722][INFO]     111     recover/fault_recover_service.go:678    receive ReportStopComplete, jobId=conformance-restart, code=0, info=stop ok
[2026-11-27 15:52:41.973930][INFO]     100     recover/controller.go:971    write configmap faultList success, {"RankList":[{"RankId":2,"LogicId":0,"Status":"fault","Policy":"","InitialPolicy":"","ErrorCode":null,"ErrorCodeHex":""},{"RankId":3,"LogicId":0,"Status":"fault","Policy":"","InitialPolicy":"","ErrorCode":null,"ErrorCodeHex":""}],"UpdateTime":1795794761,"RetryTime":0,"FaultFlushing":false,"GracefulExit":0,"RestartFaultProcess":false}
[2026-11-27 15:52:41.984257][INFO]     100     recover/controller.go:640    signal enqueue, jobId=conformance-restart, uuid=18EBF1CFBBD82552-67d17d1a6dd77be225238a2054d89d85, signalType=globalFault, strategy=, faults=2:1,3:1
[2026-11-27 15:52:41.993213][INFO]     234     recover/fault_recover_service.go:768    receive ReportProcessFault, info={jobId=conformance-restart, faultRanks={2:1,3:1}}
[2026-11-27 15:52:42.005234][INFO]     222     recover/fault_recover_service.go:702    receive ReportRecoverStrategy, jobId=conformance-restart, strategy=[exit dump recover]
[2026-11-27 15:52:42.005955][INFO]     100     recover/controller.go:1243    jobId=conformance-restart, choose strategy:recover
[2026-11-27 15:52:42.020217][INFO]     100     recover/controller.go:640    signal enqueue, jobId=conformance-restart, uuid=18EBF1CFBBD82552-67d17d1a6dd77be225238a2054d89d85, signalType=changeStrategy, strategy=recover, faults=2:1,3:1
[2026-11-27 15:52:44.297928][INFO]     265     recover/fault_recover_service.go:727    receive ReportRecoverStatus, jobId=conformance-restart, code=0, info=Mindio do repair operation ok, strategy=recover
[2026-11-27 15:52:44.299737][INFO]     100     recover/controller.go:1411    fix result annatate success, ProcessRecoverStatus=recover-success, pgName=e2e-job
[2026-11-27 15:52:44.299862][INFO]     100     recover/controller.go:225    jobId=conformance-restart's action path = {INIT(faultOccur)-->CheckRecoverResultState(recoverSuccess)-->INIT}
"""

CONTROLLER = """\
2026-11-27 15:52:25.841663 info 11711 [TTP action_engine.cpp:71] do action success. opcode: ACTION_OP_COLLECTION
2026-11-27 15:52:25.922487 info 11711 [49184][PYH ttp_mindx_api.py:67] do action report_fault_ranks, arg=({2: 1}, {2: ''})
2026-11-27 15:52:25.922699 warn 11711 [TTP controller.cpp:925] wait Mindx notify stop train...
2026-11-27 15:52:25.970939 info 11682 [TTP controller.cpp:421] Mindx notify stop train, error_rank: []
2026-11-27 15:52:25.971329 info 11711 [49184][PYH ttp_mindx_api.py:67] do action report_stop_complete, arg=(0, 'stop ok', {2: 1})
2026-11-27 15:52:41.987678 info 11682 [TTP controller.cpp:421] Mindx notify fault ranks, error_rank: [3:1, ]
2026-11-27 15:52:41.988718 info 11711 [49184][PYH ttp_mindx_api.py:67] do action report_fault_ranks, arg=({2: 1, 3: 1}, {2: ''})
2026-11-27 15:52:41.988996 info 11711 [49184][PYH ttp_mindx_api.py:67] do action report_strategies, arg=({2: 1, 3: 1}, ['exit', 'dump', 'recover'])
2026-11-27 15:52:42.17555 info 11682 [TTP mindx_engine.cpp:213] Mindx calling notify do ARF repair...
2026-11-27 15:52:44.296666 info 11711 [49184][PYH ttp_mindx_api.py:67] do action report_result, arg=(0, 'Mindio do repair operation ok', {}, 'recover')
"""


def lines(text: str) -> list[LogLine]:
    return [LogLine(float(n), line) for n, line in enumerate(text.splitlines())]


def test_clusterd_side() -> None:
    steps = [str(s) for s in clusterd_steps(lines(CLUSTERD))]
    assert steps == [
        "clusterd rpc Init",
        "clusterd rpc Subscribe",
        "clusterd rpc ReportProcessFault faults=2:1",
        "clusterd signal stopTrain faults=2:1",
        "clusterd rpc ReportStopComplete code=0",
        "clusterd signal globalFault faults=2:1,3:1",
        "clusterd rpc ReportProcessFault faults=2:1,3:1",
        "clusterd rpc ReportRecoverStrategy",
        "clusterd decision strategy strategy=recover",
        "clusterd signal changeStrategy faults=2:1,3:1 strategy=recover",
        "clusterd rpc ReportRecoverStatus strategy=recover code=0",
        "clusterd outcome recover-success",
        "clusterd cycle closed",
    ]
    closed = clusterd_steps(lines(CLUSTERD))[-1]
    assert closed.detail == "INIT(faultOccur)-->CheckRecoverResultState(recoverSuccess)-->INIT"


def test_clusterd_cycle_line_per_release() -> None:
    """v7.3.2 closes a cycle on controller.go:219: master's line number there is a
    transition, not a close."""
    v732 = CLUSTERD.replace("controller.go:225", "controller.go:219")
    assert [s.kind for s in clusterd_steps(lines(v732), "7.3.2")].count("cycle") == 1
    assert [s.kind for s in clusterd_steps(lines(v732), "master")].count("cycle") == 0


#: Platform mode's lines, verbatim from the differential's ``platform-recover`` on the
#: v7.3.2 harness (master writes the same lines at other line numbers).
PLATFORM_CLUSTERD = """\
[INFO]     2026/11/27 18:39:09.229265 94      recover/controller.go:697    start wait plat strategy ready, jobId=differential-platform-recover, pgName=e2e-job
[INFO]     2026/11/27 18:39:18.232050 94      recover/controller.go:700    finish wait plat strategy, jobId=differential-platform-recover, pgName=e2e-job, strategy=recover, err=<nil>
[INFO]     2026/11/27 18:39:19.240043 94      recover/controller.go:854    finish wait plat result fault, jobId=differential-platform-recover, faults=2:1, err=<nil>
[INFO]     2026/11/27 18:39:19.240352 94      recover/controller.go:862    plat confirm strategy=recover, jobId=differential-platform-recover, err=<nil>
[INFO]     2026/11/27 18:39:19.240455 94      recover/controller.go:977    jobId=differential-platform-recover, plat merge faults=2:1
[INFO]     2026/11/27 18:39:19.253257 94      recover/controller.go:1201    start wait plat rankTable ready, jobId=differential-platform-recover, pgName=e2e-job
[INFO]     2026/11/27 18:39:19.253622 94      recover/controller.go:1204    finish wait plat rankTable ready, jobId=differential-platform-recover, pgName=e2e-job, err=<nil>
"""


def test_clusterd_platform_mode() -> None:
    assert [str(s) for s in clusterd_steps(lines(PLATFORM_CLUSTERD), "7.3.2")] == [
        "clusterd platform wait-strategy",
        "clusterd platform strategy strategy=recover",
        "clusterd platform confirm strategy=recover",
        "clusterd platform merge faults=2:1",
        "clusterd platform rank-table-ready",
    ]
    # What an error does to them (the same format strings, an error instead of <nil>).
    failed = (PLATFORM_CLUSTERD.replace("strategy=recover, err=<nil>", "strategy=, err=wait plat strategy")
              .replace("pgName=e2e-job, err=<nil>", "pgName=e2e-job, err=check e2e-job RankTableReady failed"))
    steps = [str(s) for s in clusterd_steps(lines(failed), "7.3.2")]
    assert steps[1] == "clusterd platform strategy code=508" and steps[-1] == "clusterd platform rank-table-failed"


def test_controller_side() -> None:
    steps = [str(s) for s in controller_steps(lines(CONTROLLER))]
    assert steps == [
        "controller callback report_fault_ranks faults=2:1",
        "controller notify stop_train",
        "controller callback report_stop_complete faults=2:1 code=0",
        "controller notify on_global_rank",
        "controller callback report_fault_ranks faults=2:1,3:1",
        "controller callback report_strategies faults=2:1,3:1",
        "controller notify change_strategy strategy=recover",
        "controller callback report_result strategy=recover code=0",
    ]


def test_bridge_side_from_the_flight_recorder() -> None:
    events = [
        {"t": 1.0, "kind": "callback", "name": "report_fault_ranks"},
        {"t": 1.1, "kind": "rpc", "method": "ReportProcessFault", "code": 0, "latency": 0.006},
        {"t": 1.5, "kind": "signal", "type": "stopTrain", "uuid": "u", "actions": ["stop_train"], "strategy": ""},
        {"t": 1.6, "kind": "notify", "action": "stop_train", "rc": 0, "duration": 0.0001},
        {"t": 2.0, "kind": "rpc", "method": "ReportStopComplete", "code": "UNAVAILABLE", "latency": 2.0},
        {"t": 3.0, "kind": "outcome", "outcome": "success", "strategy": "retry"},
    ]
    assert [str(s) for s in bridge_steps(events)] == [
        "bridge rpc ReportProcessFault code=0",
        "bridge signal stopTrain",
        "bridge notify stop_train code=0",
        "bridge rpc ReportStopComplete code=UNAVAILABLE",
        "bridge outcome success strategy=retry",
    ]


@pytest.mark.parametrize(("written", "expected"), [
    ("{2:1,3:1}", "2:1,3:1"), ("3:1,2:1", "2:1,3:1"), ("[3:1, ]", "3:1"), ({3: 1, 2: 0}, "2:0,3:1"), ("", ""),
])
def test_fault_ranks_one_spelling(written: object, expected: str) -> None:
    assert faults_text(written) == expected


def test_fault_list_names_the_ranks_to_restart() -> None:
    payload = CLUSTERD.split("write configmap faultList success, ")[1].splitlines()[0]
    assert parse_fault_list(payload) == [2, 3]
    assert parse_fault_list('{"RankList":[],"UpdateTime":1}') == []
    assert parse_fault_list('{"RankList":["1","0"]}') == [0, 1]
