"""The `nemo_gym_grpc.v1.VerifyService` implementation (grpc.aio): Verify, VerifyStream,
ListResourcesServers, over the verify flow (`verifier.Verifier`) and the family machinery of
`streams.py`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import grpc

from nemo_gym_grpc.bridge.flows.verify import Verifier
from nemo_gym_grpc.bridge.nemo_gym.capabilities import ASK_TIMEOUT, LEGACY, Capabilities
from nemo_gym_grpc.bridge.rpc import kinds, streams
from nemo_gym_grpc.bridge.rpc.handlers import add_service
from nemo_gym_grpc.bridge.rpc.listing import rediscover
from nemo_gym_grpc.shared.contract import VERIFY_SERVICE
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc

log = logging.getLogger(__name__)

# Seconds before its deadline a ListResourcesServers answers with what it knows by then.
LISTING_MARGIN = 0.5


class VerifyService(verify_pb2_grpc.VerifyServiceServicer):
    """Serves Verify, VerifyStream and ListResourcesServers on one event loop.

    Args:
        verifier: scores single items.
        limits: the VerifyStream limits of `kinds.Kind` (`max_stream_items` and `max_batch_items`
            required; `max_message_bytes`, `max_stream_bytes`, `budget`).
    """

    def __init__(self, verifier: Verifier, **limits: Any) -> None:
        self._verifier = verifier
        self._kind: kinds.Kind[verify_pb2.VerifyRequest, verify_pb2.VerifyResponse] = kinds.Kind(
            answer=verifier.verify,
            refused=verifier.failed,
            response=verify_pb2.VerifyStreamResponse,
            request_name="VerifyStreamRequest",
            rpc="VerifyStream",
            event="verify_stream_end",
            answered="scored",
            log=log,
            **limits,
        )

    async def Verify(
        self,
        request: verify_pb2.VerifyRequest | streams.Unparsable,
        context: grpc.aio.ServicerContext,
    ) -> verify_pb2.VerifyResponse:
        return await streams.unary(self._kind, request, context)

    async def VerifyStream(
        self,
        request_iterator: AsyncIterable[verify_pb2.VerifyStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[verify_pb2.VerifyStreamResponse]:
        async for message in streams.serve(self._kind, request_iterator, context):
            yield message

    async def ListResourcesServers(
        self, request: verify_pb2.ListResourcesServersRequest, context: grpc.aio.ServicerContext
    ) -> verify_pb2.ListResourcesServersResponse:
        upstreams = self._verifier.upstreams
        if request.refresh:
            await rediscover(upstreams, context)
        entries = upstreams.entries()
        catalog = self._verifier.capabilities
        wait = listing_wait(context.time_remaining())
        learned = await asyncio.gather(
            *(catalog.of(u.urls[0], wait) if u.urls else _legacy() for u in entries)
        )
        return verify_pb2.ListResourcesServersResponse(
            resources_servers=[
                verify_pb2.ResourcesServer(
                    name=u.name,
                    upstream_urls=u.urls,
                    source=u.source,
                    capabilities_known=caps.learned,
                    tools=caps.tools,
                    typed_sessions=caps.typed_seed,
                    close_session=caps.close_session,
                    reverify_mode=caps.reverify_mode,
                    step_wise=caps.step_wise,
                    function_tools_json=caps.function_tools,
                )
                for u, caps in zip(entries, learned, strict=True)
            ]
        )


def listing_wait(remaining: float | None) -> float:
    """Seconds ListResourcesServers waits for what its servers support: as long as the
    learning may take (`ASK_TIMEOUT`), not an item's `LEARN_TIMEOUT` (a trainer reads the listed
    tools once, at its start, while cold servers still build their `/openapi.json`), answering
    `LISTING_MARGIN` seconds before the deadline `remaining` (seconds left; None: none) says."""
    if remaining is None:
        return ASK_TIMEOUT
    return max(0.0, min(ASK_TIMEOUT, remaining - LISTING_MARGIN))


async def _legacy() -> Capabilities:
    return LEGACY


def add_verify_service(service: VerifyService, server: grpc.aio.Server) -> None:
    """Register `service` (`handlers.add_service`), `Verify` parsed by `streams.lenient`."""
    parsers = {"Verify": streams.lenient(verify_pb2.VerifyRequest)}
    add_service(service, server, VERIFY_SERVICE, verify_pb2, parsers)
