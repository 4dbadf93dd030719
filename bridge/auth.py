"""Bearer-token authentication for the bridge (a grpc.aio server interceptor).

Clients send gRPC metadata `authorization: Bearer <token>`. The comparison is constant-time
(`hmac.compare_digest`). A missing or wrong token gets UNAUTHENTICATED with a fixed message
that says nothing about the expected token; a streaming call is refused only after its messages
are read and dropped (`refusal.refuse_stream`). Health checks stay open so that Kubernetes'
gRPC probes and grpc-health-probe work without a token.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from nemo_gym_grpc.bridge.refusal import refuse_stream

DENIED = "missing or invalid bearer token"
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def abort(request: Any, context: grpc.aio.ServicerContext) -> None:
        if handler.request_streaming:  # an iterator of unparsed bytes (no deserializer below)
            await refuse_stream(request, context, grpc.StatusCode.UNAUTHENTICATED, DENIED)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        abort,
        request_deserializer=None if handler.request_streaming else handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without `authorization: Bearer <token>` (except health checks).

    Args:
        token: the shared secret (non-empty).
    """

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the bearer token is empty")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        supplied = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                supplied = value.encode() if isinstance(value, str) else value
        if hmac.compare_digest(supplied, self._expected):
            return handler
        return _deny(handler)
