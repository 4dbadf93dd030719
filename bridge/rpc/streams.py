"""The machinery of a bidirectional batch stream (VerifyStream, RunStream): batches of items in,
each item answered by its own task, results out in completion order, batched as they finish;
and of the unary call of the same family (Verify, Run).

`serve` is the whole body of a stream handler, `unary` that of a unary one; a service passes
what differs between families (`kinds.Kind`): how one item is answered, how a refused duplicate is
answered, the response message type, the stream's limits and the names used in messages and
logs. A unary request is parsed by `lenient`: one that breaks proto3's rules (e.g. invalid
UTF-8 in a string field) gets INVALID_ARGUMENT instead of gRPC's own UNKNOWN.

Semantics (verify.proto's VerifyStream, rollout.proto's RunStream): every item read gets
exactly one result; `request_id`s must be unique among the items in flight (a duplicate gets
INVALID_ARGUMENT alone); half-close finishes the items in flight and ends the call with OK; at
most `max_stream_items` items are held at once (in flight or with a result not yet sent), and
no further message is read while the stream holds `max_stream_bytes` or the bridge its
`budget` (items as `budget.item_bytes` counts them, and unsent results, serialized); a client
that sends faster waits, because the reader stops reading and gRPC flow control slows it; a
message with more than `max_batch_items` items, or one that cannot be parsed, ends the call
(RESOURCE_EXHAUSTED / INVALID_ARGUMENT) once the items read before it are answered. When the
call ends for any other reason (cancelled, deadline, shutdown) every item's task is cancelled
and awaited, so no item's upstream call outlives its stream. A stream that holds nothing and
receives nothing for `idle_timeout` seconds is ended UNAVAILABLE / STREAM_IDLE, so an idle
client cannot keep one of the `--max-streams` places.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Generic

import grpc
from google.protobuf.message import DecodeError
from google.rpc import code_pb2
from grpc_status import rpc_status

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.rpc.budget import item_bytes
from nemo_gym_grpc.bridge.rpc.interceptors import refuse_stream
from nemo_gym_grpc.bridge.rpc.kinds import Item, Kind, Result, fitted, too_large
from nemo_gym_grpc.shared import reasons


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
    The item counts against the bridge's `budget` while it runs, and waits (within the call's
    deadline) while the streams hold all of it."""
    if isinstance(request, Unparsable):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the {request.name} could not be parsed ({request.error})",
        )
    budget = kind.budget
    await budget.room()
    held = item_bytes(request)
    budget.take(held)
    try:
        result = await kind.answer(request, call_deadline(context))
    finally:
        budget.give(held)
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
    watch = asyncio.create_task(stream.watch_idle(kind.idle_timeout)) if kind.idle_timeout else None
    try:
        async for message in stream.results():
            yield message
        if stream.idle:
            reader.cancel()  # nothing was coming: no write of the client's can be cut short
            await context.abort_with_status(rpc_status.to_status(_idle(kind).to_status()))
        await reader  # re-raises an error from reading the requests
        if stream.refusal is not None:
            await refuse_stream(request_iterator, context, *stream.refusal)
    finally:
        reader.cancel()
        if watch is not None:
            watch.cancel()
        tasks = [reader, *stream.tasks]
        for task in stream.tasks:
            task.cancel()
        # Wait for the cancelled items to close their upstream requests (each ends at its
        # next await); shielded so that a second cancellation cannot cut the wait short.
        await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
        stream.give_back()
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
        # When the stream last read or sent a message (`watch_idle`), and whether it idled out.
        self._active_at = time.monotonic()
        self.idle = False
        # Items the stream may still take in (max_stream_items less those held); the reader
        # waits on `_room_freed` when it is 0.
        self._room = kind.max_stream_items
        self._room_freed: asyncio.Future[None] | None = None
        # Serialized bytes of the items read and the results not yet sent (`budget.py`);
        # `_ready_bytes`: those of `_ready`.
        self._held = 0
        self._ready_bytes = 0
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
                    size = item_bytes(request)
                    self._take(size)
                    task = asyncio.create_task(self._answer(request, size))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
                self._active_at = time.monotonic()
                await self._bytes_room()
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

    async def _bytes_room(self) -> None:
        """Return once the stream and the bridge hold few enough bytes to read a message."""
        while self._held >= self._kind.max_stream_bytes:
            self._room_freed = asyncio.get_running_loop().create_future()
            await self._room_freed
        await self._kind.budget.room()

    def _take(self, size: int) -> None:
        self._held += size
        self._kind.budget.take(size)

    def give_back(self, size: int | None = None) -> None:
        """Count `size` bytes (None: all the stream holds) no longer held."""
        size = self._held if size is None else size
        self._held -= size
        self._kind.budget.give(size)

    async def _answer(self, request: Any, size: int) -> None:
        result = await self._kind.answer(request, self._deadline)  # answers every item
        result_size = result.ByteSize()
        self._take(result_size - size)
        self._ready_bytes += result_size
        self._ready.append(result)  # (`_ready` is read after the await: `results` swaps it)
        self._notify()

    async def watch_idle(self, seconds: float) -> None:
        """Set `idle` and wake `results` once the stream has held no item and read and sent no
        message for `seconds` (its input still open)."""
        while True:
            held = self.accepted != self.sent or self._ready or self._kept
            quiet = time.monotonic() - self._active_at
            if not held and not self._input_ended and quiet >= seconds:
                self.idle = True
                self._notify()
                return
            await asyncio.sleep(seconds if held else seconds - quiet)

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
                if (self._input_ended and self.sent == self.accepted) or self.idle:
                    return
                self._wake = loop.create_future()
                await self._wake
                self._wake = None
                continue
            freed, self._ready = self._ready, []
            freed_bytes, self._ready_bytes = self._ready_bytes, 0
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
                self._active_at = time.monotonic()
            self.give_back(freed_bytes)
            if self._room_freed is not None and not self._room_freed.done():
                self._room_freed.set_result(None)


def _idle(kind: Kind[Any, Any]) -> errors.ItemError:
    return errors.ItemError(
        code_pb2.UNAVAILABLE,
        reasons.STREAM_IDLE,
        f"the {kind.rpc} held nothing and received nothing for {kind.idle_timeout:g} s "
        "(--stream-idle-timeout): open a new one when there is work",
        idleSeconds=f"{kind.idle_timeout:g}",
    )


def _duplicate(request_id: str) -> errors.ItemError:
    return errors.invalid_item(
        f"request_id {request_id[:100]!r} is already in flight on this stream",
        field="request_id",
    )
