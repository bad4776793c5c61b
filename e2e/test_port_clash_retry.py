"""The e2e suite runs a test again when a port picked for it was taken meanwhile (conftest.py):
here the first attempt really fails to bind a port another socket holds."""

from __future__ import annotations

import socket

from meshfn.testing.ports import PortInUse, free_port

ATTEMPTS: list[int] = []


def test_a_port_clash_is_retried_with_new_ports() -> None:
    port = free_port()
    ATTEMPTS.append(port)
    if len(ATTEMPTS) == 1:
        with socket.socket() as holder, socket.socket() as ours:
            holder.bind(("127.0.0.1", port))
            holder.listen()
            try:
                ours.bind(("127.0.0.1", port))
            except OSError as exc:
                raise PortInUse(f"port {port}") from exc
    assert len(ATTEMPTS) == 2  # the clash was retried, once
