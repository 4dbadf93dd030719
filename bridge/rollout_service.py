"""The `nemo_gym_grpc.v1.RolloutService` implementation (grpc.aio): Run, RunStream, ListAgents.

RunStream has VerifyStream's semantics and machinery (`streams.serve`); Run parses its request
as Verify does (a message gRPC cannot parse gets INVALID_ARGUMENT, not UNKNOWN).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass

import aiohttp
import grpc
from google.protobuf.message import DecodeError

from nemo_gym_grpc.bridge import streams
from nemo_gym_grpc.bridge.runner import Runner
from nemo_gym_grpc.bridge.service import add_service
from nemo_gym_grpc.v1 import rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)

SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"]


@dataclass(frozen=True)
class UnparsableRun:
    """A `RunRequest` message that could not be parsed (see `parse_run_request`)."""

    error: DecodeError


def parse_run_request(raw: bytes) -> rollout_pb2.RunRequest | UnparsableRun:
    """The request deserializer of the unary `Run`: `UnparsableRun` instead of gRPC's own
    UNKNOWN for a message that breaks proto3's rules (e.g. invalid UTF-8)."""
    try:
        return rollout_pb2.RunRequest.FromString(raw)
    except DecodeError as exc:
        return UnparsableRun(exc)


class RolloutService(rollout_pb2_grpc.RolloutServiceServicer):
    """Serves Run, RunStream and ListAgents on one event loop.

    Args:
        runner: runs single rollouts.
        max_stream_items: most rollouts one RunStream holds at once (see VerifyService).
        max_batch_items: most rollouts in one RunStreamRequest message.
    """

    def __init__(self, runner: Runner, *, max_stream_items: int, max_batch_items: int) -> None:
        self._runner = runner
        self._max_stream_items = max_stream_items
        self._max_batch_items = max_batch_items
        self._kind: streams.Kind[rollout_pb2.RunRequest, rollout_pb2.RunResponse] = streams.Kind(
            answer=runner.run,
            refused=runner.failed,
            response=rollout_pb2.RunStreamResponse,
            request_name="RunStreamRequest",
            rpc="RunStream",
            event="run_stream_end",
            answered="run",
        )

    async def Run(
        self, request: rollout_pb2.RunRequest | UnparsableRun, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.RunResponse:
        if isinstance(request, UnparsableRun):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the RunRequest could not be parsed ({request.error})",
            )
        return await self._runner.run(request, streams.call_deadline(context))

    async def RunStream(
        self,
        request_iterator: AsyncIterable[rollout_pb2.RunStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[rollout_pb2.RunStreamResponse]:
        async for message in streams.serve(
            self._kind,
            request_iterator,
            context,
            max_stream_items=self._max_stream_items,
            max_batch_items=self._max_batch_items,
            log=log,
        ):
            yield message

    async def ListAgents(
        self, request: rollout_pb2.ListAgentsRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.ListAgentsResponse:
        agents = self._runner.agents
        if agents.head_url and (request.refresh or not agents.discovered):
            try:
                await agents.discover()
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                if request.refresh:
                    await context.abort(
                        grpc.StatusCode.UNAVAILABLE,
                        f"head server {agents.head_url} could not be read: {exc!r}",
                    )
        return rollout_pb2.ListAgentsResponse(
            agents=[
                rollout_pb2.Agent(
                    name=u.name, upstream_urls=u.urls, source=u.source, protocol=u.protocol
                )
                for u in agents.entries()
            ]
        )


def add_rollout_service(service: RolloutService, server: grpc.aio.Server) -> None:
    """Register `service` (`service.add_service`), `Run` parsed by `parse_run_request`."""
    add_service(service, server, SERVICE, rollout_pb2, {"Run": parse_run_request})
