"""The ports the simulations and the node service listen on (bridge/core/listen_ports.py's ``free_port``): outside
the kernel's ephemeral range, where an outgoing connection of a busy test run took a
port between its probe and the stub controller's bind (SystemExit 2 at start-up)."""

from __future__ import annotations

import os
import socket

import pytest

from bridge.core import listen_ports as port_picker
from bridge.core.listen_ports import free_port


def test_a_free_port_is_never_one_an_outgoing_connection_could_take() -> None:
    low, high = port_picker._ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert all(1024 <= port <= 65535 and not low <= port <= high for port in ports)
    assert len(set(ports)) == len(ports)  # never handed out twice


def test_the_port_is_free_to_listen_on() -> None:
    port = free_port()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()


def test_a_taken_port_is_skipped(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        draw = port_picker._pick.randint
        picks: list[int] = []

        def first_the_taken_one(start: int, end: int) -> int:
            picks.append(taken if not picks else draw(start, end))
            return picks[-1]

        monkeypatch.setattr(port_picker._pick, "randint", first_the_taken_one)
        port = free_port()
        assert picks[0] == taken and port != taken and port == picks[-1]


def test_a_slice_keeps_the_picks_to_its_part_of_each_span(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """What keeps the suite's parallel workers (each its own slice) from drawing the same
    port between a probe and the bind."""
    whole = port_picker.candidate_spans(None)
    monkeypatch.setenv(port_picker.SLICE_ENV, "2/4")
    ports = [free_port() for _ in range(100)]
    parts = [(start + (end - start + 1) // 4, start + 2 * ((end - start + 1) // 4) - 1) for start, end in whole]
    assert all(any(a <= port <= b for a, b in parts) for port in ports), (parts, sorted(ports))
    monkeypatch.setenv(port_picker.SLICE_ENV, "1/4")
    first = [free_port() for _ in range(100)]
    assert not set(first) & set(ports)


def test_every_candidate_port_is_as_likely_whichever_span_it_lies_in() -> None:
    """The narrow span above the ephemeral range gets its share of the picks, not half of
    them: where the slices grow narrow (a stage's part, a worker's, a node service's),
    two processes' picks meet there no more often than anywhere else."""
    spans = port_picker.candidate_spans(os.environ.get(port_picker.SLICE_ENV))
    if len(spans) < 2:
        pytest.skip(f"one span of candidate ports in this process's slice: {spans}")
    narrow_start, narrow_end = spans[1]
    share = (narrow_end - narrow_start + 1) / sum(end - start + 1 for start, end in spans)
    picks = [free_port() for _ in range(400)]
    for port in picks:
        port_picker.release(port)
    narrow = sum(narrow_start <= port for port in picks) / len(picks)
    assert abs(narrow - share) < 0.1, (narrow, share)  # one span of two: 0.5


def test_a_bad_slice_is_refused_saying_what_it_expects(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(port_picker.SLICE_ENV, "5/4")
    with pytest.raises(ValueError, match=r"TFT_BRIDGE_PORT_SLICE='5/4': expected K/N with 1 <= K <= N"):
        free_port()


def test_the_parts_of_a_slice_lie_inside_it_and_apart(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """What keeps processes started side by side from one worker (the chaos workers, the
    node services of a chaos schedule) from drawing each other's ports: each picks from
    a part of the worker's slice of its own (``child_slice``)."""
    monkeypatch.setenv(port_picker.SLICE_ENV, "2/3")
    parts = [port_picker.child_slice(index, 4) for index in (1, 2, 3, 4)]
    assert parts == ["2/3,1/4", "2/3,2/4", "2/3,3/4", "2/3,4/4"]
    whole = port_picker.candidate_spans(None)
    worker = port_picker._slice(whole, "2/3")
    picks = {part: {free_port(within=part) for _ in range(60)} for part in parts}
    for part, ports in picks.items():
        assert all(any(a <= port <= b for a, b in worker) for port in ports), (part, sorted(ports))
        assert all(any(a <= port <= b for a, b in port_picker._slice(whole, part)) for port in ports)
    for first in parts:
        for second in parts:
            if first != second:
                assert not picks[first] & picks[second]
                spans_a, spans_b = port_picker._slice(whole, first), port_picker._slice(whole, second)
                assert all(b_end < a_start or a_end < b_start
                           for a_start, a_end in spans_a for b_start, b_end in spans_b)


def test_a_part_of_every_port_when_the_process_has_no_slice(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv(port_picker.SLICE_ENV, raising=False)
    assert port_picker.child_slice(3, 5) == "3/5"
    with pytest.raises(ValueError, match="part 6 of 5"):
        port_picker.child_slice(6, 5)


def test_a_bad_part_of_a_chain_is_refused_saying_what_it_expects(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(port_picker.SLICE_ENV, "1/2,0/3")
    with pytest.raises(ValueError, match=r"TFT_BRIDGE_PORT_SLICE='1/2,0/3': expected K/N .* or a chain of them"):
        free_port()
