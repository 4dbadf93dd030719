"""What one family of calls (VerifyStream and Verify, RunStream and Run) does with its items
(`Kind`), and how its results are fitted into response messages under gRPC's send limit
(`fitted`, `too_large`). `streams.py` runs the calls."""

from __future__ import annotations

import logging
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from google.protobuf.message import Message
from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.rpc.budget import Budget
from nemo_gym_grpc.shared import reasons
from nemo_gym_grpc.shared.contract import MAX_MESSAGE_BYTES

# An item (VerifyRequest, RunRequest) and its result (VerifyResponse, RunResponse): messages
# with a `request_id`, the result with an `error` oneof member.
Item = TypeVar("Item", bound=Message)
Result = TypeVar("Result", bound=Message)


@dataclass(frozen=True)
class Kind(Generic[Item, Result]):
    """What one kind of stream does with its items.

    Attributes:
        answer: (item, deadline) -> its result; must answer every item (never raise but for
            cancellation). `deadline` is the call's, `time.monotonic()` seconds, or None.
        refused: (item, error) -> the result of an item refused without running.
        response: the stream response message class, built as `response(results=[...])`.
        request_name: the request message's name, for messages ("VerifyStreamRequest").
        rpc: the RPC's name, for logs ("VerifyStream").
        event: the `event` of the log record written when a stream ends.
        answered: what "run" means for the items, for messages ("scored", "run").
        max_stream_items: most items one stream holds at once (in flight or with a result
            not yet sent). A client that sends faster waits: the reader stops reading, so
            gRPC flow control slows the sender and memory stays bounded.
        max_batch_items: most items in one stream request message; a bigger message ends
            the stream with RESOURCE_EXHAUSTED naming `--max-batch-items` (the items read
            before it are answered first).
        log: where the end of each stream is logged.
        max_message_bytes: most bytes of one response message (`--max-message-mb`, gRPC's send
            limit): the results that finish together go out in as many messages as that takes,
            and a result that alone is larger is replaced by its failure (`fitted`).
        max_stream_bytes: the serialized bytes of items and unsent results past which the
            stream reads no further message until results go out (`--max-stream-mb`).
        budget: the bridge's bytes of all streams (`--max-held-mb`); over it, no stream reads
            a further message.
        idle_timeout: seconds a stream may hold nothing and receive nothing before the bridge
            ends it UNAVAILABLE / STREAM_IDLE (`--stream-idle-timeout`); 0 = never.
    """

    answer: Callable[[Item, float | None], Awaitable[Result]]
    refused: Callable[[Item, errors.ItemError], Result]
    response: Callable[..., Any]
    request_name: str
    rpc: str
    event: str
    answered: str
    max_stream_items: int
    max_batch_items: int
    log: logging.Logger
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_stream_bytes: int = sys.maxsize
    budget: Budget = field(default_factory=lambda: Budget(sys.maxsize))
    idle_timeout: float = 0.0


# Bytes a result adds to a response message beyond its own: its field tag and length prefix.
_FIELD_BYTES = 6


def fitted(kind: Kind[Item, Result], results: list[Result]) -> Iterator[Any]:
    """The response messages of `results`, each at most `kind.max_message_bytes` (gRPC's send
    limit: a larger message would end the whole stream RESOURCE_EXHAUSTED and lose every
    result in it); in one message when they fit, as they usually do. A result that alone is
    over the limit is replaced by its failure (`too_large`)."""
    message = kind.response(results=results)
    limit = kind.max_message_bytes
    if message.ByteSize() <= limit:
        yield message
        return
    chunk: list[Result] = []
    size = 0
    for result in results:
        own = result.ByteSize()
        if own + _FIELD_BYTES > limit:
            result = too_large(result, own, kind)
            own = result.ByteSize()
        if chunk and size + own + _FIELD_BYTES > limit:
            yield kind.response(results=chunk)
            chunk, size = [], 0
        chunk.append(result)
        size += own + _FIELD_BYTES
    if chunk:
        yield kind.response(results=chunk)


def too_large(result: Result, size: int, kind: Kind[Item, Result]) -> Result:
    """The failure that replaces `result` (of `size` bytes) when it cannot fit one message:
    FAILED_PRECONDITION / RESULT_TOO_LARGE (not retryable), its latency kept."""
    request_id: str = getattr(result, "request_id")  # noqa: B009
    error = errors.ItemError(
        code_pb2.FAILED_PRECONDITION,
        reasons.RESULT_TOO_LARGE,
        f"the result is {size} bytes, over the {kind.max_message_bytes}-byte message limit "
        "(--max-message-mb): ask without include_reply, or raise the limit on both ends",
        resultBytes=size,
        maxMessageBytes=kind.max_message_bytes,
    )
    error.latency_seconds = getattr(result, "latency_seconds")  # noqa: B009
    kind.log.warning("request_id=%r: %s", request_id[:100], error.message)
    return error.result(type(result), request_id)
