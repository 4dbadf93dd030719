"""Items cut at the RPC deadline get their own UPSTREAM_TIMEOUT before it passes, however long
the deadline and wherever the item is (waiting for an upstream slot, or in its HTTP call).

An in-process `Verifier` with real HTTP to the scripted fault proxy (a stand-in: an upstream
that hangs on demand). "Before the deadline" is the contract under test (the answer must
reach the client while its call is still open), not a speed figure.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.flows.upstreams import Upstreams
from nemo_gym_grpc.bridge.flows.verify import Verifier
from nemo_gym_grpc.bridge.nemo_gym.verify import read_verify_reply
from nemo_gym_grpc.v1 import verify_pb2
from tests.support.fault_proxy import Fault, FaultProxy
from tests.support.items import error_info as info
from tests.support.verifiers import verifier_for
from tests.support.waiting import until


@pytest.fixture(scope="module")
def hanging():
    """A scripted upstream that reads every request and never answers."""
    with FaultProxy(None) as running:
        running.set_faults(Fault("hang"))
        yield running


def item(request_id: str, timeout_seconds: float = 0.0) -> verify_pb2.VerifyRequest:
    return verify_pb2.VerifyRequest(
        request_id=request_id,
        resources_server="slow",
        row_json="{}",
        response_json='{"id": "resp", "output": []}',
        timeout_seconds=timeout_seconds,
    )


async def answered_at(verifier: Verifier, request: verify_pb2.VerifyRequest, deadline):
    result = await verifier.verify(request, deadline)
    return result, time.monotonic()


async def test_items_in_flight_at_a_long_deadline_get_their_timeout_before_it(hanging):
    # aiohttp rounds a timeout over 5 s up to the loop's next whole second unless told not
    # to: up to 1 s late, past the 2% margin these deadlines keep back (0.11-0.14 s).
    now = time.monotonic()
    deadlines = [now + 5.5, now + 6.25, now + 7.0]
    async with aiohttp.ClientSession() as session:
        verifier = verifier_for(Upstreams({"slow": hanging.url}), session, max_in_flight=8)
        outcomes = await asyncio.gather(
            *(answered_at(verifier, item(f"long-{i}"), d) for i, d in enumerate(deadlines))
        )
    for (result, at), deadline in zip(outcomes, deadlines, strict=True):
        assert (result.error.code, info(result).reason) == (
            code_pb2.DEADLINE_EXCEEDED,
            "UPSTREAM_TIMEOUT",
        ), result.error.message
        assert at < deadline, f"answered {at - deadline:.3f} s after its deadline"


async def test_an_item_waiting_for_a_slot_fails_at_its_deadline_not_when_the_slot_frees(
    hanging,
):
    async with aiohttp.ClientSession() as session:
        verifier = verifier_for(Upstreams({"slow": hanging.url}), session, max_in_flight=1)
        holder = asyncio.ensure_future(answered_at(verifier, item("holder", 2.5), None))
        replica = verifier.balancer.replica(hanging.url)
        await until(lambda: replica.in_flight == 1, 2, "the holder in the only slot")
        deadline = time.monotonic() + 1.0
        waiter, at = await answered_at(verifier, item("waiter"), deadline)
        held, _ = await holder
    detail = info(waiter)
    assert (waiter.error.code, detail.reason) == (code_pb2.DEADLINE_EXCEEDED, "UPSTREAM_TIMEOUT")
    assert "while waiting" in waiter.error.message and float(detail.metadata["queuedSeconds"]) > 0
    assert at < deadline, f"answered {at - deadline:.3f} s after its deadline"
    assert info(held).reason == "UPSTREAM_TIMEOUT"  # its own 2.5 s, unaffected
    assert (replica.waiting, replica.in_flight) == (0, 0)  # nothing left counted


def test_an_integer_reward_beyond_float_range_is_a_bad_reply():
    body = b'{"reward": 1' + b"0" * 400 + b"}"
    with pytest.raises(errors.ItemError) as raised:
        read_verify_reply(body, "http://upstream/verify", False)
    assert raised.value.reason == "UPSTREAM_BAD_REPLY", raised.value
    components = b'{"reward": 1.0, "reward_components": {"a": -1' + b"0" * 400 + b"}}"
    with pytest.raises(errors.ItemError) as raised:
        read_verify_reply(components, "http://upstream/verify", False)
    assert raised.value.reason == "UPSTREAM_BAD_REPLY", raised.value
