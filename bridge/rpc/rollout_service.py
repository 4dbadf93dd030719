"""The `nemo_gym_grpc.v1.RolloutService` implementation (grpc.aio): Run, RunStream, ListAgents,
over the run flow (`runner.Runner`) and the same family machinery as VerifyService
(`streams.py`)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import grpc

from nemo_gym_grpc.bridge.flows.run import Runner
from nemo_gym_grpc.bridge.rpc import kinds, streams
from nemo_gym_grpc.bridge.rpc.handlers import add_service
from nemo_gym_grpc.bridge.rpc.listing import rediscover
from nemo_gym_grpc.shared.contract import ROLLOUT_SERVICE
from nemo_gym_grpc.v1 import rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)


class RolloutService(rollout_pb2_grpc.RolloutServiceServicer):
    """Serves Run, RunStream and ListAgents on one event loop.

    Args:
        runner: runs single rollouts.
        limits: the RunStream limits of `kinds.Kind` (`max_stream_items` and `max_batch_items`
            required; `max_message_bytes`, `max_stream_bytes`, `budget`).
    """

    def __init__(self, runner: Runner, **limits: Any) -> None:
        self._runner = runner
        self._kind: kinds.Kind[rollout_pb2.RunRequest, rollout_pb2.RunResponse] = kinds.Kind(
            answer=runner.run,
            refused=runner.failed,
            response=rollout_pb2.RunStreamResponse,
            request_name="RunStreamRequest",
            rpc="RunStream",
            event="run_stream_end",
            answered="run",
            log=log,
            **limits,
        )

    async def Run(
        self,
        request: rollout_pb2.RunRequest | streams.Unparsable,
        context: grpc.aio.ServicerContext,
    ) -> rollout_pb2.RunResponse:
        return await streams.unary(self._kind, request, context)

    async def RunStream(
        self,
        request_iterator: AsyncIterable[rollout_pb2.RunStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[rollout_pb2.RunStreamResponse]:
        async for message in streams.serve(self._kind, request_iterator, context):
            yield message

    async def ListAgents(
        self, request: rollout_pb2.ListAgentsRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.ListAgentsResponse:
        agents = self._runner.agents
        if request.refresh or not agents.discovered:  # the first call learns the agents
            await rediscover(agents, context, required=request.refresh)
        return rollout_pb2.ListAgentsResponse(
            agents=[
                rollout_pb2.Agent(
                    name=u.name, upstream_urls=u.urls, source=u.source, protocol=u.protocol
                )
                for u in agents.entries()
            ]
        )


def add_rollout_service(service: RolloutService, server: grpc.aio.Server) -> None:
    """Register `service` (`handlers.add_service`), `Run` parsed by `streams.lenient`."""
    parsers = {"Run": streams.lenient(rollout_pb2.RunRequest)}
    add_service(service, server, ROLLOUT_SERVICE, rollout_pb2, parsers)
