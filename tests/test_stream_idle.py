"""A stream that holds nothing and receives nothing for `--stream-idle-timeout` seconds is ended
UNAVAILABLE with the reason STREAM_IDLE, so idle clients cannot keep the `--max-streams`
places; a stream whose item is still in flight is not idle, however long the item takes, and
the live rollout feed takes the end as a rotation, not as a bridge gone down.

A real bridge process over real gRPC on loopback; the upstream is scripted (a slow `/verify`
on demand: tests/support/fault_proxy.py).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import grpc
import pytest
from grpc_status import rpc_status

from nemo_gym_grpc.rewards.client.outcomes import Failure
from nemo_gym_grpc.shared import reasons
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc
from tests.support.fault_proxy import Fault, FaultProxy
from tests.support.items import error_info

ROW = json.dumps({"question": "2+2?", "expected_answer": "A"})


@pytest.fixture
def bridge(start_bridge) -> Iterator:
    with FaultProxy(None) as upstream:
        upstream.set_faults(Fault("status", body=b'{"reward": 1.0}', seconds=2.5))
        yield start_bridge("--server", f"slow={upstream.url}", "--stream-idle-timeout", "1")


def held_open(items: list[verify_pb2.VerifyRequest], release: threading.Event) -> Iterator:
    """A request stream that sends `items`, then nothing until `release` (never half-closed
    before)."""
    if items:
        yield verify_pb2.VerifyStreamRequest(items=items)
    release.wait(60)


def test_an_idle_stream_is_ended_with_its_reason_and_one_in_flight_is_not(bridge):
    release = threading.Event()
    item = verify_pb2.VerifyRequest(request_id="slow-1", resources_server="slow", row_json=ROW)
    try:
        with grpc.insecure_channel(bridge.target) as channel:
            stub = verify_pb2_grpc.VerifyServiceStub(channel)
            with pytest.raises(grpc.RpcError) as idle:
                list(stub.VerifyStream(held_open([], release), timeout=30))
            results = []
            with pytest.raises(grpc.RpcError) as after_item:
                for message in stub.VerifyStream(held_open([item], release), timeout=30):
                    results += message.results
    finally:
        release.set()
    for ended in (idle.value, after_item.value):
        assert ended.code() == grpc.StatusCode.UNAVAILABLE, ended
        assert "--stream-idle-timeout" in ended.details()
        assert Failure.from_rpc_error(ended).reason == reasons.STREAM_IDLE
        assert rpc_status.from_call(ended) is not None
    (result,) = results  # the item took 2.5 s, longer than the idle time: it was answered
    assert result.reward == 1.0, error_info(result) if result.HasField("error") else result
