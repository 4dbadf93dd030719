"""A cap on concurrent VerifyStream calls (a grpc.aio server interceptor).

grpc.aio's own `maximum_concurrent_rpcs` counts every RPC and answers "Concurrent RPC limit
exceeded!"; this counts only streams and names the limit and the flag that raises it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from nemo_gym_grpc.bridge.refusal import refuse_stream

STREAM_METHOD = "/nemo_gym_grpc.v1.VerifyService/VerifyStream"


class StreamLimitInterceptor(grpc.aio.ServerInterceptor):
    """Answers RESOURCE_EXHAUSTED to a VerifyStream call beyond `max_streams` open ones.

    Args:
        max_streams: most concurrent VerifyStream calls (`--max-streams`).
    """

    def __init__(self, max_streams: int) -> None:
        self.max_streams = max_streams
        self.active = 0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method != STREAM_METHOD:
            return handler
        behaviour = handler.stream_stream

        async def limited(
            request_iterator: AsyncIterator[object], context: grpc.aio.ServicerContext
        ) -> AsyncIterator[object]:
            if self.active >= self.max_streams:
                await refuse_stream(
                    request_iterator,
                    context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"too many concurrent VerifyStream calls: the limit is {self.max_streams} "
                    "(raise it with --max-streams)",
                )
            self.active += 1
            try:
                async for response in behaviour(request_iterator, context):
                    yield response
            finally:
                self.active -= 1

        return grpc.stream_stream_rpc_method_handler(
            limited,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
