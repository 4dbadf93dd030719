"""`channels.Channel.wait_ready` and its fast path `is_ready` against a real gRPC server on
loopback (grpc's own health service) and a port nothing listens on."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from nemo_gym_grpc.rewards.client import channels


@pytest.fixture
def server_target() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def _channel(target: str) -> channels.Channel:
    raw = grpc.insecure_channel(target, options=channels.CHANNEL_OPTIONS)
    return channels.Channel(raw, None, None)  # type: ignore[arg-type]  (stubs unused)


def test_a_new_channel_is_not_ready_until_it_connects_then_is_ready_at_once(server_target):
    channel = _channel(server_target)
    try:
        assert not channel.is_ready()  # IDLE: is_ready does not try to connect
        assert channel.wait_ready(10.0)
        assert channel.is_ready()
        assert channel.wait_ready(0.0)  # READY: no wait at all, even with no time left
    finally:
        channel.channel.close()


def test_a_target_without_a_server_is_never_ready_and_the_wait_times_out():
    with socket.socket() as probe:  # a free port, closed again: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    channel = _channel(f"127.0.0.1:{port}")
    try:
        assert not channel.wait_ready(0.3)
        assert not channel.is_ready()
    finally:
        channel.channel.close()
