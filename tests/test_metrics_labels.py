"""Bounded metric labels: values from ClusterD's wire map to the known
set plus ``other``, and every series with known labels exists at 0 from the start."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from bridge._proto import recover_pb2 as pb
from bridge.job.session.clusterd import ClusterDClient
from bridge.job.session.codes import Code
from bridge.core.config import ClusterDConfig
from bridge.job.reports.controller_flow import CALLBACKS, ControllerFlow, Step
from bridge.job.metrics import OTHER, RECOVERY_PHASES, REFUSAL_REASONS, REPORT_KINDS, RPC_METHODS, SIGNAL_TYPES, BridgeMetrics, code_label, drop_reason_for_code, signal_type_label
from bridge.job.session.signals import SignalDispatcher, screen_signal

from .conftest import recover_server


def series(metrics: BridgeMetrics, family: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of ``family`` (a counter's ``_total``), by its labels."""
    found: dict[tuple[tuple[str, str], ...], float] = {}
    for metric in metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == family:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


# --------------------------------------------------------------------------- mapping


@pytest.mark.parametrize("signal_type", SIGNAL_TYPES)
def test_known_signal_types_keep_their_name(signal_type: str) -> None:
    assert signal_type_label(signal_type) == signal_type


@pytest.mark.parametrize("garbage", ["stoptrain", "x" * 5000, "keep-alive ", "\x00", "globalFault\n"])
def test_unknown_signal_types_become_other(garbage: str) -> None:
    assert signal_type_label(garbage) == OTHER


def test_a_signal_without_type_is_empty() -> None:
    assert signal_type_label("") == "empty"


@pytest.mark.parametrize("code", list(Code))
def test_known_codes_keep_their_number(code: Code) -> None:
    assert code_label(int(code)) == str(int(code))
    assert drop_reason_for_code(int(code)) == f"code_{int(code)}"


@pytest.mark.parametrize("code", [-1, 1, 202, 777, 2**31 - 1, -(2**31)])
def test_unknown_codes_become_other(code: int) -> None:
    assert code_label(code) == OTHER
    assert drop_reason_for_code(code) == "code_other"


# --------------------------------------------------------------------------- call sites


class _NoController:
    """Nothing in the tested path may reach the controller."""


async def test_garbage_signal_type_from_the_stream_is_counted_as_other() -> None:
    metrics = BridgeMetrics()
    dispatcher = SignalDispatcher("job-a", ControllerFlow(), _NoController(), None, metrics,  # type: ignore[arg-type]
                                  None, None, on_kill_master=lambda: None)  # type: ignore[arg-type]
    try:
        for signal_type in ("bogus-type-1", "bogus-type-2", "stopTrain"):
            signal = pb.ProcessManageSignal(jobId="another-job", signalType=signal_type, uuid="U")
            dispatcher.submit(screen_signal(signal, signal.SerializeToString(), "token"))
    finally:
        dispatcher._executor.shutdown(wait=True)
    received = series(metrics, "tft_bridge_signals_received_total")
    assert received[(("signal_type", OTHER),)] == 2
    assert received[(("signal_type", "stopTrain"),)] == 1
    assert not any("bogus" in value for labels in received for _, value in labels)


@pytest.fixture
async def clusterd_answering_777() -> AsyncIterator[str]:
    """A gRPC server whose Init answers a Status code no protocol version defines."""

    async def init(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return pb.Status(code=777, info="made up").SerializeToString()

    async with recover_server("Init", init) as address:
        yield address


async def test_an_unknown_status_code_is_counted_as_other(clusterd_answering_777: str) -> None:
    metrics = BridgeMetrics()
    client = ClusterDClient(ClusterDConfig(address=clusterd_answering_777, rpc_timeout=10.0), metrics)
    await client.open()
    try:
        assert await client.call("/Recover/Init", b"") == 777  # the caller still sees the real code
    finally:
        await client.close()
    rpcs = series(metrics, "tft_bridge_clusterd_rpcs_total")
    assert rpcs[(("code", OTHER), ("method", "Init"))] == 1
    assert not any(value == "777" for labels in rpcs for _, value in labels)


# --------------------------------------------------------------------------- children at start


def test_known_children_exist_at_start_with_value_zero() -> None:
    metrics = BridgeMetrics()
    received = series(metrics, "tft_bridge_signals_received_total")
    assert {labels[0][1] for labels in received} == {*SIGNAL_TYPES, OTHER}
    rpcs = series(metrics, "tft_bridge_clusterd_rpcs_total")
    assert set(rpcs) == {(("code", "0"), ("method", method)) for method in RPC_METHODS}
    assert {labels[0][1] for labels in series(metrics, "tft_bridge_reports_sent_total")} == set(REPORT_KINDS)
    assert {labels[0][1] for labels in series(metrics, "tft_bridge_controller_callbacks_total")} == set(CALLBACKS)
    assert {labels[0][1] for labels in series(metrics, "tft_bridge_faults_reported_total")} == {"uce", "hccl", "other"}
    phases = series(metrics, "tft_bridge_recovery_phase_duration_seconds_count")
    assert {labels[0][1] for labels in phases} == set(RECOVERY_PHASES)
    refused = series(metrics, "tft_bridge_signals_refused_total")
    assert {labels[0][1] for labels in refused} == set(REFUSAL_REASONS)
    desync = series(metrics, "tft_bridge_flow_desync_total")
    assert set(desync) == {(("callback", c), ("step", s.value)) for c in CALLBACKS for s in Step}
    for family in ("tft_bridge_signals_received_total", "tft_bridge_clusterd_rpcs_total",
                   "tft_bridge_flow_desync_total", "tft_bridge_reports_sent_total",
                   "tft_bridge_recovery_phase_duration_seconds_count"):
        assert set(series(metrics, family).values()) == {0.0}, family


def test_desync_hook_counts_by_callback_and_step() -> None:
    metrics = BridgeMetrics()
    flow = ControllerFlow(on_desync=metrics.count_desync)
    flow.on_callback("report_strategies", strategies=("exit",))  # while IDLE
    flow.on_callback("report_strategies", strategies=("exit",))  # while AWAIT_STRATEGY
    desync = series(metrics, "tft_bridge_flow_desync_total")
    assert desync[(("callback", "report_strategies"), ("step", "idle"))] == 1
    assert desync[(("callback", "report_strategies"), ("step", "await_strategy"))] == 1
    assert sum(desync.values()) == 2


def test_every_refusal_reason_the_code_uses_is_created_up_front() -> None:
    """The reasons are string literals in three modules; a new one must join REFUSAL_REASONS."""
    bridge = Path(__file__).resolve().parent.parent / "bridge"
    used: set[str] = set()
    used |= set(re.findall(r'_refuse\("([a-z_]+)"', (bridge / "job" / "session" / "signals.py").read_text()))
    used |= set(re.findall(r'reason = "([a-z_]+)"', (bridge / "job" / "session" / "signals.py").read_text()))
    used |= set(re.findall(r'signals_refused\.labels\("([a-z_]+)"\)', (bridge / "job" / "session" / "signal_session.py").read_text()))
    gate = (bridge / "job" / "reports" / "controller_flow.py").read_text().split("def refusal", 1)[1].split("def snapshot", 1)[0]
    used |= set(re.findall(r'return "([a-z_]+)"', gate))
    used |= set(re.findall(r'else "([a-z_]+)"', gate))
    assert {"foreign_job", "stale_cycle", "unexpected_step", "strategy_not_offered"} <= used  # the scan works
    assert used <= set(REFUSAL_REASONS), sorted(used - set(REFUSAL_REASONS))
