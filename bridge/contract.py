"""The services of the contract (`nemo_gym_grpc.v1`) that the bridge serves, named once: their
descriptors and full names (health checking, reflection), the bidirectional streams that
`--max-streams` counts, and the registration of a service's handlers from its descriptor.

Also what both ends of the wire agree on outside the .proto files, declared here once: the gRPC
message size limit and the environment variables the bridge and the trainer side both read.
The trainer side imports them from here, so this module loads nothing beyond grpc and the
generated code (tests/test_shared_names.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import ModuleType

import grpc
from google.protobuf.descriptor import ServiceDescriptor

from nemo_gym_grpc.v1 import rollout_pb2, verify_pb2

MiB = 1024 * 1024
# The gRPC message size limit, both directions, in bytes: the default of the bridge's
# `--max-message-mb` and the trainer side's channel options. gRPC's own default receive limit
# (4 MiB) rejects a 64-item message of long completions.
MAX_MESSAGE_BYTES = 64 * MiB
# The bearer token: the bridge requires it (`--token-file`, else this variable holds the token)
# and the trainer side sends it as `authorization: Bearer <token>`; an embedded bridge inherits
# the trainer's environment, so both ends read the same one.
TOKEN_ENV = "NEMO_GYM_GRPC_TOKEN"
# Default seconds of one rollout's `/run` call: the bridge's `--run-timeout`; the trainer side
# sends it as `RunRequest.timeout_seconds`.
RUN_TIMEOUT_ENV = "NEMO_GYM_GRPC_RUN_TIMEOUT"

VERIFY_SERVICE = verify_pb2.DESCRIPTOR.services_by_name["VerifyService"]
ROLLOUT_SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"]
SERVICES = (VERIFY_SERVICE, ROLLOUT_SERVICE)
# Every bidirectional stream of SERVICES: full method name ("/package.Service/Method") -> RPC.
STREAM_METHODS = {
    f"/{service.full_name}/{method.name}": method.name
    for service in SERVICES
    for method in service.methods
    if method.client_streaming and method.server_streaming
}

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
