"""The services of the contract (`nemo_gym_grpc.v1`) that the bridge serves, named once: their
descriptors and full names (health checking, reflection) and the bidirectional streams that
`--max-streams` counts.

Also what both ends of the wire agree on outside the .proto files, declared here once: the gRPC
message and item size limits, the defaults both ends start from, and the environment
variables the bridge and the trainer side both read.
The trainer side imports them from here, so this module loads nothing beyond grpc and the
generated code (tests/test_shared_names.py).
"""

from __future__ import annotations

from nemo_gym_grpc.v1 import rollout_pb2, session_pb2, verify_pb2

MiB = 1024 * 1024
# The gRPC message size limit, both directions, in bytes: the default of the bridge's
# `--max-message-mb` and the trainer side's channel options. gRPC's own default receive limit
# (4 MiB) rejects a 64-item message of long completions.
MAX_MESSAGE_BYTES = 64 * MiB
# The largest item a client can send at all: a message less room for its own framing (the
# trainer side refuses a larger one before sending: it would end the whole stream).
MAX_SENDABLE_ITEM_BYTES = MAX_MESSAGE_BYTES - 64 * 1024
# The largest item the bridge takes by default (`--max-item-mb`); a larger one fails alone
# with INVALID_ARGUMENT / ITEM_TOO_LARGE.
DEFAULT_MAX_ITEM_BYTES = 16 * MiB
# Default seconds of one upstream `/verify` call: the bridge's `--verify-timeout` and the TRL
# reward functions' `verify_timeout` (axolotl's own default).
VERIFY_TIMEOUT = 30.0
# NeMo Gym's head server port (its DEFAULT_HEAD_SERVER_PORT, axolotl's `nemo_gym_head_port`
# default), on the trainer's machine unless said otherwise.
DEFAULT_HEAD_PORT = 11000
DEFAULT_HEAD_URL = f"http://127.0.0.1:{DEFAULT_HEAD_PORT}"
# The bearer token: the bridge requires it (`--token-file`, else this variable holds the token)
# and the trainer side sends it as `authorization: Bearer <token>`; an embedded bridge inherits
# the trainer's environment, so both ends read the same one.
TOKEN_ENV = "NEMO_GYM_GRPC_TOKEN"
# Default seconds of one rollout's `/run` call: the bridge's `--run-timeout`; the trainer side
# sends it as `RunRequest.timeout_seconds`.
RUN_TIMEOUT_ENV = "NEMO_GYM_GRPC_RUN_TIMEOUT"

VERIFY_SERVICE = verify_pb2.DESCRIPTOR.services_by_name["VerifyService"]
ROLLOUT_SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"]
SESSION_SERVICE = session_pb2.DESCRIPTOR.services_by_name["SessionService"]
SERVICES = (VERIFY_SERVICE, ROLLOUT_SERVICE, SESSION_SERVICE)
# Every bidirectional stream of SERVICES: full method name ("/package.Service/Method") -> RPC.
STREAM_METHODS = {
    f"/{service.full_name}/{method.name}": method.name
    for service in SERVICES
    for method in service.methods
    if method.client_streaming and method.server_streaming
}
