"""Refusing whole calls so that the client sees the status it is refused with: bearer-token
auth, the cap on concurrent VerifyStream and RunStream calls, the health service's budget
(grpc.aio server interceptors), and `refuse_stream`, which the first two use and so does
VerifyStream itself.

A server that ends a client-streaming call before it has read the client's messages sends its
status and then resets the stream. A grpc.aio client whose write is still in flight at that
moment reports INTERNAL "Internal error from Core" instead of the server's status
(grpc/grpc#36066). So a refusal first reads, and drops, what the client sends until it
half-closes, for at most DRAIN_SECONDS, and only then ends the call.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, cast

import grpc
from google.protobuf.message import DecodeError

from nemo_gym_grpc.bridge.rpc.handlers import HANDLER_KINDS
from nemo_gym_grpc.shared.contract import STREAM_METHODS

DRAIN_SECONDS = 1.0  # a client that has not half-closed by then is refused while it writes
_STREAMS = " and ".join(STREAM_METHODS.values())  # "VerifyStream and RunStream"

DENIED = "missing or invalid bearer token"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
OPEN_METHOD_PREFIXES = (HEALTH_PREFIX,)
# Largest health request taken, bytes: a HealthCheckRequest holds one service name, and the
# longest the bridge serves is "nemo_gym_grpc.v1.RolloutService/<agent name>".
MAX_HEALTH_REQUEST_BYTES = 4096

_Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]
# What a grpc.aio stream-stream handler is (grpc's stubs type the sync form).
_StreamBehaviour = Callable[
    [AsyncIterator[object], grpc.aio.ServicerContext], AsyncIterator[object]
]
# A grpc.aio handler with one request (the health service's: Watch writes through its context).
_UnaryBehaviour = Callable[[object, grpc.aio.ServicerContext], Awaitable[object]]


async def _drain(requests: AsyncIterable[object]) -> None:
    async for _ in requests:
        pass


async def refuse_stream(
    requests: AsyncIterable[object],
    context: grpc.aio.ServicerContext,
    code: grpc.StatusCode,
    details: str,
) -> NoReturn:
    """End a client-streaming call with `code` and `details` once the client has half-closed
    (or after DRAIN_SECONDS), dropping its messages unread.

    Raises:
        the exception of `context.abort`, as every abort does.
    """
    try:
        await asyncio.wait_for(_drain(requests), DRAIN_SECONDS)
    except (asyncio.TimeoutError, DecodeError):
        pass  # nothing the client sent matters any more
    await context.abort(code, details)


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def abort(request: Any, context: grpc.aio.ServicerContext) -> None:
        if handler.request_streaming:  # an iterator of unparsed bytes (no deserializer below)
            await refuse_stream(request, context, grpc.StatusCode.UNAUTHENTICATED, DENIED)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)

    make = HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)]
    return make(
        abort,
        request_deserializer=None if handler.request_streaming else handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without gRPC metadata `authorization: Bearer <token>`, except health
    checks (so Kubernetes' gRPC probes and grpc-health-probe work without a token).

    The comparison is constant-time (`hmac.compare_digest`). A missing or wrong token gets
    UNAUTHENTICATED with the fixed message DENIED, which says nothing about the expected
    token; a streaming call is refused with `refuse_stream`.

    Args:
        token: the shared secret (non-empty).

    Raises:
        ValueError: `token` is empty.
    """

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the bearer token is empty")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self, continuation: _Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
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


class StreamLimitInterceptor(grpc.aio.ServerInterceptor):
    """Holds VerifyStream and RunStream calls (`contract.STREAM_METHODS`) beyond `max_streams`
    open ones (all counted together) until a place frees, first come first served, and answers
    RESOURCE_EXHAUSTED to one that waited `max_wait` seconds.

    A waiting call's messages are not read, so gRPC flow control holds its sender and it holds
    no item (at most what the transport's flow-control window let in): what `--max-streams`
    bounds is the memory of streams that read (docs/operating.md, "Memory"). A call waits
    within its own deadline too (past it the client sees DEADLINE_EXCEEDED). grpc.aio's own
    `maximum_concurrent_rpcs` counts every RPC and refuses at once with "Concurrent RPC limit
    exceeded!"; this counts only streams and its refusal names the limit and the flag.

    Args:
        max_streams: most concurrent stream calls (`--max-streams`).
        max_wait: longest wait for a place in seconds (`--stream-idle-timeout`: a waiting
            stream is an idle one); 0 = until the call's deadline.

    Attributes:
        active: VerifyStream and RunStream calls open now, holding a place.
        waiting: calls waiting for a place.
    """

    def __init__(self, max_streams: int, max_wait: float = 0.0) -> None:
        self.max_streams = max_streams
        self.max_wait = max_wait
        self.active = 0
        self.waiting = 0
        self._places = asyncio.Semaphore(max_streams)

    async def intercept_service(
        self, continuation: _Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        rpc = STREAM_METHODS.get(handler_call_details.method)
        if handler is None or rpc is None:
            return handler
        behaviour = cast(_StreamBehaviour, handler.stream_stream)

        async def limited(
            request_iterator: AsyncIterator[object], context: grpc.aio.ServicerContext
        ) -> AsyncIterator[object]:
            if not await self._place():
                await refuse_stream(
                    request_iterator,
                    context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"too many concurrent {rpc} calls: waited {self.max_wait:g} s for one of "
                    f"the {self.max_streams} places of {_STREAMS} calls together (raise it "
                    "with --max-streams)",
                )
            self.active += 1
            try:
                async for response in behaviour(request_iterator, context):
                    yield response
            finally:
                self.active -= 1
                self._places.release()

        return grpc.stream_stream_rpc_method_handler(
            limited,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    async def _place(self) -> bool:
        """Take a place, waiting up to `max_wait` (0: without a bound of its own); False if
        none freed in time."""
        if not self._places.locked():
            await self._places.acquire()
            return True
        self.waiting += 1
        try:
            await asyncio.wait_for(self._places.acquire(), self.max_wait or None)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            self.waiting -= 1


class _Oversized:
    """A health request over MAX_HEALTH_REQUEST_BYTES, in place of its parsed message."""

    def __init__(self, size: int) -> None:
        self.size = size


class HealthBudgetInterceptor(grpc.aio.ServerInterceptor):
    """Holds the health service (open without a token: `BearerTokenInterceptor`) to a small fixed
    budget: a request over MAX_HEALTH_REQUEST_BYTES is INVALID_ARGUMENT before it is parsed, and
    `Watch` calls beyond `max_watches` open ones get RESOURCE_EXHAUSTED (each holds its request
    and a waiter for as long as the caller keeps it open).

    Args:
        max_watches: most concurrent `Watch` calls (`--max-health-watches`).

    Attributes:
        watching: `Watch` calls open now.
    """

    def __init__(self, max_watches: int) -> None:
        self.max_watches = max_watches
        self.watching = 0

    async def intercept_service(
        self, continuation: _Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        parse = cast(Callable[[bytes], object], handler.request_deserializer)

        def capped(data: bytes) -> object:
            return _Oversized(len(data)) if len(data) > MAX_HEALTH_REQUEST_BYTES else parse(data)

        behaviour = cast(_UnaryBehaviour, handler.unary_stream or handler.unary_unary)
        watch = handler.unary_stream is not None

        async def budgeted(request: object, context: grpc.aio.ServicerContext) -> object:
            if isinstance(request, _Oversized):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"a health request of {request.size} bytes: at most "
                    f"{MAX_HEALTH_REQUEST_BYTES} (one service name)",
                )
            if not watch:
                return await behaviour(request, context)
            if self.watching >= self.max_watches:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"too many concurrent health Watch calls: the limit is {self.max_watches} "
                    "(raise it with --max-health-watches)",
                )
            self.watching += 1
            try:
                return await behaviour(request, context)
            finally:
                self.watching -= 1

        make = (
            grpc.unary_stream_rpc_method_handler if watch else grpc.unary_unary_rpc_method_handler
        )
        return make(
            budgeted, request_deserializer=capped, response_serializer=handler.response_serializer
        )
