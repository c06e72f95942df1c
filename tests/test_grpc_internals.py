"""Guards for what the bridge takes from below Python's and gRPC's public surface
(bridge/job/sched/grpc_internals.py): each fails on a system or a grpcio release where it is gone, so an
upgrade cannot silently put the bridge back on its slower way."""

from __future__ import annotations

import os
import socket
import threading
import time

import grpc
import pytest

from bridge.job.sched import grpc_internals as lowlevel


def test_the_c_library_gives_the_cpu_pin_its_two_functions_both_ways() -> None:
    for keep_gil in (True, False):
        getcpu = lowlevel.libc_function("sched_getcpu", keep_gil)
        setaffinity = lowlevel.libc_function("sched_setaffinity", keep_gil)
        assert getcpu is not None and setaffinity is not None, f"keep_gil={keep_gil}"
    allowed = frozenset(os.sched_getaffinity(0))
    results: list[object] = []

    def pin_and_read() -> None:  # on a thread of its own: the test process keeps its CPUs
        getcpu = lowlevel.libc_function("sched_getcpu", keep_gil=True)
        setaffinity = lowlevel.libc_function("sched_setaffinity", keep_gil=True)
        assert getcpu is not None and setaffinity is not None
        cpu = getcpu()
        mask = lowlevel.cpu_mask({cpu})
        results.append((cpu, setaffinity(0, mask.size, mask.address), frozenset(os.sched_getaffinity(0))))

    thread = threading.Thread(target=pin_and_read)
    thread.start()
    thread.join(10)
    [(cpu, code, pinned)] = results
    assert cpu in allowed and code == 0 and pinned == {cpu}


def test_a_refused_call_leaves_its_errno() -> None:
    setaffinity = lowlevel.libc_function("sched_setaffinity", keep_gil=True)
    assert setaffinity is not None
    empty = lowlevel.cpu_mask(set())  # no CPU at all: EINVAL
    assert setaffinity(0, empty.size, empty.address) == -1
    assert lowlevel.last_errno() != 0


def test_the_gil_holding_write_increments_an_eventfd() -> None:
    write = lowlevel.gil_holding_write()
    assert write is not None
    fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    try:
        assert write(fd, lowlevel.EVENTFD_ONE, 8) == 8
        assert write(fd, lowlevel.EVENTFD_ONE, 8) == 8
        assert os.eventfd_read(fd) == 2
    finally:
        os.close(fd)


def test_grpc_has_the_channel_object_after_send_wraps() -> None:
    """gRPC's private structure: a synchronous unary callable's ``_channel`` with a
    ``segregated_call``. Called against a port nobody listens on, the call is still
    started, so ``sent`` runs once per call, on the calling thread, before it ends."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        callable_ = channel.unary_unary("/Recover/ReportStopComplete", request_serializer=None,
                                        response_deserializer=None)
        sent: list[int] = []
        assert lowlevel.after_send(callable_, lambda: sent.append(threading.get_ident())), (
            f"grpcio {grpc.__version__} has no channel object to wrap: the wire's on_sent would run before the write")
        for _ in range(2):
            try:
                callable_(b"", timeout=2.0)
            except grpc.RpcError as error:
                assert error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert sent == [threading.get_ident()] * 2
    finally:
        channel.close()


def test_after_send_leaves_a_callable_without_a_channel_object_alone() -> None:
    def plain(payload: bytes, timeout: float) -> None:
        return None

    assert not lowlevel.after_send(plain, lambda: None)
    assert not hasattr(plain, "_channel")


def test_grpc_answers_a_synchronous_channels_connectivity_without_subscribing() -> None:
    """gRPC's private ``_channel.check_connectivity_state``: what the wire reads instead of
    ``Channel.subscribe``, whose polling thread keeps gRPC's event engine waking. Asked to
    connect to a port nobody listens on, the channel leaves IDLE; closed, it raises."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    check = lowlevel.connectivity_check(channel)
    assert check is not None, f"grpcio {grpc.__version__} cannot be asked a channel's connectivity"
    try:
        assert check(False) is grpc.ChannelConnectivity.IDLE
        check(True)
        deadline = time.monotonic() + 10
        while check(False) is grpc.ChannelConnectivity.IDLE and time.monotonic() < deadline:
            time.sleep(0.01)  # polled with a deadline: the attempt runs on gRPC's threads
        assert check(False) in (grpc.ChannelConnectivity.CONNECTING, grpc.ChannelConnectivity.TRANSIENT_FAILURE)
    finally:
        channel.close()
    with pytest.raises(ValueError):
        check(False)
