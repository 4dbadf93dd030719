"""`server.build` wires a bridge in-process (no subprocess, no NeMo Gym); the ready file; a
listen port that is taken."""

from __future__ import annotations

import socket
import subprocess
import sys

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nemo_gym_grpc.bridge.nemo_gym import http
from nemo_gym_grpc.bridge.process.config import BridgeConfig
from nemo_gym_grpc.bridge.rpc.server import build
from nemo_gym_grpc.shared.child import read_ready_file, write_ready_file
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc


async def test_build_binds_a_bridge_that_is_not_serving_until_readiness():
    config = BridgeConfig(listen="127.0.0.1:0", servers={"a": ["http://127.0.0.1:1"]})
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        bridge = await build(config, http.Client(session))
        assert bridge.address.startswith("127.0.0.1:") and not bridge.address.endswith(":0")
        assert not bridge.tls
        await bridge.server.start()
        try:
            async with grpc.aio.insecure_channel(bridge.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                checked = await health.Check(health_pb2.HealthCheckRequest(service=""))
                assert checked.status == health_pb2.HealthCheckResponse.NOT_SERVING
                stub = verify_pb2_grpc.VerifyServiceStub(channel)
                listed = await stub.ListResourcesServers(verify_pb2.ListResourcesServersRequest())
                assert [(s.name, list(s.upstream_urls)) for s in listed.resources_servers] == [
                    ("a", ["http://127.0.0.1:1"])
                ]
        finally:
            await bridge.server.stop(0)


def test_the_ready_file_holds_the_address_once_written(tmp_path):
    path = tmp_path / "ready"
    assert read_ready_file(path) is None
    write_ready_file(path, "127.0.0.1:5")
    assert path.read_text() == "127.0.0.1:5\n"
    assert read_ready_file(path) == "127.0.0.1:5"
    assert [p.name for p in tmp_path.iterdir()] == ["ready"]  # no temporary file left


@pytest.fixture
def taken_port():
    """A loopback port another socket listens on (as gRPC binds: SO_REUSEADDR)."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


async def test_build_on_a_taken_port_says_so_in_one_line(taken_port):
    config = BridgeConfig(listen=f"127.0.0.1:{taken_port}")
    async with aiohttp.ClientSession() as session:
        with pytest.raises(RuntimeError) as raised:
            await build(config, http.Client(session))
    assert str(raised.value) == f"cannot listen on 127.0.0.1:{taken_port}: address already in use"


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_on_a_taken_port_writes_only_the_one_clear_line(taken_port, workers):
    listen = f"127.0.0.1:{taken_port}"
    done = subprocess.run(
        [sys.executable, "-m", "nemo_gym_grpc.bridge", "serve", "--listen", listen]
        + ["--server", "a=http://127.0.0.1:1", "--workers", workers],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"nemo-gym-grpc: cannot listen on {listen}: address already in use"
    ], done.stderr
