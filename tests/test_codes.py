"""Return codes: seed 001's table, plus the codes clients send."""

from bridge import __version__
from bridge.job.session.codes import CLIENT_CODES, SERVER_CODES, Code

SEED_001 = {
    "OK": 0, "UnRegistry": 400, "OrderMix": 401, "JobNotExist": 402, "ProcessRescheduleOff": 403,
    "ProcessNotReady": 404, "RecoverableRetryError": 405, "UnRecoverableRetryError": 406, "DumpError": 407,
    "UnInit": 408, "ClientError": 499, "OutOfMaxServeJobs": 500, "OperateConfigMapError": 501,
    "OperatePodGroupError": 502, "ScheduleTimeout": 503, "SignalQueueBusy": 504, "EventQueueBusy": 505,
    "ControllerEventCancel": 506, "WaitReportTimeout": 507, "WaitPlatStrategyTimeout": 508,
    "WriteConfirmFaultOrWaitPlatResultFault": 509, "ServerInnerError": 599,
}


def test_every_seed_code_has_its_name_and_value() -> None:
    for name, value in SEED_001.items():
        assert Code[name] == value
        assert Code(value).name == name
        assert Code(value).meaning


def test_client_codes() -> None:
    assert {int(c) for c in CLIENT_CODES} == {0, 201, 404, 405, 406, 499}
    assert Code(201).name == "ExitIsolateRanks"


def test_server_codes_are_what_the_live_server_answers() -> None:
    assert {int(c) for c in SERVER_CODES} == {0, 400, 402, 403, 408, 500, 502, 599}


def test_describe() -> None:
    assert Code.describe(403).startswith("403 ProcessRescheduleOff: ")
    assert Code.describe(7) == "7 (unknown code)"


def test_version() -> None:
    assert __version__.count(".") == 2
