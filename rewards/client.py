"""One `VerifyStream` call for a batch of `VerifyRequest`s: sync (`verify_batch`, grpcio) and
asyncio (`verify_batch_async`, grpc.aio), both returning {request_id: Outcome}.

Both wrappers share one `_Call`: it checks the requests (unique ids, each within the message
limit), chunks them into messages, matches results by `request_id`, and at the end gives every
item without a result the call's own failure. The sync wrapper uses the process's shared
channel (`channels.shared`); the async one opens a channel on the running event loop and
closes it before returning, so it can be awaited from any loop in any thread, one after
another or at the same time (a loopback handshake, about a millisecond, per call).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Protocol

import grpc

from nemo_gym_grpc.rewards import channels
from nemo_gym_grpc.rewards.channels import CHANNEL_OPTIONS as CHANNEL_OPTIONS  # benchmarks
from nemo_gym_grpc.rewards.channels import MAX_MESSAGE_BYTES, MiB, Security
from nemo_gym_grpc.rewards.outcomes import ITEM_TOO_LARGE, Failure, Outcome, ProtocolError
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc

# Room for a VerifyStreamRequest's own framing around its items.
MAX_ITEM_BYTES = MAX_MESSAGE_BYTES - 64 * 1024
ITEMS_PER_MESSAGE = 64
# A message is closed early once its items reach this size (a big message only adds latency).
BYTES_PER_MESSAGE = 16 * MiB


def _messages(
    items: Sequence[verify_pb2.VerifyRequest],
) -> Iterator[verify_pb2.VerifyStreamRequest]:
    """`items` in VerifyStreamRequests of at most ITEMS_PER_MESSAGE items and, unless a single
    item is bigger, at most BYTES_PER_MESSAGE bytes."""
    chunk: list[verify_pb2.VerifyRequest] = []
    size = 0
    for item in items:
        item_size = item.ByteSize()
        if chunk and (len(chunk) == ITEMS_PER_MESSAGE or size + item_size > BYTES_PER_MESSAGE):
            yield verify_pb2.VerifyStreamRequest(items=chunk)
            chunk, size = [], 0
        chunk.append(item)
        size += item_size
    if chunk:
        yield verify_pb2.VerifyStreamRequest(items=chunk)


class _Cancellable(Protocol):
    """A sync or asyncio gRPC call (both can be cancelled)."""

    def cancel(self) -> bool: ...


class _Call:
    """The bookkeeping of one call, the same for the sync and the async wrapper.

    `__init__` fails items over the message limit up front (not sent: `sendable`), `start`
    gives the messages and the time left, `on_message` records results, `reading` records the
    call's own failure (and `on_no_connection` the lack of a connection), `finish` returns
    every outcome.
    """

    def __init__(
        self,
        target: str,
        requests: Sequence[verify_pb2.VerifyRequest],
        *,
        timeout: float,
        connect_timeout: float,
        security: Security,
    ) -> None:
        self.target = target
        self.metadata = security.metadata()
        self.timeout = timeout
        self.connect_wait = min(connect_timeout, timeout)
        self.deadline = time.monotonic() + timeout
        self.outcomes: dict[str, Outcome] = {}
        self.sendable: list[verify_pb2.VerifyRequest] = []
        self.failure: Failure | None = None
        ids: set[str] = set()
        for request in requests:
            if request.request_id in ids:
                raise ValueError(f"duplicate request_id {request.request_id!r}")
            ids.add(request.request_id)
            size = request.ByteSize()
            if size > MAX_ITEM_BYTES:
                self.outcomes[request.request_id] = Failure(
                    "INVALID_ARGUMENT",
                    ITEM_TOO_LARGE,
                    f"item is {size} bytes; the gRPC message limit is {MAX_MESSAGE_BYTES} bytes",
                )
            else:
                self.sendable.append(request)
        self.sent = {request.request_id for request in self.sendable}

    def start(self) -> tuple[Iterator[verify_pb2.VerifyStreamRequest], float]:
        """The messages to send and the seconds left for the call."""
        return _messages(self.sendable), max(self.deadline - time.monotonic(), 0.0)

    def on_message(self, message: verify_pb2.VerifyStreamResponse) -> None:
        """Record a message's results. Raises ProtocolError for an unknown or repeated id."""
        for result in message.results:
            request_id = result.request_id
            if request_id not in self.sent or request_id in self.outcomes:
                kind = "unknown" if request_id not in self.sent else "duplicate"
                raise ProtocolError(
                    f"bridge at {self.target} sent a result for {kind} request_id "
                    f"{request_id[:100]!r}"
                )
            error = result.error if result.HasField("error") else None
            self.outcomes[request_id] = result if error is None else Failure.from_status(error)

    @contextlib.contextmanager
    def reading(self, stream: _Cancellable) -> Iterator[None]:
        """Around reading `stream`'s results: a failed call is recorded as the call's own
        failure; a ProtocolError cancels the stream and propagates."""
        try:
            yield
        except ProtocolError:
            stream.cancel()
            raise
        except grpc.RpcError as error:
            self.failure = Failure.from_rpc_error(error)

    def on_no_connection(self) -> None:
        """No connection within `connect_wait`: the call was not started."""
        self.failure = Failure(
            "DEADLINE_EXCEEDED" if self.connect_wait >= self.timeout else "UNAVAILABLE",
            None,
            f"no connection to the bridge at {self.target} within {self.connect_wait:g} s",
        )

    def finish(self) -> dict[str, Outcome]:
        """{request_id: outcome} for every request; the items without a result get the call's
        failure, marked `whole_call`.

        Raises:
            ProtocolError: items are unanswered although the call ended OK.
        """
        missing = [request_id for request_id in self.sent if request_id not in self.outcomes]
        if missing and self.failure is None:
            raise ProtocolError(
                f"bridge at {self.target} ended VerifyStream OK with {len(missing)} of "
                f"{len(self.sent)} items unanswered"
            )
        if missing and self.failure is not None:
            failure = replace(self.failure, whole_call=True)
            self.outcomes.update(dict.fromkeys(missing, failure))
        return self.outcomes


def verify_batch(
    target: str,
    requests: Sequence[verify_pb2.VerifyRequest],
    *,
    timeout: float,
    connect_timeout: float,
    security: Security = channels.PLAINTEXT,
) -> dict[str, Outcome]:
    """Score `requests` over one `VerifyStream` call; one outcome per request, by request_id.

    Items are sent in messages of at most 64. Per-item errors become `Failure`s. If the call
    fails as a whole (deadline, bridge gone, no connection, token refused), every item
    without a result gets that call's `Failure` (`whole_call`). An item bigger than the
    message limit fails alone (INVALID_ARGUMENT / ITEM_TOO_LARGE) without being sent.

    Args:
        target: the bridge's gRPC target ("host:port", "ipv4:A:P,B:P", "dns:///name:port").
        requests: items with unique `request_id`s.
        timeout: gRPC deadline of the whole call, seconds.
        connect_timeout: most seconds to wait for a connection to the bridge (bounded by
            `timeout`); a bridge that is still starting is waited for, not failed at once.
        security: TLS files and token (`settings.security`); default plaintext, no token.

    Raises:
        ValueError: two requests share a `request_id`.
        ProtocolError: the bridge answered an unknown or already answered `request_id`, or
            ended the stream OK with items unanswered.
    """
    call = _Call(
        target, requests, timeout=timeout, connect_timeout=connect_timeout, security=security
    )
    if not call.sendable:
        return call.finish()
    channel = channels.shared(target, security)
    if not channel.wait_ready(call.connect_wait):
        call.on_no_connection()
        return call.finish()
    messages, left = call.start()
    stream = channel.stub.VerifyStream(
        messages, timeout=left, metadata=call.metadata, wait_for_ready=True
    )
    with call.reading(stream):
        for message in stream:
            call.on_message(message)
    return call.finish()


async def verify_batch_async(
    target: str,
    requests: Sequence[verify_pb2.VerifyRequest],
    *,
    timeout: float,
    connect_timeout: float,
    security: Security = channels.PLAINTEXT,
) -> dict[str, Outcome]:
    """`verify_batch` for asyncio: the same arguments, outcomes and errors, over `grpc.aio`
    on a channel of its own (closed before returning, or when cancelled)."""
    call = _Call(
        target, requests, timeout=timeout, connect_timeout=connect_timeout, security=security
    )
    if not call.sendable:
        return call.finish()
    async with channels.aio_channel(target, security) as channel:
        try:
            await asyncio.wait_for(channel.channel_ready(), call.connect_wait)
        except asyncio.TimeoutError:
            call.on_no_connection()
            return call.finish()
        messages, left = call.start()
        stream = verify_pb2_grpc.VerifyServiceStub(channel).VerifyStream(
            messages, timeout=left, metadata=call.metadata, wait_for_ready=True
        )
        with call.reading(stream):
            async for message in stream:
                call.on_message(message)
        return call.finish()
