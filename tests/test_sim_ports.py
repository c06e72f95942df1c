"""The ports the simulations and the node service listen on (bridge/ports.py's ``free_port``): outside
the kernel's ephemeral range, where an outgoing connection of a busy test run took a
port between its probe and the stub controller's bind (SystemExit 2 at start-up)."""

from __future__ import annotations

import socket

from bridge import ports as port_picker
from bridge.ports import free_port


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
