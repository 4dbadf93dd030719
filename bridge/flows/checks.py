"""The checks every item passes before any upstream call, whatever its flow: its envelope
(`check_envelope`: size, request_id, server name, timeout) and its JSON text (`json_object`,
`encode`). A `VerifyRequest`'s own rules are in `verify_checks.py`, a `RunRequest`'s in
`run_checks.py`.

Pure: no I/O, no state. A failed check is that item's INVALID_ARGUMENT alone.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from google.protobuf.message import Message
from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.nemo_gym import codec
from nemo_gym_grpc.shared import reasons


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
