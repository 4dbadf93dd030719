"""The `nemo_gym_grpc.v1.VerifyService` implementation (grpc.aio)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass

import aiohttp
import grpc
from google.protobuf.message import DecodeError

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.interceptors import HANDLER_KINDS, refuse_stream
from nemo_gym_grpc.bridge.verifier import Verifier
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc

log = logging.getLogger(__name__)

SERVICE = verify_pb2.DESCRIPTOR.services_by_name["VerifyService"]


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


@dataclass(frozen=True)
class Unparsable:
    """A `VerifyRequest` message that could not be parsed (see `parse_verify_request`)."""

    error: DecodeError


def parse_verify_request(raw: bytes) -> verify_pb2.VerifyRequest | Unparsable:
    """The request deserializer of the unary `Verify` (see `add_verify_service`).

    gRPC's own parsing would fail a message that breaks proto3's rules (e.g. invalid UTF-8 in
    a `string` field) with UNKNOWN before any handler runs; this returns `Unparsable` instead,
    which `VerifyService.Verify` answers with INVALID_ARGUMENT.
    """
    try:
        return verify_pb2.VerifyRequest.FromString(raw)
    except DecodeError as exc:
        return Unparsable(exc)


class VerifyService(verify_pb2_grpc.VerifyServiceServicer):
    """Serves Verify, VerifyStream and ListResourcesServers on one event loop.

    Args:
        verifier: scores single items.
        max_stream_items: most items one VerifyStream holds at once (in flight or with a
            result not yet sent). A client that sends faster waits: the handler stops reading,
            so gRPC flow control slows the sender and memory stays bounded.
        max_batch_items: most items in one VerifyStreamRequest message; a bigger message
            ends the stream with RESOURCE_EXHAUSTED naming `--max-batch-items` (the items
            read before it are answered first).
    """

    def __init__(self, verifier: Verifier, *, max_stream_items: int, max_batch_items: int) -> None:
        self._verifier = verifier
        self._max_stream_items = max_stream_items
        self._max_batch_items = max_batch_items

    async def Verify(
        self,
        request: verify_pb2.VerifyRequest | Unparsable,
        context: grpc.aio.ServicerContext,
    ) -> verify_pb2.VerifyResponse:
        if isinstance(request, Unparsable):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the VerifyRequest could not be parsed ({request.error})",
            )
        return await self._verifier.verify(request, _deadline(context))

    async def VerifyStream(
        self,
        request_iterator: AsyncIterable[verify_pb2.VerifyStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[verify_pb2.VerifyStreamResponse]:
        stream = _Stream(
            self._verifier, _deadline(context), self._max_stream_items, self._max_batch_items
        )
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
            for task in stream.tasks:
                task.cancel()
            seconds = time.monotonic() - started_at
            log.info(
                "VerifyStream ended: %d of %d results sent (%d failed) in %.3f s",
                stream.sent,
                stream.accepted,
                stream.failed,
                seconds,
                extra={
                    "event": "verify_stream_end",
                    "peer": peer,
                    "items_received": stream.accepted,
                    "results_sent": stream.sent,
                    "results_failed": stream.failed,
                    "duration_seconds": round(seconds, 6),
                },
            )

    async def ListResourcesServers(
        self, request: verify_pb2.ListResourcesServersRequest, context: grpc.aio.ServicerContext
    ) -> verify_pb2.ListResourcesServersResponse:
        upstreams = self._verifier.upstreams
        if request.refresh and upstreams.head_url:
            try:
                await upstreams.discover()
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"head server {upstreams.head_url} could not be read: {exc!r}",
                )
        return verify_pb2.ListResourcesServersResponse(
            resources_servers=[
                verify_pb2.ResourcesServer(name=u.name, upstream_urls=u.urls, source=u.source)
                for u in upstreams.entries()
            ]
        )


async def _parsed(
    request_iterator: AsyncIterable[verify_pb2.VerifyStreamRequest],
) -> AsyncIterator[verify_pb2.VerifyStreamRequest | DecodeError]:
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


@dataclass(frozen=True, slots=True)
class _Finished:
    """A result to send. `frees_id`: its request_id leaves the stream's in-flight ids when
    sent (False for a duplicate's refusal: the id belongs to the item still in flight)."""

    result: verify_pb2.VerifyResponse
    frees_id: bool


class _Stream:
    """The state of one VerifyStream call: a reader task (`read`) starts one scoring task per
    item, and the handler sends their results as they finish (`results`). `deadline` is the
    call's (`time.monotonic()` seconds, or None).

    Each item read gets exactly one result. At most `max_stream_items` items are held at once
    (in flight or with a result not yet sent): the reader waits for a free slot, so gRPC flow
    control slows the sender.

    Attributes:
        accepted: items read.
        sent: results sent.
        failed: results sent that carry an error.
        refusal: (code, details) the call must end with once every item read is answered;
            None = it ends OK.
        tasks: the scoring tasks still running.
    """

    def __init__(
        self,
        verifier: Verifier,
        deadline: float | None,
        max_stream_items: int,
        max_batch_items: int,
    ) -> None:
        self._verifier = verifier
        self._deadline = deadline
        self._max_batch_items = max_batch_items
        self._finished: asyncio.Queue[_Finished | None] = asyncio.Queue()  # None: input ended
        self._slots = asyncio.Semaphore(max_stream_items)
        self._in_flight_ids: set[str] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.accepted = 0
        self.sent = 0
        self.failed = 0
        self.refusal: tuple[grpc.StatusCode, str] | None = None

    async def read(self, request_iterator: AsyncIterable[verify_pb2.VerifyStreamRequest]) -> None:
        """Read the requests and start scoring each item, until the input ends or a message
        must refuse the rest of the stream (`refusal`)."""
        # In grpcio 1.85 a client cancel also ends this iterator normally (grpc#36193); the
        # handler then sees CancelledError at its next await and cleans up.
        try:
            async for batch in _parsed(request_iterator):
                if isinstance(batch, DecodeError):
                    # Proto3 strings must be valid UTF-8; a message that breaks that (or is
                    # otherwise malformed) has items whose request_ids cannot be known.
                    self._refuse(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"a VerifyStreamRequest could not be parsed ({batch})",
                    )
                    return
                if len(batch.items) > self._max_batch_items:
                    self._refuse(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"a VerifyStreamRequest held {len(batch.items)} items; the limit is "
                        f"{self._max_batch_items} items per message (raise it with "
                        "--max-batch-items, or send smaller messages)",
                    )
                    return
                for request in batch.items:
                    await self._slots.acquire()
                    self.accepted += 1
                    # An empty id is no id: check_item refuses every such item the same way.
                    if request.request_id in self._in_flight_ids:
                        refused = self._verifier.failed(request, _duplicate(request))
                        self._finished.put_nowait(_Finished(refused, frees_id=False))
                        continue
                    if request.request_id:
                        self._in_flight_ids.add(request.request_id)
                    task = asyncio.create_task(self._score(request))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
        finally:
            self._finished.put_nowait(None)

    def _refuse(self, code: grpc.StatusCode, cause: str) -> None:
        # Reading stops here, so the items accepted so far are the ones answered before it.
        self.refusal = (
            code,
            f"{cause}; the {self.accepted} items read before it were answered, it and the "
            "rest of the stream were not scored",
        )

    async def _score(self, request: verify_pb2.VerifyRequest) -> None:
        result = await self._verifier.verify(request, self._deadline)  # answers every item
        self._finished.put_nowait(_Finished(result, frees_id=True))

    async def results(self) -> AsyncIterator[verify_pb2.VerifyStreamResponse]:
        """The results, batched as they finish, until the input ended and every item read is
        answered."""
        input_ended = False
        while not (input_ended and self.sent == self.accepted):
            ready = [await self._finished.get()]
            while not self._finished.empty():
                ready.append(self._finished.get_nowait())
            results = []
            for entry in ready:
                if entry is None:
                    input_ended = True
                    continue
                if entry.frees_id:
                    self._in_flight_ids.discard(entry.result.request_id)
                self._slots.release()
                self.failed += entry.result.HasField("error")
                results.append(entry.result)
            if results:
                self.sent += len(results)
                yield verify_pb2.VerifyStreamResponse(results=results)


def add_verify_service(service: VerifyService, server: grpc.aio.Server) -> None:
    """Register `service` like the generated `add_VerifyServiceServicer_to_server`, with the
    handler table built from the service's descriptor (every RPC in verify.proto), except
    that `Verify` parses its request with `parse_verify_request`: a message gRPC cannot parse
    (invalid UTF-8 in a string field) gets INVALID_ARGUMENT instead of UNKNOWN."""
    handlers = {}
    for method in SERVICE.methods:
        request_class = getattr(verify_pb2, method.input_type.name)
        response_class = getattr(verify_pb2, method.output_type.name)
        make = HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(
            getattr(service, method.name),
            request_deserializer=(
                parse_verify_request if method.name == "Verify" else request_class.FromString
            ),
            response_serializer=response_class.SerializeToString,
        )
    generic = grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)
    server.add_generic_rpc_handlers((generic,))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)


def _duplicate(request: verify_pb2.VerifyRequest) -> errors.ItemError:
    return errors.invalid_item(
        f"request_id {request.request_id[:100]!r} is already in flight on this stream",
        field="request_id",
    )
