"""The `nemo_gym_grpc.v1.VerifyService` implementation (grpc.aio)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from types import ModuleType

import aiohttp
import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError

from nemo_gym_grpc.bridge import streams
from nemo_gym_grpc.bridge.interceptors import HANDLER_KINDS
from nemo_gym_grpc.bridge.verifier import Verifier
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc

log = logging.getLogger(__name__)

SERVICE = verify_pb2.DESCRIPTOR.services_by_name["VerifyService"]


@dataclass(frozen=True)
class Unparsable:
    """A `VerifyRequest` message that could not be parsed (see `parse_verify_request`)."""

    error: DecodeError


def parse_verify_request(raw: bytes) -> verify_pb2.VerifyRequest | Unparsable:
    """The request deserializer of the unary `Verify` (see `add_verify_service`).

    gRPC's own parsing would fail a message that breaks proto3's rules (e.g. invalid UTF-8 in
    a `string` field) with UNKNOWN before any handler runs; this returns `Unparsable` instead,
    which `VerifyService.Verify` answers with INVALID_ARGUMENT.
    """
    try:
        return verify_pb2.VerifyRequest.FromString(raw)
    except DecodeError as exc:
        return Unparsable(exc)


class VerifyService(verify_pb2_grpc.VerifyServiceServicer):
    """Serves Verify, VerifyStream and ListResourcesServers on one event loop.

    Args:
        verifier: scores single items.
        max_stream_items: most items one VerifyStream holds at once (in flight or with a
            result not yet sent). A client that sends faster waits: the handler stops reading,
            so gRPC flow control slows the sender and memory stays bounded.
        max_batch_items: most items in one VerifyStreamRequest message; a bigger message
            ends the stream with RESOURCE_EXHAUSTED naming `--max-batch-items` (the items
            read before it are answered first).
    """

    def __init__(self, verifier: Verifier, *, max_stream_items: int, max_batch_items: int) -> None:
        self._verifier = verifier
        self._max_stream_items = max_stream_items
        self._max_batch_items = max_batch_items
        self._kind: streams.Kind[verify_pb2.VerifyRequest, verify_pb2.VerifyResponse] = (
            streams.Kind(
                answer=verifier.verify,
                refused=verifier.failed,
                response=verify_pb2.VerifyStreamResponse,
                request_name="VerifyStreamRequest",
                rpc="VerifyStream",
                event="verify_stream_end",
                answered="scored",
            )
        )

    async def Verify(
        self,
        request: verify_pb2.VerifyRequest | Unparsable,
        context: grpc.aio.ServicerContext,
    ) -> verify_pb2.VerifyResponse:
        if isinstance(request, Unparsable):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the VerifyRequest could not be parsed ({request.error})",
            )
        return await self._verifier.verify(request, streams.call_deadline(context))

    async def VerifyStream(
        self,
        request_iterator: AsyncIterable[verify_pb2.VerifyStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[verify_pb2.VerifyStreamResponse]:
        async for message in streams.serve(
            self._kind,
            request_iterator,
            context,
            max_stream_items=self._max_stream_items,
            max_batch_items=self._max_batch_items,
            log=log,
        ):
            yield message

    async def ListResourcesServers(
        self, request: verify_pb2.ListResourcesServersRequest, context: grpc.aio.ServicerContext
    ) -> verify_pb2.ListResourcesServersResponse:
        upstreams = self._verifier.upstreams
        if request.refresh and upstreams.head_url:
            try:
                await upstreams.discover()
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"head server {upstreams.head_url} could not be read: {exc!r}",
                )
        return verify_pb2.ListResourcesServersResponse(
            resources_servers=[
                verify_pb2.ResourcesServer(name=u.name, upstream_urls=u.urls, source=u.source)
                for u in upstreams.entries()
            ]
        )


def add_service(
    service: object,
    server: grpc.aio.Server,
    descriptor: ServiceDescriptor,
    messages: ModuleType,
    parsers: Mapping[str, Callable[[bytes], object]],
) -> None:
    """Register `service` like a generated `add_<Service>Servicer_to_server`, with the handler
    table built from `descriptor` (every RPC of the service; `messages` is the `_pb2` module
    holding its message classes), except that the RPCs in `parsers` parse their request with
    the given function (e.g. `parse_verify_request`)."""
    handlers = {}
    for method in descriptor.methods:
        request_class = getattr(messages, method.input_type.name)
        response_class = getattr(messages, method.output_type.name)
        make = HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(
            getattr(service, method.name),
            request_deserializer=parsers.get(method.name, request_class.FromString),
            response_serializer=response_class.SerializeToString,
        )
    generic = grpc.method_handlers_generic_handler(descriptor.full_name, handlers)
    server.add_generic_rpc_handlers((generic,))
    server.add_registered_method_handlers(descriptor.full_name, handlers)


def add_verify_service(service: VerifyService, server: grpc.aio.Server) -> None:
    """Register `service` (`add_service`): `Verify` parses its request with
    `parse_verify_request`, so a message gRPC cannot parse (invalid UTF-8 in a string field)
    gets INVALID_ARGUMENT instead of UNKNOWN."""
    add_service(service, server, SERVICE, verify_pb2, {"Verify": parse_verify_request})
