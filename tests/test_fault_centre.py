"""ClusterD's Fault service read for the flight recorder: bounded summaries, the cycle
each lands in, and `tft-bridge history`, on the simulated ClusterD; on the seed API
(which keeps no recorder) the same message read and logged as the recovery's cause."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from bridge._proto import fault_pb2
from bridge.cli import main
from bridge.job.session.fault_centre import MAX_CODES, MAX_DEVICES, MAX_TEXT, summarise
from bridge.job.recorder.model import clusterd_faults_text
from bridge.sim.clusterd import SimJob
from bridge.sim.clusterd_release import V7_3
from bridge.sim.scenario import SimulatedJob

from .conftest import eventually, eventually_sync
from .seedapi import JOB as SEED_JOB
from .seedapi import ServerThread, hosting_the_controller, server, training  # noqa: F401 - fixtures
from .simjobs import annotation, start_job

pytestmark = pytest.mark.timeout(60)

JOB = "job-faultinfo"


def test_summary_is_bounded_and_readable() -> None:
    message = fault_pb2.FaultMsgSignal(jobId=JOB, signalType="fault")
    node = message.nodeFaultInfo.add(nodeName="node-1", faultLevel="UnHealthy")
    node.faultDevice.add(deviceId="0", deviceType="NPU", faultCodes=["80C98000"], faultLevel="UnHealthy",
                         faultLevels=["RestartNPU"])
    info, cut = summarise(message)
    assert not cut
    assert info == {"signal": "fault", "devices": [{"node": "node-1", "device": "0", "type": "NPU",
                                                    "codes": ["80C98000"], "levels": ["RestartNPU"]}]}
    assert clusterd_faults_text(info) == "node-1 NPU 0: 80C98000 (RestartNPU)"
    huge = fault_pb2.FaultMsgSignal(jobId=JOB, signalType="fault")
    for n in range(40):
        entry = huge.nodeFaultInfo.add(nodeName="n" * 500 + str(n))
        entry.faultDevice.add(deviceId=str(n), faultCodes=[f"C{i}" for i in range(100)])
    info, cut = summarise(huge)
    assert cut and len(info["devices"]) == MAX_DEVICES and info["more"] == 40 - MAX_DEVICES
    assert all(len(d["codes"]) == MAX_CODES and len(d["node"]) == MAX_TEXT for d in info["devices"])
    assert len(json.dumps(info)) < 8000


def history(store: Path, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    capsys.readouterr()
    assert main(["history", "--state-dir", str(store), *args]) == 0
    return capsys.readouterr().out


async def recorded_recovery(jobs: list[SimulatedJob], store: Path, **kwargs) -> SimulatedJob:  # type: ignore[no-untyped-def]
    job = await start_job(jobs, SimJob(JOB, world_size=8, devices_per_pod=4),
                          config_overrides={"recorder": {"enabled": True, "directory": str(store)}}, **kwargs)
    assert job.bridge is not None and job.bridge.side is not None
    await eventually(lambda: job.bridge.side.fault_centre.stream.subscribed.is_set()  # type: ignore[union-attr]
                     or job.bridge.side.fault_centre.stream.unimplemented, 10, what="fault info stream")  # type: ignore[union-attr]
    return job


async def successful_cycle(job: SimulatedJob, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """The one successful cycle ``tft-bridge history --json`` lists, once the recorder wrote it."""
    assert job.bridge is not None
    writer = job.bridge.recording.writer
    assert writer is not None
    await eventually(lambda: writer.closed >= 1, 10, what="the cycle written")
    listing = json.loads(history(tmp_path, capsys, "--json"))
    (cycle,) = [c for c in listing["cycles"] if c["outcome"] == "success"]
    return cycle


async def test_the_npu_and_code_of_a_recovered_fault_are_in_its_record(
        jobs: list[SimulatedJob], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = await recorded_recovery(jobs, tmp_path)
    job.sim.device_fault(JOB, [6])  # the device plugin's report: node-1, NPU 2
    assert job.bridge is not None and job.bridge.side is not None
    reader = job.bridge.side.fault_centre
    await eventually(lambda: reader.last is not None and reader.last["signal"] == "fault", 10,
                     what="the fault message")
    job.training.inject_fault({6: 1})  # ... and the rank on it fails
    await annotation(job, "recover-success")
    job.sim.clear_device_faults(JOB)
    cycle = await successful_cycle(job, tmp_path, capsys)
    cause = cycle["summary"]["clusterd_faults"]
    assert cause["devices"] == [{"node": "node-1", "device": "2", "type": "NPU", "codes": ["80C98000"],
                                 "levels": ["RestartNPU"]}]
    text = history(tmp_path, capsys, "--cycle", cycle["key"])
    assert "cause     ClusterD: node-1 NPU 2: 80C98000 (RestartNPU)" in text
    assert "ClusterD fault centre: node-1 NPU 2: 80C98000 (RestartNPU)" in text
    assert job.metrics.sample("tft_bridge_fault_info_messages_total", {"result": "received"}) >= 1
    await eventually(lambda: reader.last is not None and reader.last["signal"] == "normal", 10,
                     what="the fault cleared")


async def test_a_retried_uce_names_the_fault_centres_record_as_its_cause(
        jobs: list[SimulatedJob], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No device-plugin report: the controller's UCE report alone becomes ClusterD's
    fault-centre record (80E01801 RestartBusiness on the rank's NPU), published by the
    Fault service before the cycle it starts; the recorded cycle names it."""
    job = await recorded_recovery(jobs, tmp_path)
    job.training.inject_fault({5: 0})  # rank 5: node-1, NPU 1 (4 NPUs per node)
    await annotation(job, "retry-success")
    cycle = await successful_cycle(job, tmp_path, capsys)
    cause = cycle["summary"]["clusterd_faults"]
    assert cause["devices"] == [{"node": "node-1", "device": "1", "type": "NPU", "codes": ["80E01801"],
                                 "levels": ["RestartBusiness"]}]
    assert "cause     ClusterD: node-1 NPU 1: 80E01801 (RestartBusiness)" in history(
        tmp_path, capsys, "--cycle", cycle["key"])


def test_the_seed_api_logs_the_npu_and_code_of_a_recovered_fault(
        server: ServerThread, training: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The seed API reads the same Fault service: the fault centre's device and code
    reach the launcher's log before the recovery they cause, and clear after it."""
    caplog.set_level(logging.INFO, logger="bridge.job.session.fault_centre")
    manager = hosting_the_controller(server, training)
    try:
        assert manager.side is not None
        reader = manager.side.fault_centre
        eventually_sync(lambda: reader.stream.subscribed.is_set(), 10, what="fault info stream")
        server.call(server.sim.device_fault, SEED_JOB, [6])  # the device plugin's report: node-1, NPU 2
        eventually_sync(lambda: reader.last is not None and reader.last["signal"] == "fault", 10,
                        what="the fault message")
        assert reader.last is not None and reader.last["devices"] == [
            {"node": "node-1", "device": "2", "type": "NPU", "codes": ["80C98000"], "levels": ["RestartNPU"]}]
        assert f"ClusterD's fault centre for job {SEED_JOB}: node-1 NPU 2: 80C98000 (RestartNPU)" in caplog.text
        training.inject_fault({6: 1})  # ... and the rank on it fails
        server.wait_for(lambda e: e.kind == "annotation" and e.detail.get("value") == "recover-success", 15)
        server.call(server.sim.clear_device_faults, SEED_JOB)
        eventually_sync(lambda: reader.last is not None and reader.last["signal"] == "normal", 10,
                        what="the fault cleared")
        assert manager.metrics.sample("tft_bridge_fault_info_messages_total", {"result": "received"}) >= 2
    finally:
        manager.close()


async def test_a_release_without_the_fault_service_says_so_in_the_record(
        jobs: list[SimulatedJob], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = await recorded_recovery(jobs, tmp_path, release=V7_3)
    assert job.metrics.sample("tft_bridge_fault_info_messages_total", {"result": "unavailable"}) == 1
    job.training.inject_fault({5: 1})
    await annotation(job, "recover-success")
    cycle = await successful_cycle(job, tmp_path, capsys)
    assert cycle["summary"]["clusterd_faults"]["signal"] == "unavailable"
    text = history(tmp_path, capsys, "--cycle", cycle["key"])
    assert "not available (this ClusterD release does not serve its Fault service)" in text


def test_the_trace_carries_the_cause() -> None:
    pytest.importorskip("opentelemetry.proto")
    from bridge.job.recorder.otel import build_request

    info = {"signal": "fault", "devices": [{"node": "node-1", "device": "0", "type": "NPU", "codes": ["80C98000"],
                                            "levels": ["RestartNPU"]}]}
    record = {"job": JOB, "key": "k-1", "uuid": "u", "started": 100.0, "ended": 101.0, "outcome": "success",
              "strategy": "recover", "opened_by": "fault", "summary": {"clusterd_faults": info},
              "events": [{"t": 100.2, "kind": "clusterd_faults", **info}]}
    spans = build_request(record).resource_spans[0].scope_spans[0].spans
    root = {a.key: a.value.string_value for a in spans[0].attributes}
    assert root["tft_bridge.clusterd_faults"] == "node-1 NPU 0: 80C98000 (RestartNPU)"
    details = [a.value.string_value for span in spans for event in span.events for a in event.attributes]
    assert "ClusterD fault centre: node-1 NPU 0: 80C98000 (RestartNPU)" in details


async def test_the_reader_registers_again_after_a_clusterd_restart(jobs: list[SimulatedJob], tmp_path: Path) -> None:
    """The stream's end deletes ClusterD's publisher: the reader registers again, and the
    faults that came meanwhile are read at once (GetFaultMsgSignal), not at their next change."""
    job = await recorded_recovery(jobs, tmp_path)
    assert job.bridge is not None and job.bridge.side is not None
    reader = job.bridge.side.fault_centre
    await job.sim.stop()
    job.sim.device_fault(JOB, [1])  # reported while ClusterD is down: kept in its device info
    await job.sim.start(job.sim.address or "")
    await eventually(lambda: reader.last is not None and reader.last["signal"] == "fault", 15,
                     what="the fault read after the restart")
    assert reader.last is not None and reader.last["devices"][0]["device"] == "1"
    assert job.metrics.sample("tft_bridge_clusterd_stream_failures_total", {"stream": "fault_info"}) >= 1
