"""The checks an item passes before any upstream call, and its encoding to HTTP bodies: a
`VerifyRequest` here (`check_item`), with the rules every item shares (`check_envelope`, size,
JSON); a `RunRequest`'s own rules are in `run_checks.py`.

Pure: no I/O, no state. A failed check is that item's INVALID_ARGUMENT alone.
"""

from __future__ import annotations

import json
import math
from collections.abc import Container, Iterable
from typing import Any

from google.protobuf.message import Message
from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.nemo_gym import codec
from nemo_gym_grpc.bridge.nemo_gym.sessions import seed_body
from nemo_gym_grpc.bridge.nemo_gym.verify import build_verify_body
from nemo_gym_grpc.shared import reasons
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


def check_envelope(request: Any, server_field: str, max_item_bytes: int) -> None:
    """The checks of every item (`VerifyRequest`, `RunRequest`): its size (`check_size`), a
    `request_id` and a server name (its field `server_field`) that are not empty, a finite
    `timeout_seconds` >= 0.

    Raises:
        errors.ItemError: INVALID_ARGUMENT / ITEM_TOO_LARGE or INVALID_ITEM (metadata `field`).
    """
    check_size(request, max_item_bytes)
    if not request.request_id:  # always, so the outcome cannot depend on other items
        raise errors.invalid_item("request_id is empty", field="request_id")
    if not getattr(request, server_field):
        raise errors.invalid_item(f"{server_field} is empty", field=server_field)
    if not (math.isfinite(request.timeout_seconds) and request.timeout_seconds >= 0):
        raise errors.invalid_item(
            f"timeout_seconds must be finite and >= 0, got {request.timeout_seconds!r}",
            field="timeout_seconds",
        )


def check_size(request: Message, max_item_bytes: int) -> None:
    """Raise errors.ItemError INVALID_ARGUMENT / ITEM_TOO_LARGE when the item's serialized
    size (`ByteSize()`, bytes) is over `max_item_bytes`."""
    size = request.ByteSize()
    if size > max_item_bytes:
        raise errors.ItemError(
            code_pb2.INVALID_ARGUMENT,
            reasons.ITEM_TOO_LARGE,
            f"item is {size} bytes; the bridge accepts items of at most {max_item_bytes} bytes",
            itemBytes=size,
            maxItemBytes=max_item_bytes,
        )


def encode(body: dict[str, Any], parsed: Iterable[tuple[str, dict[str, Any] | None]]) -> bytes:
    """`body` as compact UTF-8 JSON (`codec.dumps`); `parsed` is the item's (field name,
    parsed JSON object or None) that went into it (`json_object`), to tell whether it may
    hold NaN/Infinity and to name the field at fault.

    Raises:
        errors.ItemError: INVALID_ARGUMENT / INVALID_ITEM when it holds a lone surrogate,
            NaN/Infinity, or nests too deep.
    """
    parsed = list(parsed)
    exact = not any(isinstance(value, codec.StdlibParsed) for _, value in parsed)
    try:
        return codec.dumps(body, exact=exact)
    except UnicodeEncodeError:
        found = (f for f, value in parsed if value is not None and _has_lone_surrogate(value))
        field = next(found, "item")
        raise errors.invalid_item(
            f'{field} holds a lone surrogate escape (e.g. "\\ud800"): not valid '
            "Unicode text, UTF-8 cannot encode it",
            field=field,
        ) from None
    except ValueError as exc:  # NaN / Infinity in the item's JSON
        found = (f for f, value in parsed if value is not None and _has_non_finite(value))
        field = next(found, "item")
        raise errors.invalid_item(
            f"item JSON cannot be sent: {exc} ({field})", field=field
        ) from None
    except RecursionError:
        raise errors.invalid_item("item JSON nests too deeply to be sent") from None


def json_object(text: str, field: str) -> dict[str, Any]:
    """The JSON object in the item's field `field` (`codec.loads`: the standard library's
    rules and texts).

    Raises:
        errors.ItemError: INVALID_ARGUMENT / INVALID_ITEM (metadata `field`) when `text` is
            not JSON, nests too deep, or is not an object.
    """
    try:
        value = codec.loads(text)
    except (ValueError, RecursionError) as exc:
        raise errors.invalid_item(f"{field} is not valid JSON: {exc}", field=field) from None
    if not isinstance(value, dict):
        raise errors.invalid_item(
            f"{field} must be a JSON object, got {type(value).__name__}", field=field
        )
    return value


def _has_non_finite(value: dict[str, Any]) -> bool:
    # NaN / Infinity: what json.dumps(allow_nan=False) refuses (and a lone surrogate does not).
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        return True
    return False


def _has_lone_surrogate(value: dict[str, Any]) -> bool:
    # Only called once the whole body encoded as JSON text, so this one does too.
    return errors.has_lone_surrogate(json.dumps(value, ensure_ascii=False))
