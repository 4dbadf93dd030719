"""`channels.Channel.wait_ready` and its fast path `is_ready` against a real gRPC server on
loopback (grpc's own health service) and a port nothing listens on; and a `refused_fails` call
(`score`) whose bridge goes between the connection check and the stream."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from nemo_gym_grpc.rewards.client import channels, stream
from nemo_gym_grpc.v1 import verify_pb2


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


async def test_a_refused_fails_call_whose_bridge_goes_after_the_check_fails_at_once(monkeypatch):
    """The bridge goes between `channels.ready` saying READY and the stream's start: a window
    of microseconds in `score` (a CI run hit it), held open here. The stream used to wait for
    the bridge to come back (`wait_for_ready`) until the call's deadline, 600 s by default.
    A bare in-process gRPC server plays the bridge, since the window cannot be held open
    around a bridge process; no item reaches it."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    checked = channels.ready

    async def ready_then_gone(channel, timeout, *, refused_fails=False):
        connected = await checked(channel, timeout, refused_fails=refused_fails)
        if connected:
            server.stop(None).wait()
            await channel.wait_for_state_change(grpc.ChannelConnectivity.READY)  # it saw that
        return connected

    monkeypatch.setattr(channels, "ready", ready_then_gone)
    item = verify_pb2.VerifyRequest(request_id="a", resources_server="mcqa")
    call = stream.Call(
        stream.VERIFY, target, [item], timeout=20, connect_timeout=5, refused_fails=True
    )
    try:
        outcome = (await stream.asend(call))["a"]
    finally:
        server.stop(None)
    assert outcome.code == "UNAVAILABLE" and outcome.whole_call, outcome
    assert outcome.message == f"no connection to the bridge at {target}: it refused the connection"
