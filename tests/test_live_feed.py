"""The long-lived RunStream feed (rewards/client/live.py) on the books of `stream.Call`: items
booked as they come and taken as they are answered, one outcome per request, an item over the
message limit answered at once, calls rotated at half their deadline without losing items.

The agent is scripted (tests/support/fault_proxy.py: every `/run` answered with a fixed
rollout after a short wait), since what is tested is the client's bookkeeping, not NeMo Gym;
the worker on the real agent stack: tests/test_trl_async.py. Real bridge, real gRPC.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import pytest

from nemo_gym_grpc.rewards.client import stream
from nemo_gym_grpc.rewards.client.live import RunFeed
from nemo_gym_grpc.rewards.client.outcomes import Failure, ProtocolError
from nemo_gym_grpc.rewards.client.stream import Route
from nemo_gym_grpc.shared import contract
from nemo_gym_grpc.shared.reasons import ITEM_TOO_LARGE
from nemo_gym_grpc.v1 import rollout_pb2
from tests.support import BridgeProcess, start_bridge
from tests.support.fault_proxy import Fault, FaultProxy

WAIT = 60.0  # s, bound of every wait below
ROLLOUT = {"reward": 1.0, "response": {"output": []}}


@pytest.fixture(scope="module")
def bridge() -> Iterator[BridgeProcess]:
    with FaultProxy(None) as agent:
        agent.set_faults(Fault("status", body=json.dumps(ROLLOUT).encode(), seconds=0.2))
        with start_bridge("--agent", f"agent={agent.url}") as process:
            yield process


def request(request_id: str, padding: int = 0) -> rollout_pb2.RunRequest:
    row = {"responses_create_params": {"input": "hi"}, "padding": "x" * padding}
    return rollout_pb2.RunRequest(request_id=request_id, agent="agent", row_json=json.dumps(row))


def test_call_books_items_as_they_come_and_hands_each_outcome_over_once():
    call = stream.Call(stream.RUN, "127.0.0.1:1", [], timeout=1.0, connect_timeout=1.0)
    big = request("big", contract.MAX_SENDABLE_ITEM_BYTES)
    assert call.add([request("a"), big]) == [request("a")]
    failure = call.take("big")
    assert isinstance(failure, Failure) and failure.reason == ITEM_TOO_LARGE
    with pytest.raises(ValueError, match="duplicate"):
        call.add([request("a")])  # booked and unanswered
    call.on_message([rollout_pb2.RunResponse(request_id="a", rollout=rollout_pb2.Rollout())])
    assert call.take("a").HasField("rollout") and not call.sent and not call.outcomes
    with pytest.raises(ProtocolError, match="unknown"):  # taken: a second answer is refused
        call.on_message([rollout_pb2.RunResponse(request_id="a")])


def test_every_request_gets_one_outcome_across_rotated_calls(bridge):
    big = request(
        "big", contract.MAX_SENDABLE_ITEM_BYTES
    )  # made before the loop runs (seconds of CPU)

    async def feed() -> tuple[dict[str, object], RunFeed]:
        outcomes: dict[str, object] = {}

        def record(request_id: str, outcome: object) -> None:
            assert request_id not in outcomes
            outcomes[request_id] = outcome

        route = Route.resolve(target=bridge.target, timeout=1.5)  # rotated every 0.75 s
        async with RunFeed(route, bridge.target, record) as running:
            deadline = time.monotonic() + WAIT
            sent = 0
            while len(outcomes) < 21 and time.monotonic() < deadline:
                if await running.tick() and sent < 20:
                    await running.send([request(f"r{sent}"), request(f"r{sent + 1}")])
                    sent += 2
                    if sent == 20:
                        await running.send([big])
                await asyncio.sleep(0.2)
        return outcomes, running

    outcomes, running = asyncio.run(feed())
    too_large = outcomes.pop("big")
    assert isinstance(too_large, Failure) and too_large.reason == ITEM_TOO_LARGE
    assert sorted(outcomes) == sorted(f"r{i}" for i in range(20))
    assert all(o.rollout.reward == 1.0 for o in outcomes.values())  # type: ignore[attr-defined]
    assert running.counts["streams"] >= 3 and running.counts["resent_rollouts"] == 0
    assert running.in_flight == 0 and running.down_since is None


def test_a_call_the_bridge_ends_for_idling_is_a_rotation_not_a_failure(caplog):
    """A bridge with `--stream-idle-timeout 0.5`: the feed's idle calls are ended STREAM_IDLE and
    replaced; none counts as a failure, nothing is logged, and items still go through."""

    async def idle_then_send(target: str) -> tuple[dict[str, object], RunFeed]:
        outcomes: dict[str, object] = {}
        route = Route.resolve(target=target, timeout=60.0)
        async with RunFeed(route, target, outcomes.__setitem__) as running:
            deadline = time.monotonic() + WAIT
            while running.counts["streams"] < 3 and time.monotonic() < deadline:
                await running.tick()  # idle: each call is ended after 0.5 s and replaced
                await asyncio.sleep(0.1)
            await running.send([request("after-idle")])
            while not outcomes and time.monotonic() < deadline:
                await running.tick()
                await asyncio.sleep(0.1)
        return outcomes, running

    with FaultProxy(None) as agent:
        agent.set_faults(Fault("status", body=json.dumps(ROLLOUT).encode()))
        args = ("--agent", f"agent={agent.url}", "--stream-idle-timeout", "0.5")
        with start_bridge(*args) as process, caplog.at_level("WARNING"):
            outcomes, running = asyncio.run(idle_then_send(process.target))
    assert running.counts["streams"] >= 3 and running.last_failure is None
    assert running.down_since is None  # (a result arrived)
    assert outcomes["after-idle"].rollout.reward == 1.0  # type: ignore[attr-defined]
    assert not [r for r in caplog.records if r.name == "nemo_gym_grpc.rewards"]
