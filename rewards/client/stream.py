"""One streaming call for a batch of items: `VerifyStream` (`verify_batch`,
`verify_batch_async`) and `RunStream` (`run_batch`, `run_batch_async`); sync wrappers use
grpcio, async ones grpc.aio; all return {request_id: outcome}.

All four share one `_Call`: it checks the requests (unique ids, each within the message
limit), chunks them into messages, matches results by `request_id`, and at the end gives every
item without a result the call's own failure. The sync wrappers use the process's shared
channel (`channels.shared`); the async ones open a channel on the running event loop and
close it before returning, so they can be awaited from any loop in any thread, one after
another or at the same time (a loopback handshake, about a millisecond, per call).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any, Generic, Literal, Protocol, TypeVar

import grpc
from google.rpc import status_pb2

from nemo_gym_grpc.rewards.client import channels
from nemo_gym_grpc.rewards.client.channels import CHANNEL_OPTIONS as CHANNEL_OPTIONS  # benchmarks
from nemo_gym_grpc.rewards.client.channels import MAX_MESSAGE_BYTES, MiB, Security
from nemo_gym_grpc.rewards.client.outcomes import (
    ITEM_TOO_LARGE,
    Failure,
    Outcome,
    ProtocolError,
    RunOutcome,
)
from nemo_gym_grpc.v1 import rollout_pb2, rollout_pb2_grpc, verify_pb2, verify_pb2_grpc

# Room for a stream message's own framing around its items.
MAX_ITEM_BYTES = MAX_MESSAGE_BYTES - 64 * 1024
ITEMS_PER_MESSAGE = 64
# A message is closed early once its items reach this size (a big message only adds latency).
BYTES_PER_MESSAGE = 16 * MiB


class _Item(Protocol):
    """A VerifyRequest or RunRequest: what `_Call` reads of an item."""

    @property
    def request_id(self) -> str: ...

    def ByteSize(self) -> int: ...  # noqa: N802 (protobuf's name)


class _Result(Protocol):
    """A VerifyResponse or RunResponse: what `_Call` reads of a result."""

    @property
    def request_id(self) -> str: ...

    @property
    def error(self) -> status_pb2.Status: ...

    def HasField(self, field_name: Literal["error"]) -> bool: ...  # noqa: N802 (protobuf's name)


_Req = TypeVar("_Req", bound=_Item)
_Res = TypeVar("_Res", bound=_Result)
_Msg = TypeVar("_Msg")


def _chunks(items: Sequence[_Req]) -> Iterator[list[_Req]]:
    """`items` in chunks (one stream message each) of at most ITEMS_PER_MESSAGE items and,
    unless a single item is bigger, at most BYTES_PER_MESSAGE bytes."""
    chunk: list[_Req] = []
    size = 0
    for item in items:
        item_size = item.ByteSize()
        if chunk and (len(chunk) == ITEMS_PER_MESSAGE or size + item_size > BYTES_PER_MESSAGE):
            yield chunk
            chunk, size = [], 0
        chunk.append(item)
        size += item_size
    if chunk:
        yield chunk


def _messages(
    items: Sequence[verify_pb2.VerifyRequest],
) -> Iterator[verify_pb2.VerifyStreamRequest]:
    """`items` in VerifyStreamRequests, chunked by `_chunks`."""
    return (verify_pb2.VerifyStreamRequest(items=chunk) for chunk in _chunks(items))


class _Cancellable(Protocol):
    """A sync or asyncio gRPC call (both can be cancelled)."""

    def cancel(self) -> bool: ...


class _Call(Generic[_Req, _Res, _Msg]):
    """The bookkeeping of one streaming call, the same for both RPCs and both wrappers.

    `__init__` fails items over the message limit up front (not sent: `sendable`), `start`
    gives the messages and the time left, `on_message` records results, `reading` records the
    call's own failure (and `on_no_connection` the lack of a connection), `finish` returns
    every outcome.

    Args:
        method: the RPC's name, for messages ("VerifyStream", "RunStream").
        wrap: makes one stream message from a chunk of items.
    """

    def __init__(
        self,
        target: str,
        requests: Sequence[_Req],
        *,
        method: str,
        wrap: Callable[[list[_Req]], _Msg],
        timeout: float,
        connect_timeout: float,
        security: Security,
    ) -> None:
        self.target = target
        self.method = method
        self.wrap = wrap
        self.metadata = security.metadata()
        self.timeout = timeout
        self.connect_wait = min(connect_timeout, timeout)
        self.deadline = time.monotonic() + timeout
        self.outcomes: dict[str, _Res | Failure] = {}
        self.sendable: list[_Req] = []
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

    def start(self) -> tuple[Iterator[_Msg], float]:
        """The messages to send and the seconds left for the call."""
        return map(self.wrap, _chunks(self.sendable)), max(self.deadline - time.monotonic(), 0.0)

    def on_message(self, results: Iterable[_Res]) -> None:
        """Record a message's results. Raises ProtocolError for an unknown or repeated id."""
        for result in results:
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

    def finish(self) -> dict[str, _Res | Failure]:
        """{request_id: outcome} for every request; the items without a result get the call's
        failure, marked `whole_call`.

        Raises:
            ProtocolError: items are unanswered although the call ended OK.
        """
        missing = [request_id for request_id in self.sent if request_id not in self.outcomes]
        if missing and self.failure is None:
            raise ProtocolError(
                f"bridge at {self.target} ended {self.method} OK with {len(missing)} of "
                f"{len(self.sent)} items unanswered"
            )
        if missing and self.failure is not None:
            failure = replace(self.failure, whole_call=True)
            self.outcomes.update(dict.fromkeys(missing, failure))
        return self.outcomes


def _verify_call(
    target: str,
    requests: Sequence[verify_pb2.VerifyRequest],
    timeout: float,
    connect_timeout: float,
    security: Security,
) -> _Call[verify_pb2.VerifyRequest, verify_pb2.VerifyResponse, verify_pb2.VerifyStreamRequest]:
    return _Call(
        target,
        requests,
        method="VerifyStream",
        wrap=lambda chunk: verify_pb2.VerifyStreamRequest(items=chunk),
        timeout=timeout,
        connect_timeout=connect_timeout,
        security=security,
    )


def _run_call(
    target: str,
    requests: Sequence[rollout_pb2.RunRequest],
    timeout: float,
    connect_timeout: float,
    security: Security,
) -> _Call[rollout_pb2.RunRequest, rollout_pb2.RunResponse, rollout_pb2.RunStreamRequest]:
    return _Call(
        target,
        requests,
        method="RunStream",
        wrap=lambda chunk: rollout_pb2.RunStreamRequest(items=chunk),
        timeout=timeout,
        connect_timeout=connect_timeout,
        security=security,
    )


def _drive_sync(
    call: _Call[_Req, _Res, _Msg],
    stream_method: Callable[[channels.Channel], Callable[..., Any]],
    security: Security,
) -> dict[str, _Res | Failure]:
    """Run `call` on the process's shared channel to its target (`stream_method`: the
    stub's stream-stream method on that channel)."""
    if not call.sendable:
        return call.finish()
    channel = channels.shared(call.target, security)
    if not channel.wait_ready(call.connect_wait):
        call.on_no_connection()
        return call.finish()
    messages, left = call.start()
    stream = stream_method(channel)(
        messages, timeout=left, metadata=call.metadata, wait_for_ready=True
    )
    with call.reading(stream):
        for message in stream:
            call.on_message(message.results)
    return call.finish()


async def _drive_async(
    call: _Call[_Req, _Res, _Msg],
    stream_method: Callable[[grpc.aio.Channel], Callable[..., Any]],
    security: Security,
) -> dict[str, _Res | Failure]:
    """Run `call` over grpc.aio on a channel of its own (closed before returning)."""
    if not call.sendable:
        return call.finish()
    async with channels.aio_channel(call.target, security) as channel:
        try:
            await asyncio.wait_for(channel.channel_ready(), call.connect_wait)
        except asyncio.TimeoutError:
            call.on_no_connection()
            return call.finish()
        messages, left = call.start()
        stream = stream_method(channel)(
            messages, timeout=left, metadata=call.metadata, wait_for_ready=True
        )
        with call.reading(stream):
            async for message in stream:
                call.on_message(message.results)
        return call.finish()


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
    call = _verify_call(target, requests, timeout, connect_timeout, security)
    return _drive_sync(call, lambda channel: channel.stub.VerifyStream, security)


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
    call = _verify_call(target, requests, timeout, connect_timeout, security)
    return await _drive_async(
        call,
        lambda channel: verify_pb2_grpc.VerifyServiceStub(channel).VerifyStream,
        security,
    )


def run_batch(
    target: str,
    requests: Sequence[rollout_pb2.RunRequest],
    *,
    timeout: float,
    connect_timeout: float,
    security: Security = channels.PLAINTEXT,
) -> dict[str, RunOutcome]:
    """Run `requests` as rollouts over one `RunStream` call; one outcome per request, by
    request_id: the `RunResponse` (its `rollout` set) or a `Failure`.

    Arguments, chunking, whole-call failures and errors: as `verify_batch` (`timeout` is the
    gRPC deadline of the whole call, so it bounds every rollout in it).
    """
    call = _run_call(target, requests, timeout, connect_timeout, security)
    return _drive_sync(call, lambda channel: channel.rollouts.RunStream, security)


async def run_batch_async(
    target: str,
    requests: Sequence[rollout_pb2.RunRequest],
    *,
    timeout: float,
    connect_timeout: float,
    security: Security = channels.PLAINTEXT,
) -> dict[str, RunOutcome]:
    """`run_batch` for asyncio (grpc.aio, a channel of its own, closed before returning or
    when cancelled: cancelling the coroutine cancels the stream, and the bridge closes the
    agents' HTTP requests)."""
    call = _run_call(target, requests, timeout, connect_timeout, security)
    return await _drive_async(
        call,
        lambda channel: rollout_pb2_grpc.RolloutServiceStub(channel).RunStream,
        security,
    )
