"""The handler table of a service of the contract, built from its descriptor
(`nemo_gym_grpc.shared.contract`), as a generated `add_<Service>Servicer_to_server` builds it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import ModuleType

import grpc
from google.protobuf.descriptor import ServiceDescriptor

# grpc's handler factory by (request_streaming, response_streaming).
HANDLER_KINDS: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


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
    the given function (e.g. `streams.lenient`)."""
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
