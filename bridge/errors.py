"""Per-item failures and their `google.rpc.Status` form.

A failed item never becomes a reward: the bridge answers it with a `google.rpc.Status` whose
`code` is a canonical gRPC code and whose single `google.rpc.ErrorInfo` detail carries an
UPPER_SNAKE `reason` (`nemo_gym_grpc.shared.reasons`) and lowerCamel `metadata` (AIP-193).
Clients match on `reason`.

A raise of an exception a frame holds in a variable (`error = ...; raise error`, or a
parameter) makes a reference cycle: the exception's traceback holds the frame, the frame the
exception. Such a cycle, and the frames, bodies and connections it holds, waits for Python's
cycle collector, which the bridge runs rarely (`process/allocator.py`): with servers killed
under load the bridge's RSS rose 15% (the soak), a failed attempt leaving ~37 objects, frames
included. So such a raise is followed by `del` of that variable in a `finally`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import TypeVar

from google.protobuf import any_pb2
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2

from nemo_gym_grpc.shared.reasons import (
    BRIDGE_INTERNAL,
    ERROR_DOMAIN,
    INVALID_ITEM,
    RETRYABLE_CODES,
    UPSTREAM_HTTP_ERROR,
)

log = logging.getLogger(__name__)

# A result message with `request_id`, `latency_seconds` and an `error` (VerifyResponse,
# RunResponse).
Result = TypeVar("Result", bound=Message)

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def has_lone_surrogate(text: str) -> bool:
    """True when `text` holds a lone surrogate (U+D800..U+DFFF, e.g. decoded from a
    `"\\ud800"` JSON escape): not Unicode text, and UTF-8 cannot encode it."""
    return _LONE_SURROGATE.search(text) is not None


def utf8_text(text: str) -> str:
    """`text` with lone surrogates (what UTF-8 cannot encode, e.g. from a `"\\ud800"` JSON
    escape in an upstream reply) replaced by U+FFFD: proto3 strings must be valid UTF-8, and a
    status that cannot be encoded would cost the item its outcome."""
    return _LONE_SURROGATE.sub("\ufffd", text)


# Most characters of an upstream's own text (a reply body, an error) put into a message.
UPSTREAM_TEXT_CHARS = 300
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def upstream_text(raw: bytes | str, limit: int = UPSTREAM_TEXT_CHARS) -> str:
    """Text an upstream sent, fit for an error message and a log line: its first `limit`
    characters (bytes decoded as UTF-8, undecodable ones replaced), control characters
    escaped (`\\n`, `\\x1b`), "..." when cut."""
    text = raw[: limit * 4].decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    cut = len(text) > limit
    text = _CONTROL.sub(lambda m: repr(m.group())[1:-1], text[:limit])
    return utf8_text(text) + ("..." if cut else "")


class ItemError(Exception):
    """One item could not be scored.

    Args:
        code: a `google.rpc.code_pb2` value (e.g. `code_pb2.UNAVAILABLE`).
        reason: UPPER_SNAKE reason, one of `nemo_gym_grpc.shared.reasons`.
        message: human-readable text; dynamic values also go into `metadata`.
        metadata: lowerCamel keys to string values (e.g. `httpStatus="503"`).
        retryable: whether another attempt may succeed; default: `code` is one of
            RETRYABLE_CODES.

    Text that UTF-8 cannot encode is replaced (see `utf8_text`), so `to_status` never fails.

    Attributes:
        latency_seconds: wall time of the upstream call that failed, seconds; 0.0 when the
            failure is not one call's (set by whoever made the call).
    """

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        *,
        retryable: bool | None = None,
        **metadata: object,
    ) -> None:
        message = utf8_text(message)
        super().__init__(message)
        self.code = code
        self.retryable = code in RETRYABLE_CODES if retryable is None else retryable
        self.reason = reason
        self.message = message
        self.metadata = {k: utf8_text(str(v)) for k, v in metadata.items() if v is not None}
        self.latency_seconds = 0.0

    def to_status(self) -> status_pb2.Status:
        """The `google.rpc.Status` for `VerifyResponse.error`, with one ErrorInfo detail."""
        info = error_details_pb2.ErrorInfo(
            reason=self.reason, domain=ERROR_DOMAIN, metadata=self.metadata
        )
        detail = any_pb2.Any()
        detail.Pack(info)
        return status_pb2.Status(code=self.code, message=self.message, details=[detail])

    def result(self, response: Callable[..., Result], request_id: str) -> Result:
        """The failed result of item `request_id`: `response(request_id, latency_seconds)`
        (e.g. `VerifyResponse`) with `error` set to `to_status()`."""
        failed = response(request_id=request_id, latency_seconds=self.latency_seconds)
        failed.error.CopyFrom(self.to_status())  # type: ignore[attr-defined]
        return failed


def as_item_error(exc: Exception, request_id: str) -> ItemError:
    """What an item's flow raised, as its failure: `exc` itself when it is an ItemError; else
    a bug of the bridge, logged with its traceback (call this in the `except` clause), as
    INTERNAL / BRIDGE_INTERNAL: a bug must not cost the item its outcome."""
    if isinstance(exc, ItemError):
        return exc
    log.exception("unexpected error on request_id=%r", request_id[:100])
    return ItemError(code_pb2.INTERNAL, BRIDGE_INTERNAL, f"bridge error: {exc!r}")


def invalid_item(message: str, **metadata: object) -> ItemError:
    """An item the bridge cannot turn into a `/verify` call (INVALID_ARGUMENT)."""
    return ItemError(code_pb2.INVALID_ARGUMENT, INVALID_ITEM, message, retryable=None, **metadata)


def run_status_error(status: int, url: str, body: bytes) -> ItemError:
    """Map an agent's or environment server's non-200 reply to a `/run` to a final error:
    4xx -> INVALID_ARGUMENT (the rollout as sent was refused), anything else -> INTERNAL
    (5xx: the rollout may have run and failed; a retry would run it again). Reason
    UPSTREAM_HTTP_ERROR; the message holds the start of the body (`upstream_text`)."""
    code = code_pb2.INVALID_ARGUMENT if 400 <= status < 500 else code_pb2.INTERNAL
    return ItemError(
        code,
        UPSTREAM_HTTP_ERROR,
        f"{url} answered HTTP {status}: {upstream_text(body)}",
        retryable=False,
        httpStatus=status,
        upstreamUrl=url,
    )


def http_status_error(
    status: int, url: str, body: bytes, reason: str = UPSTREAM_HTTP_ERROR
) -> ItemError:
    """Map an upstream non-200 HTTP reply to a canonical code (gRPC status-code guide), with
    `reason` (UPSTREAM_HTTP_ERROR for `/verify`, UPSTREAM_SESSION_FAILED for `/seed_session`).

    502/503/504 -> UNAVAILABLE, 429 -> RESOURCE_EXHAUSTED, 400/422 -> INVALID_ARGUMENT,
    401 -> UNAUTHENTICATED, 403 -> PERMISSION_DENIED, 404/405 -> UNIMPLEMENTED (no `/verify`
    there), other 4xx -> INVALID_ARGUMENT, other 5xx and anything else -> INTERNAL.
    The message holds the start of the upstream body (`upstream_text`). Retryable: the UNAVAILABLE
    and RESOURCE_EXHAUSTED ones, and 500 (NeMo Gym's answer when its verify code raises,
    e.g. because a judge model it calls failed for a moment); other 5xx are not.
    """
    if status in (502, 503, 504):
        code = code_pb2.UNAVAILABLE
    elif status == 429:
        code = code_pb2.RESOURCE_EXHAUSTED
    elif status == 401:
        code = code_pb2.UNAUTHENTICATED
    elif status == 403:
        code = code_pb2.PERMISSION_DENIED
    elif status in (404, 405):
        code = code_pb2.UNIMPLEMENTED
    elif 400 <= status < 500:
        code = code_pb2.INVALID_ARGUMENT
    else:
        code = code_pb2.INTERNAL
    return ItemError(
        code,
        reason,
        f"{url} answered HTTP {status}: {upstream_text(body)}",
        retryable=code in RETRYABLE_CODES or status == 500,
        httpStatus=status,
        upstreamUrl=url,
    )
