"""What the List RPCs of both services (`ListResourcesServers`, `ListAgents`) share: reading a
routing table again from its head server when the caller asks for it (`refresh`)."""

from __future__ import annotations

import grpc

from nemo_gym_grpc.bridge.flows.upstreams import Upstreams
from nemo_gym_grpc.bridge.nemo_gym.head import HeadUnreadable


async def rediscover(
    table: Upstreams, context: grpc.aio.ServicerContext, *, required: bool = True
) -> None:
    """Discover `table` again from its head server, if it has one (a List call's `refresh`;
    at most at the rate `discovery.HeadServer` allows, else its last read counts).

    Raises:
        the exception of `context.abort` (UNAVAILABLE, naming the head server) when the head
        server cannot be read and `required` is set; without it the failure is ignored.
    """
    if not table.head_url:
        return
    try:
        await table.discover()
    except HeadUnreadable as exc:
        if required:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"head server {table.head_url} could not be read: {exc}",
            )
