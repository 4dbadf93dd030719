"""The fault matrix (test_faults.py): one slow item, cancellation, deadlines, SIGTERM."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
from google.rpc import code_pb2

from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc
from tests.support import fault_matrix, start_bridge
from tests.support.fault_matrix import MARGIN, assert_failed, assert_still_serves, wait_until
from tests.support.fault_proxy import Fault
from tests.support.items import mcqa_item as item
from tests.support.items import stream

# The fault matrix's fixtures (tests/support/fault_matrix.py), this module's own.
row = fault_matrix.row
proxy = fault_matrix.proxy
scripted = fault_matrix.scripted
bridge = fault_matrix.bridge
no_faults = fault_matrix.no_faults


def test_one_hung_item_of_64_does_not_hold_back_the_other_63(stub, proxy, row):
    proxy.set_faults(Fault("hang", match='resp_hung"'))
    items = [item(f"quick-{i}", row) for i in range(63)]
    items.insert(17, item("hung", row, timeout_seconds=3.0))
    call = stub.VerifyStream(iter([verify_pb2.VerifyStreamRequest(items=items)]), timeout=60)
    in_flight_when_63_done = None
    seen: list[str] = []
    started = time.monotonic()
    for message in call:
        seen += [r.request_id for r in message.results]
        if len(seen) == 63 and in_flight_when_63_done is None:
            in_flight_when_63_done = proxy.in_flight
        results = {r.request_id: r for r in message.results}
        if "hung" in results:
            hung, hung_at = results["hung"], time.monotonic() - started
    assert sorted(seen) == sorted(i.request_id for i in items)
    assert seen[-1] == "hung"  # the 63 came back first, while the hung one was pending
    assert in_flight_when_63_done == 1
    assert_failed(hung, code_pb2.DEADLINE_EXCEEDED, "UPSTREAM_TIMEOUT", attempts="1")
    assert hung_at < 3.0 + MARGIN
    print(f"\none hung item of 64: 63 results first, the hung one failed after {hung_at:.2f} s")


def test_cancelling_a_1000_item_stream_halfway_ends_its_upstream_requests(stub, proxy, row):
    proxy.set_faults(Fault("pass", times=500), Fault("hang"))
    items = [item(f"c{i}", row) for i in range(1000)]
    batches = [verify_pb2.VerifyStreamRequest(items=items[k : k + 64]) for k in range(0, 1000, 64)]
    call = stub.VerifyStream(iter(batches), timeout=120)
    received = 0
    for message in call:
        received += len(message.results)
        if received >= 500:
            break
    assert wait_until(lambda: proxy.in_flight == 64, 10)  # hung requests take every slot
    in_flight_at_cancel = proxy.in_flight
    call.cancel()
    cancelled_at = time.monotonic()
    assert wait_until(lambda: proxy.in_flight == 0, 10), proxy.in_flight
    freed_after = time.monotonic() - cancelled_at
    # --fixed-concurrency 64: had the cancelled requests kept their slots, nothing would pass
    # now.
    proxy.set_faults()
    assert_still_serves(stub, row, "after-cancel")
    print(
        f"\ncancel after {received} of 1000 results: {in_flight_at_cancel} upstream requests "
        f"in flight -> 0 in {freed_after:.3f} s"
    )


def test_the_client_deadline_ends_every_item_and_its_upstream_requests(stub, proxy, row):
    proxy.set_faults(Fault("hang"))
    items = [item(f"dl{i}", row) for i in range(16)]  # no per-item timeout: 30 s default
    outcome = stream(stub, items, timeout=2.0)
    for request in items:  # a per-item result just before the deadline, or the call's status
        result = outcome.results.get(request.request_id)
        if result is None:
            assert outcome.error is not None
            assert outcome.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        else:
            assert_failed(result, code_pb2.DEADLINE_EXCEEDED, "UPSTREAM_TIMEOUT")
    assert outcome.seconds < 2.0 + MARGIN
    assert wait_until(lambda: proxy.in_flight == 0, 10), proxy.in_flight
    try:
        single = stub.Verify(item("dl-unary", row), timeout=2.0)
        assert_failed(single, code_pb2.DEADLINE_EXCEEDED, "UPSTREAM_TIMEOUT")
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: proxy.in_flight == 0, 10), proxy.in_flight
    print(
        f"\nclient deadline 2 s: {len(outcome.results)} of 16 items answered per item, "
        f"the rest by the call's {outcome.error and outcome.error.code()}"
    )
    proxy.set_faults()
    assert_still_serves(stub, row)


def test_sigterm_mid_stream_gives_every_item_one_outcome_within_the_grace(proxy, row):
    with start_bridge(
        "--server", f"mcqa={proxy.url}", "--grace", "2", "--health-interval", "600"
    ) as bridge:
        proxy.set_faults(Fault("pass", times=100), Fault("hang"))
        items = [item(f"t{i}", row) for i in range(200)]
        keep_open = threading.Event()

        def batches():
            for k in range(0, 200, 50):
                yield verify_pb2.VerifyStreamRequest(items=items[k : k + 50])
            keep_open.wait(60)  # the client has more to send when the bridge stops

        with grpc.insecure_channel(bridge.target) as channel:
            call = verify_pb2_grpc.VerifyServiceStub(channel).VerifyStream(batches(), 60)
            results: dict[str, verify_pb2.VerifyResponse] = {}
            signalled_at = None
            try:
                for message in call:
                    for result in message.results:
                        assert result.request_id not in results
                        results[result.request_id] = result
                    if len(results) >= 100 and signalled_at is None:
                        os.kill(bridge.pid, signal.SIGTERM)
                        signalled_at = time.monotonic()
                stream_error = None
            except grpc.RpcError as exc:
                stream_error = exc
            ended_after = time.monotonic() - signalled_at
            keep_open.set()
        assert bridge.proc.wait(30) == 0
    assert len(results) == 100 and all(r.reward == 1.0 for r in results.values())
    assert stream_error is not None and stream_error.code() == grpc.StatusCode.UNAVAILABLE
    assert ended_after < 2.0 + MARGIN
    assert wait_until(lambda: proxy.in_flight == 0, 10), proxy.in_flight
    print(
        f"\nSIGTERM with 100 of 200 items unanswered (--grace 2): 100 results, the rest "
        f"ended by UNAVAILABLE {stream_error.details()!r} after {ended_after:.2f} s, exit 0"
    )
