"""A burst of unary calls at once on one connection: each gets the bridge's own answer.

gRPC's C core holds calls that arrived but that the application has not picked up yet in a
queue per server; past `grpc.server.max_pending_requests` (default 1,000) it drops new calls
at random, past the hard limit (default 3,000) all of them, each with a bare CANCELLED that no
caller can tell from its own cancel. Python's grpc.aio picks calls up one at a time, so one
client opening a few thousand sessions at once lost a third of them (issue 30's 4,000-session
run: 931 CANCELLED). The bridge raises both limits (bridge/rpc/transport.py).

A real bridge process, real gRPC over loopback; the calls open sessions on a resources server
the bridge does not know, so each is answered by the bridge at once (NOT_FOUND /
UNKNOWN_RESOURCES_SERVER) and only the queue in front of it is under test.
"""

from __future__ import annotations

import asyncio
import collections

import grpc

from nemo_gym_grpc.rewards.client.outcomes import Failure
from nemo_gym_grpc.v1 import session_pb2, session_pb2_grpc
from tests.support import closed_port

BURST = 4000


async def burst(target: str) -> collections.Counter[str]:
    """What each of BURST concurrent OpenSession calls on one channel came back with."""
    outcomes: collections.Counter[str] = collections.Counter()
    request = session_pb2.OpenSessionRequest(resources_server="nowhere", row_json="{}")
    async with grpc.aio.insecure_channel(target) as channel:
        stub = session_pb2_grpc.SessionServiceStub(channel)

        async def one() -> None:
            try:
                reply = await stub.OpenSession(request, timeout=120)
                outcomes[Failure.from_status(reply.error).cause] += 1
            except grpc.aio.AioRpcError as exc:
                outcomes[f"status {exc.code().name}"] += 1

        await asyncio.gather(*(one() for _ in range(BURST)))
    return outcomes


def test_thousands_of_calls_at_once_on_one_connection_each_get_the_bridge_answer(start_bridge):
    bridge = start_bridge("--server", f"gone=http://127.0.0.1:{closed_port()}")
    outcomes = asyncio.run(burst(bridge.target))
    assert outcomes == {"NOT_FOUND (UNKNOWN_RESOURCES_SERVER)": BURST}
