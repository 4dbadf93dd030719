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
from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.refusal import refuse_stream
from nemo_gym_grpc.bridge.verifier import Verifier
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc

log = logging.getLogger(__name__)


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


@dataclass(frozen=True)
class Unparsable:
    """A `VerifyRequest` message that could not be parsed (see `parse_verify_request`)."""

    error: DecodeError


def parse_verify_request(raw: bytes) -> verify_pb2.VerifyRequest | Unparsable:
    """The request deserializer of the unary `Verify` (registered in server.py).

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

    def __init__(
        self, verifier: Verifier, max_stream_items: int = 4096, max_batch_items: int = 4096
    ) -> None:
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
        deadline = _deadline(context)
        peer = context.peer()  # read now: the call may be gone when the stream ends
        # (result, tracked): tracked results free their request_id when sent.
        finished: asyncio.Queue[tuple[verify_pb2.VerifyResponse, bool] | None] = asyncio.Queue()
        slots = asyncio.Semaphore(self._max_stream_items)
        in_flight_ids: set[str] = set()
        tasks: set[asyncio.Task[None]] = set()
        accepted = 0  # items read; each gets exactly one result
        unreadable: DecodeError | None = None
        oversized = 0  # item count of a message over --max-batch-items
        started_at = time.monotonic()

        async def score(request: verify_pb2.VerifyRequest) -> None:
            try:
                result = await self._verifier.verify(request, deadline)
            except Exception as exc:  # verify() answers every item; this is a backstop
                log.exception("verify failed for request_id=%r", request.request_id)
                result = self._verifier.failed(request, _internal_error(exc))
            finished.put_nowait((result, True))

        async def read() -> None:
            nonlocal accepted, unreadable, oversized
            # In grpcio 1.85 a client cancel also ends this iterator normally (grpc#36193);
            # the handler then sees CancelledError at its next await and cleans up below.
            try:
                async for batch in _parsed(request_iterator):
                    if isinstance(batch, DecodeError):
                        unreadable = batch
                        return
                    if len(batch.items) > self._max_batch_items:
                        oversized = len(batch.items)
                        return
                    for request in batch.items:
                        await slots.acquire()
                        accepted += 1
                        if request.request_id in in_flight_ids:
                            finished.put_nowait(
                                (self._verifier.failed(request, _duplicate(request)), False)
                            )
                            continue
                        in_flight_ids.add(request.request_id)
                        task = asyncio.create_task(score(request))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
            finally:
                finished.put_nowait(None)

        reader = asyncio.create_task(read())
        sent, failed, input_ended = 0, 0, False
        try:
            while not (input_ended and sent == accepted):
                ready = [await finished.get()]
                while not finished.empty():
                    ready.append(finished.get_nowait())
                results = []
                for entry in ready:
                    if entry is None:
                        input_ended = True
                        continue
                    result, tracked = entry
                    if tracked:
                        in_flight_ids.discard(result.request_id)
                    slots.release()
                    failed += result.HasField("error")
                    results.append(result)
                if results:
                    sent += len(results)
                    yield verify_pb2.VerifyStreamResponse(results=results)
            await reader  # re-raises an error from reading the requests
            if oversized:
                await refuse_stream(
                    request_iterator,
                    context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"a VerifyStreamRequest held {oversized} items; the limit is "
                    f"{self._max_batch_items} items per message (raise it with "
                    f"--max-batch-items, or send smaller messages); the {sent} items read "
                    "before it were answered, it and the rest of the stream were not scored",
                )
            if unreadable is not None:
                # Proto3 strings must be valid UTF-8; a message that breaks that (or is
                # otherwise malformed) has items whose request_ids cannot be known.
                await refuse_stream(
                    request_iterator,
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"a VerifyStreamRequest could not be parsed ({unreadable}); the {sent} "
                    "items read before it were answered, it and the rest of the stream "
                    "were not scored",
                )
        finally:
            reader.cancel()
            for task in tasks:
                task.cancel()
            seconds = time.monotonic() - started_at
            log.info(
                "VerifyStream ended: %d of %d results sent (%d failed) in %.3f s",
                sent,
                accepted,
                failed,
                seconds,
                extra={
                    "event": "verify_stream_end",
                    "peer": peer,
                    "items_received": accepted,
                    "results_sent": sent,
                    "results_failed": failed,
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


def _internal_error(exc: Exception) -> errors.ItemError:
    return errors.ItemError(code_pb2.INTERNAL, errors.BRIDGE_INTERNAL, f"bridge error: {exc!r}")


def _duplicate(request: verify_pb2.VerifyRequest) -> errors.ItemError:
    return errors.invalid_item(
        f"request_id {request.request_id[:100]!r} is already in flight on this stream",
        field="request_id",
    )
