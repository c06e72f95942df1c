"""The seed API (seeds 000/001) against the simulated ClusterD and the stub controller:
a launcher script written against the seed documentation, return codes, TLS and mTLS."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest

from bridge import recover_manager
from bridge.job.session.codes import Code
from bridge.recover_manager import CertificateError, ClusterDError, ClusterDUnavailable, DLRecoverManager, ProcessRecoveryOff, pb, report_process_fault, report_recover_status, report_recover_strategy, report_stop_complete
from bridge.job.reports.controller_flow import Step
from bridge.sim.clusterd import SimJob
from bridge.sim.scenario import free_port

from .conftest import eventually_sync
from .seedapi import JOB, ServerThread, hosting_the_controller, server, training  # noqa: F401 - fixtures
from .test_clusterd_restart import HeldCallback

pytestmark = pytest.mark.timeout(60)


def test_a_script_written_against_the_seed_runs_unchanged(server: ServerThread, training) -> None:  # type: ignore[no-untyped-def]
    import mindio_ttp.controller_ttp as ttp

    # --- as a launcher following seeds 000/001 would write it -----------------------
    info = pb.ClientInfo(ip="", port="", taskId=JOB, role="master agent")
    manager = DLRecoverManager(info, server.address, secure_conn=False)
    manager.init_clusterd()
    status = manager.register(info)
    assert status.code == 0
    manager.start_subscribe()
    ttp.tft_register_mindx_callback("report_fault_ranks", report_process_fault)
    ttp.tft_register_mindx_callback("report_stop_complete", report_stop_complete)
    ttp.tft_register_mindx_callback("report_strategies", report_recover_strategy)
    ttp.tft_register_mindx_callback("report_result", report_recover_status)
    ttp.tft_init_controller(-1, 16, False, True, False)
    ttp.tft_start_controller("127.0.0.1", free_port(), False, "")
    # -------------------------------------------------------------------------------
    try:
        training.connect_ranks(range(16))
        server.wait_for(lambda e: e.kind == "stream-open")
        server.wait_for(lambda e: e.kind == "signal" and e.name == "keep-alive")
        training.inject_fault({5: 1})
        server.wait_for(lambda e: e.kind == "annotation" and e.detail.get("value") == "recover-success")
        assert [n.args[0] for n in training.notifies("change_strategy")] == ["recover"]
        assert recover_manager.__version__
    finally:
        manager.close()


def test_a_pod_sized_global_fault_reaches_the_controller_whole(server: ServerThread, training) -> None:  # type: ignore[no-untyped-def]
    """A launcher hosting the controller itself: the seed API never learns the world size
    (the controller was initialised by the launcher), and its notify guard used to drop
    every fault rank but 0, so ClusterD's globalFault for rank 5's pod, {4, 5, 6, 7}, became
    on_global_rank({}); the controller then repaired rank 5 alone while the node agent
    restarted 4..7 under it, and hung until ClusterD gave up."""
    manager = hosting_the_controller(server, training)
    try:
        training.inject_fault({5: 1})
        server.wait_for(lambda e: e.kind == "signal" and e.name == "globalFault")
        server.wait_for(lambda e: e.kind == "annotation" and e.detail.get("value") == "recover-success")
        assert [n.args[0] for n in training.notifies("on_global_rank")] == [{4: 1, 5: 1, 6: 1, 7: 1}]
        assert training.repair_hang_ranks == ()
        assert manager.metrics.sample("tft_bridge_bad_inputs_total", {"kind": "signal_argument"}) == 0
    finally:
        manager.close()


def assert_ended_with_a_dump_without_repair(server: ServerThread, training, manager: DLRecoverManager) -> None:  # type: ignore[no-untyped-def]
    """A cycle wider than the controller's offer: offered exit and dump only, the
    checkpoint saved, the controller told once and never sent into a hung repair."""
    server.wait_for(lambda e: e.kind == "annotation" and e.detail.get("value") == "dump-success", 20)
    offered = [e.detail["strategies"] for e in server.sim.journal.rpcs("ReportRecoverStrategy") if e.code == 0]
    assert offered[-1] == ["exit", "dump"], offered
    assert [n.args[0] for n in training.notifies("change_strategy")][:1] == ["dump"]
    assert len(training.notifies("on_global_rank")) == 1
    assert training.repair_hang_ranks == ()
    assert manager.metrics.sample("tft_bridge_cycle_resumes_total", {"result": "answered_without_repair"}) == 1


def test_a_resumed_cycle_wider_than_the_controllers_ends_with_a_dump(server: ServerThread, training) -> None:  # type: ignore[no-untyped-def]
    """The seed API carries a cycle across a reset of ClusterD's job like the daemon
    (tests/test_clusterd_restart.py): the stream breaks while the controller waits for its
    strategy, and the fault centre's process fault on rank 9 joins the new cycle, whose
    globalFault then names rank 9's pod too. The controller, which offered its strategies
    for ranks 4-7 and cannot be told more, must not be sent into a repair that hangs on
    ranks restarted under it: the new cycle is offered exit and dump only."""
    sim = server.sim
    stages: list[str] = []

    async def break_stream() -> None:
        await sim.drop_subscriber(JOB)
        sim.take_tweaks()  # a delay the old cycle's changeStrategy did not take must not hold the new stream

    def listener(entry) -> None:  # type: ignore[no-untyped-def]  # on the server's loop
        if entry.job_id != JOB:
            return
        if not stages and entry.kind == "state" and entry.name == "NotifyDecidedStrategyState":
            stages.append("broken")
            sim.delay_next_signal(30.0)  # the old cycle's changeStrategy never reaches the bridge
            server.loop.create_task(break_stream())
        elif stages == ["broken"] and entry.kind == "signal" and entry.name == "stopTrain":
            stages.append("stopped again")
            server.loop.create_task(join_rank_9())

    async def join_rank_9() -> None:
        stages.append(await sim.start_clusterd_fault(JOB, {9: 1}))

    sim.journal.add_listener(listener)
    manager = hosting_the_controller(server, training)
    try:
        training.inject_fault({5: 1})
        assert_ended_with_a_dump_without_repair(server, training, manager)
        assert stages == ["broken", "stopped again", "joined"]
    finally:
        manager.close()


def test_a_cycle_rebound_wider_than_the_controllers_coming_strategies_ends_with_a_dump(  # type: ignore[no-untyped-def]
        server: ServerThread, training) -> None:
    """As the daemon (tests/test_clusterd_restart.py): the stream breaks after the
    controller had on_global_rank and before its strategies reach the bridge, and rank
    9's process fault joins the new cycle, whose globalFault names rank 9's pod too. The
    controller's strategies, when they come, answer that cycle with exit and dump only."""
    sim = server.sim
    stages: list[str] = []

    async def join_rank_9() -> None:
        stages.append(await sim.start_clusterd_fault(JOB, {9: 1}))

    def listener(entry) -> None:  # type: ignore[no-untyped-def]  # on the server's loop
        if entry.job_id == JOB and stages == ["broken"] and entry.kind == "signal" and entry.name == "stopTrain":
            stages.append("stopped again")
            server.loop.create_task(join_rank_9())

    manager = hosting_the_controller(server, training)
    try:
        assert manager.link is not None
        hold = HeldCallback(training, "report_strategies")
        training.inject_fault({5: 1})
        eventually_sync(lambda: hold.held, 10, what="the controller's strategies (held from the bridge)")
        assert manager.link.flow.step is Step.GLOBAL_SENT
        sim.journal.add_listener(listener)
        stages.append("broken")
        server.run(sim.drop_subscriber(JOB))
        eventually_sync(lambda: manager.metrics.sample("tft_bridge_cycle_resumes_total", {"result": "rebound"}) == 1,
                        15, what="the new cycle's globalFault rebound to the controller")
        assert stages == ["broken", "stopped again", "joined"]
        hold.release()  # as the controller's thread would call it: a report function never blocks
        assert_ended_with_a_dump_without_repair(server, training, manager)
    finally:
        manager.close()


def test_return_codes(server: ServerThread, training) -> None:  # type: ignore[no-untyped-def]
    assert report_process_fault({1: 1}) == Code.UnRegistry  # no manager subscribed yet
    info = pb.ClientInfo(taskId=JOB, role="agent")
    manager = DLRecoverManager(info, server.address, secure_conn=False, controller_module="stub")
    try:
        assert manager.register(info).code == Code.UnInit  # Register before Init: 408
        manager.init_clusterd()
        assert manager.register(info).code == 0
        manager.start_subscribe()
        server.wait_for(lambda e: e.kind == "signal" and e.name == "keep-alive")
        assert report_process_fault({"x": 1}) == Code.ClientError  # bad input, named in the log
        assert report_stop_complete(True, "x", {}) == Code.ClientError
        assert report_recover_strategy({}, "retry") == Code.ClientError
        # no cycle is running: the report answers nothing and is dropped, never queued for the next
        assert report_stop_complete(0, "stop ok", {1: 1}, wait=5) == Code.OrderMix
        assert report_process_fault({3: 0}, {3: ""}, wait=5) == Code.OK  # delivered, ClusterD's 0
        server.wait_for(lambda e: e.kind == "rpc" and e.name == "ReportProcessFault")
        assert not server.sim.journal.rpcs("ReportStopComplete")
    finally:
        manager.close()


def test_a_callers_rpc_hook_sees_the_report_calls_too(server: ServerThread, training) -> None:  # type: ignore[no-untyped-def]
    """A launcher watching the manager's RPCs (``link.client.on_rpc``, as the flight
    recorder does) sees the Report* calls the wire makes, with ClusterD's answer, not
    only Init, Register and Subscribe."""
    info = pb.ClientInfo(taskId=JOB, role="agent")
    manager = DLRecoverManager(info, server.address, secure_conn=False, controller_module="stub")
    seen: list[tuple[str, int | str]] = []
    try:
        manager.init_clusterd()
        assert manager.register(info).code == 0
        manager.start_subscribe()
        assert manager.link is not None
        manager.link.client.on_rpc = lambda method, code, started, seconds: seen.append((method, code))
        server.wait_for(lambda e: e.kind == "signal" and e.name == "keep-alive")
        assert report_process_fault({3: 0}, {3: ""}, wait=5) == Code.OK
        eventually_sync(lambda: ("ReportProcessFault", 0) in seen, 10, "the report's call seen by the hook")
    finally:
        manager.close()


def test_init_errors_are_documented_exceptions(training) -> None:  # type: ignore[no-untyped-def]
    srv = ServerThread([SimJob("off", process_recover=False)])
    try:
        with pytest.raises(ProcessRecoveryOff) as off:
            DLRecoverManager(pb.ClientInfo(taskId="off"), srv.address, secure_conn=False).init_clusterd()
        assert off.value.code == 403
        with pytest.raises(ClusterDError) as unknown:
            DLRecoverManager(pb.ClientInfo(taskId="nobody"), srv.address, secure_conn=False).init_clusterd()
        assert unknown.value.code == 502
    finally:
        srv.close()
    closed = DLRecoverManager(pb.ClientInfo(taskId="j"), f"127.0.0.1:{free_port()}", secure_conn=False, rpc_timeout=0.5)
    with pytest.raises(ClusterDUnavailable):
        closed.init_clusterd()
    with pytest.raises(ValueError, match="no job id"):
        DLRecoverManager(pb.ClientInfo(), "127.0.0.1:1", secure_conn=False)


@pytest.mark.parametrize("wait, cap, warned", [("12", 6.0, False), ("8", 4.0, True), ("600", 10.0, False),
                                                 (None, 10.0, False), ("+20", 10.0, False)])
def test_the_controllers_wait_bounds_the_reconnect_back_off(monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture, wait: str | None,
                                                            cap: float, warned: bool) -> None:
    """The controller the launcher starts reads MINDIO_WAIT_MINDX_TIME (digits in 1..3600,
    else 30); one back-off sleep must leave most of that wait for the re-subscription,
    as the daemon's configuration requires, and a wait ClusterD cannot meet for a process
    fault (11 s or less) is warned about on this entry point too."""
    if wait is None:
        monkeypatch.delenv("MINDIO_WAIT_MINDX_TIME", raising=False)
    else:
        monkeypatch.setenv("MINDIO_WAIT_MINDX_TIME", wait)
    with caplog.at_level("WARNING", logger="bridge.recover_manager"):
        manager = DLRecoverManager(pb.ClientInfo(taskId=JOB), "127.0.0.1:1", secure_conn=False)
    try:
        assert manager.config.clusterd.reconnect_max == cap
        assert manager.config.controller.wait_mindx_time == (int(wait) if wait and wait.isdigit() else 30)
        assert any("wait_mindx_time" in record.getMessage() for record in caplog.records) is warned
    finally:
        manager.close()


# --------------------------------------------------------------------------- TLS

trustme = pytest.importorskip("trustme")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    directory = tmp_path_factory.mktemp("pki")
    ca, other_ca = trustme.CA(), trustme.CA()
    server_cert = ca.issue_cert("localhost", "127.0.0.1")
    client_cert = ca.issue_cert("tft-bridge-client")
    files = {}
    for name, blob in {"ca.pem": ca.cert_pem.bytes(), "other-ca.pem": other_ca.cert_pem.bytes(),
                       "client.pem": client_cert.cert_chain_pems[0].bytes(),
                       "client.key": client_cert.private_key_pem.bytes()}.items():
        (directory / name).write_bytes(blob)
        files[name] = str(directory / name)
    return {"ca": ca, "server_cert": server_cert, **files}


def server_credentials(pki: dict[str, object], require_client_auth: bool) -> grpc.ServerCredentials:
    cert = pki["server_cert"]
    ca = pki["ca"]
    return grpc.ssl_server_credentials(
        [(cert.private_key_pem.bytes(), b"".join(p.bytes() for p in cert.cert_chain_pems))],  # type: ignore[attr-defined]
        root_certificates=ca.cert_pem.bytes() if require_client_auth else None,  # type: ignore[attr-defined]
        require_client_auth=require_client_auth)


def test_tls_with_the_named_ca(pki: dict[str, object], training) -> None:  # type: ignore[no-untyped-def]
    srv = ServerThread([SimJob(JOB)], server_credentials(pki, require_client_auth=False))
    try:
        manager = DLRecoverManager(pb.ClientInfo(taskId=JOB), srv.address.replace("127.0.0.1", "localhost"),
                                   secure_conn=True, cert_path=str(pki["ca.pem"]))
        manager.init_clusterd()
        assert manager.register(pb.ClientInfo(taskId=JOB)).code == 0
        wrong = DLRecoverManager(pb.ClientInfo(taskId=JOB), srv.address.replace("127.0.0.1", "localhost"),
                                 secure_conn=True, cert_path=str(pki["other-ca.pem"]), rpc_timeout=1)
        with pytest.raises(ClusterDUnavailable):
            wrong.init_clusterd()
        plain = DLRecoverManager(pb.ClientInfo(taskId=JOB), srv.address, secure_conn=False, rpc_timeout=1)
        with pytest.raises(ClusterDUnavailable):
            plain.init_clusterd()
    finally:
        srv.close()


def test_mutual_tls(pki: dict[str, object], training) -> None:  # type: ignore[no-untyped-def]
    srv = ServerThread([SimJob(JOB)], server_credentials(pki, require_client_auth=True))
    address = srv.address.replace("127.0.0.1", "localhost")
    try:
        manager = DLRecoverManager(pb.ClientInfo(taskId=JOB), address, cert_path=str(pki["ca.pem"]),
                                   client_cert=str(pki["client.pem"]), client_key=str(pki["client.key"]))
        manager.init_clusterd()
        no_cert = DLRecoverManager(pb.ClientInfo(taskId=JOB), address, cert_path=str(pki["ca.pem"]), rpc_timeout=1)
        with pytest.raises(ClusterDUnavailable):
            no_cert.init_clusterd()
    finally:
        srv.close()


def test_a_missing_certificate_is_an_error_not_plaintext(tmp_path: Path) -> None:
    with pytest.raises(CertificateError, match="CA bundle .* cannot be read"):
        DLRecoverManager(pb.ClientInfo(taskId=JOB), "127.0.0.1:1", cert_path=str(tmp_path / "none.pem"))
    unreadable = tmp_path / "ca.pem"
    unreadable.write_text("x")
    with pytest.raises(CertificateError, match="both client_cert and client_key"):
        DLRecoverManager(pb.ClientInfo(taskId=JOB), "127.0.0.1:1", cert_path=str(unreadable),
                         client_cert=str(unreadable))


def test_a_closed_manager_leaves_no_thread_or_descriptor_behind(server: ServerThread, training) -> None:  # type: ignore[no-untyped-def]
    """A launcher creates a manager per job incarnation: each one's loop, its executor
    thread and its selector must go with close(), not pile up in the launcher."""
    import os

    from .conftest import eventually_sync

    def in_use() -> tuple[set[threading.Thread], dict[int, str]]:
        descriptors = {}
        for name in os.listdir("/proc/self/fd"):
            try:
                descriptors[int(name)] = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                pass  # closed since the listing (the listing's own among them)
        return set(threading.enumerate()), descriptors

    def left_behind(before: tuple[set[threading.Thread], dict[int, str]]) -> list[str]:
        """Threads and descriptors that were not there before: what the managers left, by
        identity, so a thread or descriptor of an earlier test of this worker ending
        meanwhile neither hides a leak nor counts as one."""
        threads, descriptors = in_use()
        return (sorted(f"thread {thread.name}" for thread in threads - before[0])
                + sorted(f"fd {fd} -> {target}" for fd, target in descriptors.items() if before[1].get(fd) != target))

    def one_manager() -> None:
        info = pb.ClientInfo(taskId=JOB, role="agent")
        manager = DLRecoverManager(info, server.address, secure_conn=False, controller_module="stub")
        manager.init_clusterd()
        assert manager.register(info).code == 0
        manager.start_subscribe()
        assert report_process_fault({3: 0}, {3: ""}, wait=5) == Code.OK  # the report path's thread too
        manager.close()
        manager.close()  # a second close is harmless

    one_manager()  # gRPC's process-wide threads start with the first channel
    before = in_use()
    for _ in range(3):
        one_manager()
    try:
        eventually_sync(lambda: not left_behind(before), 10, what="threads and descriptors back to those before")
    except AssertionError:
        assert left_behind(before) == []  # names what is left
        raise
