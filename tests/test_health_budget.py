"""The health service, open without the token, holds callers to a small fixed budget: a request
over what one service name needs is refused before it is parsed, and `Watch` calls are counted
and bounded (`--max-health-watches`); the token still guards everything else.

A real bridge process over real gRPC on loopback; its one upstream is a closed port (health
only reports it NOT_SERVING; no item is scored here).
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nemo_gym_grpc.bridge.rpc.interceptors import MAX_HEALTH_REQUEST_BYTES
from tests.support import closed_port
from tests.support.waiting import wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def bridge(start_bridge, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    return start_bridge(
        "--server", f"gone=http://127.0.0.1:{closed_port()}",
        "--token-file", str(token),
        "--max-health-watches", "2",
    )  # fmt: skip


def request(service: str) -> health_pb2.HealthCheckRequest:
    return health_pb2.HealthCheckRequest(service=service)


def test_a_health_request_larger_than_a_service_name_is_refused(bridge):
    with grpc.insecure_channel(bridge.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        assert stub.Check(request(""), timeout=10).status == SERVING  # no token needed
        for call in (stub.Check, lambda r, timeout: next(stub.Watch(r, timeout=timeout))):
            with pytest.raises(grpc.RpcError) as refused:
                call(request("x" * MAX_HEALTH_REQUEST_BYTES), timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"at most {MAX_HEALTH_REQUEST_BYTES}" in refused.value.details()


def test_watch_calls_beyond_the_limit_are_refused_until_one_ends(bridge):
    with grpc.insecure_channel(bridge.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        open_watches = [stub.Watch(request(""), timeout=30) for _ in range(2)]
        assert [next(w).status for w in open_watches] == [SERVING, SERVING]
        with pytest.raises(grpc.RpcError) as refused:
            next(stub.Watch(request(""), timeout=10))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-health-watches" in refused.value.details()
        open_watches[0].cancel()
        later: list = []  # the cancelled one's place is free once the bridge has seen it end
        wait_until(lambda: watched(stub, later), 10, "a Watch in the freed place")
        later[0].cancel()
        open_watches[1].cancel()


def watched(stub: health_pb2_grpc.HealthStub, kept: list) -> bool:
    """Open a Watch and keep it in `kept` when it is SERVING; False when it is refused for the
    limit."""
    watch = stub.Watch(request(""), timeout=30)
    try:
        assert next(watch).status == SERVING
    except grpc.RpcError as refused:
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        return False
    kept.append(watch)
    return True
