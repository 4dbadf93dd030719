"""Operating the bridge: health, reflection, draining, upstream safety, log format, item size.
Also: test_operations_security.py (TLS/mTLS, bearer tokens, exposure, stream limits).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from google.rpc import code_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc
from tests.support import closed_port, example_rows

SERVICE = "nemo_gym_grpc.v1.VerifyService"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health_status(channel: grpc.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def mcqa_request(request_id: str = "1") -> verify_pb2.VerifyRequest:
    row = example_rows("mcqa")[0]
    return verify_pb2.VerifyRequest(
        request_id=request_id,
        resources_server="mcqa",
        row_json=json.dumps(row),
        completion=f"\\boxed{{{row['expected_answer']}}}",
    )


# --- health and reflection -------------------------------------------------------------


def test_health_is_serving_with_a_per_upstream_readiness_view(start_bridge, nemo_gym):
    bridge = start_bridge(
        "--head-url",
        nemo_gym.head_url,
        "--server",
        f"down=http://127.0.0.1:{closed_port()}",
    )
    with grpc.insecure_channel(bridge.target) as channel:
        assert health_status(channel, "") == SERVING
        assert health_status(channel, SERVICE) == SERVING
        assert health_status(channel, f"{SERVICE}/mcqa") == SERVING
        assert health_status(channel, f"{SERVICE}/down") == NOT_SERVING


def test_health_is_not_serving_until_the_routing_table_is_known(start_bridge):
    bridge = start_bridge("--head-url", f"http://127.0.0.1:{closed_port()}")
    with grpc.insecure_channel(bridge.target) as channel:
        assert health_status(channel, "") == NOT_SERVING
        assert health_status(channel, SERVICE) == NOT_SERVING


def test_reflection_lets_a_generic_client_call_verify_without_the_proto(bridge_target):
    with grpc.insecure_channel(bridge_target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert SERVICE in database.get_services()
        pool = descriptor_pool.DescriptorPool(database)
        method = pool.FindServiceByName(SERVICE).FindMethodByName("Verify")
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        call = channel.unary_unary(
            f"/{SERVICE}/Verify",
            request_serializer=request_class.SerializeToString,
            response_deserializer=response_class.FromString,
        )
        request = request_class.FromString(mcqa_request("reflected").SerializeToString())
        response = call(request, timeout=30)
    assert (response.request_id, response.reward) == ("reflected", 1.0)


class _Slow(BaseHTTPRequestHandler):
    """Answers every POST with reward 1.0 after `delay` seconds; counts requests received."""

    delay = 2.0
    received = 0

    def do_POST(self) -> None:
        _Slow.received += 1
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(_Slow.delay)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"reward": 1.0}')

    do_GET = do_POST

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def slow_upstream():
    """A scripted upstream that takes 2 s per request (a real server cannot be told to)."""
    _Slow.received = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_sigterm_drains_health_not_serving_new_calls_refused_in_flight_finish(
    start_bridge, slow_upstream
):
    bridge = start_bridge(
        "--server",
        f"slow=http://127.0.0.1:{slow_upstream}",
        "--grace",
        "20",
        "--health-interval",
        "60",
    )
    items = [
        verify_pb2.VerifyRequest(request_id=str(i), resources_server="slow", completion="x")
        for i in range(4)
    ]
    with grpc.insecure_channel(bridge.target) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=60
        )
        assert next(watch).status == SERVING
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(
                lambda: [
                    r
                    for m in stub.VerifyStream(
                        iter([verify_pb2.VerifyStreamRequest(items=items)]), timeout=60
                    )
                    for r in m.results
                ]
            )
            while _Slow.received < 4 + 1:  # the 4 items and the readiness probe
                time.sleep(0.05)
            os.kill(bridge.pid, signal.SIGTERM)
            assert next(watch).status == NOT_SERVING
            with grpc.insecure_channel(bridge.target) as fresh:
                with pytest.raises(grpc.RpcError) as refused:
                    verify_pb2_grpc.VerifyServiceStub(fresh).Verify(items[0], timeout=10)
            results = in_flight.result(timeout=60)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert sorted((r.request_id, r.reward) for r in results) == [(str(i), 1.0) for i in range(4)]
    assert bridge.proc.wait(timeout=30) == 0


# --- upstream safety ---------------------------------------------------------------------


class _Canary(BaseHTTPRequestHandler):
    hits: list[str] = []

    def _record(self) -> None:
        _Canary.hits.append(f"{self.command} {self.path}")
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"reward": 1.0}')

    do_GET = do_POST = _record

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def canary():
    """An HTTP server on loopback that records every request it gets."""
    _Canary.hits = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Canary)
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_no_request_field_can_point_the_bridge_at_another_host_port_or_path(
    start_bridge, nemo_gym, canary
):
    bridge = start_bridge("--head-url", nemo_gym.head_url)
    here = f"127.0.0.1:{canary}"
    names = [
        f"http://{here}",
        f"http://{here}/verify",
        here,
        f"mcqa@{here}",
        f"user:pass@{here}",
        "mcqa/../mcqa",
        "../mcqa",
        "mcqa/verify",
        "mcqa:1",
        "/mcqa",
        "mcqa?x=1",
        "mcqa#frag",
        "m" * 10_000,
    ]
    items = [
        verify_pb2.VerifyRequest(
            request_id=str(i),
            resources_server=name,
            completion="\\boxed{B}",
            row_json=json.dumps({"url": f"http://{here}/verify", "host": "127.0.0.1"}),
        )
        for i, name in enumerate(names)
    ]
    with grpc.insecure_channel(bridge.target) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        stream = stub.VerifyStream(iter([verify_pb2.VerifyStreamRequest(items=items)]), 60)
        results = {r.request_id: r for m in stream for r in m.results}
    assert sorted(results) == sorted(str(i) for i in range(len(names)))
    for result in results.values():
        assert result.error.code == code_pb2.NOT_FOUND
    assert _Canary.hits == []


def test_json_log_format_writes_one_json_object_per_line(start_bridge, nemo_gym):
    bridge = start_bridge("--head-url", nemo_gym.head_url, "--log-format", "json")
    os.kill(bridge.pid, signal.SIGTERM)
    assert bridge.proc.wait(timeout=30) == 0
    records = [json.loads(line) for line in bridge.stderr_path.read_text().splitlines()]
    messages = [r["message"] for r in records]
    assert any(m.startswith("nemo-gym-grpc bridge listening on") for m in messages)
    assert {r["levelname"] for r in records} <= {"INFO", "WARNING"}
    assert all(r["name"].startswith("nemo_gym_grpc.") for r in records)


def test_item_over_max_item_mb_fails_alone(start_bridge, nemo_gym):
    bridge = start_bridge("--head-url", nemo_gym.head_url, "--max-item-mb", "0.01")
    big = mcqa_request("big")
    big.completion = "x" * 20_000
    items = [big, mcqa_request("small")]
    with grpc.insecure_channel(bridge.target) as channel:
        stream = verify_pb2_grpc.VerifyServiceStub(channel).VerifyStream(
            iter([verify_pb2.VerifyStreamRequest(items=items)]), timeout=30
        )
        results = {r.request_id: r for m in stream for r in m.results}
    assert results["small"].reward == 1.0
    assert results["big"].error.code == code_pb2.INVALID_ARGUMENT
    assert "ITEM_TOO_LARGE" in str(results["big"].error.details[0].value)
