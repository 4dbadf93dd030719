"""The gRPC client side: batches over `VerifyStream`, sync (`verify_batch`) and asyncio
(`verify_batch_async`). Channels, security and load balancing are in `channels.py`.

Sync: TRL calls most reward functions synchronously, so `verify_batch` uses grpcio's sync API.
Its channels are created lazily, one per target (and TLS files) per process, shared by all
threads (a grpc channel is thread-safe; the cache is guarded by a lock) and re-created in a
forked child (grpc state does not survive fork; the pid is checked on every lookup). A caller
may pass its own `channels.Connection` instead (the `score` command does, to cancel on Ctrl-C).

Async: `verify_batch_async` uses `grpc.aio` with a channel of its own per call, opened and
closed inside the call. A `grpc.aio` channel belongs to the event loop it was created on, so a
shared one would fail ("bound to a different event loop") when TRL's reward loop, a test's
`asyncio.run` or another thread's loop calls next; one connection per batch costs a loopback
handshake (about a millisecond) per training step.

Channel options (see `channels.CHANNEL_OPTIONS`):
- `grpc.max_receive_message_length` / `grpc.max_send_message_length` = 64 MiB: gRPC's default
  4 MiB receive limit rejects a 64-item message of long completions. The bridge's
  `--max-message-mb` defaults to the same 64 MiB; an item bigger than that on its own fails
  locally with INVALID_ARGUMENT / ITEM_TOO_LARGE (the bridge's own code and reason for an item
  over its item limit) instead of failing the whole stream.
- `grpc.max_reconnect_backoff_ms` = 5000: after the bridge restarts, reconnect within seconds
  instead of gRPC's default backoff of up to 120 s.
- `grpc.service_config`: the `round_robin` load-balancing policy (several bridges).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from nemo_gym_grpc.rewards import channels
from nemo_gym_grpc.rewards.channels import CHANNEL_OPTIONS as CHANNEL_OPTIONS  # re-export
from nemo_gym_grpc.rewards.channels import MAX_MESSAGE_BYTES, MiB, Security
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc

# Room for a VerifyStreamRequest's own framing around its items.
MAX_ITEM_BYTES = MAX_MESSAGE_BYTES - 64 * 1024
ITEMS_PER_MESSAGE = 64
# A message is closed early once its items reach this size (a big message only adds latency).
BYTES_PER_MESSAGE = 16 * MiB

_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


class ProtocolError(RuntimeError):
    """The bridge broke the VerifyStream contract: a result with an unknown or duplicate
    `request_id`, or a stream that ended OK without a result for every item. Results are
    never zipped, broadcast or truncated onto the items, so this is raised instead."""


@dataclass(frozen=True)
class Failure:
    """Why one item has no reward.

    Attributes:
        code: canonical gRPC status code name, e.g. "NOT_FOUND", "UNAVAILABLE".
        reason: `google.rpc.ErrorInfo.reason` when the status carries one (e.g.
            "UNKNOWN_RESOURCES_SERVER", "UPSTREAM_UNAVAILABLE"), else None.
        message: human-readable detail (the bridge's or gRPC's message).
        whole_call: True when the item got no result of its own because the call failed as
            a whole (no connection, deadline, token refused, channel closed, bridge
            stopped): the item itself may be fine, and sending it again may score it.
    """

    code: str
    reason: str | None
    message: str
    whole_call: bool = False

    @property
    def cause(self) -> str:
        """Code and reason, e.g. "NOT_FOUND (UNKNOWN_RESOURCES_SERVER)" or "UNAVAILABLE"."""
        return f"{self.code} ({self.reason})" if self.reason else self.code

    @classmethod
    def from_status(cls, status: status_pb2.Status) -> Failure:
        """From a `google.rpc.Status` (a per-item `VerifyResponse.error`, or a call's rich
        status); the reason is taken from its first `ErrorInfo` detail."""
        reason = None
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason = info.reason or None
                break
        code = _CODE_NAMES.get(status.code, f"CODE_{status.code}")
        return cls(code, reason, status.message)

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> Failure:
        """From a failed call (the whole stream failed; a sync `grpc.Call` error or a
        `grpc.aio.AioRpcError`): its code, its rich status's ErrorInfo reason when the server
        sent one, and its details text."""
        has_status = callable(getattr(error, "code", None))
        code = error.code() if has_status else None
        details = error.details() if has_status else None
        try:
            status = rpc_status.from_call(error) if has_status else None
        except ValueError:  # rich status inconsistent with the call's code/message
            status = None
        if status is not None:
            return cls.from_status(status)
        return cls(code.name if code is not None else "UNKNOWN", None, details or repr(error))


Outcome = verify_pb2.VerifyResponse | Failure
"""The outcome of one item: a successful `VerifyResponse` (`reward`, `reward_components`,
...), or a `Failure`."""


def channel(
    target: str, security: Security = channels.PLAINTEXT
) -> tuple[grpc.Channel, verify_pb2_grpc.VerifyServiceStub]:
    """The process's shared channel and stub for `target` (see `channels.shared`)."""
    connection = channels.shared(target, security)
    return connection.channel, connection.stub


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


class _Results:
    """The outcomes of one batch as they arrive, matched to the requests by `request_id`.

    Items over the message limit get their failure up front and are not sent (`sendable`).
    """

    def __init__(self, target: str, requests: Sequence[verify_pb2.VerifyRequest]) -> None:
        self.target = target
        self.outcomes: list[Outcome | None] = [None] * len(requests)
        self.index: dict[str, int] = {}
        self.sendable: list[verify_pb2.VerifyRequest] = []
        for i, request in enumerate(requests):
            if request.request_id in self.index:
                raise ValueError(f"duplicate request_id {request.request_id!r}")
            size = request.ByteSize()
            if size > MAX_ITEM_BYTES:
                self.outcomes[i] = Failure(
                    "INVALID_ARGUMENT",
                    "ITEM_TOO_LARGE",
                    f"item is {size} bytes; the gRPC message limit is {MAX_MESSAGE_BYTES} bytes",
                )
                continue
            self.index[request.request_id] = i
            self.sendable.append(request)

    def add(self, result: verify_pb2.VerifyResponse) -> None:
        """Record one result. Raises ProtocolError for an unknown or repeated request_id."""
        i = self.index.get(result.request_id)
        if i is None or self.outcomes[i] is not None:
            kind = "unknown" if i is None else "duplicate"
            raise ProtocolError(
                f"bridge at {self.target} sent a result for {kind} request_id "
                f"{result.request_id[:100]!r}"
            )
        self.outcomes[i] = Failure.from_status(result.error) if result.HasField("error") else result

    def finish(self, call_failure: Failure | None) -> list[Outcome]:
        """All outcomes; items without a result get `call_failure` (the call's own failure,
        marked `whole_call`).

        Raises:
            ProtocolError: items are unanswered although the call ended OK.
        """
        missing = sum(o is None for o in self.outcomes)
        if missing and call_failure is None:
            raise ProtocolError(
                f"bridge at {self.target} ended VerifyStream OK with {missing} of "
                f"{len(self.sendable)} items unanswered"
            )
        if call_failure is not None:
            call_failure = replace(call_failure, whole_call=True)
        return [call_failure if o is None else o for o in self.outcomes]  # type: ignore[misc]


CANCELLED = Failure("CANCELLED", None, "the client closed its channel to the bridge")


def _no_connection(target: str, wait: float, timeout: float) -> Failure:
    return Failure(
        "DEADLINE_EXCEEDED" if wait >= timeout else "UNAVAILABLE",
        None,
        f"no connection to the bridge at {target} within {wait:g} s",
    )


def verify_batch(
    target: str,
    requests: Sequence[verify_pb2.VerifyRequest],
    *,
    timeout: float,
    connect_timeout: float,
    security: Security = channels.PLAINTEXT,
    connection: channels.Connection | None = None,
) -> list[Outcome]:
    """Score `requests` over one `VerifyStream` call and return one outcome per request, in
    the order of `requests`.

    Items are sent in messages of at most 64; results are matched back by `request_id`.
    Per-item errors become `Failure`s. If the call fails as a whole (deadline, bridge gone,
    no connection), every item without a result gets that call's `Failure`. An item bigger
    than the message limit fails alone (INVALID_ARGUMENT / ITEM_TOO_LARGE) without being
    sent.

    Args:
        target: the bridge's gRPC target ("host:port", "ipv4:A:P,B:P", "dns:///name:port").
        requests: items with unique `request_id`s.
        timeout: gRPC deadline of the whole call, seconds.
        connect_timeout: most seconds to wait for a connection to the bridge (bounded by
            `timeout`); a bridge that is still starting is waited for, not failed at once.
        security: TLS files and token (`channels.Security.from_env`); default plaintext,
            no token. A wrong or missing token fails every item with UNAUTHENTICATED.
        connection: a `channels.Connection` to use instead of the shared one for `target`
            (with `security`'s TLS files). Once it is closed, unanswered items get
            CANCELLED (marked `whole_call`).

    Raises:
        ValueError: two requests share a `request_id`.
        ProtocolError: the bridge answered an unknown or already answered `request_id`, or
            ended the stream OK with items unanswered.
    """
    results = _Results(target, requests)
    if not results.sendable:
        return results.finish(None)

    deadline = time.monotonic() + timeout
    connection = connection or channels.shared(target, security)
    wait = min(connect_timeout, timeout)
    if not connection.wait_ready(wait):
        if connection.closed:
            return results.finish(CANCELLED)
        return results.finish(_no_connection(target, wait, timeout))
    with connection.stream(
        _messages(results.sendable),
        timeout=max(deadline - time.monotonic(), 0.0),
        metadata=security.metadata(),
        wait_for_ready=True,
    ) as call:
        if call is None:
            return results.finish(CANCELLED)
        call_failure = None
        try:
            for message in call:
                for result in message.results:
                    results.add(result)
        except ProtocolError:
            call.cancel()
            raise
        except grpc.RpcError as error:
            call_failure = Failure.from_rpc_error(error)
    return results.finish(call_failure)


async def verify_batch_async(
    target: str,
    requests: Sequence[verify_pb2.VerifyRequest],
    *,
    timeout: float,
    connect_timeout: float,
    security: Security = channels.PLAINTEXT,
) -> list[Outcome]:
    """`verify_batch` for asyncio: the same arguments, outcomes and errors, over `grpc.aio`.

    Opens its own channel on the running event loop and closes it before returning (or when
    cancelled), so it can be awaited from any loop in any thread, one after another or at the
    same time.
    """
    results = _Results(target, requests)
    if not results.sendable:
        return results.finish(None)

    deadline = time.monotonic() + timeout
    async with channels.aio_channel(target, security) as ch:
        wait = min(connect_timeout, timeout)
        try:
            await asyncio.wait_for(ch.channel_ready(), wait)
        except asyncio.TimeoutError:
            return results.finish(_no_connection(target, wait, timeout))
        stub = verify_pb2_grpc.VerifyServiceStub(ch)
        call = stub.VerifyStream(
            _messages(results.sendable),
            timeout=max(deadline - time.monotonic(), 0.0),
            metadata=security.metadata(),
            wait_for_ready=True,
        )
        call_failure = None
        try:
            async for message in call:
                for result in message.results:
                    results.add(result)
        except ProtocolError:
            call.cancel()
            raise
        except grpc.RpcError as error:
            call_failure = Failure.from_rpc_error(error)
        return results.finish(call_failure)
