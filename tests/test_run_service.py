"""The RolloutService's place in a real bridge process, without NeMo Gym: the token, the stream
cap (--max-streams counts RunStream and VerifyStream together; one over it waits, here 1 s),
the batch limit, health, reflection, ListAgents of static entries, and the flags' checks. The
agents here are closed ports (nothing needs to answer)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import code_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from nemo_gym_grpc.bridge.rpc.health import ROLLOUT_SERVICE_NAME
from nemo_gym_grpc.v1 import rollout_pb2, rollout_pb2_grpc, verify_pb2, verify_pb2_grpc
from tests.support import BridgeProcess, closed_port, start_bridge
from tests.support.rollouts import run_request
from tests.support.waiting import wait_until

TOKEN = "r0llout-t0ken"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def bridge(tmp_path_factory) -> Iterator[BridgeProcess]:
    token = Path(tmp_path_factory.mktemp("rollout_token")) / "token"
    token.write_text(TOKEN)
    args = ["--agent", f"down=http://127.0.0.1:{closed_port()}"]
    args += ["--environment-server", f"episodes=http://127.0.0.1:{closed_port()}"]
    args += ["--token-file", str(token), "--max-streams", "1", "--max-batch-items", "3"]
    args += ["--stream-idle-timeout", "1"]  # a stream over the cap waits 1 s for a place
    with start_bridge(*args) as bridge:
        yield bridge


@pytest.fixture
def channel(bridge: BridgeProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(bridge.target) as channel:
        yield channel


AUTH = (("authorization", f"Bearer {TOKEN}"),)


def test_rollouts_need_the_token(channel):
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Run(run_request("t1", "down", {}), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as streamed:
        list(stub.RunStream(iter([rollout_pb2.RunStreamRequest()]), timeout=10))
    assert streamed.value.code() == grpc.StatusCode.UNAUTHENTICATED
    result = stub.Run(run_request("t2", "down", {}), timeout=30, metadata=AUTH)
    assert result.error.code == code_pb2.UNAVAILABLE


def test_health_and_reflection_cover_the_rollout_service(channel):
    health = health_pb2_grpc.HealthStub(channel)

    def status(service: str) -> int:
        return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status

    assert status(ROLLOUT_SERVICE_NAME) == SERVING  # static entries: the table is known
    assert status(f"{ROLLOUT_SERVICE_NAME}/down") == NOT_SERVING  # nothing answers there


def test_reflection_lists_the_rollout_service():
    url = f"http://127.0.0.1:{closed_port()}"
    with start_bridge("--agent", f"a={url}") as plain, grpc.insecure_channel(plain.target) as ch:
        assert ROLLOUT_SERVICE_NAME in ProtoReflectionDescriptorDatabase(ch).get_services()


def test_list_agents_gives_the_static_entries_with_their_protocol(channel):
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
    listed = stub.ListAgents(rollout_pb2.ListAgentsRequest(), timeout=10, metadata=AUTH)
    assert [(a.name, a.source, a.protocol) for a in listed.agents] == [
        ("down", "static", "agent"),
        ("episodes", "static", "environment"),
    ]


def test_max_streams_counts_run_and_verify_streams_together(channel):
    rollouts = rollout_pb2_grpc.RolloutServiceStub(channel)
    verify = verify_pb2_grpc.VerifyServiceStub(channel)
    release = threading.Event()
    started = threading.Event()

    def held() -> Iterator[rollout_pb2.RunStreamRequest]:
        yield rollout_pb2.RunStreamRequest(items=[run_request("h1", "down", {})])
        started.set()
        while not release.wait(0.1):  # a message now and then: the stream is not idle
            yield rollout_pb2.RunStreamRequest()

    first = rollouts.RunStream(held(), timeout=60, metadata=AUTH)
    first_results = iter(first)
    assert next(first_results).results[0].request_id == "h1"  # the stream is open
    try:
        for call in (
            lambda: list(rollouts.RunStream(iter([]), timeout=10, metadata=AUTH)),
            lambda: list(
                verify.VerifyStream(
                    iter([verify_pb2.VerifyStreamRequest()]), timeout=10, metadata=AUTH
                )
            ),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-streams" in refused.value.details()
    finally:
        release.set()
        assert list(first_results) == []  # half-closed: the stream ends OK
    wait_until(started.is_set, 10, "the held stream to start")


def test_a_batch_over_max_batch_items_ends_the_stream_after_the_earlier_ones(channel):
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
    batches = [
        rollout_pb2.RunStreamRequest(items=[run_request("b1", "down", {})]),
        rollout_pb2.RunStreamRequest(items=[run_request(f"x{i}", "down", {}) for i in range(4)]),
    ]
    answered: list[str] = []
    with pytest.raises(grpc.RpcError) as refused:
        for message in stub.RunStream(iter(batches), timeout=30, metadata=AUTH):
            answered += [result.request_id for result in message.results]
    assert answered == ["b1"]
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "RunStreamRequest held 4 items" in refused.value.details()
    assert "--max-batch-items" in refused.value.details()
