"""The compiled descriptors against ClusterD's wire contract
(docs/clusterd.md section 2): names, numbers, types, labels, paths."""

from __future__ import annotations

import pytest
from google.protobuf.descriptor import FieldDescriptor as F

from bridge._proto import config_pb2, config_pb2_grpc, fault_pb2, fault_pb2_grpc, recover_pb2, recover_pb2_grpc

S, I32, I64, MSG, BOOL = F.TYPE_STRING, F.TYPE_INT32, F.TYPE_INT64, F.TYPE_MESSAGE, F.TYPE_BOOL
ONE, MANY = "one", "many"

RECOVER_MESSAGES = {
    "Status": [(1, "code", I32, ONE), (2, "info", S, ONE)],
    "ClientInfo": [(1, "jobId", S, ONE), (2, "role", S, ONE)],
    "FaultRank": [(1, "rankId", S, ONE), (2, "faultType", S, ONE)],
    "ProcessManageSignal": [
        (1, "uuid", S, ONE), (2, "jobId", S, ONE), (3, "signalType", S, ONE), (4, "actions", S, MANY),
        (5, "faultRanks", MSG, MANY), (6, "changeStrategy", S, ONE), (7, "timeout", I64, ONE),
        (8, "nodeRankIds", S, MANY), (9, "extraParams", S, ONE),
    ],
    "StopCompleteRequest": [(1, "jobId", S, ONE), (2, "status", MSG, ONE), (3, "faultRanks", MSG, MANY)],
    "RecoverStrategyRequest": [(1, "jobId", S, ONE), (2, "faultRanks", MSG, MANY), (3, "strategies", S, MANY)],
    "RecoverStatusRequest": [
        (1, "jobId", S, ONE), (2, "status", MSG, ONE), (3, "strategy", S, ONE), (4, "isolateRankIds", S, MANY),
    ],
    "ProcessFaultRequest": [(1, "jobId", S, ONE), (2, "faultRanks", MSG, MANY)],
    # the OM flows (NIC switch, stress test); a map field is a repeated entry message
    "SwitchNicResponse": [(1, "jobID", S, ONE), (2, "msg", S, ONE)],
    "SwitchNicRequest": [(1, "jobID", S, ONE)],
    "SwitchNics": [(1, "jobID", S, ONE), (2, "nicOps", MSG, MANY)],
    "DeviceList": [(1, "dev", S, MANY), (2, "op", BOOL, MANY)],
    "SwitchRankList": [(1, "rankID", S, MANY), (2, "op", BOOL, MANY), (3, "jobId", S, ONE)],
    "SwitchResult": [(1, "jobId", S, ONE), (2, "result", BOOL, ONE)],
    "StressOpList": [(1, "ops", I64, MANY)],
    "StressTestParam": [(1, "jobID", S, ONE), (2, "stressParam", MSG, MANY), (3, "allNodesOps", I64, MANY)],
    "StressTestRequest": [(1, "jobID", S, ONE)],
    "StressTestResponse": [(1, "jobID", S, ONE), (2, "msg", S, ONE)],
    "StressTestRankParams": [(1, "stressParam", MSG, MANY), (2, "jobId", S, ONE)],
    "StressTestResult": [(1, "jobId", S, ONE), (2, "stressResult", MSG, MANY)],
    "StressTestRankResult": [(1, "rankResult", MSG, MANY)],
    "StressTestOpResult": [(1, "code", S, ONE), (2, "result", S, ONE)],
}
#: map<string, V> fields: (message, field) -> the value's message type.
MAP_VALUES = {
    ("SwitchNics", "nicOps"): "DeviceList",
    ("StressTestParam", "stressParam"): "StressOpList",
    ("StressTestRankParams", "stressParam"): "StressOpList",
    ("StressTestResult", "stressResult"): "StressTestRankResult",
    ("StressTestRankResult", "rankResult"): "StressTestOpResult",
}
CONFIG_MESSAGES = {
    "Status": RECOVER_MESSAGES["Status"],
    "ClientInfo": RECOVER_MESSAGES["ClientInfo"],
    "RankTableStream": [(1, "jobId", S, ONE), (2, "rankTable", S, ONE)],
}
SUBMESSAGE = {
    ("ProcessManageSignal", "faultRanks"): "FaultRank",
    ("StopCompleteRequest", "status"): "Status",
    ("StopCompleteRequest", "faultRanks"): "FaultRank",
    ("RecoverStrategyRequest", "faultRanks"): "FaultRank",
    ("RecoverStatusRequest", "status"): "Status",
    ("ProcessFaultRequest", "faultRanks"): "FaultRank",
}
RECOVER_METHODS = {
    "Init": ("ClientInfo", "Status", False),
    "Register": ("ClientInfo", "Status", False),
    "SubscribeProcessManageSignal": ("ClientInfo", "ProcessManageSignal", True),
    "ReportStopComplete": ("StopCompleteRequest", "Status", False),
    "ReportRecoverStrategy": ("RecoverStrategyRequest", "Status", False),
    "ReportRecoverStatus": ("RecoverStatusRequest", "Status", False),
    "ReportProcessFault": ("ProcessFaultRequest", "Status", False),
    "HealthCheck": ("ClientInfo", "Status", False),
    "SwitchNicTrack": ("SwitchNics", "Status", False),
    "SubscribeSwitchNicSignal": ("SwitchNicRequest", "SwitchNicResponse", True),
    "SubscribeNotifySwitch": ("ClientInfo", "SwitchRankList", True),
    "ReplySwitchNicResult": ("SwitchResult", "Status", False),
    "StressTest": ("StressTestParam", "Status", False),
    "SubscribeStressTestResponse": ("StressTestRequest", "StressTestResponse", True),
    "SubscribeNotifyExecStressTest": ("ClientInfo", "StressTestRankParams", True),
    "ReplyStressTestResult": ("StressTestResult", "Status", False),
}
FAULT_MESSAGES = {
    "FaultQueryResult": [(1, "code", I32, ONE), (2, "info", S, ONE), (3, "faultSignal", MSG, ONE)],
    "Status": RECOVER_MESSAGES["Status"],
    "ClientInfo": RECOVER_MESSAGES["ClientInfo"],
    "FaultMsgSignal": [(1, "uuid", S, ONE), (2, "jobId", S, ONE), (3, "signalType", S, ONE),
                       (4, "nodeFaultInfo", MSG, MANY)],
    "NodeFaultInfo": [(1, "nodeName", S, ONE), (2, "nodeIP", S, ONE), (3, "nodeSN", S, ONE),
                      (4, "faultLevel", S, ONE), (5, "faultDevice", MSG, MANY)],
    "SwitchFaultInfo": [(1, "faultCode", S, ONE), (2, "switchChipId", S, ONE), (3, "switchPortId", S, ONE),
                        (4, "faultTime", S, ONE), (5, "faultLevel", S, ONE)],
    "DeviceFaultInfo": [(1, "deviceId", S, ONE), (2, "deviceType", S, ONE), (3, "faultCodes", S, MANY),
                        (4, "faultLevel", S, ONE), (5, "faultType", S, MANY), (6, "faultReason", S, MANY),
                        (7, "switchFaultInfos", MSG, MANY), (8, "faultLevels", S, MANY)],
}
FAULT_METHODS = {
    "Register": ("ClientInfo", "Status", False),
    "SubscribeFaultMsgSignal": ("ClientInfo", "FaultMsgSignal", True),
    "GetFaultMsgSignal": ("ClientInfo", "FaultQueryResult", False),
}


def _fields(descriptor) -> list[tuple[int, str, int, str]]:
    return sorted(
        (f.number, f.name, f.type, MANY if f.is_repeated else ONE) for f in descriptor.fields
    )


@pytest.mark.parametrize("name", sorted(RECOVER_MESSAGES))
def test_recover_messages(name: str) -> None:
    descriptor = recover_pb2.DESCRIPTOR.message_types_by_name[name]
    assert descriptor.full_name == name  # no package
    assert _fields(descriptor) == sorted(RECOVER_MESSAGES[name])
    for field in descriptor.fields:
        if field.type != MSG:
            continue
        if (name, field.name) in MAP_VALUES:
            entry = field.message_type
            assert entry.GetOptions().map_entry
            assert entry.fields_by_name["key"].type == S
            assert entry.fields_by_name["value"].message_type.full_name == MAP_VALUES[(name, field.name)]
        else:
            assert field.message_type.full_name == SUBMESSAGE[(name, field.name)]


@pytest.mark.parametrize("name", sorted(CONFIG_MESSAGES))
def test_config_messages(name: str) -> None:
    descriptor = config_pb2.DESCRIPTOR.message_types_by_name[name]
    assert descriptor.full_name == f"config.{name}"
    assert _fields(descriptor) == sorted(CONFIG_MESSAGES[name])


def test_recover_service_paths() -> None:
    assert recover_pb2.DESCRIPTOR.package == ""
    service = recover_pb2.DESCRIPTOR.services_by_name["Recover"]
    assert service.full_name == "Recover"
    methods = {m.name: m for m in service.methods}
    assert set(methods) == set(RECOVER_METHODS)
    for name, (request, response, streaming) in RECOVER_METHODS.items():
        method = methods[name]
        assert (method.input_type.full_name, method.output_type.full_name) == (request, response)
        assert method.server_streaming is streaming and not method.client_streaming
    assert hasattr(recover_pb2_grpc, "RecoverStub")


def test_config_service_paths() -> None:
    service = config_pb2.DESCRIPTOR.services_by_name["Config"]
    assert service.full_name == "config.Config"
    methods = {m.name: m for m in service.methods}
    assert set(methods) == {"Register", "SubscribeRankTable"}
    assert methods["SubscribeRankTable"].server_streaming
    assert methods["SubscribeRankTable"].output_type.full_name == "config.RankTableStream"
    assert methods["Register"].output_type.full_name == "config.Status"
    assert hasattr(config_pb2_grpc, "ConfigStub")


def test_generated_stub_uses_the_live_paths() -> None:
    source = open(recover_pb2_grpc.__file__).read()
    assert "'/Recover/ReportProcessFault'" in source
    assert "'/config.Config/SubscribeRankTable'" in open(config_pb2_grpc.__file__).read()


@pytest.mark.parametrize("name", sorted(FAULT_MESSAGES))
def test_fault_messages(name: str) -> None:
    descriptor = fault_pb2.DESCRIPTOR.message_types_by_name[name]
    assert descriptor.full_name == f"fault.{name}"
    assert _fields(descriptor) == sorted(FAULT_MESSAGES[name])


def test_fault_service_paths() -> None:
    service = fault_pb2.DESCRIPTOR.services_by_name["Fault"]
    assert service.full_name == "fault.Fault"
    methods = {m.name: m for m in service.methods}
    assert set(methods) == set(FAULT_METHODS)
    for name, (request, response, streaming) in FAULT_METHODS.items():
        method = methods[name]
        assert (method.input_type.full_name, method.output_type.full_name) == (f"fault.{request}", f"fault.{response}")
        assert method.server_streaming is streaming and not method.client_streaming
    assert "'/fault.Fault/SubscribeFaultMsgSignal'" in open(fault_pb2_grpc.__file__).read()
