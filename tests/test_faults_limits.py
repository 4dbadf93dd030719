"""The fault matrix (test_faults.py): the bridge's memory under a long stream, the retry
budget and queueing of the in-process Verifier over real HTTP, and the adaptive limit in
front of real mcqa.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import grpc
import pytest
from google.rpc import code_pb2

from nemo_gym_grpc.bridge.flows.attempts import RetryPolicy
from nemo_gym_grpc.bridge.flows.limits import QUEUE_HIGH
from nemo_gym_grpc.bridge.flows.upstreams import Upstreams
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc
from tests.support import closed_port, fault_matrix, start_bridge
from tests.support.fault_matrix import MARGIN, assert_failed
from tests.support.fault_proxy import Fault
from tests.support.items import error_info as info
from tests.support.items import mcqa_item as item
from tests.support.items import scored
from tests.support.verifiers import verifier_for

# The fault matrix's fixtures (tests/support/fault_matrix.py), this module's own.
row = fault_matrix.row
proxy = fault_matrix.proxy
scripted = fault_matrix.scripted
no_faults = fault_matrix.no_faults


# --- memory under a long stream ------------------------------------------------------------


def _memory_mib(pid: int) -> dict[str, int]:
    """VmRSS (resident now) and VmHWM (peak resident) of `pid`, MiB."""
    values = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(value.split()[0]) // 1024
    return values


def slow_requests(ids: range, completion: str) -> list[verify_pb2.VerifyRequest]:
    """One request per id (its request_id) for the bridge's "slow" server."""
    return [
        verify_pb2.VerifyRequest(request_id=str(i), resources_server="slow", completion=completion)
        for i in ids
    ]


@pytest.mark.nemo_gym  # starts a bridge process (tests.support.start_bridge) itself
def test_10000_items_against_a_slow_upstream_keep_the_bridge_memory_bounded(scripted):
    """50 ms per /verify, 64 at a time: the client could send far faster than the upstream
    answers. The bridge holds at most --max-stream-items; the rest waits in the client
    (gRPC flow control). Without the bound the bridge grew by ~230 MiB here."""
    held, total = 256, 10_000
    scripted.set_faults(Fault("status", body=b'{"reward": 1.0}', seconds=0.05))
    completion = "Let me think. " * 570  # ~8 KB per item
    with (
        start_bridge(
            "--server",
            f"slow={scripted.url}",
            "--max-stream-items",
            str(held),
            "--max-in-flight",
            "64",
            "--health-interval",
            "600",
        ) as bridge,
        grpc.insecure_channel(bridge.target) as channel,
    ):
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        warm = slow_requests(range(64), completion)
        scored(stub, warm)
        before = _memory_mib(bridge.pid)["VmRSS"]
        sent = 0
        lead = 0

        def batches():
            nonlocal sent
            for k in range(0, total, 64):
                chunk = slow_requests(range(k, min(total, k + 64)), completion)
                sent += len(chunk)
                yield verify_pb2.VerifyStreamRequest(items=chunk)

        received, rewards = set(), 0.0
        for message in stub.VerifyStream(batches(), timeout=600):
            for result in message.results:
                assert not result.HasField("error") and result.request_id not in received
                received.add(result.request_id)
                rewards += result.reward
            lead = max(lead, sent - len(received))
        memory = _memory_mib(bridge.pid)
    grown = memory["VmHWM"] - before
    print(
        f"\n10,000 items x 8 KB, 50 ms upstream, --max-stream-items {held}: bridge RSS "
        f"{before} MiB before, peak {memory['VmHWM']} MiB (+{grown}), {memory['VmRSS']} MiB "
        f"after; most items sent but unanswered: {lead}; upstream peak in flight "
        f"{scripted.peak_in_flight}"
    )
    assert len(received) == total and rewards == total
    assert grown < 100
    # How far ahead of the results the client gets (`lead`, printed above) is gRPC's own
    # buffering, client and transport, which the bridge does not set: 831-5,694 items in
    # earlier runs, ~1,000 here, and once 9,823 in CI with the bridge still under its memory
    # bound. The bridge's bound is what is asserted: `grown` above.
    assert scripted.peak_in_flight <= 64


# --- retry budget and queueing (in-process Verifier, real HTTP) ----------------------------


async def test_the_retry_budget_bounds_attempts_and_time():
    policy = RetryPolicy(attempts=50, initial_backoff=0.05, max_backoff=0.2, budget=1.0)
    async with aiohttp.ClientSession() as session:
        upstreams = Upstreams({"down": f"http://127.0.0.1:{closed_port()}"})
        verifier = verifier_for(upstreams, session, retry=policy)
        started = time.monotonic()
        result = await verifier.verify(
            verify_pb2.VerifyRequest(request_id="x", resources_server="down"), None
        )
    attempts = int(info(result).metadata["attempts"])
    assert info(result).reason == "UPSTREAM_UNAVAILABLE" and 2 <= attempts < 50
    assert time.monotonic() - started < 1.0 + MARGIN


async def test_waiting_for_an_upstream_slot_does_not_eat_the_item_timeout(proxy, row):
    """--max-in-flight 1 and a 0.5 s upstream: the third item waits ~1 s for its slot yet
    still gets its own 0.8 s. Under an RPC deadline, the wait is reported."""
    proxy.set_faults(Fault("pass", seconds=0.5))
    async with aiohttp.ClientSession() as session:
        upstreams = Upstreams({"mcqa": proxy.url})
        verifier = verifier_for(upstreams, session, max_in_flight=1)
        items = [item(f"q{i}", row, timeout_seconds=0.8) for i in range(3)]
        results = await _gather(verifier, items, None)
        assert all(not r.HasField("error") and r.reward == 1.0 for r in results)
        assert proxy.peak_in_flight == 1

        deadline = time.monotonic() + 1.3
        results = await _gather(verifier, [item(f"d{i}", row) for i in range(3)], deadline)
    assert results[0].reward == 1.0 and results[2].error.code == code_pb2.DEADLINE_EXCEEDED
    late = info(results[2])
    assert late.reason == "UPSTREAM_TIMEOUT" and float(late.metadata["queuedSeconds"]) >= 0.5


async def _gather(verifier, items, deadline):
    return await asyncio.gather(*(verifier.verify(i, deadline) for i in items))


async def test_a_retry_never_overlaps_the_attempt_before_it(proxy, row):
    proxy.set_faults(Fault("status", status=503, seconds=0.2))
    async with aiohttp.ClientSession() as session:
        verifier = verifier_for(Upstreams({"mcqa": proxy.url}), session)
        result = await verifier.verify(item("one", row), None)
    assert info(result).metadata["attempts"] == "3" and proxy.attempts["one"] == 3
    assert proxy.peak_in_flight == 1


async def test_max_item_bytes_is_a_verifier_argument(row):
    async with aiohttp.ClientSession() as session:
        verifier = verifier_for(Upstreams({}), session, max_item_bytes=1000)
        result = await verifier.verify(item("big", row, completion="x" * 1000), None)
    assert_failed(result, code_pb2.INVALID_ARGUMENT, "ITEM_TOO_LARGE", maxItemBytes="1000")


# --- the adaptive limit on a real server ---------------------------------------------------


@pytest.mark.nemo_gym  # starts a bridge process (tests.support.start_bridge) itself
def test_a_bridge_with_its_defaults_holds_real_mcqa_to_a_small_queue(proxy, row):
    """Real mcqa (one uvicorn process, CPU-bound) behind the fault proxy, a bridge with its
    defaults: after a first round (a cold server's first answers overshoot once,
    bridge/flows/limits.py), 600 items sent at once reach the server a few dozen at a time,
    where the old fixed default let 256 in; every item is scored."""
    with (
        start_bridge("--server", f"mcqa={proxy.url}", "--health-interval", "600") as bridge,
        grpc.insecure_channel(bridge.target) as channel,
    ):
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        peaks = []
        for round_ in range(3):
            proxy.reset_counters()
            items = [item(f"limit-{round_}-{i}", row) for i in range(600)]
            results = scored(stub, items)
            assert all(r.reward == 1.0 for r in results.values())
            peaks.append(proxy.peak_in_flight)
    print(f"\nreal mcqa, 600 items at once per round: peak in flight {peaks}")
    assert max(peaks[1:]) <= 2 * QUEUE_HIGH, peaks
