"""The machinery of a bidirectional batch stream (VerifyStream, RunStream): batches of items in,
each item answered by its own task, results out in completion order, batched as they finish;
and of the unary call of the same family (Verify, Run).

`serve` is the whole body of a stream handler, `unary` that of a unary one; a service passes
what differs between families (`Kind`): how one item is answered, how a refused duplicate is
answered, the response message type, the stream's limits and the names used in messages and
logs. A unary request is parsed by `lenient`: one that breaks proto3's rules (e.g. invalid
UTF-8 in a string field) gets INVALID_ARGUMENT instead of gRPC's own UNKNOWN.

Semantics (verify.proto's VerifyStream, rollout.proto's RunStream): every item read gets
exactly one result; `request_id`s must be unique among the items in flight (a duplicate gets
INVALID_ARGUMENT alone); half-close finishes the items in flight and ends the call with OK; at
most `max_stream_items` items are held at once (in flight or with a result not yet sent) and a
client that sends faster waits, because the reader stops reading and gRPC flow control slows
it; a message with more than `max_batch_items` items, or one that cannot be parsed, ends the
call (RESOURCE_EXHAUSTED / INVALID_ARGUMENT) once the items read before it are answered. When
the call ends for any other reason (cancelled, deadline, shutdown) every item's task is
cancelled and awaited, so no item's upstream call outlives its stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.rpc.interceptors import refuse_stream
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


@dataclass(frozen=True)
class Unparsable:
    """A unary request message that could not be parsed (`lenient`): its type's name and the
    error."""

    name: str
    error: DecodeError


def lenient(message: type[Item]) -> Callable[[bytes], Item | Unparsable]:
    """The request deserializer of a unary RPC taking `message`: the parsed message, or
    `Unparsable` where gRPC's own parsing would end the call UNKNOWN before any handler runs
    (`unary` answers it INVALID_ARGUMENT)."""

    def parse(raw: bytes) -> Item | Unparsable:
        try:
            return message.FromString(raw)
        except DecodeError as exc:
            return Unparsable(message.DESCRIPTOR.name, exc)

    return parse


async def unary(
    kind: Kind[Item, Result], request: Item | Unparsable, context: grpc.aio.ServicerContext
) -> Result:
    """The body of a unary handler: the item's result (`kind.answer`, under the call's
    deadline), or the call aborted INVALID_ARGUMENT for a request `lenient` could not parse.
    """
    if isinstance(request, Unparsable):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the {request.name} could not be parsed ({request.error})",
        )
    result = await kind.answer(request, call_deadline(context))
    size = result.ByteSize()
    return result if size <= kind.max_message_bytes else too_large(result, size, kind)


def call_deadline(context: grpc.aio.ServicerContext) -> float | None:
    """The call's deadline as a `time.monotonic()` value, or None when it has none."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


async def serve(
    kind: Kind[Item, Result],
    request_iterator: AsyncIterable[Any],
    context: grpc.aio.ServicerContext,
) -> AsyncIterator[Any]:
    """The body of a stream handler: yields the response messages (see the module docstring).

    Raises:
        the exception of `context.abort` when the stream is refused, and what reading the
        requests raised.
    """
    stream = _Stream(kind, call_deadline(context))
    peer = context.peer()  # read now: the call may be gone when the stream ends
    started_at = time.monotonic()
    reader = asyncio.create_task(stream.read(request_iterator))
    try:
        async for message in stream.results():
            yield message
        await reader  # re-raises an error from reading the requests
        if stream.refusal is not None:
            await refuse_stream(request_iterator, context, *stream.refusal)
    finally:
        reader.cancel()
        tasks = [reader, *stream.tasks]
        for task in stream.tasks:
            task.cancel()
        # Wait for the cancelled items to close their upstream requests (each ends at its
        # next await); shielded so that a second cancellation cannot cut the wait short.
        await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
        seconds = time.monotonic() - started_at
        kind.log.info(
            "%s ended: %d of %d results sent (%d failed) in %.3f s",
            kind.rpc,
            stream.sent,
            stream.accepted,
            stream.failed,
            seconds,
            extra={
                "event": kind.event,
                "peer": peer,
                "items_received": stream.accepted,
                "results_sent": stream.sent,
                "results_failed": stream.failed,
                "duration_seconds": round(seconds, 6),
            },
        )


async def _parsed(request_iterator: AsyncIterable[Any]) -> AsyncIterator[Any]:
    """The stream's messages; one that cannot be parsed ends it as its DecodeError."""
    iterator = aiter(request_iterator)
    while True:
        try:
            batch = await anext(iterator)
        except StopAsyncIteration:
            return
        except DecodeError as exc:
            yield exc
            return
        yield batch


class _Stream(Generic[Item, Result]):
    """The state of one stream call: a reader task (`read`) starts one task per item, and the
    handler sends their results as they finish (`results`). `deadline` is the call's
    (`time.monotonic()` seconds, or None).

    Attributes:
        accepted: items read.
        sent: results sent.
        failed: results sent that carry an error.
        refusal: (code, details) the call must end with once every item read is answered;
            None = it ends OK.
        tasks: the item tasks still running.
    """

    def __init__(self, kind: Kind[Item, Result], deadline: float | None) -> None:
        self._kind = kind
        self._deadline = deadline
        self._max_batch_items = kind.max_batch_items
        # Results to send, in the order they finished: `_ready` frees its request_id when
        # sent, `_kept` (a duplicate's refusal) does not: the id belongs to the item still in
        # flight. `_wake`: set when either grows or the input ends, while `results` waits.
        self._ready: list[Result] = []
        self._kept: list[Result] = []
        self._wake: asyncio.Future[None] | None = None
        self._input_ended = False
        # Items the stream may still take in (max_stream_items less those held); the reader
        # waits on `_room_freed` when it is 0.
        self._room = kind.max_stream_items
        self._room_freed: asyncio.Future[None] | None = None
        self._in_flight_ids: set[str] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.accepted = 0
        self.sent = 0
        self.failed = 0
        self.refusal: tuple[grpc.StatusCode, str] | None = None

    async def read(self, request_iterator: AsyncIterable[Any]) -> None:
        """Read the requests and start each item, until the input ends or a message must
        refuse the rest of the stream (`refusal`)."""
        # In grpcio 1.85 a client cancel also ends this iterator normally (grpc#36193); the
        # handler then sees CancelledError at its next await and cleans up.
        try:
            async for batch in _parsed(request_iterator):
                if isinstance(batch, DecodeError):
                    # Proto3 strings must be valid UTF-8; a message that breaks that (or is
                    # otherwise malformed) has items whose request_ids cannot be known.
                    self._refuse(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"a {self._kind.request_name} could not be parsed ({batch})",
                    )
                    return
                if len(batch.items) > self._max_batch_items:
                    self._refuse(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"a {self._kind.request_name} held {len(batch.items)} items; the "
                        f"limit is {self._max_batch_items} items per message (raise it with "
                        "--max-batch-items, or send smaller messages)",
                    )
                    return
                for request in batch.items:
                    while not self._room:
                        self._room_freed = asyncio.get_running_loop().create_future()
                        await self._room_freed
                    self._room -= 1
                    self.accepted += 1
                    # An empty id is no id: the item checks refuse every such item alike.
                    if request.request_id in self._in_flight_ids:
                        refused = self._kind.refused(request, _duplicate(request.request_id))
                        self._kept.append(refused)
                        self._notify()
                        continue
                    if request.request_id:
                        self._in_flight_ids.add(request.request_id)
                    task = asyncio.create_task(self._answer(request))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
        finally:
            self._input_ended = True
            self._notify()

    def _refuse(self, code: grpc.StatusCode, cause: str) -> None:
        # Reading stops here, so the items accepted so far are the ones answered before it.
        self.refusal = (
            code,
            f"{cause}; the {self.accepted} items read before it were answered, it and the "
            f"rest of the stream were not {self._kind.answered}",
        )

    async def _answer(self, request: Any) -> None:
        result = await self._kind.answer(request, self._deadline)  # answers every item
        self._ready.append(result)  # (`_ready` is read after the await: `results` swaps it)
        self._notify()

    def _notify(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def results(self) -> AsyncIterator[Any]:
        """The response messages until the input ended and every item read is answered: each
        holds every result that finished since the last one was sent (at least those that
        finished in the same turn of the event loop)."""
        loop = asyncio.get_running_loop()
        while True:
            if not (self._ready or self._kept):
                if self._input_ended and self.sent == self.accepted:
                    return
                self._wake = loop.create_future()
                await self._wake
                self._wake = None
                continue
            freed, self._ready = self._ready, []
            results = self._kept + freed if self._kept else freed
            self._kept = []
            for result in freed:
                self._in_flight_ids.discard(getattr(result, "request_id"))  # noqa: B009
            self._room += len(results)
            if self._room_freed is not None and not self._room_freed.done():
                self._room_freed.set_result(None)
            for message in fitted(self._kind, results):
                yield message
                # counted once gRPC took it (it asks for the next message after the write)
                self.failed += sum(result.HasField("error") for result in message.results)
                self.sent += len(message.results)


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


def _duplicate(request_id: str) -> errors.ItemError:
    return errors.invalid_item(
        f"request_id {request_id[:100]!r} is already in flight on this stream",
        field="request_id",
    )
