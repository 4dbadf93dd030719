"""The checks a `VerifyRequest` passes before any upstream call, and its encoding to the
`/verify` (and `/seed_session`) body; the rules every item shares are `checks`'. Pure: no I/O,
no state. A failed check is that item's INVALID_ARGUMENT alone.
"""

from __future__ import annotations

from collections.abc import Container

from nemo_gym_grpc.bridge.flows.checks import check_envelope, encode, json_object
from nemo_gym_grpc.bridge.nemo_gym.sessions import seed_body
from nemo_gym_grpc.bridge.nemo_gym.verify import build_verify_body
from nemo_gym_grpc.v1 import verify_pb2

# The VerifyRequest fields that carry JSON text.
JSON_FIELDS = ("row_json", "responses_create_params_json", "response_json")


def check_item(
    request: verify_pb2.VerifyRequest, *, max_item_bytes: int, session_servers: Container[str]
) -> tuple[bytes, bytes | None]:
    """The item checked and turned into the UTF-8 `/verify` body and, when it runs as a
    session (`seed_session` set, or its resources server in `session_servers`), the
    `/seed_session` body (else None).

    Args:
        request: the item.
        max_item_bytes: largest accepted `request.ByteSize()`, bytes.
        session_servers: resources server names whose items always run as a session.

    Raises:
        errors.ItemError: INVALID_ARGUMENT with reason ITEM_TOO_LARGE for an item over
            `max_item_bytes`; with reason INVALID_ITEM for one without a `request_id` or a
            `resources_server`, with a negative or non-finite `timeout_seconds`, or with
            JSON text that is invalid, not an object, holds NaN/Infinity, nests too deep,
            or holds a lone surrogate (a `"\\ud800"` escape: UTF-8 cannot encode it, and a
            NeMo Gym server answers such a body with HTTP 500).
    """
    check_envelope(request, "resources_server", max_item_bytes)
    row = json_object(request.row_json, "row_json") if request.row_json else None
    params = None
    if request.responses_create_params_json:
        params = json_object(request.responses_create_params_json, "responses_create_params_json")
    response = (
        json_object(request.response_json, "response_json") if request.response_json else None
    )
    body = build_verify_body(request, row=row, params=params, response=response)
    payload = encode(body, zip(JSON_FIELDS, (row, params, response), strict=True))
    if request.seed_session or request.resources_server in session_servers:
        return payload, seed_body(body)  # a part of what encoded above
    return payload, None
