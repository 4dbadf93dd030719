"""Several upstream replicas for one resources server name: least in-flight load spreading,
skipping a replica that refuses connections, and load counters that never leak.

Real parts: two fault proxies (tests/support/fault_proxy.py) in front of the real NeMo Gym mcqa
server act as two replicas (a proxy only delays or holds requests where a test says so), a
closed port is a replica that is down, real bridge processes, real gRPC, and the bridge's own
Prometheus metrics over real HTTP for its counters.
"""

from __future__ import annotations

import threading

import grpc
import pytest
from google.rpc import code_pb2

from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc
from tests.support import closed_port
from tests.support.fault_matrix import wait_until
from tests.support.fault_proxy import Fault, FaultProxy
from tests.support.items import mcqa_item as item
from tests.support.prometheus_scrape import metrics_url, scrape, value, wait_for

IN_FLIGHT = "nemo_gym_grpc_upstream_in_flight"
WAITING = "nemo_gym_grpc_upstream_waiting"


@pytest.fixture(scope="module")
def replicas(nemo_gym):
    """Two proxies in front of the real mcqa server: replica A and replica B."""
    with (
        FaultProxy(nemo_gym.server_urls["mcqa"]) as a,
        FaultProxy(nemo_gym.server_urls["mcqa"]) as b,
    ):
        yield a, b


@pytest.fixture(autouse=True)
def no_faults(replicas):
    for proxy in replicas:
        proxy.set_faults()


def rewarded(result: verify_pb2.VerifyResponse) -> bool:
    assert not result.HasField("error"), result.error.message
    return result.reward == 1.0


def test_load_goes_to_the_replica_with_the_fewest_requests_in_flight(start_bridge, replicas):
    """A holds its first 10 requests for 5 s, B answers at once. 20 items: 10 each (equal
    load takes turns). Once B's 10 are answered, A still holds 10; the next 20 items then go
    15 to B and 5 to A (round robin would give 10 and 10)."""
    a, b = replicas
    bridge = start_bridge("--server", f"mcqa={a.url}", "--server", f"mcqa={b.url}")
    a.set_faults(Fault("pass", seconds=5.0, times=10))
    second_batch = threading.Event()

    def messages():
        yield verify_pb2.VerifyStreamRequest(items=[item(f"first{i}") for i in range(20)])
        second_batch.wait(60)
        yield verify_pb2.VerifyStreamRequest(items=[item(f"second{i}") for i in range(20)])

    results = []
    with grpc.insecure_channel(bridge.target) as channel:
        for message in verify_pb2_grpc.VerifyServiceStub(channel).VerifyStream(messages(), 60):
            results += message.results
            if len(results) == 10 and not second_batch.is_set():
                assert wait_until(lambda: a.in_flight == 10, 10), a.in_flight
                assert (a.total, b.total) == (10, 10)
                assert {r.request_id for r in results} == {f"first{i}" for i in range(20)} - set(
                    a.attempts
                )
                a.reset_counters()
                b.reset_counters()
                second_batch.set()
    assert len(results) == 40 and all(rewarded(r) for r in results)
    assert (a.total, b.total) == (5, 15)


def test_a_replica_that_refuses_connections_is_skipped_and_its_items_retried_elsewhere(
    start_bridge, replicas
):
    a, b = replicas
    down = f"http://127.0.0.1:{closed_port()}"
    bridge = start_bridge(
        *("--server", f"mcqa={a.url}", "--server", f"mcqa={down}", "--server", f"mcqa={b.url}"),
        *("--metrics-port", "0", "--health-interval", "600"),
    )
    url = metrics_url(bridge)
    with grpc.insecure_channel(bridge.target) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        listed = stub.ListResourcesServers(verify_pb2.ListResourcesServersRequest(), timeout=10)
        assert [(s.name, list(s.upstream_urls), s.source) for s in listed.resources_servers] == [
            ("mcqa", [a.url, down, b.url], "static")
        ]
        # One at a time: equal load takes turns, so without skipping every third call would
        # go to the closed port first.
        assert all(rewarded(stub.Verify(item(f"u{i}"), timeout=30)) for i in range(30))
        retried = value(scrape(url), "nemo_gym_grpc_upstream_retries_total")
        assert (a.total + b.total, min(a.total, b.total) > 0) == (30, True)
        assert 1 <= retried <= 3  # the first refusal, then (after a 5 s cooldown) one more
        call = stub.VerifyStream(
            iter([verify_pb2.VerifyStreamRequest(items=[item(f"s{i}") for i in range(64)])]), 60
        )
        assert sum(rewarded(r) for m in call for r in m.results) == 64
    print(f"\n30 calls over 3 replicas, one down: {retried:.0f} retried, A {a.total}, B {b.total}")


def test_load_counters_return_to_zero_after_cancellation_failures_and_deadlines(
    start_bridge, replicas
):
    a, b = replicas
    bridge = start_bridge(
        *("--server", f"mcqa={a.url}", "--server", f"mcqa={b.url}", "--max-in-flight", "4"),
        *("--metrics-port", "0", "--health-interval", "600"),
    )
    url = metrics_url(bridge)

    def idle(samples) -> bool:
        return value(samples, IN_FLIGHT) == 0 and value(samples, WAITING) == 0

    with grpc.insecure_channel(bridge.target) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        # cancelled: 20 items held by both replicas, 4 in flight at each, 12 waiting
        for proxy in replicas:
            proxy.set_faults(Fault("hang"))
        call = stub.VerifyStream(
            iter([verify_pb2.VerifyStreamRequest(items=[item(f"c{i}") for i in range(20)])]), 60
        )
        held = wait_for(url, lambda s: value(s, IN_FLIGHT) == 8 and value(s, WAITING) == 12)
        assert (value(held, IN_FLIGHT, upstream=a.url), value(held, WAITING)) == (4, 12)
        call.cancel()
        assert idle(wait_for(url, idle)), "counters leaked after a cancel"

        # failed: 503 from both replicas, every attempt
        for proxy in replicas:
            proxy.set_faults(Fault("status", status=503))
        call = stub.VerifyStream(
            iter([verify_pb2.VerifyStreamRequest(items=[item(f"f{i}") for i in range(20)])]), 60
        )
        failed = [r for m in call for r in m.results]
        assert len(failed) == 20 and all(r.error.code == code_pb2.UNAVAILABLE for r in failed)
        assert idle(scrape(url)), "counters leaked after failures"

        # deadline: the RPC deadline passes with every item held or waiting (items then end
        # with a per-item UPSTREAM_TIMEOUT just before it, or with the call's status)
        for proxy in replicas:
            proxy.set_faults(Fault("hang"))
        batch = verify_pb2.VerifyStreamRequest(items=[item(f"d{i}") for i in range(20)])
        try:
            timed_out = [r for m in stub.VerifyStream(iter([batch]), 2.0) for r in m.results]
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        else:
            assert all(r.error.code == code_pb2.DEADLINE_EXCEEDED for r in timed_out)
        assert idle(wait_for(url, idle)), "counters leaked after deadlines"

        for proxy in replicas:
            proxy.set_faults()
        assert rewarded(stub.Verify(item("after"), timeout=30))
