"""Connections that never finish the HTTP/2 handshake are bounded in number
(`--max-connections`: one more is closed as it comes) and in time (`--handshake-timeout`:
closed when it passes), so squatters cannot use up the bridge's file descriptors; legit calls
go through once they are gone.

A real bridge process and raw TCP connections over loopback (a client that opens sockets and
sends nothing: no gRPC client can be told to stop before its preface).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support import closed_port
from tests.support.waiting import wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture
def squatters() -> Iterator[list[socket.socket]]:
    """Where the test keeps its raw connections; all closed at the end."""
    kept: list[socket.socket] = []
    yield kept
    for sock in kept:
        sock.close()


def test_silent_connections_are_capped_and_closed_after_the_handshake_timeout(
    start_bridge, squatters
):
    bridge = start_bridge(
        "--server", f"gone=http://127.0.0.1:{closed_port()}",
        "--max-connections", "8",
        "--handshake-timeout", "1",
    )  # fmt: skip
    host, port = bridge.target.rsplit(":", 1)
    before = open_fds(bridge.pid)
    for _ in range(40):
        squatters.append(socket.create_connection((host, int(port)), timeout=5))
    wait_until(lambda: open_fds(bridge.pid) <= before + 8, 10, "connections over 8 closed")
    wait_until(lambda: open_fds(bridge.pid) <= before, 10, "silent connections closed")
    wait_until(lambda: serving(bridge.target), 10, "a health check through")


def serving(target: str) -> bool:
    """A health Check on a new channel answers SERVING (False: the connection was refused)."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            return stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == SERVING
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            return False
